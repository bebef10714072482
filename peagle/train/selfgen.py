"""The target answers its own prompts and records its hidden states in the same forwards: drafter training
data in one pass of the target (`peagle datagen --hidden-states`).

Invariants:
* greedy (or seeded sampled) continuation of every prompt until EOS or max_new tokens, the sequence
  `prompt + answer` with loss_mask = 1 on the answer;
* hidden_states[q] = the residual states entering each of `layer_ids` at position q (the last id is the
  final pre-norm state), for every position of the sequence, the final token's included: exactly what a
  separate extraction pass (peagle/train/hidden_states.py) would compute, up to float summation order;
* continuous batching: active rows stay compact at cache rows 0..n-1 (a finished row is replaced by the last
  one), free rows are refilled with waiting prompts of similar length (prompts are taken shortest first, so
  a prefill block pads little); one host copy of the new tokens per step.
A finished sample is handed to `emit` at once, so an interrupted run loses only the rows in flight."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..sampling import make_generator


class _Row:
    __slots__ = ("idx", "ids", "n_prompt", "states", "done")

    def __init__(self, idx: int, ids: list, states: torch.Tensor):
        self.idx, self.ids, self.n_prompt, self.states, self.done = idx, list(ids), len(ids), [states], False


@torch.no_grad()
def generate_with_states(target, prompts: list[list[int]], max_new: int, eos: set, layer_ids: tuple,
                         batch: int = 64, temperature: float = 0.0, seed: int = 0, state_dtype=torch.bfloat16,
                         emit: Callable | None = None, progress: Callable | None = None) -> dict:
    """Generate for every prompt (index into `prompts`) and call emit(i, token_ids [n], loss_mask [n] uint8,
    hidden [n, len(layer_ids), H] state_dtype) as each finishes. progress(new_tokens) after every step.
    Returns {"samples", "tokens" (generated), "seconds"}."""
    H, nl = target.cfg.hidden_size, len(layer_ids)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    longest = max((len(p) for p in prompts), default=1)
    cache = target.new_cache(batch, longest + max_new + 8)
    gen = make_generator(seed, target.device) if temperature > 0 else None
    rows: list[_Row] = []
    last = torch.zeros(0, dtype=torch.long, device=target.device)         # [n] the token each row feeds next
    t0, n_samples, n_tok, nxt = time.perf_counter(), 0, 0, 0

    def pick(logits):                                                      # [n, V] -> [n]
        if gen is None:
            return logits.argmax(-1)
        p = torch.softmax(logits.float() / temperature, -1)
        return torch.multinomial(p, 1, generator=gen)[:, 0]

    while nxt < len(order) or rows:
        # admit: prompts of similar length into the free rows, one padded prefill block
        if nxt < len(order) and (len(rows) <= batch - max(1, batch // 8) or not rows):
            new = order[nxt: nxt + batch - len(rows)]
            nxt += len(new)
            lens = [len(prompts[i]) for i in new]
            T, b0 = max(lens), len(rows)
            toks = torch.zeros(len(new), T, dtype=torch.long)
            for j, i in enumerate(new):
                toks[j, : lens[j]] = torch.tensor(prompts[i])
            plen = torch.tensor(lens, device=target.device)
            zeros = torch.zeros(len(new), dtype=torch.long, device=target.device)
            logits, aux = target.forward(toks.to(target.device), cache, b0, zeros, layer_ids, logits_at=plen - 1,
                                         span=T, s0=0)
            cache.lens[b0: b0 + len(new)] = plen
            aux = aux.view(len(new), T, nl, H).to(state_dtype).cpu()       # [B, T, nl, H]
            rows += [_Row(i, prompts[i], aux[j, : lens[j]]) for j, i in enumerate(new)]
            last = torch.cat([last, pick(logits)])
        # one decode step: every row feeds its last token (a finished row only to record that token's states)
        n = len(rows)
        start = cache.lens[:n]
        span = max(len(r.ids) for r in rows) + 1
        logits, aux = target.forward(last[:, None], cache, 0, start, layer_ids, span=span, s0=None)
        cache.lens[:n] += 1
        nxt_tok = pick(logits[:, 0])
        aux = aux.view(n, nl, H).to(state_dtype).cpu()                     # [n, nl, H]
        fed = last.tolist()                                                # the step's one host copy
        for j, r in enumerate(rows):
            r.ids.append(fed[j])
            r.states.append(aux[j: j + 1])
            if fed[j] in eos or len(r.ids) - r.n_prompt >= max_new:
                r.done = True
        n_tok += n
        last = nxt_tok
        keep = []
        for j, r in enumerate(rows):
            if not r.done:
                keep.append(j)
                continue
            ids = torch.tensor(r.ids, dtype=torch.long)
            mask = torch.zeros(len(ids), dtype=torch.uint8)
            mask[r.n_prompt:] = 1
            if emit is not None:
                emit(r.idx, ids, mask, torch.cat(r.states))
            n_samples += 1
        if len(keep) < n:                                                  # compact: rows 0..len(keep)-1
            for dst, src in enumerate(keep):
                if dst != src:
                    cache.move_row(src, dst)
            rows = [rows[j] for j in keep]
            last = last[keep]
        if progress is not None:
            progress(n)
    return {"samples": n_samples, "tokens": n_tok, "seconds": time.perf_counter() - t0}
