"""One interface for proposers: propose(batch, k) -> draft token ids [B, k] (target vocabulary), on the device;
k may change from step to step (1..the k the proposer was built for; None: that k).

Draft sampling (the speculative config's "draft_sampling", peagle/spec_config.py): a proposer built with
"argmax" drafts every row's argmax; one built with "sample" draws the drafts of the batch's sampled rows
(batch.sampled, the temperature > 0 rows) from its distribution q -- the draft logits processed with the row's
own temperature / top-k / top-p, as the verifier processes the target's (peagle/sampling.py) -- with the row's
generator, and leaves q over the target vocabulary (zero outside the draft vocabulary) in batch.q for the
verifier (peagle/verify.py). Greedy rows draft the argmax in both modes. Invariant: a proposer that leaves
batch.q None drafts deterministically from the context (its q is one-hot, which the verifier then assumes).

A proposer never reads device values back to the host: the engine hands it host-side facts (its cached lengths
and a `shape(span, s0)` function, as the target's forward gets them: peagle/models/layers.py BlockCtx).

The proposer owns the drafter's per-row state (peagle/drafters/context.py): what each row still has to feed the
drafter and what that catch-up costs. The engine tells it when requests arrive (add_requests) and leave
(remove_row), asks it to draft (draft, draft_tree) and tells it what the target accepted (advance); a K policy
asks it for the catch-up's cost (catch_up_rows)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import KVCache
from ..heads.model import DrafterHead
from ..sampling import greedy, probs_from_logits, sample_rows
from ..spec_config import DRAFT_SAMPLING
from ..verify import SampledRows
from .context import DraftContext


@dataclass
class DraftBatch:
    """Per row: the drafter rows this step must add (ids [B,T] = tokens x_{q+1}, aux [B,T,3T] = target aux
    state at q, for positions start..start+n_real-1; rows beyond n_real are padding).
    span: a host-side upper bound of max(start) + T (None: read from start on the host, for tools and tests);
    s0: the host start shared by all rows (layers.BlockCtx's); the engine gives it for one row, whose entries are
    then all real (n_real == T), and for prefills (all rows start at 0, n_real may differ between rows)."""
    ids: torch.Tensor
    aux: torch.Tensor
    start: torch.Tensor
    n_real: torch.Tensor
    b0: int = 0
    requests: list | None = None   # the engine's Request objects, row-aligned (for context-based proposers)
    span: int | None = None
    s0: int | None = None
    sampled: "SampledRows | None" = None   # in: the sampled rows (peagle/verify.py), drawn from q in "sample" mode
    q: torch.Tensor | None = None          # out: [S,k,V] the q each sampled row's drafts were drawn from


class Proposer:
    name = "base"
    draft_sampling = "argmax"
    context: DraftContext | None = None        # the per-row state: made by the first add_requests, on its device
    max_rows: int | None = None                # rows never double past this (the engine's max_num_seqs)

    def __init__(self, head: DrafterHead, k: int, max_len: int, rows: int = 1, draft_sampling: str = "argmax",
                 dual: bool = False, quantization: str = "none"):
        """dual: keep the head's weights in both layouts, as the target does (its `dual_layout`). quantization:
        the head's projections' (DrafterHead.prepare_inference: the target's a8 / weight-only choice as Q8_0)."""
        if draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}, got {draft_sampling!r}")
        c = head.config
        self.head, self.k, self.draft_sampling = head.prepare_inference(dual, quantization), k, draft_sampling
        w = head.fc.weight
        # no lengths of its own: the engine derives the drafter's valid length (peagle/engine.py)
        self.cache = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_len, rows, w.dtype,
                             w.device, lens=False)

    @torch.no_grad()
    def prefill(self, batch: DraftBatch):
        """Add context rows to the drafter cache without drafting (new requests' prompts)."""
        self.head(batch.ids, self.head.combine(batch.aux), None, cache=self.cache, b0=batch.b0, start=batch.start,
                  span=batch.span, s0=batch.s0)

    def propose(self, batch: DraftBatch, k: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    # ---------------------------------------------------------------- the engine's side: rows and steps
    def ensure_rows(self, rows: int, limit: int | None = None):
        """At least `rows` rows of the drafter's cache (and of its context, when add_requests makes it), not
        doubling past limit."""
        self.cache.ensure_rows(rows, limit)
        self.max_rows = limit

    def remove_row(self, row: int, last: int):
        """The request in `row` has left; the last row in use, `last`, moves into its place."""
        if row != last:
            self.cache.move_row(last, row)
            self.context.move(last, row)
        del self.context.behind[last:]

    def add_requests(self, requests: list, b0: int, ids: torch.Tensor, aux: torch.Tensor | None, prompt_lens: list,
                     prompt_lens_dev: torch.Tensor, first: torch.Tensor, now: bool, shape):
        """New requests in rows b0..: their prompts ids [B,T] (right-padded), the target's aux states at them
        [B,T,A] (None without aux layers), prompt lengths (host list and [B] on the device), first sampled tokens
        [B]. now: feed the drafter the prompt now; otherwise every row of it (x_{q+1} with aux at q, q = 0..P-1,
        the last one the first sampled token) waits for the catch-up of the next step that drafts, so a request
        that never drafts costs no drafter work."""
        (B, T), dev = ids.shape, ids.device
        if self.context is None:
            self.context = DraftContext(dev, self.max_rows, getattr(self.cache, "max_len", None))
        ctx, rows = self.context, slice(b0, b0 + B)
        ctx.ensure(b0 + B, self.k + 1)
        del ctx.behind[b0:]
        if not now:
            ctx.ensure(b0 + B, max(self.k, T) + 1, None if aux is None else aux.shape[-1],
                       None if aux is None else aux.dtype)
            ctx.ids[rows, : T - 1] = ids[:, 1:]
            ctx.ids[b0 + torch.arange(B, device=dev), prompt_lens_dev - 1] = first
            if aux is not None:
                ctx.aux[rows, :T] = aux[:, :T]
            ctx.behind += prompt_lens
            return
        # position q gets token x_{q+1} with the target's aux state at q, for q < P - 1; the row at P - 1 (the
        # first sampled token) is what the first decode step adds
        if T > 1:
            self.prefill(DraftBatch(ids[:, 1:], None if aux is None else aux[:, : T - 1],
                                    torch.zeros(B, dtype=torch.long, device=dev), prompt_lens_dev - 1, b0, requests,
                                    **shape(T - 1, 0)))
        ctx.ids[rows, 0] = first
        if aux is not None:
            ctx.ensure(b0 + B, self.k + 1, aux.shape[-1], aux.dtype)
            ctx.aux[rows, 0] = aux[torch.arange(B, device=dev), prompt_lens_dev - 1]
        ctx.behind += [1] * B

    def draft(self, requests: list, k: int, start: torch.Tensor, cached: list, shape, sampled=None):
        """A decode step's drafts: feed each row's pending context, draft k tokens. start [B]: the target's cached
        lengths (device), `cached` the same on the host. -> (drafts [B,k], q [S,k,V] | None: what the sampled
        rows' drafts were drawn from)."""
        batch = self._step_batch(requests, k, start, cached, shape, sampled)
        drafts = self.propose(batch, k)
        return drafts, batch.q

    def draft_tree(self, requests: list, k: int, start: torch.Tensor, cached: list, shape, topk: int, nodes: int):
        """As draft, a tree of depth k per row: the drafter's deterministic candidates, for greedy and sampled rows
        alike (peagle/drafters/tree.py)."""
        return self.propose_tree(self._step_batch(requests, k, start, cached, shape), k, topk, nodes)

    def _step_batch(self, requests, k, start, cached, shape, sampled=None) -> DraftBatch:
        ctx, B = self.context, len(requests)
        behind = ctx.behind[:B]
        width = max(behind)
        ctx.ensure(B, max(k, width) + 1)
        n = torch.tensor(behind, dtype=torch.long, device=start.device)        # [B] rows to feed per row
        span = max(c - b for c, b in zip(cached, behind)) + width
        return DraftBatch(ctx.ids[:B, :width], None if ctx.aux is None else ctx.aux[:B, :width], start - n, n, 0,
                          requests, **shape(span, cached[0] - behind[0] if B == 1 else None), sampled=sampled)

    def advance(self, k: int, accepted: torch.Tensor | None, tokens: torch.Tensor, aux: torch.Tensor | None,
                accepted_host: list):
        """What the step kept: accepted drafts [B] (device; host list accepted_host), tokens [B,k+1] and the
        target's aux states at them [B,k+1,A]. After a step that drafted, the drafter is fed accepted + 1 rows
        next; after one that did not (k = 0), the row joins those it has still to catch up."""
        ctx, B = self.context, tokens.shape[0]
        if k:
            ctx.ids[:B, : k + 1] = tokens
            if aux is not None:
                ctx.aux[:B, : k + 1] = aux
            ctx.behind[:B] = [a + 1 for a in accepted_host]
            return
        behind = ctx.behind[:B]
        ctx.ensure(B, max(behind) + 1)
        # each row's next column is its count behind; rows level (always at B = 1) write it by plain slicing,
        # ~20 us where index tensors cost ~45 us per step
        rows, col = ((slice(0, B), behind[0]) if min(behind) == max(behind) else
                     (torch.arange(B, device=tokens.device), torch.tensor(behind, device=tokens.device)))
        ctx.ids[rows, col] = tokens[:, 0]
        if aux is not None:
            ctx.aux[rows, col] = aux[:, 0]
        ctx.behind[:B] = [b + 1 for b in behind]

    def catch_up_rows(self, batch_size: int, steady: int) -> int:
        """The cost of catching the drafter up, in drafter rows: the padded rows the next step that drafts feeds
        `batch_size` rows beyond a steady step's `steady` per row (0 when it is caught up)."""
        behind = self.context.behind[:batch_size] if self.context is not None else []
        return batch_size * max(0, max(behind, default=0) - steady)

    def one_greedy_row(self, batch: DraftBatch) -> bool:
        """The engine's one row (s0 given: all its entries real) with argmax drafts (no row drawn from q): where
        the head's one-call pass (DrafterHead.greedy_pass) may run."""
        return batch.ids.shape[0] == 1 and batch.s0 is not None and not (
            batch.sampled is not None and self.draft_sampling == "sample")

    def pick(self, normed: torch.Tensor, sampled: "SampledRows | None"):
        """normed [B,J,H] (J draft slots per row) -> (draft ids [B,J] in the target vocabulary, q [S,J,V] or None).
        Every row's argmax; in "sample" mode the sampled rows' slots are drawn from their q instead (all slots
        at once, each row with its own generator) and q comes back over the target vocabulary."""
        h = self.head
        logits = h.draft_logits(normed)                                              # [B,J,Vd]
        ids = greedy(logits)                                                         # [B,J]
        if sampled is None or self.draft_sampling != "sample":
            return h.to_target(ids), None
        qd = probs_from_logits(logits[sampled.index], sampled.temperature, sampled.top_k, sampled.top_p)
        ids[sampled.index] = sample_rows(qd, sampled.gens)                           # [S,J]
        to_t = h.to_target(torch.arange(qd.shape[-1], device=qd.device))            # [Vd] draft id -> target id
        q = qd.new_zeros(qd.shape[:-1] + (h.config.vocab_size,)).index_copy_(-1, to_t, qd)   # [S,J,V]
        return h.to_target(ids), q
