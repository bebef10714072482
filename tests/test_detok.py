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
        d = IncrementalDetokenizer(tok, stops)
        sent, i = "", 0
        while True:
            n = rng.randrange(1, 5)
            if i + n >= len(out):
                sent += d.finish(stop_at, out[i:])
                break
            sent += d.add(out[i:i + n])
            assert want.startswith(sent), (trial, sent, want)
            i += n
        assert sent == want, (trial, stops)

