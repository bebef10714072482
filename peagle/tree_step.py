"""The engine's tree decode step (peagle/tree.py): draft a tree per row, verify all its nodes in one target
forward with the tree mask, accept the longest root path that follows the target's argmax, move that path's
KV entries to contiguous cache slots, and hand the engine's `_advance` what a chain step of depth K hands it:
accepted counts, the emitted tokens [B,K+1] and the target's aux states at the path [B,K+1,A] (the drafter's
next context). Greedy batches only: a batch with a sampled row runs the chain step (its rows verify their
top chain, exactly as without trees; see the engine)."""
from __future__ import annotations

import time

import torch

from .tree import accept_greedy, compact_kv


def tree_step(engine, K: int, start: torch.Tensor, cached: list):
    """start [B]: the target's cached lengths (device), `cached` the same on the host -> (K, accepted [B],
    tokens [B,K+1], aux [B,K+1,A] | None, drafting seconds); K: the step's depth (<= the tree's nodes)."""
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
    compact_kv(engine.cache, 0, start, path)
    if aux is not None:
        aux = aux.gather(1, path[..., None].expand(-1, -1, aux.shape[-1]))
    engine.metrics.add_tree(tree.valid[:, 1:].sum(), B)
    return K, accepted, tokens, aux, t1 - t0
