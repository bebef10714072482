"""`peagle generate`: streams text, reports tokens/s; bad input is one clear line and a non-zero exit."""
import json
import os
import subprocess
import sys

import pytest
from heads import save_random_head
from tiny import save_tiny_text_model


def peagle(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "peagle.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.fixture(scope="module")
def textmodel(tmp_path_factory):
    return save_tiny_text_model(str(tmp_path_factory.mktemp("tm") / "m"))


def test_generate_streams_and_matches_api(textmodel):
    from peagle import LLM, SamplingParams
    r = peagle("generate", "--model", textmodel, "--prompt", "def foo(x):", "--max-tokens", "20")
    assert r.returncode == 0, r.stderr
    # the summary: tokens, seconds, the first token's wait (no longer than the run) and the rate after it
    import re
    m = re.search(r"\[(\d+) tokens in ([\d.]+) s: [\d.]+ tokens/s; first token after (\d+) ms \((\d+)-token "
                  r"prompt\), then [\d.]+ tokens/s; finish_reason=(\w+)\]", r.stderr)
    assert m, r.stderr
    n, secs, first_ms, plen, why = m.groups()
    assert int(n) == 20 and why == "length" and 0 < int(first_ms) <= float(secs) * 1e3 + 5, m.group(0)
    from transformers import AutoTokenizer
    assert int(plen) == len(AutoTokenizer.from_pretrained(textmodel)("def foo(x):")["input_ids"])
    want = LLM(textmodel).generate("def foo(x):", SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].text
    assert r.stdout.rstrip("\n") == want


def test_generate_with_speculative_config_prints_metrics(textmodel, tmp_path):
    head = save_random_head(textmodel, str(tmp_path / "h"), layers=2)
    spec = json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": 3, "parallel_drafting": True})
    r = peagle("generate", "--model", textmodel, "--prompt", "hello", "--chat", "--max-tokens", "12",
               "--speculative-config", spec)
    assert r.returncode == 0, r.stderr
    plain = peagle("generate", "--model", textmodel, "--prompt", "hello", "--chat", "--max-tokens", "12")
    assert r.stdout == plain.stdout
    assert "mean acceptance length" in r.stderr


def test_generate_with_auto_k_measures_batch_size_one_only(textmodel, tmp_path, monkeypatch):
    """One request runs at batch size 1: K "auto" measures its step costs there only (the first start of a
    server measures up to its max_num_seqs); the output is plain decoding's."""
    head = save_random_head(textmodel, str(tmp_path / "h"), layers=2)
    spec = json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": "auto", "parallel_drafting": True})
    monkeypatch.setenv("PEAGLE_CACHE_DIR", str(tmp_path / "costs"))
    r = peagle("generate", "--model", textmodel, "--prompt", "hello", "--max-tokens", "12", "--speculative-config", spec)
    assert r.returncode == 0, r.stderr
    assert "batch sizes [1] " in r.stderr, r.stderr
    assert r.stdout == peagle("generate", "--model", textmodel, "--prompt", "hello", "--max-tokens", "12").stdout


@pytest.mark.parametrize("case", ["missing_dir", "bad_arch", "too_long", "bad_spec_key", "bad_spec_k", "bad_head"])
def test_bad_input_is_one_clear_line(textmodel, tmp_path, case, capsys):
    args = ["generate", "--model", textmodel, "--prompt", "hi"]
    if case == "missing_dir":
        args[2] = str(tmp_path / "nope")
    elif case == "bad_arch":
        d = tmp_path / "gpt2"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
        args[2] = str(d)
    elif case == "too_long":
        args[4] = "word " * 3000
    elif case == "bad_spec_key":
        args += ["--speculative-config", '{"method": "eagle3", "model": "x", "num_speculative_tokens": 3, "foo": 1}']
    elif case == "bad_spec_k":
        args += ["--speculative-config", '{"method": "eagle3", "model": "x", "num_speculative_tokens": 0}']
    elif case == "bad_head":
        head = save_random_head(textmodel, str(tmp_path / "h"), layers=1, aux=[1, 2, 9])   # aux id 9 > 4 layers
        args += ["--speculative-config", json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": 3})]
    from peagle.cli import main
    rc = main(args)                   # in-process: an uncaught exception would fail the test with a traceback
    err = capsys.readouterr().err
    assert rc != 0
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("peagle: error:"), err


def test_bad_input_subprocess_has_no_traceback(tmp_path):
    r = peagle("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("peagle: error: model directory not found")


def test_generate_passes_top_k_top_p_and_max_model_len_on(textmodel, capsys):
    """--top-k 1 (or a tiny --top-p) at temperature 1 keeps only the likeliest token: greedy's text, whatever the
    seed; --max-model-len bounds the context (a longer prompt is one error line)."""
    from peagle.cli import main
    base = ["generate", "--model", textmodel, "--prompt", "def foo(x):", "--max-tokens", "16"]
    assert main(base) == 0
    greedy = capsys.readouterr().out
    for flags in (["--top-k", "1"], ["--top-p", "1e-6"]):
        assert main(base + ["--temperature", "1.0", "--seed", "3", *flags]) == 0
        assert capsys.readouterr().out == greedy, flags
    assert main(base + ["--max-model-len", "8", "--prompt", "word " * 20]) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("peagle: error:") and "8" in err[0], err
