"""Quantized targets (peagle/models/llama.py with quant.py's weights, loader.resolve_quantization): close to
float32, greedy speculative output identical to plain decoding on q8 / q4 / q4a8 / q8a8, clear refusals, the
`--quantization` flag on the CLI and the server, and "auto" resolved per model and machine."""
import os

import pytest
import torch

from peagle.models import quant as Q
from peagle.models import quant_ext

EXT = quant_ext.get()


def test_quantized_target_close_to_float(qtarget):
    from peagle.models.llama import Transformer
    ids = torch.randint(5, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    out = {}
    for q in ("none", "q8", "q4", "q4a8"):
        t = Transformer.from_pretrained(qtarget, quantization=q)
        out[q], _ = t.forward(ids, t.new_cache(2, 16), 0, torch.zeros(2, dtype=torch.long))
        if q != "none":
            assert all(getattr(w, "quantized", False) for w in t._projections())
            assert q in t.precision
            assert all(getattr(p, "act8", False) == q.endswith("a8") for w in t._projections()
                       for p in getattr(w, "parts", None) or [w])
    rel = {q: float((out[q] - out["none"]).norm() / out["none"].norm()) for q in ("q8", "q4", "q4a8")}
    assert rel["q8"] < 0.03 and rel["q4"] < 0.4 and rel["q8"] < rel["q4"] / 4, rel   # random weights: 4 bits hurt
    a8 = float((out["q4a8"] - out["q4"]).norm() / out["q4"].norm())
    assert 1e-4 < a8 < 0.1, a8                      # 8-bit activations: a small, nonzero change to q4


def _spec(head, k, parallel):
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, "parallel_drafting": parallel}


@pytest.mark.parametrize("quantization", ["q8", "q4", "q4a8", "q8a8"])
def test_greedy_speculative_identical_to_plain(qtarget, tmp_path, quantization):
    from fakes import FakeProposer, install_proposer
    from heads import save_random_head

    from peagle import LLM, SamplingParams
    g = torch.Generator().manual_seed(8)
    ps = [{"prompt_token_ids": torch.randint(5, 500, (int(n),), generator=g).tolist()}
          for n in torch.randint(2, 30, (6,), generator=g)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = LLM(qtarget, quantization=quantization)
    assert quantization in base.engine.target.precision
    ref = [o.outputs[0].token_ids for o in base.generate(ps, sp)]
    head = save_random_head(qtarget, str(tmp_path / "p"), layers=1)
    llm = LLM(qtarget, quantization=quantization, speculative_config=_spec(head, 3, True), max_num_seqs=4)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, sp)] == ref
    lm = llm.engine.proposer.head._lm_head_t                # the head's projections follow the target: Q8_0
    assert isinstance(lm, Q.QuantWeight) and lm.qtype == Q.Q8_0 and lm.act8 == quantization.endswith("a8")

    class Oracle(FakeProposer):          # proposes the plain continuation: long accepted blocks, bonus tokens
        def propose(self, batch, k=None):
            k = k or self.k
            out = []
            for r in batch.requests:
                full = truth[tuple(r.prompt_token_ids)]
                n = len(r.output_ids)
                out.append((full[n:n + k] + [7] * k)[:k])
            return torch.tensor(out)
    truth = {tuple(p["prompt_token_ids"]): r for p, r in zip(ps, ref)}
    for k in (1, 4, 7):
        llm = install_proposer(LLM(qtarget, quantization=quantization), Oracle(k), k)
        assert [o.outputs[0].token_ids for o in llm.generate(ps, sp)] == ref
        assert llm.get_metrics()["mean_acceptance_length"] > 1 + 0.5 * k


