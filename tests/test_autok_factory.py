"""The K policy a speculative config asks for, end to end through LLM: "auto" measures this machine once
(cached), stays greedy-identical; the trained depth bounds K by default; vLLM's schedule picks K by batch
size."""
import json
import os

import pytest
from heads import save_random_head
from test_engine_lossless import ids, prompts

from peagle import LLM, SamplingParams
from peagle.autok.costmodel import cache_dir
from peagle.models import quant_ext


def spec(head, k, parallel=True, **kw):
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, "parallel_drafting": parallel, **kw}


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_is_greedy_identical_and_measures_once(target, tmp_path, capsys, parallel):
    head = save_random_head(target, str(tmp_path / "h"), layers=1, parallel=parallel)
    ps = prompts(6, seed=5)
    # ~94 decode steps: auto's first plain reference takes 16-64 before the model chooses (peagle/autok/guard.py)
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ref = ids(LLM(target).generate(ps, sp))
    llm = LLM(target, speculative_config=spec(head, "auto", parallel, max_num_speculative_tokens=4), max_num_seqs=4)
    err = capsys.readouterr().err
    assert "autok: measuring step costs" in err
    done = [line for line in err.splitlines() if line.startswith("autok: measured B=")]
    assert [line.split()[2] for line in done] == ["B=1", "B=2", "B=4"] and all(" s: K0=" in line for line in done)
    assert "more)" not in done[-1]                              # the last batch size: nothing left to announce
    prior_row_s = llm.engine.k_policy.row_s     # before any catch-up step refines it
    assert ids(llm.generate(ps, sp)) == ref
    m = llm.get_metrics()
    pol = m["k_policy"]
    assert pol["mode"] == "auto" and pol["k_max"] == 4 and 0 <= pol["k"] <= 4
    assert len(m["num_steps_per_k"]) == 5 and sum(m["num_steps_per_k"]) > 0
    assert len(pol["step_time_s"]) == 5 and all(t > 0 for t in pol["step_time_s"])
    assert m["num_draft_tokens"] >= m["num_drafts"]
    path = os.path.expanduser(pol["cost_model"])   # shown as ~/... when under the home directory
    assert os.path.dirname(path) == cache_dir() and os.path.isfile(path)
    with open(path) as f:
        saved = json.load(f)
    assert saved["batch_sizes"] == [1, 2, 4] and saved["k"] == [0, 1, 2, 3, 4]
    assert saved["samples_per_cell"] == [16, 8, 4]     # small batches measured over more passes (8 // B)
    # the catch-up price is measured (a drafter prefill), well below a whole step per row
    assert 0 < saved["drafter_row_s"] < saved["seconds_per_step"][0][1]
    assert prior_row_s == saved["drafter_row_s"]   # the policy starts from the measured price
    LLM(target, speculative_config=spec(head, "auto", parallel, max_num_speculative_tokens=3), max_num_seqs=2)
    assert "measuring" not in capsys.readouterr().err          # covered by the cached model: not measured again


def test_auto_k_max_defaults_to_the_trained_depth(target, tmp_path):
    head = save_random_head(target, str(tmp_path / "h"), layers=1)
    with open(os.path.join(head, "config.json")) as f:
        c = json.load(f)
    c["peagle"] = {"method": "peagle", "train_depths": 3}
    with open(os.path.join(head, "config.json"), "w") as f:
        json.dump(c, f)
    llm = LLM(target, speculative_config=spec(head, "auto"), max_num_seqs=2)
    assert llm.engine.k == 3 and llm.engine.k_policy.k_max == 3


def test_vllm_schedule_picks_k_by_batch_size(target, tmp_path):
    head = save_random_head(target, str(tmp_path / "h"), layers=1)
    ps = prompts(8, seed=9)
    sps = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(8)]
    ref = ids(LLM(target).generate(ps, sps))
    llm = LLM(target, speculative_config=spec(head, 5, num_speculative_tokens_per_batch_size=[[1, 2, 5], [3, 8, 0]]),
              max_num_seqs=4)
    assert ids(llm.generate(ps, sps)) == ref
    m = llm.get_metrics()
    steps = m["num_steps_per_k"]
    assert steps[0] > 0 and steps[5] > 0 and sum(steps[1:5]) == 0      # 3-4 rows: K=0; 1-2 rows: K=5
    assert m["k_policy"] == {"mode": "schedule", "k_max": 5, "schedule": [[1, 2, 5], [3, 8, 0]]}


@pytest.mark.skipif(quant_ext.get() is None,
                    reason="needs the built extension (the difference is loaded vs not)")
def test_cost_models_are_cached_per_kernels(monkeypatch):
    """Steps through the C++ kernels and through torch's products cost different times: different keys."""
    import types

    import peagle.autok.factory as factory
    tgt = types.SimpleNamespace(device="cpu", quantization="none", f32_kernel=True)
    with_ext = factory.cost_settings(tgt)
    monkeypatch.setattr(factory.quant_ext, "get", lambda: None)
    assert factory.cost_settings(tgt) != with_ext
    assert factory.cost_settings(types.SimpleNamespace(device="cpu", quantization="none", f32_kernel=False)) != \
        factory.cost_settings(tgt)


def test_cost_models_are_cached_per_quantization(tmp_path, monkeypatch):
    """A q4 target's steps cost another time than the float one's: their cost models never share a cache file."""
    import types

    import peagle.autok.factory as factory
    from peagle.autok.costmodel import CostModel
    monkeypatch.setenv("PEAGLE_CACHE_DIR", str(tmp_path / "cache"))
    measured = []
    monkeypatch.setattr(factory, "measure", lambda *a, **kw: measured.append(1) or CostModel([1], [[0.01, 0.02]]))
    paths = []
    for q in ("none", "q4", "q4"):
        tgt = types.SimpleNamespace(device="cpu", quantization=q)
        paths.append(factory.cost_model_for(tgt, None, "peagle", 1, 1, str(tmp_path), str(tmp_path), "float32",
                                            log=None).meta["path"])
    assert paths[0] != paths[1] == paths[2] and len(measured) == 2
