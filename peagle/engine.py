"""The engine: continuous batching of requests through plain, EAGLE-3 or P-EAGLE decoding.

Each step: (1) admit waiting requests into free cache rows and prefill them (target, then drafter
context); (2) the K policy picks this step's K (0..k) and the proposer drafts K tokens for every running row;
(3) the target verifies [last, d1..dK] in one pass; (4) each row keeps its own accepted prefix + one token
(ragged acceptance), caches roll back, finished requests leave and their rows are compacted. With no
drafter, or K = 0 this step, (2) is skipped (a plain decoding step).

The step is a tensor program on the run's device: tokens, positions, lengths and the per-row state
(peagle/rowstate.py) stay there, masks are built from lengths there, and verification is batched over rows
and draft positions (peagle/verify.py). A decode step copies device -> host exactly once (accepted counts and
tokens, for stop checks and the caller); a step that admits requests copies their first tokens once more,
before decoding, because a request may stop at its first token and context-reading proposers see it.

Row invariant (row i = running[i]): the target cache holds all of the sequence but its last token
(cache.lens[i] = seq_len - 1; state.last[i] = the last token). The drafter's side of the row -- its cache, the
context it has still to be fed, what catching up costs -- is the proposer's (peagle/drafters/base.py): the
engine tells it what arrived, what was accepted and what left, and asks it to draft.
cache.lens is the one record of lengths on the device; the host keeps each request's token list and, from
the copies, `seq_len`, used only to size work (attention spans, block widths)."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from .compile import bucket, compile_step
from .drafters.base import Proposer
from .errors import DecodeError, PeagleError, PrefillError
from .kpolicy import FixedK, KPolicy
from .rowstate import RowState
from .sampling import SamplingParams, greedy, make_generator, unseeded_seed
from .spec_metrics import SpecMetrics
from .stops import find_stop
from .threads import ThreadGovernor
from .tree import TreeSpec
from .tree_step import tree_step
from .verify import SampledRows, verify_greedy, verify_greedy_advance, verify_sampled


def cache_len(max_model_len: int, k: int, tree: TreeSpec | None = None) -> int:
    """Cache positions per row, for the target's cache and the drafter's (peagle/llm.py make_engine): the context limit
    plus a margin of 3k + 8 for the rows a decode step with up to k drafts writes past the accepted length (a
    tree's: its widest block, TreeSpec.width)."""
    return max_model_len + 3 * (k if tree is None else tree.width(k)) + 8


def context_len(max_model_len: int | None, ctx: int) -> int:
    """The context a run allows: max_model_len (None: the model's, ctx), cut to ctx with a line saying so;
    PeagleError if it is not an integer >= 2 (a prompt token and one more)."""
    if max_model_len is None:
        return ctx
    if not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or max_model_len < 2:
        raise PeagleError(f"max_model_len must be an integer >= 2 (a prompt token and one more), got "
                          f"{max_model_len!r}")
    if max_model_len > ctx:
        print(f"peagle: max_model_len {max_model_len} is above the model's context ({ctx}): using {ctx}",
              file=sys.stderr)
    return min(max_model_len, ctx)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list
    params: SamplingParams
    prompt: str | None = None
    output_ids: list = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_text_at: int | None = None           # char index where the text ends: a stop string's start, a stop token's
    stop_reason: int | str | None = None      # vLLM's: the stop token id (not EOS) or stop string that ended it
    gen: torch.Generator | None = None
    seq_len: int = 0                           # tokens of the sequence on the device (prompt + generated)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_drafts: int = 0
    num_accepted: int = 0

    @property
    def all_ids(self):
        return self.prompt_token_ids + self.output_ids


@dataclass
class StepOutput:
    request: Request
    new_token_ids: list
    finished: bool


class Engine:
    def __init__(self, target, tokenizer=None, proposer: Proposer | None = None, k: int = 0,
                 max_num_seqs: int = 128, max_model_len: int | None = None, seed: int = 0,
                 prefill_token_budget: int = 8192, k_policy: KPolicy | None = None, compile: bool = False,
                 tree: TreeSpec | None = None):
        """tree: token trees (peagle/tree.py, peagle/tree_step.py) instead of chains."""
        if max_num_seqs < 1:                       # no row to admit a request into: generate() would never end
            raise PeagleError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        self.target, self.tok, self.proposer = target, tokenizer, proposer
        self.device = torch.device(target.device)
        self.k = k if proposer is not None else 0          # the largest K a step may use
        self.tree = tree if proposer is not None and self.k else None
        self.k_policy = k_policy if k_policy is not None and proposer is not None else FixedK(self.k)
        self.k_policy.attach(proposer)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = context_len(max_model_len, target.cfg.max_position_embeddings)
        self.cache = target.new_cache(1, cache_len(self.max_model_len, self.k, self.tree))
        self.state = RowState(self.device)
        self.aux_ids = proposer.head.aux_ids if proposer is not None else ()
        self.eos = set(target.cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos.add(tokenizer.eos_token_id)
        self.seed, self._n = seed, 0
        self.prefill_token_budget = prefill_token_budget
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._live: set[str] = set()                # ids of the requests waiting or running
        self._sampled: SampledRows | None = None
        self._sampled_stale = True
        self.metrics = SpecMetrics(max(self.k, 1))
        self.threads = ThreadGovernor() if self.device.type == "cpu" else None   # fewer threads while others load the CPUs
        self._decoded = None                       # the last decode step's shape (rows, K, tree), for the governor
        self.metrics.extra = lambda: {"k_policy": self.k_policy.describe()} | (
            {"threads": self.threads.threads, "thread_switches": self.threads.switches} if self.threads else {})
        self.compiled = compile                 # peagle/compile.py: compiled forwards, no host-keyed fast paths
        if compile:
            compile_step(target, proposer)
    # ---------------------------------------------------------------- requests
    def add_request(self, request_id, prompt_token_ids, params: SamplingParams, prompt=None) -> Request:
        ids = list(prompt_token_ids)
        if not ids:
            raise PeagleError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PeagleError(f"prompt has {len(ids)} tokens, which does not fit the context "
                              f"(max_model_len={self.max_model_len})")
        if params.stop and self.tok is None:
            raise PeagleError("stop strings need the model's tokenizer (this model has none): use stop_token_ids")
        vocab = self.target.cfg.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise PeagleError(f"prompt token ids must be in 0..{vocab - 1}")
        rid = str(request_id)
        if rid in self._live:                       # abort and auto K's statistics go by id
            raise PeagleError(f"request id {rid!r} is already in use")
        r = Request(rid, ids, params, prompt)
        seed = params.seed if params.seed is not None else unseeded_seed(self.seed, self._n)
        self._n += 1
        r.gen = None if params.greedy else make_generator(seed, self.device)   # greedy rows draw nothing
        self.waiting.append(r)
        self._live.add(rid)
        return r

    def abort(self, request_id) -> bool:
        for i, r in enumerate(self.waiting):
            if r.request_id == request_id:
                r.finished, r.finish_reason, r.finish_time = True, "abort", time.perf_counter()
                self.waiting.pop(i)
                self._live.discard(r.request_id)
                return True
        for i, r in enumerate(self.running):
            if r.request_id == request_id:
                r.finished, r.finish_reason, r.finish_time = True, "abort", time.perf_counter()
                self._remove(i)
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_rows_in_use(self) -> int:
        return len(self.running)

    # ---------------------------------------------------------------- step
    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        outs: list[StepOutput] = []
        if self.threads is not None:
            self.threads.tick()
        self._decoded = None
        admitted = bool(self.waiting and len(self.running) < self.max_num_seqs)
        if admitted:
            outs += self._prefill()
            self._compact()
        if self.running:
            outs += self._decode()
        self._compact()
        if self.threads is not None:             # decode steps' times by shape, steps that admitted left out
            self.threads.rest(None if admitted else self._decoded)
        return outs

    def release_memory(self) -> bool:
        """With no request running or waiting: both KV caches back to one row of their initial length and the
        drafter's backlog dropped (they grow with the largest batch and longest row and never shrank). Returns
        whether it released."""
        if self.running or self.waiting:
            return False
        self.cache.release()
        if self.proposer is not None:
            self.proposer.cache.release()
            self.proposer.context = None           # made again by the next add_requests
        if self.device.type == "cuda":
            torch.cuda.empty_cache()               # else torch's allocator keeps the freed blocks
        return True

    def _ensure_rows(self, n: int):
        self.cache.ensure_rows(n, self.max_num_seqs)
        if self.proposer is not None:
            self.proposer.ensure_rows(n, self.max_num_seqs)
        self.state.ensure(n, self.max_num_seqs)

    def _sampled_rows(self) -> SampledRows | None:
        if self._sampled_stale:
            self._sampled, self._sampled_stale = SampledRows.of(self.running, self.device), False
        return self._sampled

    def _prefill(self) -> list[StepOutput]:
        new, budget = [], self.prefill_token_budget
        while self.waiting and len(self.running) + len(new) < self.max_num_seqs:
            n = len(self.waiting[0].prompt_token_ids)
            if new and n > budget:
                break
            new.append(self.waiting.pop(0))
            budget -= n
        b0 = len(self.running)
        t0 = time.perf_counter()
        try:
            first = self._to_host(self._prefill_rows(new, b0))
        except BaseException as e:          # Ctrl-C too: no row left half admitted (running, not drafting)
            del self.running[b0:]
            self._live.difference_update(r.request_id for r in new)
            self._sampled_stale = True
            if not isinstance(e, Exception):
                raise
            raise PrefillError(f"prefill failed: {type(e).__name__}: {e}", [r.request_id for r in new]) from e
        self.metrics.prefill_time_s += time.perf_counter() - t0
        now = time.perf_counter()
        outs = []
        for r, tok in zip(new, first):
            r.first_token_time = now
            outs.append(self._emit(r, [tok]))
        return outs

    def _prefill_forward(self, toks, lens: list, plen, b0: int):
        """The target's prefill of padded prompts toks [B, T] into rows b0..: (logits at each prompt's last token
        [B, V], aux states [B, T, A] or None). A block longer than the target's exact attention covers
        (exact_max_t) attends through SDPA, whose sums follow the padded length: then each prompt is prefilled
        alone, so its bits do not depend on the prompts admitted with it (they differ between plain and
        speculative runs, whose requests finish at other steps)."""
        B, T = toks.shape
        lim = getattr(self.target, "exact_max_t", None)
        if B == 1 or not getattr(self.target, "exact_attention", False) or lim is None or T <= lim:
            zeros = torch.zeros(B, dtype=torch.long, device=toks.device)
            return self.target.forward(toks, self.cache, b0, zeros, self.aux_ids, logits_at=plen - 1,
                                       **self._shape(T, 0))
        outs = [self._prefill_forward(toks[i:i + 1, :n], [n], plen[i:i + 1], b0 + i) for i, n in enumerate(lens)]
        aux = None if outs[0][1] is None else \
            torch.cat([torch.nn.functional.pad(a, (0, 0, 0, T - a.shape[1])) for _, a in outs])
        return torch.cat([lg for lg, _ in outs]), aux

    def _prefill_rows(self, new: list[Request], b0: int) -> torch.Tensor:
        """Target prefill of the new requests into rows b0.., their first tokens, the drafter's context;
        returns the first tokens [B] (device)."""
        B, dev = len(new), self.device
        lens = [len(r.prompt_token_ids) for r in new]
        T = max(lens)
        self._ensure_rows(b0 + B)
        host = torch.zeros(B, T, dtype=torch.long, device="cpu")
        for i, r in enumerate(new):
            host[i, : lens[i]] = torch.tensor(r.prompt_token_ids, dtype=torch.long, device="cpu")
        toks = host.to(dev)
        plen = torch.tensor(lens, dtype=torch.long, device="cpu").to(dev)
        logits, aux = self._prefill_forward(toks, lens, plen, b0)
        self.running += new
        self._sampled_stale = True
        self.cache.lens[b0:b0 + B] = plen
        _, first = self._verify(logits[:, None], toks[:, :0], SampledRows.of(new, dev))
        first = first[:, 0]
        self.state.last[b0:b0 + B] = first
        for r, n in zip(new, lens):
            r.seq_len = n + 1
        if self.proposer is not None:
            # the batch these rows will decode in: the running ones, these, and those still waiting for a row
            coming = min(b0 + B + len(self.waiting), self.max_num_seqs)
            self.proposer.add_requests(new, b0, toks, aux, lens, plen, first, self.k_policy.drafts_next(coming),
                                       self._shape)
        return first

    def _decode(self) -> list[StepOutput]:
        rows, proposer = self.running, self.proposer
        t_step = t_phase = time.perf_counter()
        B = len(rows)
        K = min(max(int(self.k_policy.choose(rows)), 0), self.k) if proposer is not None else 0
        try:
            sampled, q = self._sampled_rows(), None
            start = self.cache.lens[:B]                      # device: each row's cached length
            cached = [r.seq_len - 1 for r in rows]           # host: the same, to size the work
            # one tree per row, unless the K policy chose the chain for this step
            tree = bool(K and self.tree is not None and self.k_policy.wants_tree())
            self._decoded = (B, K, tree)                     # the step's shape, for the thread governor
            if tree:
                K, accepted, tokens, aux, draft_s = tree_step(self, K, start, cached, sampled)
                t_phase += draft_s                           # verify_time_s: the step without its drafting
                host = self._advance(B, K, accepted, tokens, aux)
            else:
                if K:
                    drafts, q = proposer.draft(rows, K, start, cached, self._shape, sampled)
                    drafts = drafts.to(self.device)          # q [S,K,V]: the sampled rows' drafts ~ q (or None)
                    now = time.perf_counter()
                    self.metrics.draft_time_s += now - t_phase
                    t_phase = now
                    block = torch.cat([self.state.last[:B, None], drafts], 1)
                else:
                    block = self.state.last[:B, None]
                    drafts = block[:, :0]
                logits, aux = self.target.forward(block, self.cache, 0, start, self.aux_ids,
                                                  **self._shape(max(cached) + K + 1, cached[0] if B == 1 else None))
                if sampled is None:                          # a greedy batch: verified and advanced in one call
                    both = verify_greedy_advance(logits, drafts, self.state.last, self.cache.lens)   # [B,K+2]
                    host = self._to_host(both)
                    if proposer is not None:
                        proposer.advance(K, both[:, 0], both[:, 1:], aux, [h[0] for h in host])
                else:
                    host = self._advance(B, K, *self._verify(logits, drafts, sampled, q), aux)
        except Exception as e:
            raise DecodeError(f"decode step failed: {type(e).__name__}: {e}", [r.request_id for r in rows]) from e
        outs = []
        for r, (n_accepted, *kept) in zip(rows, host):
            r.seq_len += n_accepted + 1
            if K:
                self.metrics.add_draft(n_accepted, K)
                r.num_drafts += 1
                r.num_accepted += n_accepted
            outs.append(self._emit(r, kept[:n_accepted + 1]))
        self.metrics.verify_time_s += time.perf_counter() - t_phase
        self.metrics.add_step(K)
        self.k_policy.observe(rows, K, [h[0] for h in host], time.perf_counter() - t_step, tree=tree)
        return outs

    def _advance(self, B: int, K: int, accepted, tokens, aux) -> list:
        """The next step's state on the device -- lengths (a rollback is setting them), last tokens -- then the
        step's one copy to the host, per row [accepted, tokens...]; then the proposer hears what was kept."""
        start = self.cache.lens[:B]
        if K:
            self.state.last[:B] = tokens.gather(1, accepted[:, None])[:, 0]
            start += accepted + 1
            host = self._to_host(torch.cat([accepted[:, None], tokens], 1))
        else:
            self.state.last[:B] = tokens[:, 0]
            start += 1
            host = [[0, t] for t in self._to_host(tokens[:, 0])]
        if self.proposer is not None:
            self.proposer.advance(K, accepted, tokens, aux, [h[0] for h in host])
        return host

    def _shape(self, span: int, s0: int | None) -> dict:
        """The host-side facts a forward gets (layers.BlockCtx); compiled: spans in buckets, no s0 fast path."""
        return {"span": bucket(span), "s0": None} if self.compiled else {"span": span, "s0": s0}

    def _verify(self, logits: torch.Tensor, drafts: torch.Tensor, sampled: SampledRows | None, q=None):
        """logits [B,K+1,V], drafts [B,K], q [S,K,V] (the sampled rows' draft distributions; None: argmax
        drafts) -> (accepted [B] (None for plain greedy), tokens [B,K+1]), all on the device."""
        if drafts.shape[1] == 0 and sampled is None:
            return None, greedy(logits)
        acc, toks = verify_greedy(logits, drafts)
        if sampled is not None:
            i = sampled.index
            acc[i], toks[i] = verify_sampled(logits[i], drafts[i], sampled, q)
        return acc, toks

    @staticmethod
    def _to_host(t: torch.Tensor) -> list:
        """The step's device -> host copy."""
        return t.tolist()

    def _emit(self, r: Request, toks: list) -> StepOutput:
        """Append tokens one by one, stopping at EOS / stop ids / stop strings / max_tokens / context."""
        p, added = r.params, []
        limit = min(p.max_tokens or 10**9, self.max_model_len - len(r.prompt_token_ids))
        for t in toks:
            r.output_ids.append(t)
            added.append(t)
            if (t in self.eos and not p.ignore_eos) or t in p.stop_token_ids:
                r.finished, r.finish_reason = True, "stop"
                r.stop_reason = None if t in self.eos and not p.ignore_eos else t
                # the stop token's own text is left out, as vLLM leaves it out (EOS and other special tokens
                # have none: no decode of the whole output on the engine thread for them)
                if self.tok is not None and self.tok.decode([t], skip_special_tokens=True):
                    r.stop_text_at = len(self.tok.decode(r.output_ids[:-1], skip_special_tokens=True))
            elif p.stop and self._hit_stop_string(r):
                r.finished, r.finish_reason = True, "stop"
            elif len(r.output_ids) >= limit:
                r.finished, r.finish_reason = True, "length"
            if r.finished:
                r.finish_time = time.perf_counter()
                break
        return StepOutput(r, added, r.finished)

    def _hit_stop_string(self, r: Request) -> bool:
        hit = find_stop(self.tok, r.output_ids, r.params.stop)
        if hit is not None:
            r.stop_text_at, r.stop_reason = hit
        return hit is not None

    def _compact(self):
        for i in range(len(self.running) - 1, -1, -1):
            if self.running[i].finished:
                self._remove(i)

    def _remove(self, i: int):
        self._live.discard(self.running[i].request_id)
        last = len(self.running) - 1
        if i != last:
            self.cache.move_row(last, i)
            self.state.move(last, i)
            self.running[i] = self.running[last]
        if self.proposer is not None:
            self.proposer.remove_row(i, last)
        self.running.pop()
        self._sampled_stale = True
