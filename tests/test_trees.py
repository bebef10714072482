"""Token trees (peagle/tree.py, peagle/tree_step.py, peagle/drafters/tree.py): the tree mask against a reference
(each node's logits = a plain forward of its root path), KV compaction after acceptance, ragged trees in one
batch, greedy identity with plain decoding (random heads and an oracle tree drafter that accepts deep), sampled
batches, and negative controls: a broken mask, wrong positions or a skipped compaction make identity fail."""
import itertools

import pytest
import torch
from fakes import FakeProposer, install_proposer
from heads import save_random_head
from test_engine_lossless import ids, prompts

import peagle.tree as tree_mod
import peagle.tree_step as tree_step_mod
from peagle import LLM, SamplingParams
from peagle.engine import cache_len
from peagle.errors import PeagleError
from peagle.models.layers import causal_block_mask
from peagle.models.loader import load_target
from peagle.spec_config import parse_spec_config
from peagle.tree import Tree, TreeSpec, accept_greedy, ancestors, compact_kv, select_nodes

TOL = 1e-4


@pytest.fixture(scope="module")
def target(tiny_dirs):
    return tiny_dirs["llama"]


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("tree-heads")
    return {"peagle": save_random_head(target, str(d / "p"), layers=2),
            "eagle3": save_random_head(target, str(d / "e"), layers=1, parallel=False, draft_vocab=256)}


