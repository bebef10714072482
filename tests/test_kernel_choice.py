"""impl 0's AVX2 / AVX-512 choice by row count (peagle/models/kernel_choice.py, peagle/csrc/ops.h): the threshold
rule, the C++ switch it sets, that the switch changes no bit, and the timing kept per CPU and step shapes."""
import json
import os

import pytest
import torch
from test_quant import random_blocks

from peagle.models import kernel_choice as KC
from peagle.models import quant as Q
from peagle.models import quant_ext

EXT = quant_ext.get()
needs_avx512 = pytest.mark.skipif(EXT is None or not EXT.has_avx512(), reason="a choice exists only with AVX-512")
KINDS = [(qt, a8) for _, qt, a8 in KC.KINDS]


@pytest.fixture
def thresholds_restored():
    """The process's thresholds as they were (other tests' targets set them too)."""
    before = {(qt, a8): EXT.avx512_min_rows(qt, a8) for qt, a8 in KINDS}
    yield
    for (qt, a8), t in before.items():
        EXT.set_avx512_min_rows(qt, a8, t)
    KC._applied.clear()
    KC._active = None


@pytest.fixture
def timing_home(tmp_path, monkeypatch):
    """A build directory of its own for the kept timings, one round per timing, no PEAGLE_KERNEL_CHOICE."""
    monkeypatch.setattr(quant_ext, "BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(KC, "ROUNDS", 1)
    monkeypatch.delenv("PEAGLE_KERNEL_CHOICE", raising=False)
    return tmp_path


def times(avx2, avx512, rows=KC.ROWS):
    return {(m, p): t for m, a, b in zip(rows, avx2, avx512) for p, t in (("avx2", a), ("avx512", b))}


def test_choose_takes_the_cheapest_threshold():
    rows = (1, 2, 4, 8)
    assert KC.choose(times([1, 1, 3, 6], [2, 2, 2, 3], rows), rows) == 4           # AVX2 wins below 4 rows
    assert KC.choose(times([2, 2, 3, 6], [1, 1, 2, 3], rows), rows) == 1           # AVX-512 everywhere
    assert KC.choose(times([1, 1, 1, 1], [2, 2, 2, 2], rows), rows) == 9           # AVX2 at every count timed
    assert KC.choose(times([1, 1, 1, 1], [1, 1, 1, 1], rows), rows) == 1           # a tie keeps the default
    # one noisy row count does not flip the rest: AVX2 1.05x slower at 2 rows, 2x faster at 1
    assert KC.choose(times([1, 2.1, 3, 6], [2, 2, 2, 3], rows), rows) == 2


@needs_avx512
def test_product_impl_follows_the_threshold(thresholds_restored):
    EXT.set_avx512_min_rows(Q.Q4_1, False, 1)
    EXT.set_avx512_min_rows(Q.Q4_1, True, 4)
    assert [EXT.product_impl(0, Q.Q4_1, True, m) for m in (1, 3, 4, 16)] == [2, 2, 0, 0]
    assert EXT.product_impl(0, Q.Q4_1, False, 1) == 0                   # another kind keeps its own
    assert [EXT.product_impl(i, Q.Q4_1, True, 1) for i in (1, 2, 3)] == [1, 2, 3]   # a forced path stays
    with pytest.raises(RuntimeError, match="at least 1 row"):
        EXT.set_avx512_min_rows(Q.Q8_0, False, 0)
    with pytest.raises(RuntimeError, match="no 8-bit activations"):
        EXT.set_avx512_min_rows(Q.F32, True, 2)


@needs_avx512
@pytest.mark.parametrize("qtype,act8", KINDS)
def test_the_switch_changes_no_bit(thresholds_restored, qtype, act8):
    w = random_blocks(qtype, 40, 96, seed=3, act8=act8)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(1))
    ref = Q.qmm(x, w, 2)
    assert torch.equal(ref, Q.qmm(x, w, 3))
    for t in (1, 3, 9, 10):                       # AVX-512 for all 9 rows, from 3, from 9, never
        EXT.set_avx512_min_rows(qtype, act8, t)
        for m in (1, 2, 3, 8, 9):
            assert torch.equal(Q.qmm(x[:m], w, 0), ref[:m]), (t, m)


