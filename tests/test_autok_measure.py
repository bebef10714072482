"""peagle/autok/measure.py's bookkeeping: the grid of batch sizes, passes per batch size, and the time still to
go that the first start prints after each batch size, and where it stops measuring a K that cannot pay (through
measure() with a scripted engine; the measurement with a real engine runs end to end in test_autok_factory.py)."""
import pytest

from peagle.autok.measure import cannot_pay, extrapolate, grid_batch_sizes, max_tokens, measure, passes_for, seconds_left


def test_grid_doubles_up_to_the_largest_batch():
    assert grid_batch_sizes(1) == [1]
    assert grid_batch_sizes(4) == [1, 2, 4]
    assert grid_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_small_batches_get_more_passes():
    assert [passes_for(B, 8) for B in (1, 2, 4, 8, 64)] == [8, 4, 2, 2, 2]


def test_seconds_left_prices_each_larger_batch_by_its_passes_and_rows():
    bs = [1, 2, 4, 8, 16, 32, 64, 128]
    assert seconds_left(bs, 5, 7.2, 8) == pytest.approx(7.2 * (2 + 4))    # after B=32 (2 passes): 64, 128 to go
    # after B=1 (8 passes): B=2 has 4 passes of 2 rows, B=4 2 of 4, then 2 passes each
    assert seconds_left(bs, 0, 1.0, 8) == pytest.approx(1.0 + 1.0 + (8 + 16 + 32 + 64 + 128) / 4)
    assert seconds_left(bs, len(bs) - 1, 40.0, 8) == 0                   # the last: nothing left
    assert seconds_left([1, 2, 4, 100], 2, 4.0, 8) == pytest.approx(100.0)   # a last size off the doubling


def test_cannot_pay_bounds_tokens_by_the_acceptance():
    assert max_tokens(0) == 1 and max_tokens(2, 0.5) == pytest.approx(1.75)
    assert not cannot_pay(1.0, 1.7, 1)            # 1.7x plain: pays if 1.9 tokens come back
    assert cannot_pay(1.0, 1.95, 1)
    assert not cannot_pay(1.0, 9.0, 0)            # plain decoding is always measured
    assert extrapolate([1.0, 2.0, 3.5, 0.0, 0.0], 2) == [1.0, 2.0, 3.5, 5.0, 6.5]
    assert extrapolate([1.0, 2.0], 1) == [1.0, 2.0]


class Cfg:
    max_position_embeddings, vocab_size = 4096, 100


class Target:
    cfg = Cfg()


class ScriptedEngine:
    """measure()'s view of an engine: admits, steps with the policy's K, reports seconds(B, K) as the step's time."""

    def __init__(self, policy, seconds):
        self.policy, self.seconds, self.proposer = policy, seconds, None
        self.waiting, self.running, self.steps = [], [], []

    def add_request(self, rid, ids, params):
        self.waiting.append(type("R", (), {"request_id": rid})())

    def step(self):
        if self.waiting:
            self.running, self.waiting = self.running + self.waiting, []
            return
        k = self.policy.choose(self.running)
        self.steps.append((len(self.running), k))
        self.policy.observe(self.running, k, [0] * len(self.running), self.seconds(len(self.running), k))

    def abort(self, rid):
        self.running = [r for r in self.running if r.request_id != rid]


def test_measure_stops_where_no_k_can_pay_and_extrapolates():
    # B = 1: a draft costs 0.1 plain steps (every K may pay); B = 8: 1.0 (K = 1 costs 2x plain, K = 2 3x: cannot
    # pay)
    seconds = {1: lambda k: 1.0 + 0.1 * k, 8: lambda k: 8.0 + 8.0 * k}
    engines, lines = [], []

    def make(policy, rows, mlen, seed):
        engines.append(ScriptedEngine(policy, lambda B, k: seconds[B](k)))
        return engines[0]
    cm = measure(Target(), make, 4, [1, 8], steps=2, log=lines.append)
    measured = [k for B, k in engines[0].steps if B == 8]
    assert set(measured) == {0, 1, 2}                # K = 1 and 2 cannot pay: K 3, 4 never run at B = 8
    assert max(k for B, k in engines[0].steps if B == 1) == 4
    assert cm.meta["measured_k_max"] == [4, 2]
    assert cm.meta["raw_seconds_per_step"][1] == pytest.approx([8.0, 16.0, 24.0, 32.0, 40.0])
    assert "K3..4 extrapolated" in lines[1] and "extrapolated" not in lines[0]


def test_one_step_that_cannot_pay_cuts_nothing():
    # K = 1 looks too slow once (a noisy step); K = 2 pays at acceptance 0.9: every K is measured
    seconds = {1: lambda k: 1.0 + 0.1 * k + (1.0 if k == 1 else 0.0)}
    eng = []
    cm = measure(Target(), lambda policy, *a: eng.append(ScriptedEngine(policy, lambda B, k: seconds[B](k))) or eng[0],
                 4, [1], steps=2)
    assert cm.meta["measured_k_max"] == [4] and max(k for _, k in eng[0].steps) == 4


def test_rows_at_the_context_limit_end_the_cell_instead_of_failing():
    """A step that decodes nothing (every row finished: a tiny context limit) logs no step: measure() moved on
    instead of reading a log entry that is not there (IndexError)."""
    class Finishing(ScriptedEngine):
        def step(self):
            if len(self.steps) >= 3 and not self.waiting:
                self.running = []                                      # every row reached the limit
                return
            super().step()
    eng = []
    cm = measure(Target(), lambda policy, *a: eng.append(Finishing(policy, lambda B, k: 1.0 + 0.1 * k)) or eng[0],
                 2, [1, 2], steps=2)
    assert cm.t.shape == (2, 3) and (cm.t > 0).all()


def test_one_k_left_out_is_named_alone():
    seconds = {1: lambda k: 1.0 + (0.1 * k if k < 3 else 1.0 * k)}      # K = 3 and 4 cannot pay: K5 extrapolated
    eng, lines = [], []
    measure(Target(), lambda policy, *a: eng.append(ScriptedEngine(policy, lambda B, k: seconds[B](k))) or eng[0],
            5, [1], steps=2, log=lines.append)
    assert "; K5 extrapolated" in lines[0] and "K5.." not in lines[0]
