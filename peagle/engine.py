"""The engine: continuous batching of requests through plain, EAGLE-3 or P-EAGLE decoding.

Each step: (1) admit waiting requests into free cache rows and prefill them (target, then drafter
context); (2) the K policy picks this step's K (0..k) and the proposer drafts K tokens for every running row;
(3) the target verifies [last, d1..dK] in one pass; (4) each row keeps its own accepted prefix + one token
(ragged acceptance), caches roll back, finished requests leave and their rows are compacted. With no
drafter, or K = 0 this step, (2) is skipped (a plain decoding step).

Row invariant: the target cache of a running request holds all its tokens but the last; the drafter cache
holds positions < pending start; `pending` holds the drafter rows the next step with K > 0 must add (a
K = 0 step appends its row to `pending`: the drafter catches up later)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .autok.policy import FixedK, KPolicy
from .drafters.base import DraftBatch, Proposer
from .errors import PeagleError
from .spec_metrics import SpecMetrics
from .sampling import SamplingParams, make_generator, probs_from_logits, sample_from
from .verify import verify_greedy, verify_sampled


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list
    params: SamplingParams
    prompt: str | None = None
    output_ids: list = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_text_at: int | None = None           # char index where a stop string begins
    gen: torch.Generator | None = None
    pending: tuple | None = None               # (ids list, aux [c,3T] or None, start)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_drafts: int = 0
    num_accepted: int = 0

    @property
    def all_ids(self):
        return self.prompt_token_ids + self.output_ids


def _rows(t, sl):
    return None if t is None else t[sl]


def _extend(pending, ids, aux):
    """Append drafter rows to a request's pending rows (a K = 0 step: the drafter catches up later)."""
    p_ids, p_aux, start = pending
    return (p_ids + ids, None if aux is None else torch.cat([p_aux, aux]), start)


@dataclass
class StepOutput:
    request: Request
    new_token_ids: list
    finished: bool