def small_step(act8=True):
    return [random_blocks(Q.Q4_1, 64, 128, seed=s, act8=act8) for s in range(3)] + \
        [random_blocks(Q.Q8_0, 96, 128, seed=9, act8=act8)]


@needs_avx512
def test_ensure_times_once_then_reads_what_it_kept(thresholds_restored, timing_home, monkeypatch):
    tmp_path = timing_home
    said = []
    got = KC.ensure(small_step(), log=said.append)
    assert set(got) == {"q4_1a8", "q8_0a8"} and all(1 <= t <= KC.ROWS[-1] + 1 for t in got.values())
    assert len(said) == 2 and "timing" in said[0]
    kept = json.loads((tmp_path / KC.CACHE_NAME).read_text())
    (key, entry), = kept.items()
    assert entry["thresholds"] == got and set(entry["ms"]["q4_1a8"]) == {str(m) for m in KC.ROWS}
    assert f"{torch.get_num_threads()} threads" in key
    assert [EXT.avx512_min_rows(Q.Q4_1, True), EXT.avx512_min_rows(Q.Q8_0, True)] == \
        [got["q4_1a8"], got["q8_0a8"]]

    (tmp_path / KC.CACHE_NAME).rename(tmp_path / "moved")       # the same process: its memo, not the file
    assert KC.ensure(small_step(), log=said.append) == got and len(said) == 2
    (tmp_path / "moved").rename(tmp_path / KC.CACHE_NAME)

    KC._applied.clear()                           # a new process: read, not timed
    entry["thresholds"] = {"q4_1a8": 6, "q8_0a8": 17}
    (tmp_path / KC.CACHE_NAME).write_text(json.dumps({key: entry}))
    monkeypatch.setattr(KC, "measure", lambda *a, **k: pytest.fail("timed again"))
    assert KC.ensure(small_step(), log=said.append) == {"q4_1a8": 6, "q8_0a8": 17} and len(said) == 2
    assert EXT.avx512_min_rows(Q.Q4_1, True) == 6 and EXT.avx512_min_rows(Q.Q8_0, True) == 17


@needs_avx512
def test_ensure_times_again_for_other_shapes_or_a_broken_file(thresholds_restored, timing_home, monkeypatch):
    tmp_path = timing_home
    said = []
    KC.ensure(small_step(), log=said.append)
    KC.ensure(small_step(act8=False), log=said.append)            # weight-only kinds: another step
    assert len(said) == 4 and len(json.loads((tmp_path / KC.CACHE_NAME).read_text())) == 2
    wider = small_step()[:3] + [random_blocks(Q.Q8_0, 160, 128, seed=9, act8=True)]   # same kinds, other shapes
    KC.ensure(wider, log=said.append)
    assert len(said) == 6 and len(json.loads((tmp_path / KC.CACHE_NAME).read_text())) == 3
    KC._applied.clear()
    (tmp_path / KC.CACHE_NAME).write_text("{not json")
    KC.ensure(small_step(), log=said.append)
    assert len(said) == 8 and len(json.loads((tmp_path / KC.CACHE_NAME).read_text())) == 1
    kept = json.loads((tmp_path / KC.CACHE_NAME).read_text())
    for bad in (0, "4", 2.5, None):                # a hand-edited value is timed again, never applied
        KC._applied.clear()
        (key, entry), = kept.items()
        (tmp_path / KC.CACHE_NAME).write_text(json.dumps({key: {**entry, "thresholds": {
            **entry["thresholds"], "q4_1a8": bad}}}))
        n = len(said)
        assert KC.ensure(small_step(), log=said.append)["q4_1a8"] in range(1, KC.ROWS[-1] + 2)
        assert len(said) == n + 2, bad


def test_every_row_count_a_verify_block_uses_is_timed():
    """A row count between two timed ones takes the threshold's path untimed: 5-row verify blocks once ran
    AVX2 where AVX-512 was 1.25x faster, timed at 4 and 6 rows only."""
    assert set(range(1, 10)) <= set(KC.ROWS) and list(KC.ROWS) == sorted(set(KC.ROWS))


