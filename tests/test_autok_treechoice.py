"""Auto K with token trees (peagle/autok/treechoice.py): per step tree, chain or plain, whichever the models expect
to yield the most tokens per second; tree acceptance learned from tree steps only, explored while unknown and
again once its evidence has aged. Fixed cost models (refinement off), guard off: the choice alone."""
import numpy as np
import pytest
import torch
from autok_sim import autok_config

from peagle.autok.acceptance import Acceptance
from peagle.autok.auto import AutoK
from peagle.autok.costmodel import CostModel
from peagle.autok.treechoice import TreeChoice

K = 4


class Row:
    def __init__(self, rid):
        self.request_id = rid


def costs():
    """Chain steps: 10 ms + 1 ms per draft; tree steps: 10 ms + 3 ms per depth (more nodes verified)."""
    chain = CostModel([1], [[10e-3 + 1e-3 * k for k in range(K + 1)]])
    tree = CostModel([1], [[10e-3 + 3e-3 * k for k in range(K + 1)]])
    return chain, tree


def policy(half_life=1e9, low=16, high=64, budget=None, tree_cost=None):
    chain, tree = costs()
    tree = tree_cost or tree
    acc = Acceptance(K, prior=[0.5] * K, half_life_rows=half_life)
    tacc = Acceptance(K, prior=[0.5] * K, half_life_rows=half_life)
    return AutoK(K, chain, acc, autok_config(refine=False, guard=False, margin=0.0),
                 tree=TreeChoice(tree, tacc, low, high, budget))


def step(pol, rows, alpha_chain, alpha_tree, g, timed=False):
    """One decode step as the engine runs it: choose K, ask tree or chain, draw acceptance, report (timed: the
    step's seconds as its cost model predicts them, else 10 ms)."""
    k = pol.choose(rows)
    tree = bool(k) and pol.wants_tree()
    alpha = alpha_tree if tree else alpha_chain
    a = torch.zeros(len(rows), dtype=torch.long)
    alive = torch.ones(len(rows), dtype=torch.bool)
    for _ in range(k):
        alive &= torch.rand(len(rows), generator=g) < alpha
        a += alive.long()
    secs = float((pol.tree.cost if tree else pol.cost).predict(len(rows))[k]) if timed else 0.01
    pol.observe(rows, k, a, secs, tree=tree)
    return k, tree


def brute_force(pol, rows):
    """(K, tree) maximising expected tokens / seconds over chain and tree at every K (K = 0: plain)."""
    best = None
    for tree, acc, cost in ((False, pol.acc, pol.cost), (True, pol.tree.acc, pol.tree.cost)):
        al = acc.global_alpha()
        for k in range(K + 1):
            e = len(rows) * (1 + np.cumprod(al[:k]).sum())
            cand = (e / float(cost.predict(len(rows))[k]), k, tree and k > 0)
            best = max(best or cand, cand)
    return best[1], best[2]


def test_explores_trees_first_then_picks_the_faster_kind():
    g = torch.Generator().manual_seed(0)
    rows = [Row("a")]
    pol = policy()
    first = [step(pol, rows, 0.7, 0.05, g) for _ in range(70)]
    assert all(t for k, t in first[:60] if k)          # tree acceptance unknown: trees verified until known
    assert pol.tree.steps >= 60 and not pol.tree.exploring
    ks = [step(pol, rows, 0.7, 0.05, g) for _ in range(100)]
    assert all(k > 0 and not t for k, t in ks[-50:])  # trees accept almost nothing: chains
    k = pol.choose(rows)
    assert (k, pol.wants_tree()) == brute_force(pol, rows)


def test_trees_chosen_when_they_accept_enough_more():
    g = torch.Generator().manual_seed(1)
    rows = [Row("a")]
    pol = policy()
    for _ in range(200):
        step(pol, rows, 0.3, 0.85, g)
    k, tree = step(pol, rows, 0.3, 0.85, g)
    assert tree and k > 0
    k = pol.choose(rows)
    assert (k, pol.wants_tree()) == brute_force(pol, rows)
    d = pol.describe()
    assert d["tree_steps"] > 100 and d["tree_alpha_per_pos"][0] > 0.7 and d["alpha_per_pos"][0] < 0.6


