"""Token trees: several draft candidates per step, verified by the target in ONE forward with a tree mask.

A step's verification block per row is [root, n_1 .. n_N]: the root is the row's last token (state.last),
node j > 0 a draft token whose parent parents[j] < j (topological order: a node's ancestors come before it).
Tensors per row, all on the device, ragged across rows (`valid` marks real nodes; padding nodes hang off the
root, see nothing but the context and are never accepted):
  tokens  [B,T]  target-vocabulary ids (column 0 is the root, filled in by the engine);
  parents [B,T]  parent index (root: 0, its own parent);
  depth   [B,T]  edges from the root (root 0): the node's position is context_len + depth;
  valid   [B,T]  real node.
The block occupies cache slots start .. start+T-1 (slot = index, position = start + depth); attention
(`TreeAttn`, applied to a layers.BlockCtx or as the transformers backend's mask) lets node i see the context
(slots < start) and the slots of its ancestors and itself only. Greedy acceptance (`accept_greedy`) follows the
target's argmax from the root: a node is accepted iff its parent is and its token is the target's argmax at
the parent; the deepest accepted node ends the path (siblings are distinct tokens, so the accepted nodes are
one root path). The emitted tokens are the target's argmax along that path (accepted drafts + the correction or
bonus token). `compact_kv` then moves the path's KV entries to the contiguous slots start+0..start+a, so the
cache is the cache of plain decoding of the emitted tokens (positions match: the node at depth i sits at
position start + i), and the rest of the block is rolled back by the usual length update.

Node selection (`select_nodes`): candidates carry cumulative log path probabilities (the sum of the drafter's
log-probabilities along the path); the `nodes` best are kept, ties to the earlier candidate, so the set is
closed under parents (a child's path probability never exceeds its parent's, which comes first); a kept node
whose parent was not kept would be dropped (a safeguard).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .models import quant_ext
from .models.quant import EXT_CACHE_DTYPES
from .sampling import greedy, probs_from_logits, sample_rows

MAX_NODES = 64


@dataclass(frozen=True)
class TreeSpec:
    """The speculative config's tree: `topk` children per node (SGLang's --speculative-eagle-topk) and `nodes`
    draft nodes verified per step (--speculative-num-draft-tokens; the root is not counted)."""
    topk: int
    nodes: int

    def width(self, k: int) -> int:
        """Cache slots a step of depth k may write past a row's length (target: nodes + 1; EAGLE-3's drafter:
        one level of topk nodes per depth)."""
        return max(self.nodes + 1, k * self.topk + 1, k + 1)


@dataclass
class Tree:
    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor
    score: torch.Tensor | None = None    # [B,T] the drafter's cumulative log path probability (root 0)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def attn(self, start: torch.Tensor, max_depth: int) -> "TreeAttn":
        return TreeAttn(start[:, None] + self.depth, start, ancestors(self.parents, self.depth, max_depth, self.valid))


def ancestors(parents: torch.Tensor, depth: torch.Tensor, max_depth: int,
              valid: torch.Tensor | None = None) -> torch.Tensor:
    """[B,T,T] bool: anc[b,i,j] iff block node j is node i itself or one of its ancestors (padding nodes:
    themselves only); max_depth: a host-side bound of depth."""
    B, T = parents.shape
    cols = torch.arange(T, device=parents.device)
    anc = (cols[:, None] == cols[None]).expand(B, T, T)
    cur = parents
    live = depth > 0 if valid is None else (depth > 0) & valid
    for _ in range(max_depth):                  # one ancestor level per pass, no host reads
        anc = anc | ((cols[None, None] == cur[..., None]) & live[..., None])
        live = live & (cur != 0)
        cur = parents.gather(1, cur)
    return anc


@dataclass
class TreeAttn:
    """What a forward over a tree block needs beyond a BlockCtx: positions pos [B,T] (rope) and visibility: keys
    at slots < base [B] (the context) and, of the slots base .. base+W-1, those with anc[b, i, slot - base]."""
    pos: torch.Tensor
    base: torch.Tensor
    anc: torch.Tensor

    def mask(self, S: int, window: int | None = None) -> torch.Tensor:
        """[B,1,T,S] bool (True: visible). window: a sliding window (transformers' rule: key position >
        query position - window), by positions: slots for the context, and when the block is its own key
        region (the target's verification) the nodes' positions for the tree keys."""
        B, T, W = self.anc.shape
        k = torch.arange(S, device=self.pos.device)[None, None, :]
        base = self.base[:, None, None]
        ctx = k < base
        rel = (k - base).expand(B, T, S)
        inreg = (rel >= 0) & (rel < W)
        tree = self.anc.gather(2, rel.clamp(0, W - 1)) & inreg
        if window is not None:
            lo = self.pos[:, :, None] - window
            ctx = ctx & (k > lo)
            if W == T:
                tree = tree & (self.pos[:, None, :].expand(B, T, T).gather(2, rel.clamp(0, W - 1)) > lo)
        return (ctx | tree).unsqueeze(1)

    def apply(self, ctx, rope, window: int | None = None):
        """Turn a layers.BlockCtx built for this block's slots into the tree's: rope at the node positions and
        the tree mask (the slot writes are the BlockCtx's own; positions never exceed slots, so the rope
        tables BlockCtx ensured cover them)."""
        ctx.cos, ctx.sin = rope(self.pos)
        ctx.mask = self.mask(ctx.S, window)
        return ctx


def select_nodes(tokens, parents, depth, score, nodes: int, max_depth: int) -> Tree:
    """Candidates in topological order (parents index earlier candidates; -1: the root) -> the tree of the
    `nodes` best by score (cumulative log-probability; -inf: never), closed under parents, in candidate order.
    tokens/parents/depth/score [B,C] (depth >= 1). Returns a Tree of width min(nodes, C) + 1 (column 0 the root:
    a tree of depth 1 from topk candidates verifies topk + 1 positions, not nodes + 1 with padding)."""
    B, C = tokens.shape
    dev = tokens.device
    n = min(nodes, C)
    top = score.sort(dim=1, descending=True, stable=True).indices[:, :n]   # ties: the earlier (a parent first)
    keep = torch.zeros(B, C, dtype=torch.bool, device=dev)
    keep.scatter_(1, top, True)
    keep &= score > float("-inf")
    # close under parents (ties only); at most depth passes, each a gather
    par = parents.clamp(min=0)
    for _ in range(max_depth - 1):
        keep = keep & ((parents < 0) | keep.gather(1, par))
    # new index of each kept candidate: 1 + its rank among kept ones, in candidate order
    newi = keep.long().cumsum(1)
    T = n + 1
    tgt = torch.where(keep, newi, T)                                 # dropped -> a scratch column
    out_tok = torch.zeros(B, T + 1, dtype=torch.long, device=dev)
    out_par = torch.zeros(B, T + 1, dtype=torch.long, device=dev)
    out_valid = torch.zeros(B, T + 1, dtype=torch.bool, device=dev)
    out_dep = torch.ones(B, T + 1, dtype=torch.long, device=dev)
    out_sc = torch.full((B, T + 1), float("-inf"), dtype=score.dtype, device=dev)
    pnew = torch.where(parents < 0, 0, newi.gather(1, par))
    out_tok.scatter_(1, tgt, tokens)
    out_par.scatter_(1, tgt, pnew)
    out_valid.scatter_(1, tgt, keep)
    out_dep.scatter_(1, tgt, torch.where(keep, depth, 1))
    out_sc.scatter_(1, tgt, score)
    out_tok, out_par, out_valid, out_dep = out_tok[:, :T], out_par[:, :T], out_valid[:, :T], out_dep[:, :T]
    out_valid[:, 0] = True
    out_dep[:, 0] = 0
    out_par = torch.where(out_valid, out_par, 0)
    out_dep = torch.where(out_valid, out_dep, 1).masked_fill_(torch.arange(T, device=dev)[None] == 0, 0)
    out_sc = torch.where(out_valid, out_sc[:, :T], float("-inf"))
    out_sc[:, 0] = 0.0
    return Tree(out_tok, out_par, out_dep, out_valid, out_sc)


def accept_greedy(tree: Tree, logits: torch.Tensor, K: int):
    """logits [B,T,V] of the tree block -> (accepted [B], path [B,K+1] node indices (root first; past the end
    the last node repeated), tokens [B,K+1]: the target's argmax along the path; row b emits
    tokens[b, :accepted[b] + 1])."""
    B, T = tree.tokens.shape
    target = greedy(logits)                                             # [B,T]
    match = tree.valid & (tree.tokens == target.gather(1, tree.parents))
    match[:, 0] = True
    ok = match
    for _ in range(K):
        ok = match & ok.gather(1, tree.parents)
    d = torch.where(ok, tree.depth, -1)
    best = d.argmax(1)                                                  # deepest accepted (first such node)
    acc = d.gather(1, best[:, None])[:, 0]
    path = torch.zeros(B, K + 1, dtype=torch.long, device=logits.device)
    cur = best
    for i in range(K, -1, -1):                                          # walk up from depth `acc`
        here = acc >= i
        path[:, i] = torch.where(here, cur, 0)
        cur = torch.where(here, tree.parents.gather(1, cur[:, None])[:, 0], cur)
    path = torch.where(torch.arange(K + 1, device=logits.device)[None] <= acc[:, None], path,
                       path.gather(1, acc[:, None]))
    return acc, path, target.gather(1, path)


def accept_sampled(tree: Tree, logits: torch.Tensor, K: int, rows) -> tuple:
    """The sampled rows' acceptance (rows: verify.SampledRows; tree and logits [S,T,V] are theirs) -> (accepted
    [S], path [S,K+1], tokens [S,K+1]) as accept_greedy's. Every emitted token is a sample of the target's
    processed distribution p at its node, whatever the tree: at the node reached (the root first) one uniform u
    picks its children in node order by p's mass, child c with probability p(c) (the first child whose running
    sum of p over the children so far exceeds u); no child picked, the row emits a sample of p with the node's
    children removed (renormalised) and stops; past depth K (no children) it emits a sample of p (the bonus
    token). So the token at each position is drawn from p: P(child c) = p(c), P(x) = p(x) for any other x. The
    candidates are the drafter's deterministic choices (SpecInfer's rule for one-hot draft distributions). Draws:
    K uniforms, then one more, per row from its generator, as verify_sampled's argmax mode draws them, so a
    tree that is a chain (eagle_topk 1) gives the chain's samples."""
    S, T = tree.tokens.shape
    dev = logits.device
    u = torch.stack([torch.rand(K, generator=g, dtype=torch.float64, device=dev) for g in rows.gens])   # [S,K]
    idx = torch.arange(T, device=dev)[None]                                                    # [1,T] node indices
    real = tree.valid & (idx > 0)                                                             # [S,T] a draft node
    ar = torch.arange(S, device=dev)
    cur = torch.zeros(S, dtype=torch.long, device=dev)                                        # the node reached
    alive = torch.ones(S, dtype=torch.bool, device=dev)
    acc = torch.zeros(S, dtype=torch.long, device=dev)
    path = torch.zeros(S, K + 1, dtype=torch.long, device=dev)
    dist = None                                                       # [S,V] what each row emits from

    def p_at(node):                                                   # p at each row's node [S,V]
        return probs_from_logits(logits[ar, node][:, None], rows.temperature, rows.top_k, rows.top_p)[:, 0]
    for lvl in range(K + 1):
        pc = p_at(cur)
        if lvl == K:                                                                          # depth K: the bonus token
            dist = pc if dist is None else torch.where(alive[:, None], pc, dist)
            break
        kids = real & (tree.parents == cur[:, None])                                          # [S,T] its children
        # a row stopping here emits from p without the node's children (siblings are distinct tokens)
        drop = torch.zeros_like(pc).scatter_add_(1, tree.tokens, kids.to(pc.dtype)) > 0
        here = torch.where(drop, 0.0, pc)
        run = torch.where(kids, pc.gather(1, tree.tokens).double(), 0.0).cumsum(1)             # p summed in node order
        hit = kids & (u[:, lvl, None] < run)
        # children holding all of p's mass may sum to just under 1 (float32 p in float64): a u in that rounding
        # gap takes the last child, as nothing else could be emitted
        last = kids & (idx == (kids * idx).amax(1, True))
        hit = torch.where((~hit.any(1) & (here.sum(1) == 0))[:, None], last, hit)
        took = alive & hit.any(1)
        stop = alive & ~took
        dist = here if dist is None else torch.where(stop[:, None], here, dist)
        cur = torch.where(took, hit.int().argmax(1), cur)                                     # the first such child
        acc += took
        alive &= took
        path[:, lvl + 1] = cur
    tokens = tree.tokens.gather(1, path[:, list(range(1, K + 1)) + [K]])                     # the accepted drafts
    tokens[ar, acc] = sample_rows(dist, rows.gens)
    return acc, path, tokens


def compact_kv(cache, b0: int, start: torch.Tensor, path: torch.Tensor):
    """Move the KV entries at slots start + path[:, i] to start + i (rows b0..; every allocated layer).
    path is increasing along each row's accepted part and repeats its last node after it, so sources are
    read before any destination is written (advanced indexing gathers first)."""
    B, W = path.shape
    ext = quant_ext.get()
    layers = [i for i, t in enumerate(cache.k) if t is not None]
    if ext is not None and hasattr(ext, "compact_kv") and all(
            cache.k[i].device.type == "cpu" and cache.k[i].dtype in EXT_CACHE_DTYPES for i in layers):
        ext.compact_kv([cache.k[i] for i in layers], [cache.v[i] for i in layers], b0, start, path)  # one call
        return
    rows = torch.arange(b0, b0 + B, device=path.device)[:, None]
    src = start[:, None] + path
    dst = start[:, None] + torch.arange(W, device=path.device)[None]
    for store in (cache.k, cache.v):
        for t in store:
            if t is not None:
                t[rows, :, dst] = t[rows, :, src]
