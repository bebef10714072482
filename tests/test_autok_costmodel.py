"""The step-cost model: interpolation over batch sizes, online refinement, storage and its cache key."""
import json
import math

import numpy as np
import pytest
import torch

from peagle.autok.costmodel import CostModel, cache_key


def model():
    # t(B, K) = 1 ms * B + 2 ms * K at B = 1, 4, 16
    bs = [1, 4, 16]
    return CostModel(bs, [[1e-3 * b + 2e-3 * k for k in range(4)] for b in bs])


def test_interpolates_linearly_in_batch_size_and_extrapolates_past_the_grid():
    cm = model()
    for B in (1, 2, 3, 4, 10, 16, 40):
        want = np.array([1e-3 * B + 2e-3 * k for k in range(4)])
        assert np.allclose(cm.predict(B), want), B
    assert cm.k_max == 3 and cm.covers(3, 16) and not cm.covers(4, 16) and not cm.covers(3, 32)


def test_online_refinement_converges_to_what_steps_take_and_resists_outliers():
    cm = model()
    before = cm.predict(4).copy()
    cm.update(4, 2, 100.0)                             # one absurd step: scale and cell each move <= exp(0.05 * 0.5)
    after = cm.predict(4)
    assert float(after[2]) <= float(before[2]) * math.exp(0.05) + 1e-12
    ratio = after / before                             # the other K only through the machine-wide scale
    assert np.allclose(ratio[[0, 1, 3]], cm.scale)
    assert 1 < cm.scale <= math.exp(0.025) + 1e-12
    for _ in range(400):
        cm.update(10, 1, 0.05)                          # between grid points 4 and 16
    assert float(cm.predict(10)[1]) == pytest.approx(0.05, rel=0.02)
    assert cm.updates == 401


def test_machine_wide_slowdown_moves_every_k_and_monotone_grid():
    cm = model()
    want = cm.predict(8) * 2
    for i in range(300):                               # everything now takes twice as long (other load)
        k = i % 4
        cm.update(8, k, float(want[k]))
    assert np.allclose(cm.predict(8), want, rtol=0.03)
    noisy = CostModel([1, 8], [[5e-3, 3e-3, 6e-3, 6e-3], [4e-3, 7e-3, 8e-3, 9e-3]]).monotone()
    assert np.allclose(noisy.t, [[4e-3, 4e-3, 6e-3, 6e-3], [4e-3, 7e-3, 8e-3, 9e-3]])
    # nondecreasing in B too: a larger batch measured cheaper (noise) takes the smaller batch's cost
    dip = CostModel([1, 8], [[5e-3, 6e-3, 7e-3, 8e-3], [4e-3, 5e-3, 9e-3, 9e-3]]).monotone()
    assert np.allclose(dip.t, [[5e-3, 6e-3, 7e-3, 8e-3], [5e-3, 6e-3, 9e-3, 9e-3]])


def test_a_step_past_the_grid_refines_only_the_last_batch_size():
    """Past the largest measured batch size the prediction extrapolates (weights below 0 and above 1); refining
    with those weights made a slow B=40 step cheapen B=4 (a mutation review). Only the last row moves, up."""
    cm = model()
    before = cm.t.copy()
    cm.update(40, 1, float(cm.predict(40)[1]) * 1.5)
    assert np.array_equal(cm.t[:2], before[:2]) and cm.t[2, 1] > before[2, 1]
    assert np.array_equal(np.delete(cm.t[2], 1), np.delete(before[2], 1))


