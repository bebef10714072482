"""The engine's tree decode step (peagle/tree.py): draft a tree per row, verify all its nodes in one target
forward with the tree mask, accept a root path -- greedy rows the longest that follows the target's argmax,
sampled rows the path their samples of the target's distribution take (tree.accept_sampled) --, move that
path's KV entries to contiguous cache slots, and hand the engine's `_advance` what a chain step of depth K hands
it: accepted counts, the emitted tokens [B,K+1] and the target's aux states at the path [B,K+1,A] (the
drafter's next context). A tree's nodes are the drafter's deterministic choices in both cases (in the "sample"
draft mode too: trees take no draft distribution q)."""
from __future__ import annotations

import time

import torch

from .tree import Tree, accept_greedy, accept_sampled, compact_kv


def tree_step(engine, K: int, start: torch.Tensor, cached: list, sampled=None):
    """start [B]: the target's cached lengths (device), `cached` the same on the host, sampled: the batch's
    sampled rows (verify.SampledRows, None: none) -> (K, accepted [B], tokens [B,K+1], aux [B,K+1,A] | None,
    drafting seconds); K: the step's depth (<= the tree's nodes)."""
    spec, B = engine.tree, len(cached)
    K = min(K, spec.nodes)
    t0 = time.perf_counter()
    tree = engine.proposer.draft_tree(engine.running, K, start, cached, engine._shape, spec.topk, spec.nodes)
    t1 = time.perf_counter()
    engine.metrics.draft_time_s += t1 - t0
    tree.tokens[:, 0] = engine.state.last[:B]
    logits, aux = engine.target.forward(tree.tokens, engine.cache, 0, start, engine.aux_ids, tree=tree.attn(start, K),
                                        **engine._shape(max(cached) + tree.size, cached[0] if B == 1 else None))
    accepted, path, tokens = accept_greedy(tree, logits, K)
    if sampled is not None:
        i = sampled.index
        sub = Tree(tree.tokens[i], tree.parents[i], tree.depth[i], tree.valid[i])
        accepted[i], path[i], tokens[i] = accept_sampled(sub, logits[i], K, sampled)
    compact_kv(engine.cache, 0, start, path)
    if aux is not None:
        aux = aux.gather(1, path[..., None].expand(-1, -1, aux.shape[-1]))
    engine.metrics.add_tree(tree.valid[:, 1:].sum(), B)
    return K, accepted, tokens, aux, t1 - t0
