"""Token trees, the pieces (peagle/tree.py, peagle/drafters/tree.py): the tree mask and positions against a
reference (each node's logits = a plain forward of its root path) on both target backends, ragged trees in one
batch, sliding windows, KV compaction after acceptance (the cache equals plain decoding's), node selection, the
P-EAGLE slot tree (brute force), EAGLE-2 expansion against sequential drafting, the speculative config keys and
the cost model's pricing by positions; with negative controls. The engine end to end: test_trees_engine.py."""
import itertools

import pytest
import torch
from heads import save_random_head
from test_verify_sampling import synthetic_rows

import peagle.tree as tree_mod
from peagle.errors import PeagleError
from peagle.models.loader import load_target
from peagle.spec_config import parse_spec_config
from peagle.tree import Tree, TreeSpec, accept_greedy, ancestors, compact_kv, select_nodes

TOL = 1e-4


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


def test_a_tree_is_no_wider_than_its_candidates():
    """K = 1 with topk 4 and 8 nodes: 4 candidates, so 5 positions to verify (was 9: 4 of them padding); the
    candidates stay whole. With more candidates than nodes the width is nodes + 1."""
    from peagle.drafters.tree import slots_tree
    head = type("H", (), {"to_target": staticmethod(lambda i: i + 1000)})()
    logits = torch.randn(2, 1, 50, generator=torch.Generator().manual_seed(3))
    t = slots_tree(head, logits, 4, 8)
    assert t.size == 5 and bool(t.valid.all())
    assert torch.equal(t.tokens[:, 1:].sort(1).values, (logits[:, 0].topk(4, -1).indices + 1000).sort(1).values)
    assert slots_tree(head, torch.randn(2, 3, 50), 4, 8).size == 9


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


def test_compact_kv_extension_matches_the_torch_copies():
    """The extension's one-call compaction (every layer) leaves the cache bit-identical to the torch path's
    indexed copies, for ragged rows, paths that stop early (last node repeated) and rows b0 > 0; negative
    control: another path leaves another cache."""
    from peagle.cache import KVCache
    from peagle.models import quant_ext
    if quant_ext.get() is None:
        pytest.skip("needs the built extension")
    g = torch.Generator().manual_seed(9)

    def cache():
        c = KVCache(3, 2, 8, 40, 4)
        for store in (c.k, c.v):
            for t in store:
                t.copy_(torch.randn(t.shape, generator=g))
        return c
    orig = cache()

    def copy():
        c = KVCache(3, 2, 8, 40, 4)
        for s, d in zip(orig.k + orig.v, c.k + c.v):
            d.copy_(s)
        return c
    a, b, c = copy(), copy(), copy()
    start = torch.tensor([5, 11, 0])
    path = torch.tensor([[0, 2, 5, 6], [0, 1, 1, 1], [0, 3, 3, 3]])
    compact_kv(a, 1, start, path)
    saved = quant_ext._mod
    try:
        quant_ext._mod = None                          # the torch path
        compact_kv(b, 1, start, path)
    finally:
        quant_ext._mod = saved
    assert all(torch.equal(x, y) for x, y in zip(a.k + a.v, b.k + b.v))
    assert not all(torch.equal(x, y) for x, y in zip(a.k + a.v, orig.k + orig.v))
    compact_kv(c, 1, start, torch.tensor([[0, 1, 5, 6], [0, 1, 1, 1], [0, 3, 3, 3]]))
    assert not all(torch.equal(x, y) for x, y in zip(a.k + a.v, c.k + c.v))


def test_compact_kv_extension_reads_a_rows_sources_before_its_writes():
    """ops.h's promise for the C++ compaction: a row's W sources are all read before any is written, so a path
    that moves an entry onto a slot another source still needs (a rotation, a reversal) gives the gathered copy.
    tree.py's increasing paths never need it (an in-place copy gives them the same cache), so only this pins it.
    Reference: the gather written out in torch."""
    from peagle.models import quant_ext
    ext = quant_ext.get()
    if ext is None:
        pytest.skip("needs the built extension")
    g = torch.Generator().manual_seed(10)
    k, v = torch.randn(3, 2, 12, 8, generator=g), torch.randn(3, 2, 12, 8, generator=g)
    start, path = torch.tensor([2, 0]), torch.tensor([[2, 0, 1], [3, 2, 1]])          # rows b0 = 1 and 2
    want_k, want_v = k.clone(), v.clone()
    for b in range(2):
        s = int(start[b])
        want_k[1 + b, :, s:s + 3] = k[1 + b, :, s + path[b]]
        want_v[1 + b, :, s:s + 3] = v[1 + b, :, s + path[b]]
    got_k, got_v = k.clone(), v.clone()
    ext.compact_kv([got_k], [got_v], 1, start, path)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert not torch.equal(got_k, k)