def test_save_load_round_trip(tmp_path):
    cm = model()
    cm.meta["ctx_len"] = 64
    p = str(tmp_path / "c" / "m.json")
    cm.save(p)
    back = CostModel.load(p)
    assert back.bs == cm.bs and np.allclose(back.t, cm.t) and back.meta["ctx_len"] == 64
    with open(p, "w") as f:
        json.dump({"format": 0}, f)
    assert CostModel.load(p) is None and CostModel.load(str(tmp_path / "none.json")) is None
    # a damaged file is measured again, not a crash (a list) or NaN costs that a step then trusts
    good = cm.to_json()
    for bad in ([], None, "x", {**good, "batch_sizes": good["batch_sizes"][::-1]},
                {**good, "seconds_per_step": [[float("nan")] + r[1:] for r in good["seconds_per_step"]]},
                {**good, "seconds_per_step": [[None] + r[1:] for r in good["seconds_per_step"]]},
                {**good, "seconds_per_step": good["seconds_per_step"][:-1]}):
        with open(p, "w") as f:
            json.dump(bad, f)
        assert CostModel.load(p) is None, bad
    with open(p, "w") as f:
        json.dump(good, f)
    assert CostModel.load(p) is not None                                    # the control loads


def test_cache_key_of_a_gguf_file_follows_the_file(tmp_path):
    """A .gguf model has no config.json: its size and time identify it (two files shared one cost model)."""
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"x" * 10)
    b.write_bytes(b"x" * 20)
    key = lambda p: cache_key(str(p), str(tmp_path), "peagle", torch.float32, {"ctx_len": 64})[0]
    assert key(a) != key(b) and key(a) == key(a)


def test_cache_key_follows_the_head_content_not_its_path(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, cfg in ((a, {"x": 1}), (b, {"x": 1})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text("{}")
    ka, _ = cache_key(str(m), str(a), "peagle", torch.float32, {"ctx_len": 64})
    kb, _ = cache_key(str(m), str(b), "peagle", torch.float32, {"ctx_len": 64})
    assert ka == kb
    (b / "config.json").write_text(json.dumps({"x": 2}))
    assert cache_key(str(m), str(b), "peagle", torch.float32, {"ctx_len": 64})[0] != ka
    assert cache_key(str(m), str(a), "eagle3", torch.float32, {"ctx_len": 64})[0] != ka


def test_reports_show_cache_files_under_home_as_tilde(monkeypatch, tmp_path):
    import os

    from peagle.autok.costmodel import shown_path
    monkeypatch.setenv("HOME", str(tmp_path / "u"))
    inside = os.path.join(str(tmp_path / "u"), ".cache", "peagle", "costs-x.json")
    assert shown_path(inside) == os.path.join("~", ".cache", "peagle", "costs-x.json")
    assert os.path.expanduser(shown_path(inside)) == inside
    assert shown_path(str(tmp_path / "other.json")) == str(tmp_path / "other.json") and shown_path(None) is None


def test_a_cell_priced_out_by_costly_steps_relaxes_back_to_its_measured_value():
    """A stretch of slow K = 3 steps (long contexts) raises that cell; while only K = 1 runs afterwards (at its
    measured cost), the K = 3 cell drifts back toward its measured value, so K = 3 is tried again. Without
    relaxation it would stay priced out."""
    for relax, back in ((0.01, True), (0.0, False)):
        cm = CostModel([1, 4, 16], [[1e-3 * b + 2e-3 * k for k in range(4)] for b in (1, 4, 16)], relax=relax)
        measured = float(cm.predict(1)[3])
        ratio = lambda: float(cm.predict(1)[3]) / float(cm.predict(1)[1]) / (measured / float(cm.t0[0, 1]))
        for _ in range(200):
            cm.update(1, 3, 3 * measured)
        raised = ratio()                                 # K = 3 now priced above K = 1 by more than measured
        for _ in range(300):
            cm.update(1, 1, float(cm.t0[0, 1]) * cm.scale)
        assert raised > 1.2
        assert (ratio() < 1.02) == back, (relax, raised, ratio())


def test_cache_key_follows_the_step_code(tmp_path, monkeypatch):
    """Step times measured before a change to the code a step runs are not reused after it."""
    import peagle.autok.costmodel as cm
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text("{}")
    before, ident = cache_key(str(m), str(m), "peagle", torch.float32, {})
    assert ident["code"] == cm._code_id()
    monkeypatch.setattr(cm, "_code_id", lambda: "changed")
    assert cache_key(str(m), str(m), "peagle", torch.float32, {})[0] != before