def test_unsupported_quantization_is_refused(qtarget, monkeypatch):
    from peagle.errors import PeagleError
    from peagle.models.loader import load_target
    with pytest.raises(PeagleError, match="quantization"):
        load_target(qtarget, quantization="q3")
    with pytest.raises(PeagleError, match="native"):
        load_target(qtarget, backend="transformers", quantization="q8")
    monkeypatch.setattr(quant_ext, "get", lambda: None)        # 8-bit activations are exact only in the kernels
    with pytest.raises(PeagleError, match="C\\+\\+ kernels"):
        load_target(qtarget, quantization="q4a8")


def test_cli_generate_quantized_matches_api_and_says_so(tmp_path):
    import subprocess
    import sys

    from tiny import save_tiny_text_model

    from peagle import LLM, SamplingParams
    model = save_tiny_text_model(str(tmp_path / "m"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "peagle.cli", "generate", "--model", model, "--prompt", "def foo(x):",
                        "--max-tokens", "12", "--quantization", "q8"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "[target: quantization q8" in r.stderr
    want = LLM(model, quantization="q8").generate("def foo(x):", SamplingParams(temperature=0, max_tokens=12))
    assert r.stdout.rstrip("\n") == want[0].outputs[0].text
    for cmd in ("serve", "bench"):
        h = subprocess.run([sys.executable, "-m", "peagle.cli", cmd, "--help"], capture_output=True, text=True,
                           env=env, timeout=120)
        assert "--quantization" in h.stdout, cmd


def test_server_state_runs_the_quantized_target(qtarget):
    pytest.importorskip("fastapi")
    from peagle.server.start import build_state
    state = build_state(qtarget, "m", None, quantization="q4")
    assert state.engine.target.quantization == "q4" and "Q4_1" in state.engine.target.precision


def test_auto_quantization_resolves_per_model_and_machine(qtarget, tiny_gguf, capsys):
    """The default, "auto": q4a8 for a model that is a GGUF file's blocks (a .gguf path; the default target,
    converted from its package's file) where the AVX2 kernels run, else float weights; said on stderr. Not for
    a float checkpoint, another dtype or the transformers backend."""
    import torch

    from peagle import LLM
    from peagle.llm import DEFAULT_MODEL
    from peagle.models.loader import resolve_quantization
    fast = "q4a8" if EXT is not None and EXT.has_avx2() else "none"
    assert resolve_quantization(qtarget, "auto", "native", torch.float32, "cpu")[0] == "none"
    assert resolve_quantization(tiny_gguf, "auto", "native", torch.float32, "cpu")[0] == fast
    assert resolve_quantization(tiny_gguf, "auto", "native", torch.bfloat16, "cpu")[0] == "none"
    assert resolve_quantization(qtarget, "auto", "transformers", torch.float32, "cpu")[0] == "none"
    assert resolve_quantization(tiny_gguf, "q8", "native", torch.float32, "cpu")[0] == "q8"   # explicit: kept
    if os.path.isfile(os.path.join(DEFAULT_MODEL, "conversion.json")):
        assert resolve_quantization(DEFAULT_MODEL, "auto", "native", torch.float32, "cpu")[0] == fast
    capsys.readouterr()
    assert LLM(qtarget).engine.target.quantization == "none"
    assert "quantization auto" not in capsys.readouterr().err          # float weights: nothing to announce
    assert LLM(tiny_gguf).engine.target.quantization == fast
    assert f"quantization auto -> {fast}" in capsys.readouterr().err   # said either way: the output follows it


def test_auto_says_when_missing_kernels_leave_a_gguf_model_in_float(tiny_gguf, capsys, monkeypatch):
    """Without the kernels, auto runs a GGUF-backed model's float32 weights, whose output differs from q4a8's:
    said on stderr with the reason (it was silent)."""
    from peagle import LLM
    from peagle.models import quant_ext
    for name, v in (("_tried", True), ("_mod", None), ("_why", "not built")):
        monkeypatch.setattr(quant_ext, name, v)
    assert LLM(tiny_gguf).engine.target.quantization == "none"
    assert "quantization auto -> none (the C++ kernels do not run here (not built); float32" in capsys.readouterr().err
