"""The live acceptance estimate: recovers known conditional acceptance whatever K the steps used, forgets,
falls back to its prior for positions no longer drafted, and keeps requests apart."""
import numpy as np
import torch

from peagle.autok.acceptance import Acceptance


def simulate(acc, alpha, steps, B=8, ks=(0, 1, 2, 3, 5), seed=0, rids=None):
    """Rows accept draft i with probability alpha[i-1] (or alpha[row][i-1]) given drafts 1..i-1 were accepted;
    K cycles over ks."""
    g = torch.Generator().manual_seed(seed)
    rids = rids or [f"r{i}" for i in range(B)]
    al = torch.tensor(alpha, dtype=torch.float64)
    al = al.expand(len(rids), -1) if al.dim() == 1 else al
    for s in range(steps):
        k = ks[s % len(ks)]
        a = torch.zeros(len(rids), dtype=torch.long)
        alive = torch.ones(len(rids), dtype=torch.bool)
        for i in range(k):
            alive &= torch.rand(len(rids), generator=g, dtype=torch.float64) < al[:, i]
            a += alive.long()
        acc.observe(rids, k, a)


def test_recovers_conditional_acceptance_with_k_changing():
    alpha = [0.9, 0.5, 0.8, 0.7, 0.6]
    acc = Acceptance(5, half_life_rows=1e9)          # no forgetting: a plain estimate
    simulate(acc, alpha, 3000)
    est = acc.global_alpha()
    assert np.allclose(est, alpha, atol=0.03), est
    # E[accepted + 1 | K] = 1 + sum_i prod_{j<=i} alpha_j, per row, summed over the batch
    e = acc.expected_tokens(["x", "y"])               # unknown requests: the global estimate
    want = [1.0]
    p = 1.0
    for a in est.tolist():
        p *= a
        want.append(want[-1] + p)
    assert np.allclose(e, 2 * np.array(want), atol=1e-9)


def test_unused_positions_follow_the_position_before_and_evidence_is_forgotten():
    acc = Acceptance(6, prior=[0.8, 0.4, 0.4, 0.2, 0.2, 0.2], half_life_rows=64)
    simulate(acc, [0.95, 0.9], 400, ks=(2,))          # only K = 2 drafted
    a = acc.global_alpha()
    assert a[0] > 0.9 and a[1] > 0.85
    assert np.isclose(a[2], a[1] * 1.0, atol=1e-6) and np.isclose(a[3], a[2] * 0.5, atol=1e-6)
    simulate(acc, [0.0, 0.0], 400, ks=(2,))           # acceptance collapses: the estimate follows
    assert acc.global_alpha()[0] < 0.1
    simulate(acc, [0.0], 4000, ks=(0,))               # K = 0 steps only: evidence ages, back to the prior
    assert abs(float(acc.global_alpha()[0]) - 0.8) < 0.02


def test_requests_are_estimated_apart_and_forgotten_when_they_leave():
    acc = Acceptance(3, half_life_rows=1e9)
    simulate(acc, [[0.95] * 3, [0.05] * 3], 200, rids=["good", "bad"], ks=(3,), seed=1)
    a = acc.alphas(["good", "bad", "new"])
    assert a[0, 0] > 0.85 and a[1, 0] < 0.2
    assert np.allclose(a[2], acc.global_alpha())
    acc.observe(["bad"], 1, torch.zeros(1, dtype=torch.long))           # "good" left the batch
    assert "good" not in acc.slots
    assert np.allclose(acc.alphas(["good"])[0], acc.global_alpha())
    acc.observe(["bad", "n2"], 1, torch.ones(2, dtype=torch.long))      # its slot is reused
    assert sorted(acc.slots.values()) == sorted(set(acc.slots.values()))
    i = acc.slots["n2"]                      # n2 holds its own one step, nothing of "good" (a mutation review)
    assert acc.rt[i].tolist() == [1.0, 0.0, 0.0] and acc.rs[i].tolist() == [1.0, 0.0, 0.0]


def test_an_unused_position_is_never_estimated_above_the_one_before():
    """A prior rising with depth (a head's training accuracy can) must not lift an undrafted position above the
    position before it: that flatters large K."""
    a = Acceptance(3, prior=[0.4, 0.8, 0.9]).global_alpha()
    assert a[1] <= a[0] and a[2] <= a[1]


def test_ageing_is_applied_before_the_counts_are_read():
    """age() defers its product to the next read: the counts then equal the eager ones (decay per row-step
    to the power of the rows aged), however the ageing was split and whatever reads first."""
    acc = Acceptance(3, half_life_rows=10)
    acc.observe(["x", "y"], 2, [1, 2])
    t0, s0 = acc.t.copy(), acc.s.copy()
    acc.age(7)
    acc.age(8)
    assert np.array_equal(acc._t, t0)               # not yet applied: a step without drafts adds an integer
    assert np.allclose(acc.t, t0 * 0.5 ** 1.5) and np.allclose(acc.s, s0 * 0.5 ** 1.5)
    acc.age(10)
    a = acc.global_alpha()
    fresh = Acceptance(3, half_life_rows=10)
    fresh.observe(["x", "y"], 2, [1, 2])
    fresh.observe(["x", "y"] * 12 + ["x"], 0, [0] * 25)          # 25 row-steps without drafts, aged at once
    assert np.allclose(a, fresh.global_alpha()) and not np.allclose(a, Acceptance(3).global_alpha())