def random_tree(B, K, nodes, topk, seed, vocab=500, spine=False) -> Tree:
    """Ragged random trees: per row a random candidate tree (up to topk children per node, depth <= K) reduced to
    its `nodes` best by random scores; rows get different node budgets (some -inf candidates). spine: every
    first child costs almost nothing, so a path of depth K survives the budget."""
    g = torch.Generator().manual_seed(seed)
    toks, pars, deps, scores = [], [], [], []
    for b in range(B):
        t, p, d, s = [], [], [], []
        frontier = [(-1, 0.0, 0)]
        while frontier:
            par, sc, dep = frontier.pop(0)
            if dep == K:
                continue
            n = int(torch.randint(1, topk + 1, (1,), generator=g))
            kids = torch.randperm(vocab - 5, generator=g)[:n] + 5
            for i, tok in enumerate(kids.tolist()):
                t.append(tok)
                p.append(par)
                d.append(dep + 1)
                s.append(sc + (-1e-3 if spine and i == 0 else float(torch.log(torch.rand((), generator=g)))))
                frontier.append((len(t) - 1, s[-1], dep + 1))
        cut = [len(t), nodes // 2 + 1, 3][b % 3]                   # ragged budgets (BFS order: closed)
        s = [x if i < cut else float("-inf") for i, x in enumerate(s)]
        toks.append(t), pars.append(p), deps.append(d), scores.append(s)
    C = max(len(t) for t in toks)

    def pad(xs, v):
        return torch.tensor([x + [v] * (C - len(x)) for x in xs])
    return select_nodes(pad(toks, 0), pad(pars, -1), pad(deps, 1), pad(scores, float("-inf")).double(), nodes, K)


def path_of(tree, b, j):
    out = []
    while j:
        out.append(j)
        j = int(tree.parents[b, j])
    return out[::-1]


def fill(t, cache, ctxs):
    """Prefill row b with ctxs[b] (cache.lens = its length)."""
    L = max(len(c) for c in ctxs)
    x = torch.tensor([c + [0] * (L - len(c)) for c in ctxs])
    t.forward(x, cache, 0, torch.zeros(len(ctxs), dtype=torch.long))
    cache.lens[: len(ctxs)] = torch.tensor([len(c) for c in ctxs])


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_tree_forward_matches_each_nodes_root_path_ragged_batch(target, backend):
    """Every node's logits and aux states equal a plain forward of context + its root path, for three rows with
    different context lengths and different (ragged, padded) trees in one block."""
    t = load_target(target, torch.float32, backend)
    ctxs = [[7, 8, 9, 10, 11], list(range(20, 33)), [40, 41]]
    B, K = len(ctxs), 4
    tree = random_tree(B, K, 12, 3, seed=1)
    assert len(set(tree.valid.sum(1).tolist())) > 1 or not tree.valid.all()      # ragged / padded
    root = torch.tensor([c[-1] for c in ctxs])
    tree.tokens[:, 0] = root
    cache = t.new_cache(4, 64)
    fill(t, cache, [c[:-1] for c in ctxs])
    start = cache.lens[:B].clone()
    aux_ids = (0, 1)
    logits, aux = t.forward(tree.tokens, cache, 0, start, aux_ids, tree=tree.attn(start, K))
    for b in range(B):
        for j in range(tree.size):
            if not tree.valid[b, j]:
                continue
            seq = ctxs[b] + tree.tokens[b, path_of(tree, b, j)].tolist()
            c2 = t.new_cache(1, 64)
            ref, ref_aux = t.forward(torch.tensor([seq]), c2, 0, torch.zeros(1, dtype=torch.long), aux_ids)
            assert torch.allclose(logits[b, j], ref[0, -1], atol=TOL, rtol=TOL), (b, j)
            assert torch.allclose(aux[b, j], ref_aux[0, -1], atol=TOL, rtol=TOL), (b, j)


def test_ancestors_and_tree_mask_against_a_loop():
    tree = random_tree(3, 5, 20, 4, seed=2)
    anc = ancestors(tree.parents, tree.depth, 5, tree.valid)
    for b, i, j in itertools.product(range(3), range(tree.size), range(tree.size)):
        want = i == j or (bool(tree.valid[b, i]) and j in [0] + path_of(tree, b, i))
        assert bool(anc[b, i, j]) == want, (b, i, j)
        if tree.valid[b, i] and i:
            assert int(tree.depth[b, i]) == len(path_of(tree, b, i))
            assert int(tree.parents[b, i]) < i                                  # topological order
    start = torch.tensor([3, 0, 7])
    m = tree.attn(start, 5).mask(40)[:, 0]
    for b in range(3):
        s = int(start[b])
        assert m[b, :, :s].all() and not m[b, :, s + tree.size:].any()
        assert torch.equal(m[b, :, s:s + tree.size], anc[b])


def test_select_nodes_keeps_the_best_closed_under_parents():
    # chain a(-1) -> b(0) -> c(1); sibling d(-1); scores: c ties with its parent b (closure must hold)
    tok = torch.tensor([[10, 11, 12, 13]])
    par = torch.tensor([[-1, 0, 1, -1]])
    dep = torch.tensor([[1, 2, 3, 1]])
    sc = torch.tensor([[-0.1, -0.5, -0.5, -0.3]]).double()
    t = select_nodes(tok, par, dep, sc, 3, 3)
    kept = sorted(t.tokens[0, 1:][t.valid[0, 1:]].tolist())
    assert kept in ([10, 11, 13], [10, 11, 12])
    for j in range(1, 4):
        if t.valid[0, j]:
            p = int(t.parents[0, j])
            assert p == 0 or t.valid[0, p]


def test_peagle_slot_tree_is_the_top_paths_by_probability():
    """slots_tree keeps exactly the `nodes` most probable paths (brute force over every path)."""
    from peagle.drafters.tree import slots_tree
    head = type("H", (), {"to_target": staticmethod(lambda i: i + 1000)})()
    g = torch.Generator().manual_seed(5)
    K, V, topk, nodes = 3, 6, 3, 9
    logits = torch.randn(2, K, V, generator=g) * 2
    tree = slots_tree(head, logits, topk, nodes)
    lp = torch.log_softmax(logits, -1)
    for b in range(2):
        top = lp[b].topk(topk, -1).indices
        allp = {}
        for d in range(1, K + 1):
            for path in itertools.product(range(topk), repeat=d):
                toks = tuple(int(top[i, c]) for i, c in enumerate(path))
                allp[toks] = float(sum(lp[b, i, t] for i, t in enumerate(toks)))
        best = sorted(allp, key=allp.get, reverse=True)[:nodes]
        got = {tuple((tree.tokens[b, path_of(tree, b, j)] - 1000).tolist()) for j in range(1, tree.size)
               if tree.valid[b, j]}
        assert got == set(best)


def test_kv_after_a_tree_step_equals_plain_decoding_of_the_accepted_tokens(target):
    t = load_target(target, torch.float32, "native")
    ctxs = [[7, 8, 9, 10, 11], list(range(20, 30))]
    B, K = 2, 4
    # the target's own greedy continuations, to plant an accepted path of depth >= 2 in each row
    conts = []
    for c in ctxs:
        seq = list(c)
        for _ in range(K + 1):
            lg, _ = t.forward(torch.tensor([seq]), t.new_cache(1, 64), 0, torch.zeros(1, dtype=torch.long))
            seq.append(int(lg[0, -1].argmax()))
        conts.append(seq[len(c):])
    tree = random_tree(B, K, 14, 3, seed=3)
    for b in range(B):                               # the deepest valid node's path becomes the continuation
        j = int(torch.where(tree.valid[b], tree.depth[b], -1).argmax())
        for i, n in enumerate(path_of(tree, b, j)):
            tree.tokens[b, n] = conts[b][i]
    tree.tokens[:, 0] = torch.tensor([c[-1] for c in ctxs])
    cache = t.new_cache(2, 64)
    fill(t, cache, [c[:-1] for c in ctxs])
    start = cache.lens[:B].clone()
    logits, _ = t.forward(tree.tokens, cache, 0, start, tree=tree.attn(start, K))
    acc, path, toks = accept_greedy(tree, logits, K)
    assert (acc >= 2).all()
    compact_kv(cache, 0, start, path)
    for b in range(B):
        a = int(acc[b])
        assert toks[b, :a + 1].tolist() == conts[b][:a + 1]
        seq = ctxs[b] + conts[b][:a]                       # what plain decoding has in its cache
        ref = t.new_cache(1, 64)
        t.forward(torch.tensor([seq]), ref, 0, torch.zeros(1, dtype=torch.long))
        n = len(seq)
        for layer in range(len(cache.k)):
            assert torch.allclose(cache.k[layer][b, :, :n], ref.k[layer][0, :, :n], atol=TOL, rtol=TOL), (b, layer)
            assert torch.allclose(cache.v[layer][b, :, :n], ref.v[layer][0, :, :n], atol=TOL, rtol=TOL), (b, layer)


class OracleTreeProposer(FakeProposer):
    """Trees around the reference continuation: at every depth the true token is one of up to topk shuffled
    siblings (missing with probability `noise`), distractor nodes get children too, scores are random, so the
    accepted path sits at varying node indices and depths, and rows' trees differ (ragged)."""

    def __init__(self, k, ref, noise, seed=0):
        super().__init__(k)
        self.ref, self.noise = ref, noise
        self.g = torch.Generator().manual_seed(seed)
        self.trees = 0

    def propose(self, batch, k=None):                     # chain steps (sampled batches): the true drafts
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


@pytest.mark.parametrize("backend", ["native", "transformers"])
@pytest.mark.parametrize("k,topk,nodes,batch,seqs", [(4, 3, 12, 1, 128), (5, 4, 20, 3, 128), (3, 2, 6, 16, 5),
                                                     (6, 3, 64, 7, 128)])
def test_oracle_trees_greedy_identical_ragged_batches(target, backend, k, topk, nodes, batch, seqs):
    if backend == "transformers" and batch == 16:
        pytest.skip("one continuous-batching case per backend is enough (native)")
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


def test_sampled_batches_verify_their_chain_and_greedy_rows_stay_identical(target):
    """A batch with a sampled row runs the chain step: its sampled rows draw exactly what the chain engine draws
    (same seeds), its greedy rows match plain decoding, and greedy-only batches run trees."""
    ps = prompts(6, seed=21)
    full = ids(LLM(target).generate(ps, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    ref = {tuple(p["prompt_token_ids"]): f for p, f in zip(ps, full)}
    sps = [SamplingParams(temperature=0.8 if i % 2 else 0, max_tokens=3 if i % 2 else 36, ignore_eos=True, seed=i)
           for i in range(6)]
    chain = install_proposer(LLM(target), OracleTreeProposer(4, ref, 0.0), 4)
    prop = OracleTreeProposer(4, ref, 0.0)
    tree = tree_llm(target, prop, 4, 3, 12)
    a, b = ids(chain.generate(ps, sps)), ids(tree.generate(ps, sps))
    assert a == b
    assert [x for i, x in enumerate(b) if i % 2 == 0] == [full[i][:36] for i in range(0, 6, 2)]
    assert prop.trees > 0                      # the sampled rows ran longer: the greedy rest ran as trees


def test_spec_config_tree_keys():
    base = {"method": "eagle3", "model": "h", "num_speculative_tokens": 5, "parallel_drafting": True}
    s = parse_spec_config(base)
    assert s.tree(5) is None and "eagle_topk" not in s.as_dict()
    s = parse_spec_config(dict(base, eagle_topk=4))
    assert s.tree(5) == TreeSpec(4, 20) and s.as_dict()["eagle_topk"] == 4
    assert parse_spec_config(dict(base, eagle_topk=8, num_draft_tokens=64)).tree(16) == TreeSpec(8, 64)
    assert parse_spec_config(dict(base, eagle_topk=32)).tree(5) == TreeSpec(32, 64)
    for bad in ({"eagle_topk": 0}, {"eagle_topk": True}, {"num_draft_tokens": 65}, {"num_draft_tokens": "8"}):
        with pytest.raises(PeagleError):
            parse_spec_config(dict(base, **bad))


def test_tree_engine_sampling_matches_exact_distribution_and_wrong_verifier_fails(monkeypatch, tmp_path):
    """Sampled rows under a tree config (they verify their chain): chi-square against the exact joint of the
    first three tokens, and the deliberately wrong verifier of test_sampling_lossless fails here too."""
    import test_sampling_lossless as sl
    from tiny import save_tiny

    import peagle.engine as engine_mod
    small = save_tiny("llama", str(tmp_path / "m"), vocab=sl.V, hidden=32, layers=2, seed=3)
    base = LLM(small, seed=0)
    joint, _ = sl.exact_joint(base)
    table = sl.table_for(base)

    def make(seed):
        prop = sl.TableProposer(2, table)
        prop.propose_tree = lambda *a: pytest.fail("a sampled batch ran a tree step")
        return tree_llm(small, prop, 2, 3, 6, seed=seed, max_num_seqs=128)
    llm = make(1)
    p, stat, df = sl.chi2_pvalue(sl.sample_counts(llm), joint)
    m = llm.get_metrics()
    assert 0.1 < m["draft_acceptance_rate"] < 0.95 and p > 1e-3, (stat, df, m)
    monkeypatch.setattr(engine_mod, "verify_sampled", sl.wrong_verifier)
    p_bad, stat, df = sl.chi2_pvalue(sl.sample_counts(make(2)), joint)
    assert p_bad < 1e-6, (stat, df)


def test_bench_tree_runs_and_report():
    """`peagle bench --trees`: tree runs per integer K beside the chains, their specs, and the report's table."""
    from peagle.bench.runner import split_method
    from peagle.bench.sweep import configs
    from peagle.bench.trees_report import render
    from peagle.cli.bench import _trees
    assert _trees("4x8, 8x16") == ["4x8", "8x16"]
    cfgs = configs(["baseline", "peagle"], [3, "auto"], ["4x8"])
    assert cfgs == [("baseline", 0), ("peagle", 3), ("peagle", "auto"), ("peagle+tree4x8", 3)]
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


def test_cost_model_prices_a_step_by_its_verified_positions():
    from peagle.autok.costmodel import CostModel
    cm = CostModel([1, 8], [[1.0, 1.2, 1.3, 1.5], [2.0, 2.6, 3.0, 3.6]])
    assert cm.price(1, 3) == pytest.approx(1.3)                     # a chain of K = 2: 3 positions
    assert cm.price(1, 9) == pytest.approx(1.5 + 0.2 * 5)           # a tree of 8 nodes: past k_max, linear
    assert cm.price(8, 1) == pytest.approx(2.0)
    # at B = 1 a tree of 8 nodes accepting 3.2 tokens beats a K = 3 chain at 1.8; at B = 8 it does not
    assert cm.tree_or_chain(1, (1.8, 4), (3.2, 9)) == "tree"
    assert cm.tree_or_chain(8, (1.8, 4), (3.2, 9)) == "chain"


@pytest.mark.parametrize("broken", [False, True])
def test_eagle3_expansion_scores_equal_sequential_drafting_along_each_path(target, tmp_path, monkeypatch, broken):
    """EAGLE-2's level passes (tree mask over the drafter's cache, positions by depth, the parent's pre-norm
    output as hidden) give every node the log path probability a sequential EAGLE-3 chain along its path gives,
    for two rows with different contexts in one batch; and every node is among its parent's topk children.
    Negative control (broken): the drafter's level passes without the tree mask and depth positions fail."""
    import copy

    from peagle.drafters.base import DraftBatch
    from peagle.drafters.eagle3 import Eagle3Proposer
    from peagle.drafters.tree import expand_tree
    from peagle.heads.model import DrafterHead
    t = load_target(target, torch.float32, "native")
    d = save_random_head(target, str(tmp_path / "e"), layers=1, parallel=False, draft_vocab=256)
    head = DrafterHead.from_pretrained(d, t.cfg, parallel=False, target_embed=t.embed)
    K, topk, nodes = 4, 3, 14
    prop = Eagle3Proposer(head, K, 128, rows=2)
    g = torch.Generator().manual_seed(4)
    A = 3 * t.cfg.hidden_size
    lens = [6, 3]
    ids = torch.randint(5, 500, (2, 6), generator=g)
    aux = torch.randn(2, 6, A, generator=g)
    prop.prefill(DraftBatch(ids, aux, torch.zeros(2, dtype=torch.long), torch.tensor(lens)))
    snap = copy.deepcopy(prop.cache)
    new_ids, new_aux = torch.randint(5, 500, (2, 2), generator=g), torch.randn(2, 2, A, generator=g)
    n_real = torch.tensor([2, 1])
    batch = DraftBatch(new_ids, new_aux, torch.tensor(lens), n_real)
    if broken:
        monkeypatch.setattr(tree_mod.TreeAttn, "apply", lambda self, ctx, rope, window=None: ctx)
    tree = expand_tree(prop, batch, K, topk, nodes)
    if broken:
        with pytest.raises(AssertionError):
            check_expansion(head, snap, tree, new_ids, new_aux, n_real, lens, topk)
    else:
        check_expansion(head, snap, tree, new_ids, new_aux, n_real, lens, topk)


@torch.no_grad()
def check_expansion(head, snap, tree, new_ids, new_aux, n_real, lens, topk):
    import copy
    for b in range(2):
        for j in range(1, tree.size):
            if not tree.valid[b, j]:
                continue
            path = tree.tokens[b, path_of(tree, b, j)].tolist()
            cache = copy.deepcopy(snap)
            n = int(n_real[b])
            normed, pre = head(new_ids[b:b + 1, :n], head.combine(new_aux[b:b + 1, :n]), None, cache=cache, b0=b,
                               start=torch.tensor([lens[b]]))
            normed, gh = normed[:, -1:], pre[:, -1:]
            p, score = lens[b] + n, 0.0
            for i, tok in enumerate(path):
                lp = torch.log_softmax(head.draft_logits(normed[0, 0]).float(), -1)
                best = lp.topk(topk).indices
                top = head.to_target(best).tolist()
                assert tok in top, (b, j, i)
                score += float(lp[best[top.index(tok)]])
                if i + 1 < len(path):
                    normed, gh = head(torch.tensor([[tok]]), gh, None, cache=cache, b0=b, start=torch.tensor([p + i]))
            assert score == pytest.approx(float(tree.score[b, j]), abs=1e-4), (b, j)


@pytest.mark.parametrize("family,broken", [("gemma3_text", False), ("gpt_oss", False), ("gemma3_text", True)])
def test_tree_forward_past_a_sliding_window_matches_each_path(family_dirs, family, broken, monkeypatch):
    """Transformers backend, sliding-window layers (window 8), contexts longer than the window and a tree deeper
    than the window is wide for some keys: each node's logits equal a plain forward of context + its path.
    Negative control (broken): the window left off the tree keys."""
    from families import WINDOW
    if broken:
        orig = tree_mod.TreeAttn.mask

        def no_tree_window(self, S, window=None):      # the context's keys windowed, the tree's not
            ctx = (torch.arange(S)[None, None, :] < self.base[:, None, None]).unsqueeze(1)
            return torch.where(ctx, orig(self, S, window), orig(self, S, None))
        monkeypatch.setattr(tree_mod.TreeAttn, "mask", no_tree_window)
    t = load_target(family_dirs[family], torch.float32, "transformers")
    g = torch.Generator().manual_seed(6)
    ctxs = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (3 * WINDOW, 2 * WINDOW + 3)]
    B, K = 2, WINDOW + 2
    tree = random_tree(B, K, 24, 2, seed=7, spine=True)
    tree.tokens[:, 0] = torch.tensor([c[-1] for c in ctxs])
    cache = t.new_cache(2, 128)
    fill(t, cache, [c[:-1] for c in ctxs])
    start = cache.lens[:B].clone()
    logits, _ = t.forward(tree.tokens, cache, 0, start, tree=tree.attn(start, K))
    assert int(tree.depth.max()) > WINDOW
    bad = 0
    for b in range(B):
        for j in range(tree.size):
            if tree.valid[b, j]:
                seq = ctxs[b] + tree.tokens[b, path_of(tree, b, j)].tolist()
                ref, _ = t.forward(torch.tensor([seq]), t.new_cache(1, 128), 0, torch.zeros(1, dtype=torch.long))
                ok = torch.allclose(logits[b, j], ref[0, -1], atol=TOL, rtol=TOL)
                assert ok or broken, (family, b, j)
                bad += not ok
    assert bool(bad) == broken


def test_auto_k_with_trees_measures_tree_steps_apart_and_stays_identical(target, heads, capsys):
    """K "auto" with a tree: the cost model is measured on tree steps and cached apart from the chain's
    (costs-peagle-tree3x8-*), auto picks the depth per step, greedy outputs stay identical."""
    import os
    ps = prompts(4, seed=13)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = ids(LLM(target).generate(ps, sp))
    base = {"method": "eagle3", "model": heads["peagle"], "num_speculative_tokens": "auto",
            "max_num_speculative_tokens": 3, "parallel_drafting": True}
    LLM(target, speculative_config=base, max_num_seqs=2)
    capsys.readouterr()
    llm = LLM(target, speculative_config=dict(base, eagle_topk=3, num_draft_tokens=8), max_num_seqs=2)
    assert "autok: measuring step costs for peagle-tree3x8" in capsys.readouterr().err   # not the chain's model
    assert ids(llm.generate(ps, sp)) == ref
    pol = llm.get_metrics()["k_policy"]
    assert pol["mode"] == "auto" and os.path.basename(pol["cost_model"]).startswith("costs-peagle-tree3x8-")
