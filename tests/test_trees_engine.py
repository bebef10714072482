"""Token trees through the engine (peagle/tree_step.py): greedy identity with plain decoding on ragged batches
(random heads on both drafters and both target backends, and an oracle tree drafter that accepts deep paths at
varying node indices), sampled rows verifying trees (exact: chi-square, and a one-child tree draws what the
chain draws), auto K with trees, `peagle bench --trees`; negative controls: a broken mask, slot positions or a
skipped KV compaction make identity fail, and a wrong sampled verification fails the chi-square."""
import pytest
import torch
from fakes import FakeProposer, install_proposer
from test_engine_lossless import ids, prompts

import peagle.tree as tree_mod
import peagle.tree_step as tree_step_mod
from peagle import LLM, SamplingParams
from peagle.autok.costmodel import CostModel
from peagle.engine import cache_len
from peagle.models.layers import causal_block_mask
from peagle.tree import TreeSpec, select_nodes


class OracleTreeProposer(FakeProposer):
    """Trees around the reference continuation: at every depth the true token is one of up to topk shuffled
    siblings (missing with probability `noise`), distractor nodes get children too, scores are random, so the
    accepted path sits at varying node indices and depths, and rows' trees differ (ragged)."""

    def __init__(self, k, ref, noise, seed=0):
        super().__init__(k)
        self.ref, self.noise = ref, noise
        self.g = torch.Generator().manual_seed(seed)
        self.trees = 0

    def propose(self, batch, k=None):                     # chain steps: the true drafts
        k = k or self.k
        return torch.tensor([(self.ref[tuple(r.prompt_token_ids)][len(r.output_ids):] + [7] * k)[:k]
                             for r in batch.requests])

    def propose_tree(self, batch, K, topk, nodes):
        self.trees += 1
        g, rows = self.g, []
        for r in batch.requests:
            true = (self.ref[tuple(r.prompt_token_ids)][len(r.output_ids):] + [7] * K)[:K]
            t, p, d, s = [], [], [], []
            frontier = [(-1, 0.0, 0, True)]
            while frontier:
                par, sc, dep, on = frontier.pop(0)
                if dep == K:
                    continue
                n = int(torch.randint(1, topk + 1, (1,), generator=g))
                kids = [(x, False) for x in (torch.randperm(490, generator=g)[:n + 1] + 5).tolist() if x != true[dep]][:n]
                if on and torch.rand((), generator=g) > self.noise:
                    kids[int(torch.randint(0, len(kids), (1,), generator=g))] = (true[dep], True)
                for tok, on_k in kids:
                    t.append(tok), p.append(par), d.append(dep + 1)
                    s.append(sc + float(torch.log(torch.rand((), generator=g))) + (2.0 if on_k else 0.0))
                    frontier.append((len(t) - 1, s[-1], dep + 1, on_k))
            rows.append((t, p, d, s))
        C = max(len(x[0]) for x in rows)

        def col(i, v):
            return torch.tensor([x[i] + [v] * (C - len(x[i])) for x in rows])
        return select_nodes(col(0, 0), col(1, -1), col(2, 1), col(3, float("-inf")).double(), nodes, K)


def tree_llm(target, proposer, k, topk, nodes, backend="auto", **kw):
    llm = install_proposer(LLM(target, target_backend=backend, **kw), proposer, k)
    e = llm.engine
    e.tree = TreeSpec(topk, nodes)
    e.cache = e.target.new_cache(1, cache_len(e.max_model_len, k, e.tree))
    return llm