def test_chain_estimate_learns_nothing_from_tree_steps_and_vice_versa():
    pol = policy()
    rows = [Row("a"), Row("b")]
    pol.choose(rows)
    pol.observe(rows, 3, [3, 3], 0.01, tree=True)
    assert pol.acc.t.sum() == 0 and np.allclose(pol.tree.acc.t[:3], [2, 2, 2])
    pol.observe(rows, 2, [0, 1], 0.01, tree=False)        # (evidence only ages: half-life 1e9 rows)
    assert np.allclose(pol.tree.acc.t[:3], [2, 2, 2]) and np.allclose(pol.acc.t[:2], [2, 1])
    # a K = 0 step is neither, even if the engine says tree (it cannot verify one)
    pol.observe(rows, 0, [0, 0], 0.01, tree=True)
    assert pol.tree.steps == 1


def test_unused_trees_are_explored_again_once_their_evidence_ages():
    g = torch.Generator().manual_seed(2)
    rows = [Row("a")]
    pol = policy(half_life=64)
    kinds = [step(pol, rows, 0.7, 0.05, g)[1] for _ in range(600)]
    starts = [i for i in range(1, len(kinds)) if kinds[i] and not kinds[i - 1]]
    assert kinds[0] and starts, "a tree left unused must be tried again"
    assert sum(kinds) < len(kinds) // 2                # but mostly chains: trees do not pay here


def test_no_tree_choice_keeps_the_engine_default():
    chain, _ = costs()
    pol = AutoK(K, chain, Acceptance(K), autok_config(refine=False, guard=False))
    pol.choose([Row("a")])
    assert pol.wants_tree()                            # an engine with trees verifies them, as before


def explore_share(budget, steps=300, seed=3):
    """Trees that do not pay (acceptance 0.05 vs the chain's 0.7), steps timed by the cost models: the share of
    all seconds that tree steps cost beyond the chain of the same K, and how many tree steps ran."""
    g = torch.Generator().manual_seed(seed)
    rows = [Row("a")]
    pol = policy(budget=budget)
    extra = total = 0.0
    for _ in range(steps):
        k, tree = step(pol, rows, 0.7, 0.05, g, timed=True)
        chain_s = float(pol.cost.predict(1)[k])
        total += float(pol.tree.cost.predict(1)[k]) if tree else chain_s
        extra += float(pol.tree.cost.predict(1)[k]) - chain_s if tree else 0.0
    return extra / total, pol.tree.steps


def test_exploring_trees_costs_at_most_its_budget():
    share, trees = explore_share(0.05)
    assert trees > 0, "trees must still be tried"
    assert share <= 0.05 + 1e-9
    share_unbounded, trees_unbounded = explore_share(None)      # negative control: the unbounded exploration
    assert share_unbounded > 0.05 and trees_unbounded > trees


def test_trees_that_accept_more_are_still_found_under_the_budget():
    g = torch.Generator().manual_seed(4)
    rows = [Row("a")]
    pol = policy(budget=0.05)
    kinds = [step(pol, rows, 0.3, 0.85, g, timed=True)[1] for _ in range(1500)]
    assert sum(kinds[-100:]) >= 95                    # learnt: the tree pays, so it is chosen, not forced
    k = pol.choose(rows)
    assert (k, pol.wants_tree()) == brute_force(pol, rows)


def test_a_tree_that_cannot_pay_is_never_explored():
    """Tree steps at 100 ms: even accepting every draft (K + 1 tokens) they lose to the chain, so no step is
    spent learning their acceptance, budget or not."""
    slow = CostModel([1], [[10e-3] + [100e-3] * K])
    for budget in (None, 0.05):
        g = torch.Generator().manual_seed(5)
        pol = policy(budget=budget, tree_cost=slow)
        kinds = [step(pol, [Row("a")], 0.7, 0.05, g, timed=True) for _ in range(200)]
        assert pol.tree.steps == 0 and any(k for k, _ in kinds)


def test_budget_must_be_non_negative():
    chain, tree = costs()
    with pytest.raises(ValueError, match="budget"):
        TreeChoice(tree, Acceptance(K), budget=-0.1)
