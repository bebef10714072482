"""Incremental detokenization (peagle/detok.py): what a stream sends concatenates to exactly the final
text, whatever the chunking and stop strings."""
import random

from serving import (  # noqa: F401 (fixtures)
    model_dir,
)

from peagle.detok import IncrementalDetokenizer


def test_detokenizer_stream_equals_final_text(model_dir):
    """Random token streams (many invalid UTF-8 byte tokens) in random chunk sizes, with stop strings: the
    streamed pieces concatenate to exactly decode(ids)[:stop_at], and nothing past a stop start is sent."""
    from peagle.llm import load_tokenizer
    tok = load_tokenizer(model_dir)
    rng = random.Random(0)
    for trial in range(150):
        ids = [rng.randrange(5, 512) for _ in range(rng.randrange(1, 60))]
        full = tok.decode(ids, skip_special_tokens=True)
        stops = []
        if trial % 2 and len(full) > 4:
            a = rng.randrange(len(full) - 2)
            stops = [full[a:a + rng.randrange(1, 4)], "zzq"]
        # what the engine does: after each token, look for a stop string in the decoded text
        out, stop_at = [], None
        for t in ids:
            out.append(t)
            text = tok.decode(out, skip_special_tokens=True)
            hits = [text.find(s) for s in stops if s and s in text]
            if hits:
                stop_at = min(hits)
                break
        want = tok.decode(out, skip_special_tokens=True)
        want = want if stop_at is None else want[:stop_at]
        for split in (True, False):             # decoding from the last whole character on; the whole output
            d = IncrementalDetokenizer(tok, stops)
            assert d.split                        # the tiny tokenizer is byte-level, as SmolLM2's
            d.split = split
            sent, i = "", 0
            while True:
                n = rng.randrange(1, 5)
                if i + n >= len(out):
                    sent += d.finish(stop_at, out[i:])
                    break
                sent += d.add(out[i:i + n])
                assert want.startswith(sent), (trial, sent, want)
                i += n
            assert sent == want, (trial, stops, split)


def test_a_byte_level_stream_decodes_each_token_about_once(model_dir):
    """Each step decoded the whole output: 400 tokens one at a time decoded 80,200 ids. From the last whole
    character on: about one decode per token, and the same text."""
    from peagle.llm import load_tokenizer
    tok = load_tokenizer(model_dir)
    ids = (tok("The quick brown fox jumps over the lazy dog. café naïve 東京 😀 " * 40)["input_ids"])[:400]
    decoded = []
    real = tok.decode
    tok.decode = lambda x, **k: decoded.append(len(x)) or real(x, **k)
    d = IncrementalDetokenizer(tok, ["zzq"])
    sent = "".join(d.add([t]) for t in ids[:-1]) + d.finish(None, ids[-1:])
    assert sent == real(ids, skip_special_tokens=True)
    assert sum(decoded[:-1]) < 2 * len(ids), sum(decoded)     # the last: finish's one decode of the whole output