class Engine:
    def __init__(self, target, tokenizer=None, proposer: Proposer | None = None, k: int = 0,
                 max_num_seqs: int = 128, max_model_len: int | None = None, seed: int = 0,
                 prefill_token_budget: int = 8192, k_policy: KPolicy | None = None):
        self.target, self.tok, self.proposer = target, tokenizer, proposer
        self.k = k if proposer is not None else 0          # the largest K a step may use
        self.k_policy = k_policy if k_policy is not None and proposer is not None else FixedK(self.k)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = min(max_model_len or target.cfg.max_position_embeddings,
                                 target.cfg.max_position_embeddings)
        cache_len = self.max_model_len + 3 * self.k + 8
        self.cache = target.new_cache(1, cache_len)
        if proposer is not None:
            self.aux_ids = proposer.head.aux_ids
        else:
            self.aux_ids = ()
        self.eos = set(target.cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos.add(tokenizer.eos_token_id)
        self.seed, self._n = seed, 0
        self.prefill_token_budget = prefill_token_budget
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.metrics = SpecMetrics(max(self.k, 1))
        self.metrics.extra = lambda: {"k_policy": self.k_policy.describe()}

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id, prompt_token_ids, params: SamplingParams, prompt=None) -> Request:
        ids = list(prompt_token_ids)
        if not ids:
            raise PeagleError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PeagleError(f"prompt has {len(ids)} tokens, which does not fit the context "
                              f"(max_model_len={self.max_model_len})")
        vocab = self.target.cfg.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise PeagleError(f"prompt token ids must be in 0..{vocab - 1}")
        r = Request(str(request_id), ids, params, prompt)
        seed = params.seed if params.seed is not None else self.seed * 1_000_003 + self._n
        self._n += 1
        r.gen = make_generator(seed)
        self.waiting.append(r)
        return r

    def abort(self, request_id) -> bool:
        for i, r in enumerate(self.waiting):
            if r.request_id == request_id:
                self.waiting.pop(i)
                return True
        for i, r in enumerate(self.running):
            if r.request_id == request_id:
                r.finished, r.finish_reason = True, "abort"
                self._remove(i)
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_rows_in_use(self) -> int:
        return len(self.running)

    # ---------------------------------------------------------------- step
    def step(self) -> list[StepOutput]:
        outs: list[StepOutput] = []
        if self.waiting and len(self.running) < self.max_num_seqs:
            outs += self._prefill()
            self._compact()
        if self.running:
            outs += self._decode()
        self._compact()
        return outs

    def _prefill(self) -> list[StepOutput]:
        new, budget = [], self.prefill_token_budget
        while self.waiting and len(self.running) + len(new) < self.max_num_seqs:
            n = len(self.waiting[0].prompt_token_ids)
            if new and n > budget:
                break
            new.append(self.waiting.pop(0))
            budget -= n
        b0, B = len(self.running), len(new)
        self.cache.ensure_rows(b0 + B)
        if self.proposer is not None:
            self.proposer.cache.ensure_rows(b0 + B)
        lens = torch.tensor([len(r.prompt_token_ids) for r in new])
        T = int(lens.max())
        toks = torch.zeros(B, T, dtype=torch.long)
        for i, r in enumerate(new):
            toks[i, : lens[i]] = torch.tensor(r.prompt_token_ids)
        t0 = time.perf_counter()
        logits, aux = self.target.forward(toks, self.cache, b0, torch.zeros(B, dtype=torch.long),
                                          self.aux_ids, logits_at=lens - 1)
        self.running += new
        outs = []
        for i, r in enumerate(new):
            self.cache.truncate(b0 + i, int(lens[i]))
            tok = self._sample_one(r, logits[i])
            r.first_token_time = time.perf_counter()
            if self.proposer is not None:
                P = int(lens[i])
                r.pending = (r.prompt_token_ids[1:] + [tok], aux[i, :P] if aux is not None else None, 0)
            outs.append(self._emit(r, [tok]))
        self.metrics.verify_time_s += time.perf_counter() - t0
        if self.proposer is not None:
            t0 = time.perf_counter()
            # drafter context for the new rows: everything but the last pending row
            ctx = [(r.pending[0][:-1], _rows(r.pending[1], slice(None, -1))) for r in new]
            if max(len(c[0]) for c in ctx) > 0:
                self.proposer.prefill(self._draft_batch(ctx, torch.zeros(B, dtype=torch.long), b0))
            for r in new:
                ids, a, _ = r.pending
                r.pending = (ids[-1:], _rows(a, slice(-1, None)), len(ids) - 1)
            self.metrics.draft_time_s += time.perf_counter() - t0
        return outs

    def _draft_batch(self, rows, start, b0=0) -> DraftBatch:
        n = torch.tensor([max(len(ids), 1) for ids, _ in rows])
        T = int(n.max())
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        aux = None
        if rows[0][1] is not None:
            aux = torch.zeros(len(rows), T, rows[0][1].shape[-1], dtype=rows[0][1].dtype)
        for i, (t, a) in enumerate(rows):
            if len(t):
                ids[i, : len(t)] = torch.tensor(t)
                if aux is not None:
                    aux[i, : len(t)] = a
        return DraftBatch(ids, aux, start, n, b0)

    def _decode(self) -> list[StepOutput]:
        rows = self.running
        t_step = time.perf_counter()
        B = len(rows)
        K = min(max(int(self.k_policy.choose(rows)), 0), self.k) if self.proposer is not None else 0
        # every running request has sampled at least one token (in prefill): no list concatenation per step
        last = torch.tensor([r.output_ids[-1] for r in rows])
        start = torch.tensor([len(r.prompt_token_ids) + len(r.output_ids) - 1 for r in rows])
        if K:
            t0 = time.perf_counter()
            db = self._draft_batch([(r.pending[0], r.pending[1]) for r in rows],
                                   torch.tensor([r.pending[2] for r in rows]))
            db.requests = rows
            drafts = self.proposer.propose(db, K)
            self.metrics.draft_time_s += time.perf_counter() - t0
            block = torch.cat([last[:, None], drafts], 1)
        else:
            drafts, block = None, last[:, None]
        t0 = time.perf_counter()
        logits, aux = self.target.forward(block, self.cache, 0, start, self.aux_ids)
        greedy = [r.params.greedy for r in rows]
        if K and any(greedy):
            acc_g, tgt_g = verify_greedy(logits, drafts)
        elif not K:
            tgt_g = logits.argmax(-1)
        outs, accepted = [], torch.zeros(B, dtype=torch.long)
        for i, r in enumerate(rows):
            if K and greedy[i]:
                a = int(acc_g[i])
                emitted = tgt_g[i, : a + 1].tolist()
            elif K:
                p = r.params
                a, emitted = verify_sampled(logits[i], drafts[i], p.temperature, p.top_k, p.top_p, r.gen)
            else:
                a = 0
                emitted = [int(tgt_g[i, 0])] if greedy[i] else [self._sample_one(r, logits[i, 0])]
            m = int(start[i])
            self.cache.truncate(i, m + a + 1)
            if K:
                self.metrics.add_draft(a, K)
                r.num_drafts += 1
                r.num_accepted += a
                accepted[i] = a
                r.pending = (emitted, None if aux is None else aux[i, : a + 1], m)
            elif self.proposer is not None:
                r.pending = _extend(r.pending, emitted, None if aux is None else aux[i, :1])
            outs.append(self._emit(r, emitted))
        self.metrics.verify_time_s += time.perf_counter() - t0
        self.metrics.add_step(K)
        self.k_policy.observe(rows, K, accepted, time.perf_counter() - t_step)
        return outs

    def _sample_one(self, r: Request, logits: torch.Tensor) -> int:
        p = r.params
        if p.greedy:
            return int(logits.argmax(-1))
        return int(sample_from(probs_from_logits(logits[None], p.temperature, p.top_k, p.top_p), r.gen)[0])

    def _emit(self, r: Request, toks: list) -> StepOutput:
        """Append tokens one by one, stopping at EOS / stop ids / stop strings / max_tokens / context."""
        p, added = r.params, []
        limit = min(p.max_tokens or 10**9, self.max_model_len - len(r.prompt_token_ids))
        for t in toks:
            r.output_ids.append(t)
            added.append(t)
            if (t in self.eos and not p.ignore_eos) or t in p.stop_token_ids:
                r.finished, r.finish_reason = True, "stop"
            elif p.stop and self._hit_stop_string(r):
                r.finished, r.finish_reason = True, "stop"
            elif len(r.output_ids) >= limit:
                r.finished, r.finish_reason = True, "length"
            if r.finished:
                r.finish_time = time.perf_counter()
                break
        return StepOutput(r, added, r.finished)

    def _hit_stop_string(self, r: Request) -> bool:
        text = self.tok.decode(r.output_ids, skip_special_tokens=True)
        hits = [text.find(s) for s in r.params.stop if s and s in text]
        if hits:
            r.stop_text_at = min(hits)
            return True
        return False

    def _compact(self):
        for i in range(len(self.running) - 1, -1, -1):
            if self.running[i].finished:
                self._remove(i)

    def _remove(self, i: int):
        last = len(self.running) - 1
        if i != last:
            self.cache.move_row(last, i)
            if self.proposer is not None:
                self.proposer.cache.move_row(last, i)
            self.running[i] = self.running[last]
        self.running.pop()