@needs_avx512
def test_a_choice_timed_on_other_row_counts_is_timed_again(thresholds_restored, timing_home, monkeypatch):
    said = []
    monkeypatch.setattr(KC, "ROWS", (1, 2, 4))
    KC.ensure(small_step(), log=said.append)
    (old_key, old), = json.loads((timing_home / KC.CACHE_NAME).read_text()).items()
    assert set(old["ms"]["q4_1a8"]) == {"1", "2", "4"} and " | rows 1,2,4" in old_key.split(" | step ")[0]
    KC._applied.clear()
    monkeypatch.setattr(KC, "ROWS", (1, 2, 3, 4))
    KC.ensure(small_step(), log=said.append)
    kept = json.loads((timing_home / KC.CACHE_NAME).read_text())
    assert len(said) == 4 and len(kept) == 2
    new_key = KC.cpu_key(torch.get_num_threads()) + " | step " + KC.signature(KC.groups(small_step()))
    assert set(kept[new_key]["ms"]["q4_1a8"]) == {"1", "2", "3", "4"}


def test_nothing_to_choose(tmp_path, monkeypatch):
    monkeypatch.setattr(quant_ext, "BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("PEAGLE_KERNEL_CHOICE", "widest")
    assert KC.ensure(small_step(), log=pytest.fail) is None
    monkeypatch.delenv("PEAGLE_KERNEL_CHOICE")
    assert KC.ensure([torch.zeros(4, 4)], log=pytest.fail) is None             # no kernel products
    assert not os.listdir(tmp_path)


@needs_avx512
def test_a_target_sets_its_own_thresholds_before_each_forward(thresholds_restored, qtarget):
    from peagle.models.llama import Transformer
    a = Transformer.from_pretrained(qtarget, quantization="q4a8")
    b = Transformer.from_pretrained(qtarget, quantization="q4a8")
    assert a.kernel_paths is not None and "timed here" in a.precision
    a.kernel_paths, b.kernel_paths = {"q4_1a8": 5}, {"q4_1a8": 9}      # as two targets' timings could differ
    ids, start = torch.tensor([[7, 8]]), torch.zeros(1, dtype=torch.long)
    for t, want in ((a, 5), (b, 9), (a, 5)):
        t.forward(ids, t.new_cache(1, 8), 0, start)
        assert EXT.avx512_min_rows(Q.Q4_1, True) == want


@needs_avx512
def test_activate_applies_only_when_another_set_was_applied(thresholds_restored):
    a, b = {"q8_0a8": 3}, {"q8_0a8": 6}
    KC.apply(EXT, a)
    KC.apply(EXT, b)
    KC.activate(a)
    assert EXT.avx512_min_rows(Q.Q8_0, True) == 3
    EXT.set_avx512_min_rows(Q.Q8_0, True, 4)          # behind its back: a's set is still the active one
    KC.activate(a)
    assert EXT.avx512_min_rows(Q.Q8_0, True) == 4
    KC.activate(b)
    assert EXT.avx512_min_rows(Q.Q8_0, True) == 6


def test_the_summary_names_each_kinds_path():
    assert KC.summary({"q4_1a8": 1, "f32": 1}) == "AVX-512 at every row count"
    vnni = EXT is not None and EXT.avx2_vnni()
    assert KC.summary({"q4_1a8": 5, "f32": 2, "q8_0a8": 1}) == \
        f"q4_1a8 {'AVX2+VNNI' if vnni else 'AVX2'} below 5 rows, f32 AVX2 below 2 rows"
    if vnni:
        try:
            EXT.set_avx2_vnni(False)             # the maddubs form: plain AVX2
            assert KC.summary({"q4_1a8": 5}) == "q4_1a8 AVX2 below 5 rows"
        finally:
            EXT.set_avx2_vnni(True)


@needs_avx512
def test_the_key_names_the_avx2_paths_form():
    on = KC.cpu_key(2)
    try:
        EXT.set_avx2_vnni(False)
        off = KC.cpu_key(2)
    finally:
        EXT.set_avx2_vnni(True)
    assert on.endswith(" | avx2 vnni") and off == on[: -len(" | avx2 vnni")]