def test_accept_greedy_takes_only_paths_accepted_from_the_root():
    """Hand-built trees (a mutation review: acceptance looked one parent up only, and padding nodes could be
    accepted): a rejected node's matching descendants are not accepted, a padding node (token 0 under the root)
    is not accepted when the root's argmax is 0, and an accepted path emits the target's argmax along it."""
    V = 16

    def logits_for(argmax):                                     # [1, T, V] with these argmaxes
        lg = torch.zeros(1, len(argmax), V)
        lg[0, torch.arange(len(argmax)), torch.tensor(argmax)] = 1.0
        return lg

    # node: 0 root, 1 "5" (wrong: the root's argmax is 7), 2 "6" under 1, 3 "8" under 2, 4 padding
    tree = Tree(tokens=torch.tensor([[3, 5, 6, 8, 0]]), parents=torch.tensor([[0, 0, 1, 2, 0]]),
                depth=torch.tensor([[0, 1, 2, 3, 1]]), valid=torch.tensor([[True, True, True, True, False]]))
    acc, path, toks = accept_greedy(tree, logits_for([7, 6, 8, 9, 1]), 3)    # 6 and 8 follow 5's and 6's argmax
    assert acc.tolist() == [0] and toks[0, 0].item() == 7
    acc, _, _ = accept_greedy(tree, logits_for([0, 1, 1, 1, 1]), 3)         # the padding's token is the argmax
    assert acc.tolist() == [0]
    acc, path, toks = accept_greedy(tree, logits_for([5, 6, 8, 9, 1]), 3)    # the whole path follows
    assert acc.tolist() == [3] and path[0].tolist() == [0, 1, 2, 3] and toks[0].tolist() == [5, 6, 8, 9]


@pytest.mark.parametrize("parallel", [False, True])
def test_tree_width_covers_the_slots_a_tree_step_writes(target, tmp_path, parallel):
    """TreeSpec.width(K) bounds the slots a step writes past a row's length: the target's nodes + 1 and the
    drafter's (EAGLE-3: a level of topk nodes per depth, more than nodes + 1 here; P-EAGLE: K - 1 mask rows)."""
    from peagle.drafters.base import DraftBatch
    from peagle.drafters.eagle3 import Eagle3Proposer
    from peagle.drafters.peagle import PEagleProposer
    from peagle.heads.model import DrafterHead
    t = load_target(target, torch.float32, "native")
    d = save_random_head(target, str(tmp_path / "h"), layers=1, parallel=parallel)
    head = DrafterHead.from_pretrained(d, t.cfg, parallel=parallel, target_embed=t.embed)
    K, topk, nodes = 4, 4, 4
    prop = (PEagleProposer if parallel else Eagle3Proposer)(head, K, 128)
    g = torch.Generator().manual_seed(6)
    A = 3 * t.cfg.hidden_size
    prop.prefill(DraftBatch(torch.randint(5, 500, (1, 6), generator=g), torch.randn(1, 6, A, generator=g),
                            torch.zeros(1, dtype=torch.long), torch.tensor([6])))
    written, write, write_at = [], prop.cache.write, prop.cache.write_at

    def rec_write(layer, b0, pos, k, v):
        written.append(int(pos.max()))
        return write(layer, b0, pos, k, v)

    def rec_write_at(layer, b0, s0, k, v):
        written.append(s0 + k.shape[1] - 1)
        return write_at(layer, b0, s0, k, v)
    prop.cache.write, prop.cache.write_at = rec_write, rec_write_at
    batch = DraftBatch(torch.randint(5, 500, (1, 2), generator=g), torch.randn(1, 2, A, generator=g),
                       torch.tensor([6]), torch.tensor([2]), span=8, s0=6)
    tree = prop.propose_tree(batch, K, topk, nodes)
    length = 6 + 2                                      # the row's length: the target verifies from here
    width = TreeSpec(topk, nodes).width(K)
    assert tree.size == nodes + 1 <= width
    drafter = max(written) + 1 - length
    assert drafter <= width, (drafter, width)
    assert parallel or drafter > nodes + 1              # EAGLE-3's levels: more than the target's block
    assert width >= K * topk                            # the documented rule: a level of topk nodes per depth


