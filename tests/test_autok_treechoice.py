"""Auto K with token trees (peagle/autok/treechoice.py): per step tree, chain or plain, whichever the models expect
to yield the most tokens per second; tree acceptance learned from tree steps only, explored while unknown and
again once its evidence has aged. Fixed cost models (refinement off), guard off: the choice alone."""
import numpy as np
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


def policy(half_life=1e9, low=16, high=64):
    chain, tree = costs()
    acc = Acceptance(K, prior=[0.5] * K, half_life_rows=half_life)
    tacc = Acceptance(K, prior=[0.5] * K, half_life_rows=half_life)
    return AutoK(K, chain, acc, autok_config(refine=False, guard=False, margin=0.0),
                 tree=TreeChoice(tree, tacc, low, high))


def step(pol, rows, alpha_chain, alpha_tree, g):
    """One decode step as the engine runs it: choose K, ask tree or chain, draw acceptance, report."""
    k = pol.choose(rows)
    tree = bool(k) and pol.wants_tree()
    alpha = alpha_tree if tree else alpha_chain
    a = torch.zeros(len(rows), dtype=torch.long)
    alive = torch.ones(len(rows), dtype=torch.bool)
    for _ in range(k):
        alive &= torch.rand(len(rows), generator=g) < alpha
        a += alive.long()
    pol.observe(rows, k, a, 0.01, tree=tree)
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