def oracle_case(target, batch, k, topk, nodes, noise, backend="auto", max_num_seqs=128, seed=0):
    ps = prompts(batch, seed=seed + 17)
    sp = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    base = LLM(target, target_backend=backend)
    full = ids(base.generate(ps, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    ref = {tuple(p["prompt_token_ids"]): f for p, f in zip(ps, full)}
    prop = OracleTreeProposer(k, ref, noise, seed)
    llm = tree_llm(target, prop, k, topk, nodes, backend, max_num_seqs=max_num_seqs)
    return ids(llm.generate(ps, sp)), [f[:23] for f in full], llm


ORACLE = [(4, 3, 12, 1, 128), (5, 4, 20, 3, 128), (3, 2, 6, 16, 5), (6, 3, 64, 7, 128)]   # k, topk, nodes, batch, seqs


# the continuous-batching case (16 prompts through 5 rows) on the native backend only: one is enough
@pytest.mark.parametrize("backend,k,topk,nodes,batch,seqs", [("native", *c) for c in ORACLE] +
                         [("transformers", *c) for c in ORACLE if c[3] != 16])
def test_oracle_trees_greedy_identical_ragged_batches(target, backend, k, topk, nodes, batch, seqs):
    got, want, llm = oracle_case(target, batch, k, topk, nodes, 0.15, backend, seqs)
    assert got == want
    m = llm.get_metrics()
    assert m["mean_acceptance_length"] > 1.5 and m["num_accepted_tokens_per_pos"][k - 1] > 0   # full depth too
    assert m["num_tree_nodes"] > m["num_tree_rows"] and m["mean_tree_nodes_per_step"] <= nodes


def test_negative_control_broken_mask_breaks_identity(target, monkeypatch):
    """Nodes attending to every earlier block slot (a chain's causal mask) instead of their ancestors."""
    def causal(self, S, window=None):
        return causal_block_mask(self.base, self.anc.shape[1], S, window)
    monkeypatch.setattr(tree_mod.TreeAttn, "mask", causal)
    got, want, _ = oracle_case(target, 3, 5, 4, 20, 0.15, "native")
    assert got != want


def test_negative_control_slot_positions_break_identity(target, monkeypatch):
    """Rope at the node's slot (start + index) instead of its depth."""
    orig = tree_mod.Tree.attn

    def slots(self, start, max_depth):
        a = orig(self, start, max_depth)
        a.pos = start[:, None] + torch.arange(self.size)[None]
        return a
    monkeypatch.setattr(tree_mod.Tree, "attn", slots)
    got, want, _ = oracle_case(target, 3, 5, 4, 20, 0.15, "native")
    assert got != want


def test_negative_control_skipped_kv_compaction_breaks_identity(target, monkeypatch):
    monkeypatch.setattr(tree_step_mod, "compact_kv", lambda *a: None)
    got, want, _ = oracle_case(target, 3, 5, 4, 20, 0.15, "native")
    assert got != want


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_random_head_trees_greedy_identical(target, heads, method, backend):
    ps = prompts(6, seed=5, hi=40)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = ids(LLM(target, target_backend=backend).generate(ps, sp))
    spec = {"method": "eagle3", "model": heads[method], "num_speculative_tokens": 4,
            "parallel_drafting": method == "peagle", "eagle_topk": 3, "num_draft_tokens": 10}
    llm = LLM(target, target_backend=backend, speculative_config=spec, max_num_seqs=4)
    assert ids(llm.generate(ps, sp)) == ref
    m = llm.get_metrics()
    assert m["num_tree_rows"] > 0 and m["mean_tree_nodes_per_step"] == 10


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_topk_one_tree_is_the_chain(target, heads, method):
    """eagle_topk 1 with num_draft_tokens >= K drafts the chain's tokens: same outputs and same acceptance."""
    ps = prompts(4, seed=9, hi=30)
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    base = {"method": "eagle3", "model": heads[method], "num_speculative_tokens": 3,
            "parallel_drafting": method == "peagle"}
    chain = LLM(target, speculative_config=base)
    tree = LLM(target, speculative_config=dict(base, num_draft_tokens=3))
    assert tree.engine.tree == TreeSpec(1, 3) and chain.engine.tree is None
    assert ids(tree.generate(ps, sp)) == ids(chain.generate(ps, sp))
    mc, mt = chain.get_metrics(), tree.get_metrics()
    assert mc["num_accepted_tokens_per_pos"] == mt["num_accepted_tokens_per_pos"]


def test_mixed_batches_run_trees_and_greedy_rows_stay_identical(target):
    """Batches with sampled and greedy rows run tree steps: the greedy rows match plain decoding, the sampled
    rows' tokens are the tree verification's (tree.accept_sampled; exact: the tests below)."""
    ps = prompts(6, seed=21)
    full = ids(LLM(target).generate(ps, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    ref = {tuple(p["prompt_token_ids"]): f for p, f in zip(ps, full)}
    sps = [SamplingParams(temperature=0.8 if i % 2 else 0, max_tokens=30, ignore_eos=True, seed=i)
           for i in range(6)]
    prop = OracleTreeProposer(4, ref, 0.0)
    mixed = []
    prop.propose = lambda *a, **kw: pytest.fail("a chain step ran under a tree config")
    propose_tree = prop.propose_tree

    def counted(batch, *a):
        mixed.append(len({r.params.greedy for r in batch.requests}) == 2)
        return propose_tree(batch, *a)
    prop.propose_tree = counted
    tree = tree_llm(target, prop, 4, 3, 12)
    got = ids(tree.generate(ps, sps))
    assert [x for i, x in enumerate(got) if i % 2 == 0] == [full[i][:30] for i in range(0, 6, 2)]
    assert sum(mixed) > 5                             # trees drafted for batches of greedy and sampled rows
    assert [len(x) for x in got] == [30] * 6


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_topk_one_tree_samples_what_the_chain_samples(target, heads, method):
    """A tree of one child per node (eagle_topk 1) drafts the chain's tokens, and its sampled rows draw what
    the chain's verification draws from the same seeds in the argmax draft mode (tree.accept_sampled's draws
    and rule are verify_sampled's argmax mode on a chain): the same outputs, sampled and greedy rows in one
    batch. (Trees take the drafter's deterministic candidates in the default "sample" mode too.)"""
    ps = prompts(4, seed=19, hi=30)
    sps = [SamplingParams(temperature=0.9 if i % 2 else 0, top_p=0.95, max_tokens=14, ignore_eos=True, seed=i)
           for i in range(4)]
    base = {"method": "eagle3", "model": heads[method], "num_speculative_tokens": 3,
            "parallel_drafting": method == "peagle", "draft_sampling": "argmax"}
    chain = LLM(target, speculative_config=base)
    tree = LLM(target, speculative_config=dict(base, num_draft_tokens=3))
    assert ids(tree.generate(ps, sps)) == ids(chain.generate(ps, sps))
    assert tree.get_metrics()["num_accepted_tokens_per_pos"] == chain.get_metrics()["num_accepted_tokens_per_pos"]
    assert tree.get_metrics()["num_tree_nodes"] > 0 and chain.get_metrics().get("num_tree_nodes", 0) == 0


class TableTreeProposer:
    """Trees for test_sampling_lossless's table drafter: under every node its table token and two others
    (the table's token not always first), to depth K; per row the same tree shape. one_child: the table's token
    only (the chain)."""

    def __init__(self, k, table, V, one_child=False):
        self.k, self.table, self.V, self.one_child = k, table, V, one_child

    def propose_tree(self, batch, K, topk, nodes):
        rows = []
        for r in batch.requests:
            t, p, d = [], [], []
            frontier = [(-1, r.all_ids[-1], 0)]
            while frontier:
                par, last, dep = frontier.pop(0)
                if dep == K:
                    continue
                best = int(self.table[last])
                kids = [(best + 1) % self.V, best, (best + 3) % self.V] if dep % 2 else \
                    [best, (best + 2) % self.V, (best + 5) % self.V]
                for tok in ([best] if self.one_child else kids):
                    t.append(tok), p.append(par), d.append(dep + 1)
                    frontier.append((len(t) - 1, tok, dep + 1))
            rows.append((t, p, d))
        col = [torch.tensor([x[i] for x in rows]) for i in range(3)]
        score = -torch.arange(col[0].shape[1], dtype=torch.float64).expand(len(rows), -1)
        return select_nodes(col[0], col[1], col[2], score, nodes, K)


def test_one_child_trees_sample_what_the_chain_samples_and_accept(tmp_path):
    """The table drafter's chain and its one-child trees on a tiny 8-token model, sampled rows with the same
    seeds: the same tokens, and the same acceptance, well above zero (the random heads above accept ~nothing
    sampled)."""
    import test_sampling_lossless as sl
    from tiny import save_tiny
    small = save_tiny("llama", str(tmp_path / "m"), vocab=sl.V, hidden=32, layers=2, seed=3)
    table = sl.table_for(LLM(small, seed=0))
    chain = sl.spec_llm(small, table, k=2, seed=4)
    prop = sl.TableProposer(2, table)
    prop.propose_tree = TableTreeProposer(2, table, sl.V, one_child=True).propose_tree
    tree = tree_llm(small, prop, 2, 1, 2, seed=4, max_num_seqs=128)
    ps = [{"prompt_token_ids": sl.PROMPT}] * 200
    sp = SamplingParams(max_tokens=6, ignore_eos=True, **sl.SP)
    assert ids(tree.generate(ps, sp)) == ids(chain.generate(ps, sp))
    mt, mc = tree.get_metrics(), chain.get_metrics()
    assert mt["num_accepted_tokens"] == mc["num_accepted_tokens"] > 100, mt           # 220 of 1652 here
    assert mt["num_tree_nodes"] > 0


def test_tree_engine_sampling_matches_exact_distribution_and_wrong_verifier_fails(monkeypatch, tmp_path):
    """Sampled rows verifying trees (3 children per node, 2 levels, the table drafter's token among them):
    chi-square of the first three tokens against the exact joint; negative control: the row-by-row
    verification that leaves a stopping node's children in its sample fails the same test."""
    import test_sampling_lossless as sl
    from test_trees import loop_accept_sampled
    from tiny import save_tiny
    small = save_tiny("llama", str(tmp_path / "m"), vocab=sl.V, hidden=32, layers=2, seed=3)
    base = LLM(small, seed=0)
    joint, _ = sl.exact_joint(base)
    table = sl.table_for(base)

    def make(seed):
        prop = sl.TableProposer(2, table)
        prop.propose_tree = TableTreeProposer(2, table, sl.V).propose_tree
        prop.propose = lambda *a, **kw: pytest.fail("a chain step ran under a tree config")
        return tree_llm(small, prop, 2, 3, 12, seed=seed, max_num_seqs=128)
    llm = make(1)
    p, stat, df = sl.chi2_pvalue(sl.sample_counts(llm), joint)
    m = llm.get_metrics()
    assert 0.1 < m["draft_acceptance_rate"] < 0.95 and p > 1e-3, (stat, df, m)
    monkeypatch.setattr(tree_step_mod, "accept_sampled",
                        lambda tree, logits, K, rows: loop_accept_sampled(tree, logits, K, rows, False))
    p_bad, stat, df = sl.chi2_pvalue(sl.sample_counts(make(2)), joint)
    assert p_bad < 1e-6, (stat, df)


def test_auto_k_with_trees_measures_tree_steps_apart_and_stays_identical(target, heads, capsys, monkeypatch,
                                                                         tmp_path):
    """K "auto" with a tree: tree steps get their own cost model, cached apart from the chain's
    (costs-peagle-tree3x8-*); auto picks tree, chain or plain per step and the depth; greedy outputs stay
    identical, and tree steps were verified (while it explores the trees' acceptance, at least)."""
    import os
    monkeypatch.setenv("PEAGLE_CACHE_DIR", str(tmp_path))     # the flattened models below stay in this test
    ps = prompts(4, seed=13)
    # 2 x 47 decode steps: auto's first plain reference takes 16-64 of them by default (peagle/autok/guard.py), so
    # the run below caps it at 16 (with 64 on a noisy machine no tree step was left: seen once in make test)
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ref = ids(LLM(target).generate(ps, sp))
    base = {"method": "eagle3", "model": heads["peagle"], "num_speculative_tokens": "auto",
            "max_num_speculative_tokens": 3, "parallel_drafting": True}
    LLM(target, speculative_config=base, max_num_seqs=2)
    capsys.readouterr()
    tree_cfg = dict(base, eagle_topk=3, num_draft_tokens=8)
    llm = LLM(target, speculative_config=tree_cfg, max_num_seqs=2)
    assert "autok: measuring step costs for peagle-tree3x8" in capsys.readouterr().err   # not the chain's model
    # Whether drafting pays on a tiny random head depends on this machine's timings; so that auto drafts (and
    # must explore trees) on any machine, the cached cost models are rewritten flat: every K costs what plain
    # decoding does. They are loaded from the cache, not measured again, and not refined from wall time.
    pol = llm.engine.k_policy
    for cm in (pol.cost, pol.tree.cost):
        flat = [[row[0]] * len(row) for row in cm.t0.tolist()]
        CostModel(cm.bs, flat, meta={k: v for k, v in cm.meta.items() if k != "path"}).save(cm.meta["path"])
    llm = LLM(target, speculative_config=dict(tree_cfg, auto_k={"refine": False, "guard": {"plain_max": 16}}),
              max_num_seqs=2)
    assert "measuring" not in capsys.readouterr().err
    assert ids(llm.generate(ps, sp)) == ref
    pol = llm.get_metrics()["k_policy"]
    assert pol["mode"] == "auto" and os.path.basename(pol["cost_model"]).startswith("costs-peagle-")
    assert pol["tree_steps"] > 0 and len(pol["tree_alpha_per_pos"]) == 3
    tree_cost = llm.engine.k_policy.tree.cost.meta["path"]
    assert os.path.basename(tree_cost).startswith("costs-peagle-tree3x8-")


def test_bench_tree_runs_and_report():
    """`peagle bench --trees`: tree runs per K (auto too) beside the chains, their specs, and the report's table."""
    from peagle.bench.runner import split_method
    from peagle.bench.sweep import configs
    from peagle.bench.trees_report import render
    from peagle.cli.bench import _trees
    assert _trees("4x8, 8x16") == ["4x8", "8x16"]
    cfgs = configs(["baseline", "peagle"], [3, "auto"], ["4x8"])
    assert cfgs == [("baseline", 0), ("peagle", 3), ("peagle", "auto"), ("peagle+tree4x8", 3),
                    ("peagle+tree4x8", "auto")]
    assert split_method("eagle3+tree8x16") == ("eagle3", (8, 16)) and split_method("peagle") == ("peagle", None)

    def run(label, k, tok_s, al, nodes=None):
        m = {"mean_acceptance_length": al, "acceptance_rate_per_pos": [0.5, 0.25, 0.1],
             "mean_num_speculative_tokens": k}
        if nodes:
            m["mean_tree_nodes_per_step"] = nodes
        return {"dataset": "mtbench", "concurrency": 1, "method": label, "k": k, "output_tok_s": tok_s,
                "metrics": m, "identity": {"ok": True}}
    res = {"meta": {"command": "peagle bench --trees 4x8"},
           "runs": [run("baseline", 0, 10.0, 1.0), run("peagle", 3, 12.0, 1.8), run("peagle+tree4x8", 3, 15.0, 2.4, 8)]}
    text = render(res)
    assert "| peagle | 3 | 4x8 | 2.40 | 8.0 | 15.0 | 1.25 | 1.50 | 0.50 0.25 0.10 | yes |" in text
    # repeats: tokens/s is their median (not the first, mean or best), and one diverging repeat makes the row NO
    bad = run("peagle+tree4x8", 3, 9.0, 2.4, 8)
    bad["identity"] = {"ok": False}
    res["runs"] += [run("peagle+tree4x8", 3, 30.0, 2.4, 8), bad]
    assert "| peagle | 3 | 4x8 | 2.40 | 8.0 | 15.0 | 1.25 | 1.50 | 0.50 0.25 0.10 | NO |" in render(res)
    # with run times, tokens/s at the baseline's pace (summary.paced): the baseline 10 -> 5 tok/s over t = 0..3
    # puts the chain at 12 x 7.5 / (25/3), the tree at 15 x 7.5 / (20/3): 1.56x the chain, 2.25x plain
    timed = [dict(r, t_mid=t) for r, t in zip([run("baseline", 0, 10.0, 1.0), run("peagle", 3, 12.0, 1.8),
                                              run("peagle+tree4x8", 3, 15.0, 2.4, 8), run("baseline", 0, 5.0, 1.0)],
                                             (0.0, 1.0, 2.0, 3.0))]
    assert "| peagle | 3 | 4x8 | 2.40 | 8.0 | 16.9 | 1.56 | 2.25 |" in render(dict(res, runs=timed))


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_the_drafter_is_fed_the_target_states_along_the_accepted_path(method):
    """After a tree step the drafter's next context is the target's states at the accepted path's nodes, which
    sit at varying slots of the tree block: states taken by slot (the first K+1 nodes) kept the output exact
    (verification) and went unnoticed (a mutation review). The demo target's trained heads accept deep paths;
    every state the drafter is fed equals a fresh forward's at that position."""
    from test_engine_lossless import DrafterFeed

    from peagle.llm import DEMO_EAGLE3_HEAD, DEMO_PEAGLE_HEAD, DEMO_TARGET
    spec = {"method": "eagle3", "model": DEMO_PEAGLE_HEAD if method == "peagle" else DEMO_EAGLE3_HEAD,
            "num_speculative_tokens": 3, "parallel_drafting": method == "peagle", "eagle_topk": 4,
            "num_draft_tokens": 8}
    llm = LLM(DEMO_TARGET, speculative_config=spec, max_num_seqs=3)
    e = llm.engine
    feed = DrafterFeed(e)
    reqs, add = [], e.add_request
    e.add_request = lambda *a, **kw: reqs.append(add(*a, **kw)) or reqs[-1]
    ps = ["Once upon a time", "def add(a, b):", "The weather today is", "import os\n"]
    llm.generate(ps, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    feed.check_aux(reqs)
    m = llm.get_metrics()
    assert m["num_tree_rows"] > 0 and m["num_accepted_tokens_per_pos"][1] > 0      # paths past depth 1