def loop_accept_sampled(tree, logits, K, rows, remove_children=True):
    """tree.accept_sampled row by row in plain Python (a reference: the same draws from each row's generator, K
    uniforms then one more). remove_children=False is WRONG on purpose: a row that stops emits a sample
    of p with the node's children left in, so they come out too often."""
    from peagle.sampling import probs_from_logits, sample_from
    p = probs_from_logits(logits, rows.temperature, rows.top_k, rows.top_p)               # [S,T,V]
    S, T = tree.tokens.shape
    acc, paths, toks = [], [], []
    for s, g in enumerate(rows.gens):
        u = torch.rand(K, generator=g, dtype=torch.float64)
        tok, par, valid = tree.tokens[s].tolist(), tree.parents[s].tolist(), tree.valid[s].tolist()

        def kids(n):
            return [j for j in range(1, T) if valid[j] and par[j] == n]
        cur, path, out = 0, [0], []
        for lvl in range(K):
            run, took = 0.0, None
            for j in kids(cur):
                run += float(p[s, cur, tok[j]])
                if u[lvl] < run:
                    took = j
                    break
            if took is None:
                break
            cur = took
            path.append(cur)
            out.append(tok[cur])
        dist = p[s, cur].clone()
        if remove_children:
            for j in kids(cur):
                dist[tok[j]] = 0.0
        out.append(int(sample_from(dist[None], g)[0]))
        acc.append(len(path) - 1)
        paths.append(path + [path[-1]] * (K + 1 - len(path)))
        toks.append(out + [out[-1]] * (K + 1 - len(out)))
    return torch.tensor(acc), torch.tensor(paths), torch.tensor(toks)


@pytest.mark.parametrize("remove_children", [True, False])
def test_accept_sampled_emits_p_at_every_node_reached(remove_children):
    """tree.accept_sampled on a fixed ragged tree (3 children under the root, 2 and 1 below two of them, a
    padding node), the same logits for 12,000 rows with their own generators: the first token follows p at the
    root, and among the rows that took a node, the next token follows p at that node (chi-square); every
    accepted token is the node's and every node a child of the one before; the vectorised function gives the
    row-by-row reference's tokens bit for bit. Negative control: the reference that leaves a stopping node's
    children in its sample fails the same test."""
    from test_sampling_lossless import chi2_pvalue

    from peagle.sampling import probs_from_logits
    from peagle.tree import accept_sampled
    n, K, V = 12000, 2, 6
    g = torch.Generator().manual_seed(5)
    # node: 0 root, 1-3 under the root, 4-5 under 1, 6 under 2, 7 padding (under the root, token 0)
    tok = [0, 1, 3, 4, 2, 5, 0, 0]
    tree = Tree(tokens=torch.tensor([tok] * n), parents=torch.tensor([[0, 0, 0, 0, 1, 1, 2, 0]] * n),
                depth=torch.tensor([[0, 1, 1, 1, 2, 2, 2, 1]] * n), valid=torch.tensor([[True] * 7 + [False]] * n))
    logits = torch.randn(1, 8, V, generator=g) * 1.5
    for node, kids in ((0, [1, 3, 4]), (1, [2, 5]), (2, [0])):
        logits[0, node, kids] += 1.5                            # a node's children likely: deep paths are reached
    logits = logits.expand(n, -1, -1)
    p = probs_from_logits(logits[:1], 0.8, 5, 1.0)[0].double()   # [T,V] what each node's next token must follow
    if remove_children:
        acc, path, toks = accept_sampled(tree, logits, K, synthetic_rows(n, 0.8, 5, 1.0, seed=2))
        ref = loop_accept_sampled(tree, logits[:200], K, synthetic_rows(200, 0.8, 5, 1.0, seed=2))
        keep = torch.arange(K + 1)[None] <= ref[0][:, None]       # each row's path and emitted tokens
        assert torch.equal(acc[:200], ref[0]) and torch.equal(path[:200][keep], ref[1][keep])
        assert torch.equal(toks[:200][keep], ref[2][keep])
    else:
        acc, path, toks = loop_accept_sampled(tree, logits, K, synthetic_rows(n, 0.8, 5, 1.0, seed=2), False)
    assert (acc == K).sum() > 500 and (acc == 0).sum() > 500, torch.bincount(acc)
    pvals = []
    for j in range(K + 1):                                      # position j: rows that reached depth j, per node
        for node in range(7):
            at = (acc >= j) & (path[:, j] == node)
            if at.sum() < 200:
                continue
            counts = torch.bincount(toks[at, j], minlength=V).double()
            pvals.append(chi2_pvalue(counts, p[node])[0])
            if j:                                               # an accepted draft: the node's token, a child
                assert (toks[at, j - 1] == tok[node]).all() and (path[at, j - 1] == tree.parents[0, node]).all()
    assert len(pvals) >= 4
    assert (min(pvals) > 1e-4) if remove_children else (min(pvals) < 1e-6), pvals


