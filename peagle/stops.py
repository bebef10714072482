"""Stop strings: where a request's output stops, found as a decode of the whole output would find it.

Invariant: find_stop(tok, ids, stops) after each new token gives the same stop step and the same cut as
searching `tok.decode(ids)` after each token (the text callers cut at the returned index), while decoding only
the last tokens on the steps where no stop string is found. Where one token completes several stop strings, the
one that ends first wins (list order among equals), as in vLLM's check_stop_strings."""
from __future__ import annotations


def find_stop(tok, ids: list, stops) -> tuple[int, str] | None:
    """(where it begins in the decode of ids, the stop string) for the stop string that ends first, if one ends in
    the last token (called after each
    token, so an earlier one would have stopped the request before): looked for first in the decode of the last
    tokens only, a window whose text before the last token is at least 8 characters longer than the longest stop
    string (its first characters may differ from the whole decode's: a partial UTF-8 character, a stripped
    leading space), and placed in the whole
    output's decode -- the text callers cut -- only when found there. Decoding the whole output after every token
    cost O(n^2) on the engine thread."""
    longest = max((len(s) for s in stops if s), default=0)
    if not longest:
        return None
    # most tokens carry a character or more (SmolLM2's ~3.7 per token on code): start at one token per
    # character and double where the text is shorter (bytes of a character, special tokens)
    w = longest + 9
    while w < len(ids):
        # the text before the last token must reach past the window's first characters: a stop string ending in
        # the last token starts at most longest - 1 characters before it (special tokens decode to nothing)
        if len(tok.decode(ids[-w:-1], skip_special_tokens=True)) >= longest + 8:
            tail = tok.decode(ids[-w:], skip_special_tokens=True)
            if not any(s and s in tail for s in stops):
                return None
            break
        w *= 2
    text = tok.decode(ids, skip_special_tokens=True)
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s and s in text]
    if not hits:
        return None
    _, at, s = min(hits, key=lambda h: h[0])          # the first to end; list order among equal ends
    return at, s
