"""Incremental detokenization for streaming.

The streamed pieces always concatenate to exactly the non-streamed text, `decode(ids)[:stop_text_at]`:
each step sends only the part of the decoded output that can no longer change or be cut, i.e. it holds back
trailing U+FFFD (an incomplete UTF-8 character whose next bytes are still to come) and any tail that could be
the start of a stop string (the engine cuts the text where a stop string begins).

What each step decodes: with a byte-level tokenizer (GPT-2's decoder, SmolLM2's, no space clean-up) the text of
ids is the UTF-8 decode of their bytes, so where the text so far ends in a whole character it is the decode of
every later token appended to it: the step decodes only the tokens since the last such point (linear in the
output). Other tokenizers (SentencePiece's leading-space rule, clean-up of spaces) decode the whole output each
step (quadratic, exact). The final text is always one decode of the whole output.
"""
from __future__ import annotations


def _byte_level(tok) -> bool:
    """Whether decode(a + b) == decode(a) + decode(b) wherever decode(a) ends in a whole character."""
    dec = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
    return type(dec).__name__ == "ByteLevel" and not getattr(tok, "clean_up_tokenization_spaces", True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.sent = ""               # text sent so far (a prefix of the final text)
        self.split = tokenizer is not None and _byte_level(tokenizer)
        self.base, self.base_text = 0, ""    # ids[:base] decode to base_text, which ends in a whole character

    def _decode(self) -> str:
        """The text of all ids so far (from the last whole-character point on, where the tokenizer allows)."""
        if not self.split:
            return self.tok.decode(self.ids, skip_special_tokens=self.skip)
        text = self.base_text + self.tok.decode(self.ids[self.base:], skip_special_tokens=self.skip)
        if not text.endswith("\ufffd"):
            self.base, self.base_text = len(self.ids), text
        return text

    def _holdback(self, text: str, end: int) -> int:
        """Chars at the end of text[:end] that might begin a stop string."""
        for k in range(min(self.max_stop - 1, end), 0, -1):
            tail = text[end - k:end]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def add(self, new_ids) -> str:
        """Append tokens; return the newly safe text."""
        self.ids.extend(new_ids)
        if self.tok is None:
            return ""
        text = self._decode()
        end = len(text.rstrip("\ufffd"))
        if self.stop:
            end -= self._holdback(text, end)
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent):end]
        self.sent += delta
        return delta

    def finish(self, stop_text_at: int | None = None, new_ids=()) -> str:
        """The request finished with `new_ids` as its last tokens: return the rest of the final text. (The last
        tokens must not go through add(): they may complete a stop string, which add() does not look for.)"""
        self.ids.extend(new_ids)
        if self.tok is None:
            return ""
        text = self.final_text(stop_text_at)
        if not text.startswith(self.sent):        # cannot happen with prefix-stable decoding; never resend
            return ""
        delta = text[len(self.sent):]
        self.sent = text
        return delta

    def final_text(self, stop_text_at: int | None = None) -> str:
        text = self.tok.decode(self.ids, skip_special_tokens=self.skip) if self.tok is not None else ""
        return text if stop_text_at is None else text[:stop_text_at]
