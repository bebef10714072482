"""AutoK's choice: argmax_K sum_rows E[accepted + 1 | K] / t_step(B, K), on a given cost model and live
acceptance (no timing: the cost model is fixed, refinement off). The model alone: the loss guard is off here
(guard=False; tests/test_autok_guard.py tests it)."""
import torch
from autok_sim import Backlog, autok_config

from peagle.autok.acceptance import Acceptance
from peagle.autok.auto import PRIOR_ROWS, AutoK
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
    pol = AutoK(6, cost(), Acceptance(6), autok_config(refine=False, guard=False))
    one, many = [Row("a")], [Row(f"r{i}") for i in range(64)]
    feed(pol, many, 0.8, 50, k=6)
    k1, k64 = pol.choose(one), pol.choose(many)
    assert k1 == brute_force(pol, one) and k64 == brute_force(pol, many)
    assert k1 == 6 and 0 < k64 < 6                   # deep at c=1, shallower when verification costs
    d = pol.describe()
    assert d["mode"] == "auto" and d["k"] == k64 and len(d["step_time_s"]) == 7 and len(d["alpha_per_pos"]) == 6


def test_k0_when_drafts_are_rejected_and_tries_again_once_evidence_ages():
    # a small margin: this is about how fast old evidence ages, not about the default margin's caution
    pol = AutoK(6, cost(), Acceptance(6, prior=[0.8] * 6, half_life_rows=256),
                autok_config(refine=False, guard=False, margin=0.02))
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
    pol = AutoK(6, cost(), Acceptance(6, half_life_rows=1e9), autok_config(refine=False, guard=False))
    rows = [Row("good"), Row("bad")]
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        a = torch.tensor([6 if torch.rand((), generator=g) < 0.9 else 0, 0])
        pol.observe(rows, 6, a, 0.01)
    e_good = pol.acc.expected_tokens(["good"])
    e_bad = pol.acc.expected_tokens(["bad"])
    assert e_good[6] > 4 and e_bad[6] < 1.5
    assert pol.choose([Row("bad")]) < pol.choose([Row("good")]) == 6


class Behind(Row):
    """A running request whose drafter is `behind` rows behind, with `left` tokens still to generate."""

    def __init__(self, rid, behind, left):
        super().__init__(rid)
        from peagle.sampling import SamplingParams
        self.behind, self.params, self.output_ids = behind, SamplingParams(max_tokens=left + 10), [0] * 10


def batch(pol, n, behind, left):
    """n Behind rows, with a stand-in proposer attached to pol that counts their drafter rows."""
    rows = [Behind(f"r{i}", behind, left) for i in range(n)]
    pol.attach(Backlog(rows))
    return rows


def test_a_drafter_catch_up_is_paid_only_when_the_remaining_tokens_repay_it():
    """After K = 0 steps the drafter is behind; the first K > 0 step feeds every skipped row (a padded block of
    B x max rows), a one-off cost amortised over the tokens the batch still generates: a long backlog with few
    tokens left stays at K = 0, the same backlog with many tokens left (or a short one) drafts."""
    pol = AutoK(6, cost(), Acceptance(6, prior=[0.8] * 6), autok_config(refine=False, guard=False, settle=1))
    pol.row_s = 1e-3
    steady = pol.choose(batch(pol, 4, 1, 8))
    assert steady > 0 and pol.last["catch_up_rows"] == 0
    assert pol.choose(batch(pol, 4, 300, 8)) == 0                                 # 4 x 293 rows for 8 tokens
    assert pol.last["catch_up_rows"] == 4 * (300 - 7)
    assert pol.choose(batch(pol, 4, 300, 2000)) > 0                               # repaid over many steps
    assert pol.choose(batch(pol, 4, 12, 8)) > 0                                   # a short backlog


def test_a_k0_choice_stands_for_settle_steps_of_the_same_batch():
    """Deciding K = 0 again at every step costs the estimate (~0.5 ms, 7 % of the demo target's step) and
    rarely changes it: a K = 0 choice stands `settle` steps while the batch's requests are unchanged, then is
    made again; a changed batch is decided at once. settle=1 (the negative control) estimates every step."""
    def run(settle, batches, alpha=0.02):
        pol = AutoK(6, cost(), Acceptance(6, prior=[alpha] * 6),
                    autok_config(refine=False, guard=False, settle=settle))
        n, rates = [0], pol.rates

        def counted(rids):
            n[0] += 1
            return rates(rids)
        pol.rates = counted
        ks = []
        for rows in batches:
            ks.append(pol.choose(rows))
            pol.observe(rows, ks[-1], [ks[-1] if alpha > 0.5 else 0] * len(rows), 0.01)
        return ks, n[0]

    same = [[Row("a"), Row("b")]] * 40
    assert run(16, same) == ([0] * 40, 3)                  # estimated at steps 1, 17 and 33
    assert run(1, same) == ([0] * 40, 40)
    assert run(16, [[Row("a")]] * 5 + [[Row("a"), Row("b")]] * 5)[1] == 2    # a new request: decided again
    ks, n = run(16, same, alpha=0.9)                       # K > 0 chosen: decided every step
    assert all(ks) and n == 40