def test_accept_sampled_on_a_chain_draws_what_verify_sampled_draws():
    """A tree that is a chain (one child per node) gives verify_sampled's argmax-mode result bit for bit from
    the same generators: the same draws in the same order, the same rule (accept d with p(d), else a sample of p
    without d)."""
    from peagle.tree import accept_sampled
    from peagle.verify import verify_sampled
    n, K, V = 400, 3, 7
    g = torch.Generator().manual_seed(8)
    drafts = torch.randint(0, V, (n, K), generator=g)
    logits = torch.randn(n, K + 1, V, generator=g)
    logits[:, :K].scatter_add_(2, drafts[..., None], torch.full((n, K, 1), 1.5))   # drafts often accepted
    tree = Tree(tokens=torch.cat([torch.zeros(n, 1, dtype=torch.long), drafts], 1),
                parents=torch.tensor([[0] + list(range(K))] * n), depth=torch.arange(K + 1).expand(n, -1),
                valid=torch.ones(n, K + 1, dtype=torch.bool))
    a_t, _, t_t = accept_sampled(tree, logits, K, synthetic_rows(n, 0.9, 0, 0.9, seed=3))
    a_c, t_c = verify_sampled(logits, drafts, synthetic_rows(n, 0.9, 0, 0.9, seed=3))
    assert 0 < (a_c == K).sum() < n and (a_c == 0).sum() > 0
    assert torch.equal(a_t, a_c)
    keep = torch.arange(K + 1)[None] <= a_c[:, None]            # the emitted part of each row
    assert torch.equal(t_t[keep], t_c[keep])


def test_accept_sampled_matches_the_row_by_row_reference_on_ragged_trees():
    """Rows with different trees in one batch (three shapes: padding in the middle and at the end, a child
    without children, depths 1-3), their own logits and top-p: the vectorised acceptance gives the row-by-row
    reference's paths and tokens bit for bit."""
    from peagle.tree import accept_sampled
    shapes = [  # tokens, parents, depth, valid
        ([0, 2, 5, 1, 0, 3], [0, 0, 0, 1, 0, 3], [0, 1, 1, 2, 1, 3], [1, 1, 1, 1, 0, 1]),
        ([0, 4, 2, 6, 7, 0], [0, 0, 1, 1, 2, 0], [0, 1, 2, 2, 3, 1], [1, 1, 1, 1, 1, 0]),
        ([0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]),
    ]
    n, K, V = 300, 3, 8
    pick = [shapes[i % 3] for i in range(n)]
    tree = Tree(*(torch.tensor([sh[j] for sh in pick]) for j in range(3)),
                valid=torch.tensor([sh[3] for sh in pick]).bool())
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(n, 6, V, generator=g) * 2
    top_p = torch.rand(n, 1, 1, generator=g) * 0.5 + 0.5

    def rows():
        r = synthetic_rows(n, 0.9, 0, 1.0, seed=4)
        r.top_p = top_p
        return r
    acc, path, toks = accept_sampled(tree, logits, K, rows())
    ref = loop_accept_sampled(tree, logits, K, rows())
    keep = torch.arange(K + 1)[None] <= ref[0][:, None]
    assert torch.equal(acc, ref[0]) and torch.equal(path[keep], ref[1][keep]) and torch.equal(toks[keep], ref[2][keep])
    assert set(torch.bincount(acc).nonzero()[:, 0].tolist()) >= {0, 1, 2}      # shallow and deep paths taken


def test_accept_sampled_takes_the_last_child_where_the_children_hold_all_of_p(monkeypatch):
    """Children holding all of p's mass (top-k = their number: every other token has p = 0) whose float32
    probabilities sum to just under 1 in float64, and every uniform just under 1: the row takes the last child
    (nothing else could be emitted), never a token of probability 0. Without the guard it emitted the last
    vocabulary token (p = 0)."""
    from peagle.sampling import probs_from_logits
    from peagle.tree import accept_sampled
    V, g = 8, torch.Generator().manual_seed(0)
    for _ in range(1000):                                        # logits whose top 3 probabilities sum under 1
        logits = torch.randn(1, 2, V, generator=g)
        p = probs_from_logits(logits, 1.0, 3, 1.0)
        if float(p[0, 0].double().sum()) < 1.0:
            break
    top3 = p[0, 0].topk(3).indices.tolist()
    tree = Tree(tokens=torch.tensor([[0] + top3]), parents=torch.tensor([[0, 0, 0, 0]]),
                depth=torch.tensor([[0, 1, 1, 1]]), valid=torch.ones(1, 4, dtype=torch.bool))
    monkeypatch.setattr(torch, "rand", lambda *size, generator=None, dtype=None, device=None:
                        torch.full(size[0] if size and isinstance(size[0], tuple) else size, 1 - 2.0**-40,
                                   dtype=dtype or torch.float32))
    lg = torch.cat([logits[:, :1], logits[:, 1:].expand(1, 3, V)], 1)             # [1, 4 nodes, V]
    acc, path, toks = accept_sampled(tree, lg, 1, synthetic_rows(1, 1.0, 3, 1.0, 0))
    assert acc.tolist() == [1] and path[0].tolist() == [0, 3] and toks[0, 0] == top3[2]
