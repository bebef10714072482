"""Incremental detokenization for streaming.

The streamed pieces always concatenate to exactly the non-streamed text, `decode(ids)[:stop_text_at]`:
each step decodes the output so far and sends only the part that can no longer change or be cut, i.e. it
holds back trailing U+FFFD (an incomplete UTF-8 character whose next bytes are still to come) and any tail
that could be the start of a stop string (the engine cuts the text where a stop string begins).

Each step decodes the whole output (tens of µs per 100 tokens with a fast tokenizer): simple, and exactly
consistent with the engine's stop-string positions, which are indices into that same full decode.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.sent = ""               # text sent so far (a prefix of the final text)

    def _decode(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=self.skip)

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
        text = self._decode() if self.tok is not None else ""
        return text if stop_text_at is None else text[:stop_text_at]