def test_catch_up_cost_is_learned_from_catch_up_steps_and_kept_out_of_the_cost_model():
    measured = cost()
    measured.meta["drafter_row_s"] = 2e-4                  # measure.py's drafter prefill per row
    pol = AutoK(6, measured, Acceptance(6, prior=[0.8] * 6), autok_config(refine=True, guard=False))
    prior = pol.row_s
    assert prior == 2e-4                                   # the measured price is the prior
    rows = batch(pol, 4, 50, 2000)
    k = pol.choose(rows)
    assert k > 0
    before = pol.cost.t.copy()
    steady = float(pol.cost.predict(4)[k])
    pol.observe(rows, k, torch.zeros(4, dtype=torch.long), steady + 0.5)          # 0.5 s beyond steady state
    rows_fed = 4 * (50 - 7)
    assert abs(pol.row_s - (PRIOR_ROWS * prior + 0.5) / (PRIOR_ROWS + rows_fed)) < 1e-12   # pooled by rows
    assert (pol.cost.t == before).all() and pol.cost.updates == 0
    steady_rows = batch(pol, 4, 1, 2000)
    k = pol.choose(steady_rows)
    pol.observe(steady_rows, k, torch.zeros(4, dtype=torch.long), 0.5)
    assert pol.cost.updates == 1                                                    # a steady step refines it


def test_a_small_noisy_catch_up_barely_moves_the_row_price_and_large_ones_dominate():
    """A catch-up of few rows carries a whole step's noise: one 8-row catch-up 15 ms over its prediction moves
    the measured 0.28 ms per row by < 20 % (taken alone, as before the pooling, it read 1.9 ms: 7x), while a
    steady stream of large catch-ups at a truly higher price takes the estimate there."""
    measured = cost()
    measured.meta["drafter_row_s"] = 2.8e-4
    pol = AutoK(6, measured, Acceptance(6, prior=[0.8] * 6), autok_config(refine=True, guard=False))
    assert pol.row_s == 2.8e-4
    few = batch(pol, 1, 7 + 8, 2000)                         # 8 rows beyond a steady step's k_max + 1
    k = pol.choose(few)
    assert k > 0 and pol.last["catch_up_rows"] == 8
    pol.observe(few, k, torch.zeros(1, dtype=torch.long), float(pol.cost.predict(1)[k]) + 0.015)
    naive = 0.015 / 8
    assert naive > 6 * 2.8e-4 and pol.row_s < 1.2 * 2.8e-4
    big = batch(pol, 4, 7 + 300, 2000)
    for _ in range(40):                                      # 1,200 rows each at 1 ms per row
        k = pol.choose(big)
        pol.observe(big, k, torch.zeros(4, dtype=torch.long), float(pol.cost.predict(4)[k]) + 1200 * 1e-3)
    assert abs(pol.row_s - 1e-3) < 0.05e-3


def test_admission_prefills_the_drafter_only_for_a_batch_that_will_draft():
    """drafts_next(B): the engine skips the drafter prefill of new prompts when a batch of B rows is expected
    to decode with K = 0 (here: drafts rejected, so no batch size drafts; with good drafts B = 1 does)."""
    pol = AutoK(6, cost(), Acceptance(6, prior=[0.8] * 6), autok_config(refine=False, guard=False))
    assert pol.drafts_next(1)
    expensive = CostModel([1, 64], [[10e-3 + 30e-3 * k for k in range(7)], [40e-3 + 120e-3 * k for k in range(7)]])
    pol2 = AutoK(6, expensive, Acceptance(6, prior=[0.3] * 6), autok_config(refine=False, guard=False))
    assert not pol2.drafts_next(64) and not pol2.drafts_next(1)
    feed(pol, [Row(f"r{i}") for i in range(64)], 0.02, 40, k=6)          # drafts are rejected
    assert not pol.drafts_next(64)
