"""Stop strings (peagle/stops.py find_stop): found where a decode of the whole output finds them."""


def test_stop_strings_are_found_where_a_whole_decode_finds_them():
    """find_stop decodes only the last tokens unless a stop string is there: against the whole decode after
    every token (what the engine did, O(n^2)) on SmolLM2's byte-level tokenizer -- multi-byte characters split
    over tokens, special tokens (no characters), stop strings across token boundaries -- the same stop step and
    the same cut."""
    import random

    from transformers import AutoTokenizer

    from peagle.llm import DEMO_TARGET
    from peagle.stops import find_stop
    tok = AutoTokenizer.from_pretrained(DEMO_TARGET)
    rng = random.Random(0)
    special = list(tok.all_special_ids)
    byte_ids = tok.convert_tokens_to_ids(["Ã", "©", "â", "Ģ", "ĺ", "ð", "Ł", "ĺ", "Ģ"])   # pieces of é, ’, 😀
    found = 0
    for trial in range(300):
        n = rng.randint(30, 90)
        few = 0.8 if trial % 3 == 0 else 0.25        # mostly bytes and special tokens: the window must double
        ids = [rng.choice(special + byte_ids) if rng.random() < few else rng.randrange(len(tok) - 20)
               for _ in range(n)]
        full = tok.decode(ids, skip_special_tokens=True)
        a = rng.randrange(max(1, len(full) - 2))
        stops = [full[a:a + rng.randint(1, 6)], rng.choice(["\ufffd", "é", " the", "zzq"])]
        want = got = None
        for i in range(1, n + 1):
            text = tok.decode(ids[:i], skip_special_tokens=True)
            hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s and s in text]
            w = (i, min(hits, key=lambda h: h[0])[1:]) if hits else None
            at = find_stop(tok, ids[:i], stops)
            g = (i, at) if at is not None else None
            want, got = want or w, got or g
            if w or g:
                break
        assert got == want, (ids, stops, got, want)
        found += want is not None
    assert found > 250                                   # most trials do stop (the stop strings are in the text)
    # special tokens (no text) between a stop string's start and a long last token: the window must reach back
    # past them (a review's case: the tail held only the last token's text)
    ids = tok("x a")["input_ids"] + [special[0]] * 20 + tok.convert_tokens_to_ids(["================================"])
    assert find_stop(tok, ids, ["a="]) == (2, "a=")
    # a partial UTF-8 character at the window's start, then special tokens: the window must reach past the
    # character's first byte (a mutation review: a window 9 characters shorter missed it)
    ids = tok("x", add_special_tokens=False)["input_ids"] + tok.convert_tokens_to_ids(["Ã", "©"]) + \
        [special[0]] * 15 + tok("=", add_special_tokens=False)["input_ids"]
    assert find_stop(tok, ids, ["é="]) == (1, "é=")


def test_the_stop_string_that_ends_first_wins_as_in_vllm():
    """One token completing two stop strings (the demo tokenizer's "ok, hello": ... " hel", "lo"): vLLM's
    check_stop_strings takes the one that ends first (list order among equal ends) and cuts at its start;
    find_stop took the one that starts first ("hello" before "ell")."""
    from transformers import AutoTokenizer

    from peagle.llm import DEMO_TARGET
    from peagle.stops import find_stop
    tok = AutoTokenizer.from_pretrained(DEMO_TARGET)
    ids = tok("ok, hello", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids[-1:]) == "lo"                       # the last token completes each pair below
    assert find_stop(tok, ids, ["hello", "ell"]) == (5, "ell")
    assert find_stop(tok, ids, ["lo", "ello"]) == (7, "lo")    # equal ends: list order
    assert find_stop(tok, ids, ["ello", "lo"]) == (5, "ello")


def test_a_step_without_a_stop_decodes_a_short_window():
    """Where no stop string ends, a step decodes about one token per character of the longest stop string on
    ordinary text (not the whole output, nor the 4 tokens per character a byte-heavy text may need)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    import peagle.stops
    from peagle.llm import DEMO_TARGET
    from peagle.stops import find_stop
    tok = AutoTokenizer.from_pretrained(DEMO_TARGET)
    ids = tok(Path(peagle.stops.__file__).read_text() * 3, add_special_tokens=False)["input_ids"]
    assert len(ids) > 1500

    class Counting:
        decoded = 0

        def decode(self, x, **kw):
            Counting.decoded += len(x)
            return tok.decode(x, **kw)
    stop = ["never in the text " * 11]                       # 198 characters
    assert find_stop(Counting(), ids, stop) is None
    assert 2 * len(stop[0]) < Counting.decoded <= 2 * (len(stop[0]) + 9), Counting.decoded
