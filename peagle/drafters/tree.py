"""Draft trees (peagle/tree.py) from the two drafters: deterministic candidates (the drafter's top tokens), for
greedy and sampled rows alike (a sampled row's verification: tree.accept_sampled).

P-EAGLE (`slots_tree`): the one parallel pass gives a distribution at every depth 1..K, and no slot depends on
the draft chosen at the slot before it, so a node's children are the same top-`topk` tokens of the next slot
whatever the node. Candidates are built level by level on the device, keeping per level the `nodes` best paths
by cumulative log-probability (a path among the global best `nodes` has every prefix among them and is among
its level's best `nodes`, so nothing of the final tree is lost), then `select_nodes` keeps the `nodes` best.

EAGLE-3 (`expand_tree`, EAGLE-2's dynamic tree): pass 1 (the step's context rows) gives the depth-1
distribution; then per level the `topk` best nodes of that level are fed to the drafter in ONE pass (each with
its parent's pre-norm output as hidden, at position start + depth - 1, attending to the context and to its
expanded ancestors through a tree mask over the drafter's cache slots), each of them gets its `topk` best
children, and finally all candidates are re-ranked to the `nodes` best. K - 1 drafter passes after the first,
as the chain's; the drafter's slots past the context are stale afterwards, as the chain's are."""
from __future__ import annotations

import torch

from ..tree import Tree, TreeAttn, select_nodes


def slots_tree(head, logits: torch.Tensor, topk: int, nodes: int) -> Tree:
    """logits [B,K,Vd]: the draft logits of depths 1..K -> the tree (target-vocabulary tokens)."""
    B, K, Vd = logits.shape
    dev = logits.device
    top = torch.log_softmax(logits.float(), -1).topk(min(topk, Vd), -1)
    k = top.values.shape[-1]
    tok = head.to_target(top.indices)                                   # [B,K,k]
    toks, pars, deps, scores = [tok[:, 0]], [torch.full((B, k), -1, device=dev)], [], [top.values[:, 0]]
    deps.append(torch.ones(B, k, dtype=torch.long, device=dev))
    beam_score, beam_idx, offset = top.values[:, 0], torch.arange(k, device=dev)[None].expand(B, k), k
    for d in range(1, K):
        m = beam_score.shape[1]
        child = (beam_score[:, :, None] + top.values[:, d, None, :]).reshape(B, m * k)
        s, i = child.topk(min(nodes, m * k), 1)
        n = s.shape[1]
        toks.append(tok[:, d].gather(1, i % k))
        pars.append(beam_idx.gather(1, i // k))
        deps.append(torch.full((B, n), d + 1, dtype=torch.long, device=dev))
        scores.append(s)
        beam_score, beam_idx, offset = s, offset + torch.arange(n, device=dev)[None].expand(B, n), offset + n
    return select_nodes(torch.cat(toks, 1), torch.cat(pars, 1).long(), torch.cat(deps, 1), torch.cat(scores, 1),
                        nodes, K)


@torch.no_grad()
def expand_tree(proposer, batch, K: int, topk: int, nodes: int) -> Tree:
    """EAGLE-2's expansion with an EAGLE-3 proposer (see the module doc)."""
    h, B = proposer.head, batch.ids.shape[0]
    dev = batch.ids.device
    rows = torch.arange(B, device=dev)
    normed, pre = h(batch.ids, h.combine(batch.aux), None, cache=proposer.cache, b0=batch.b0, start=batch.start,
                    span=batch.span, s0=batch.s0)
    last = batch.n_real - 1
    lp = torch.log_softmax(h.draft_logits(normed[rows, last]).float(), -1)      # [B,Vd]
    k = min(topk, lp.shape[-1])
    s, i = lp.topk(k, -1)
    H = pre.shape[-1]
    W = max(K - 1, 1) * k                                  # drafter slots of the expanded levels
    lvl_tok, lvl_score = h.to_target(i), s
    lvl_hid = pre[rows, last][:, None].expand(B, k, H)
    lvl_glob = torch.arange(k, device=dev)[None].expand(B, k)
    lvl_anc = torch.zeros(B, k, W, dtype=torch.bool, device=dev)
    toks, pars, deps, scores = [lvl_tok], [torch.full((B, k), -1, device=dev)], [], [s]
    deps.append(torch.ones(B, k, dtype=torch.long, device=dev))
    p, offset = batch.start + batch.n_real, k
    jj = torch.arange(k, device=dev)
    for d in range(1, K):
        sel = lvl_score.topk(k, 1).indices                                       # the level's nodes to expand
        e_tok, e_score, e_glob = lvl_tok.gather(1, sel), lvl_score.gather(1, sel), lvl_glob.gather(1, sel)
        e_hid = lvl_hid.gather(1, sel[..., None].expand(B, k, H))
        anc = lvl_anc.gather(1, sel[..., None].expand(B, k, W)).clone()
        anc[:, jj, (d - 1) * k + jj] = True
        attn = TreeAttn((p + d - 1)[:, None].expand(B, k), p, anc)
        span = None if batch.span is None else batch.span + d * k
        normed, pre = h._forward_cached(e_tok, e_hid, proposer.cache, batch.b0, p + (d - 1) * k, span, None,
                                        tree=attn)
        cs, ci = torch.log_softmax(h.draft_logits(normed).float(), -1).topk(k, -1)   # [B,k,k]
        lvl_score = (e_score[:, :, None] + cs).reshape(B, k * k)
        lvl_tok = h.to_target(ci).reshape(B, k * k)
        lvl_hid = pre[:, :, None].expand(B, k, k, H).reshape(B, k * k, H)
        lvl_anc = anc[:, :, None].expand(B, k, k, W).reshape(B, k * k, W)
        toks.append(lvl_tok)
        pars.append(e_glob[:, :, None].expand(B, k, k).reshape(B, k * k))
        deps.append(torch.full((B, k * k), d + 1, dtype=torch.long, device=dev))
        scores.append(lvl_score)
        lvl_glob = offset + torch.arange(k * k, device=dev)[None].expand(B, k * k)
        offset += k * k
    return select_nodes(torch.cat(toks, 1), torch.cat(pars, 1).long(), torch.cat(deps, 1), torch.cat(scores, 1),
                        nodes, K)
