"""AutoK's choice: argmax_K sum_rows E[accepted + 1 | K] / t_step(B, K), on a given cost model and live
acceptance (no timing: the cost model is fixed, refinement off)."""
import torch

from peagle.autok.acceptance import Acceptance
from peagle.autok.auto import AutoK
from peagle.autok.costmodel import CostModel


class Row:
    def __init__(self, rid):
        self.request_id = rid


def cost(k_max=6):
    # drafting is cheap at B=1 and expensive per token at B=64 (verification is no longer free)
    return CostModel([1, 64], [[10e-3 + 1e-3 * k for k in range(k_max + 1)],
                               [40e-3 + 12e-3 * k for k in range(k_max + 1)]])


def feed(policy, rows, alpha, steps, k=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    rids = [r.request_id for r in rows]
    for _ in range(steps):
        kk = policy.choose(rows) if k is None else k
        a = torch.zeros(len(rows), dtype=torch.long)
        alive = torch.ones(len(rows), dtype=torch.bool)
        for i in range(kk):
            alive &= torch.rand(len(rows), generator=g) < alpha
            a += alive.long()
        policy.acc.observe(rids, kk, a)


def brute_force(policy, rows):
    al = policy.acc.global_alpha().tolist()
    best = None
    for k in range(policy.k_max + 1):
        e, p = 1.0, 1.0
        for i in range(k):
            p *= al[i]
            e += p
        rate = len(rows) * e / float(policy.cost.predict(len(rows))[k])
        best = max(best or (rate, k), (rate, k))
    return best[1]


def test_chooses_the_k_with_most_tokens_per_second():
    pol = AutoK(6, cost(), Acceptance(6), refine=False)
    one, many = [Row("a")], [Row(f"r{i}") for i in range(64)]
    feed(pol, many, 0.8, 50, k=6)
    k1, k64 = pol.choose(one), pol.choose(many)
    assert k1 == brute_force(pol, one) and k64 == brute_force(pol, many)
    assert k1 == 6 and 0 < k64 < 6                   # deep at c=1, shallower when verification costs
    d = pol.describe()
    assert d["mode"] == "auto" and d["k"] == k64 and len(d["step_time_s"]) == 7 and len(d["alpha_per_pos"]) == 6


def test_k0_when_drafts_are_rejected_and_tries_again_once_evidence_ages():
    pol = AutoK(6, cost(), Acceptance(6, prior=[0.8] * 6, half_life_rows=256), refine=False)
    rows = [Row(f"r{i}") for i in range(64)]
    assert pol.drafts_next(64) and pol.choose(rows) > 0   # the prior says drafting pays
    feed(pol, rows, 0.0, 20, k=2)                      # nothing is accepted
    assert pol.choose(rows) == 0                       # speculation would cost: plain decoding
    assert not pol.drafts_next(len(rows))              # new prompts are not prefilled into the drafter
    ks = []
    for _ in range(200):                               # K = 0 steps: no new evidence, the old one ages
        k = pol.choose(rows)
        ks.append(k)
        pol.observe(rows, k, torch.zeros(len(rows), dtype=torch.long), 0.04)
        if k:
            break
    assert ks[0] == 0 and ks[-1] > 0                   # probes again after a while


def test_per_request_acceptance_counts():
    pol = AutoK(6, cost(), Acceptance(6, half_life_rows=1e9), refine=False)
    rows = [Row("good"), Row("bad")]
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        a = torch.tensor([6 if torch.rand((), generator=g) < 0.9 else 0, 0])
        pol.observe(rows, 6, a, 0.01)
    e_good = pol.acc.expected_tokens(["good"])
    e_bad = pol.acc.expected_tokens(["bad"])
    assert e_good[6] > 4 and e_bad[6] < 1.5
    assert pol.choose([Row("bad")]) < pol.choose([Row("good")]) == 6
