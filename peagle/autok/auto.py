"""`"num_speculative_tokens": "auto"`: each step, the K in 0..k_max with the most expected output tokens per
second for the batch: argmax_K  sum_rows E[accepted + 1 | K] / t_step(B, K).

E comes from the live acceptance (acceptance.py), t_step from the measured cost model (costmodel.py); after
each step both learn from what happened (acceptance counts, the step's wall time). t_step(B, 0), plain
decoding, is the guard's measurement of K = 0 steps once there is one: the cost model's machine-wide scale also
follows K > 0 steps, so its own K = 0 estimate drifts with what drafting costs. K = 0 wins when no K > 0 is
expected to beat plain decoding by `margin`, so speculation is expected never to cost. Deterministic given its
inputs: the choice depends only on earlier steps.

Catch-up: after steps with K = 0 the drafter is behind (each row's skipped tokens, and the prompts of requests
admitted meanwhile, wait as drafter rows), and the first step with K > 0 feeds them all in one padded block of
B x max(rows) -- a one-off cost the cost model (measured in steady state) does not hold. For K > 0 that cost,
(padded rows beyond a steady step's k_max + 1) x seconds per drafter row, is added to t_step amortised over the
steps it pays for: the batch's remaining tokens per row (max_tokens minus generated) divided by the tokens per
row that K yields, capped at `horizon`. Seconds per drafter row start from the cost model's timed drafter prefill
and are learned from catch-up steps, pooled by rows (their time beyond the steady prediction / their rows, the
measured price weighing as PRIOR_ROWS rows); those steps do not refine the cost model.

Guard (guard.py): the model above can be wrong (a cost model measured at another context length, a prior that
flatters the head), so what speculation delivers is checked against plain decoding measured on this engine, and
while it is behind the policy returns K = 0 without consulting the model, probing again after an exponential
back-off; the most time that can lose is stated there. A fallback step costs the policy no estimate and no
refinement (the acceptance evidence only ages; the cost model learns nothing from it, the guard's plain
reference does). Trace (trace.py): one JSON line per step, the K chosen and why, predicted vs measured step time
and tokens.

Trust (probing up; off by default): the model can also price a K > 0 step above what it costs, and then the
margin keeps auto plain where drafting would pay. So when the best K > 0 misses the margin but is within
`probe_tol` of plain decoding, auto drafts with it until one guard window ends (a probe, given up if the estimate
falls further; at most one per back-off: 64, 128, ... 2048 steps after a failed one). If the guard measures that
window at >= 1 + `keep` times plain decoding's tokens/s, that batch size is trusted: K > 0 is chosen there while
the model expects it within `probe_tol` of plain, and each later window must again pass `keep`; a window below it
ends the trust (a window below 1.0 is also the guard's fallback). What a failed probe costs is bounded by the
guard's early stop.

Trees (treechoice.py): with a token-tree engine, each K > 0 is priced both as a chain and as a tree (its own
cost model and acceptance); the faster stands for that K, and `wants_tree` tells the engine which to verify.

The knobs: AutoKConfig (config.py). Why the defaults are what they are: docs/benchmarks/auto/README.md."""
from __future__ import annotations

import numpy as np

from ..kpolicy import KPolicy
from .acceptance import Acceptance
from .config import AutoKConfig
from .costmodel import CostModel, shown_path
from .guard import FALLBACK, Guard
from .trace import open_trace, r6
from .treechoice import TreeChoice

# After a failed probe, no probe (nor trust) for PROBE_BACKOFF x 2^failures steps, at most PROBE_MAX_BACKOFF.
PROBE_BACKOFF, PROBE_MAX_BACKOFF = 64, 2048
# Seconds per catch-up row are pooled: (sum of catch-up steps' time beyond steady state) / (their rows), with the
# measured price counting as PRIOR_ROWS rows (a catch-up of a few rows carries the whole step's noise) and old
# evidence halved past ROW_MEMORY rows.
PRIOR_ROWS, ROW_MEMORY = 256, 4096


class AutoK(KPolicy):
    mode = "auto"

    def __init__(self, k_max: int, cost: CostModel, acceptance: Acceptance, config: AutoKConfig | None = None,
                 tree: TreeChoice | None = None):
        """config: the knobs (AutoKConfig's defaults if None); the environment is not read here (the factory
        applies its A/B overrides: AutoKConfig.with_env). tree: the tree steps' cost and acceptance, for an
        engine with token trees (None: every K > 0 step is what the engine makes of it, chain or tree)."""
        if cost.k_max < k_max or acceptance.k_max < k_max or (
                tree is not None and (tree.cost.k_max < k_max or tree.acc.k_max < k_max)):
            raise ValueError(f"the cost models and acceptance estimates must cover K up to {k_max}")
        self.tree = tree
        super().__init__(k_max)
        cfg = self.config = config or AutoKConfig()
        self.cost, self.acc, self.refine, self.margin = cost, acceptance, cfg.refine, cfg.margin
        self.settle, self.settled = int(cfg.settle), 0   # settled: steps the last K = 0 choice still stands
        self._batch = ()                                  # the request ids that choice was made for
        self.horizon, self.default_max_tokens = cfg.horizon, cfg.default_max_tokens
        # seconds per drafter row of a catch-up: measured with the cost model (a drafter prefill), then learned
        self.row_s = float(cost.meta.get("drafter_row_s") or 0.0)
        prior_rows = PRIOR_ROWS if self.row_s > 0 else 0             # no measured price: evidence only
        self._row_sums = [self.row_s * prior_rows, prior_rows]      # [seconds beyond steady state, rows]
        self.last: dict = {}
        self.probe_tol, self.keep = cfg.probing, float(cfg.keep)   # probing needs the guard
        self.trusted: set = set()               # batch sizes whose realised windows beat plain by `keep`
        self.probing = None                     # the batch size of the probe under way, if any
        self.probe_fails, self.probe_at = 0, 0  # failed probes (less one per pass); first step the next may start
        self.probe_stats = {"probes": 0, "passed": 0}
        self.guard = Guard(lambda B: float(self.cost.predict(B, measured=True)[0]), cfg.guard)
        self.trace = open_trace(cfg.trace, {"k_max": k_max, "guard": self.guard.settings(),
                                            "cost_model": shown_path(cost.meta.get("path")), "margin": cfg.margin})

    def rates(self, rids) -> tuple:
        """(expected tokens [k_max+1], seconds per step [k_max+1], tokens per second [k_max+1]) for a batch; with
        trees, per K the faster of chain and tree (`self.tree_k[K]`: the tree's)."""
        tokens = self.acc.expected_tokens(rids)
        secs = self.cost.predict(len(rids))[: self.k_max + 1]
        if self.guard.log_scale is not None:     # K = 0 as measured (the cost model's scale follows K > 0 too)
            secs[0] = self.guard.plain_s(len(rids))
        if self.tree is not None:
            t_tok, t_secs = self.tree.rates(rids, self.k_max)
            self.tree_k = t_tok / t_secs > tokens / secs
            self.tree_k[0] = False
            tokens, secs = np.where(self.tree_k, t_tok, tokens), np.where(self.tree_k, t_secs, secs)
        return tokens, secs, tokens / secs

    def wants_tree(self) -> bool:
        return self.tree is None or bool(self.last.get("tree", True))

    def _cost_of(self, tree: bool) -> CostModel:
        return self.tree.cost if tree and self.tree is not None else self.cost

    def _best(self, rate, B: int | None = None, start_probe: bool = False) -> int:
        """The K with the most tokens per second; a K > 0 must beat K = 0 by the margin, or, where batch size B
        is trusted or probed, come within probe_tol of it (start_probe: a probe may start now)."""
        k = 1 + int(rate[1:].argmax()) if len(rate) > 1 else 0
        if not k or rate[k] >= rate[0] * (1 + self.margin):
            return k if k and rate[k] >= rate[0] else 0
        if self.probe_tol is None:
            return 0
        near = rate[k] >= rate[0] * (1 - self.probe_tol)
        if near and (B in self.trusted or B == self.probing):
            return k
        if start_probe and self.probing is not None:     # the model gave the probe up, or the batch changed size
            self._probe_failed()
        if near and start_probe and self.probing is None and self.guard.stats["steps"] >= self.probe_at:
            self.probing = B
            self.probe_stats["probes"] += 1
            return k
        return 0

    def _judge(self, B: int, act: dict):
        """A guard window ended at batch size B: keep, grant or end the trust there; close a probe."""
        if not act or "speedup" not in act or not (B in self.trusted or self.probing is not None):
            return
        ok = act["verdict"] == "passed" and act["speedup"] >= 1 + self.keep
        if ok:
            self.trusted.add(B)
            self.probe_stats["passed"] += self.probing is not None
            self.probe_fails = max(self.probe_fails - 1, 0)
            self.probing = None
        else:
            self.trusted.discard(B)
            self._probe_failed()

    def _probe_failed(self):
        """No probe (nor trust) for the next 64 x 2^failures steps (at most PROBE_MAX_BACKOFF)."""
        self.probe_at = self.guard.stats["steps"] + min(PROBE_BACKOFF * 2 ** min(self.probe_fails, 40),
                                                        PROBE_MAX_BACKOFF)
        self.probe_fails += 1
        self.probing = None

    def catch_up_rows(self, rows) -> int:
        """Padded drafter rows the next K > 0 step feeds beyond a steady step's (B x (k_max + 1)), as the proposer
        counts them (none attached: 0)."""
        return self.proposer.catch_up_rows(len(rows), self.k_max + 1) if self.proposer is not None else 0

    def remaining_tokens(self, rows) -> float:
        """Mean tokens each row may still generate."""
        left = [max(1, ((getattr(r, "params", None) and r.params.max_tokens) or self.default_max_tokens)
                    - len(getattr(r, "output_ids", ()))) for r in rows]
        return sum(left) / max(1, len(left))

    def choose(self, rows) -> int:
        forced = self.guard.forced()
        if forced and self.trace is None:       # K = 0 decided: no estimate needed (a fallback costs no work)
            self.last.update(batch_size=len(rows), k=0, k_model=None, forced=forced, catch_up_rows=0, settled=False)
            self.settled = 0
            return 0
        if not forced and self.settled and self._batch == tuple(r.request_id for r in rows):
            self.settled -= 1                   # the last K = 0 choice stands: no estimate (but for the trace)
            k_model = self._choose(rows, start_probe=False) if self.trace is not None else None
            self.last.update(k=0, k_model=k_model, forced=None, catch_up_rows=0, settled=True)
            return 0
        k = self._choose(rows, start_probe=not forced)
        self.last.update(k_model=k, forced=forced, settled=False)
        self.settled = self.settle - 1 if not (k or forced) else 0
        self._batch = tuple(r.request_id for r in rows) if self.settled else ()
        if forced:
            self.last.update(k=0, catch_up_rows=0)
            return 0
        return k

    def _choose(self, rows, start_probe: bool = True) -> int:
        rids = [r.request_id for r in rows]
        tokens, secs, rate = self.rates(rids)
        extra = self.catch_up_rows(rows)
        if extra:
            per_row = tokens / max(1, len(rids))                       # tokens per row per step, by K
            steps = np.clip(self.remaining_tokens(rows) / per_row, 1, self.horizon)
            catch = extra * self.row_s / steps
            catch[0] = 0.0                                             # K = 0 feeds the drafter nothing
            secs = secs + catch
            rate = tokens / secs
        k = self._best(rate, len(rids), start_probe)
        # a tree to learn from only on a step that runs (start_probe: not a trace-only or forced estimate), as
        # explore charges its budget
        tree = (bool(k and (self.tree_k[k] or (start_probe and self.tree.explore(k, len(rids), float(secs[k]),
                                                                                 float(rate[k])))))
                if self.tree is not None else None)
        self.last = {"batch_size": len(rids), "k": k, "expected_tokens": tokens, "step_time_s": secs,
                     "tokens_per_s": rate, "catch_up_rows": extra, "drafter_row_s": self.row_s, "tree": tree}
        return k

    def drafts_next(self, batch_size: int) -> bool:
        """Would a step of this many rows (the batch after admission), with the drafter caught up, draft? A
        prompt admitted when not gets no drafter prefill (it joins the catch-up), so a batch that will decode
        with K = 0 (large batches) never pays for drafter context it does not use. A prompt admitted while the
        guard takes its first plain reference (an engine's first prompt) is prefilled when the model expects
        drafting to pay: deferred, its catch-up would be priced against that request's drafting (a long prompt's
        ~50 us per row, amortised over at most `horizon` steps, can keep a one-request run plain)."""
        if self.guard.holding():                # a fallback: K = 0 for the coming steps
            return False
        return self._best(self.rates([None] * batch_size)[2], batch_size) > 0   # anonymous rows: the global estimate

    def observe(self, rows, k, accepted, step_s, tree=False):
        B, tree = len(rows), bool(k and tree and self.tree is not None)
        pred = self._predicted(B, k, tree) if self.trace is not None else None    # before this step refines them
        if not k and (self.last.get("forced") == FALLBACK or self.last.get("settled")):
            self.acc.age(B)                     # a fallback or settled step: the evidence ages, nothing else to learn
            if self.tree is not None:
                self.tree.age(B, step_s)
            act, tokens, extra = self.guard.observe(B, 0, B, step_s), B, 0
        else:
            accepted = accepted.tolist() if hasattr(accepted, "tolist") else list(accepted)
            rids = [r.request_id for r in rows]
            self.acc.observe(rids, 0 if tree else k, accepted)      # a tree step is no evidence about chains
            extra = self.last.get("catch_up_rows", 0) if self.last.get("batch_size") == B else 0
            catch_up = bool(k and extra)
            if self.tree is not None:
                self.tree.observe(rids, k, accepted, step_s, tree, self.refine and not catch_up)
            if catch_up:      # learn seconds per drafter row from the step's time beyond steady state
                self._learn_row_s(max(0.0, step_s - float(self._cost_of(tree).predict(B)[k])), extra)
            elif self.refine and not tree:
                self.cost.update(B, k, step_s)
            tokens = B + (sum(accepted) if k else 0)
            act = self.guard.observe(B, k, tokens, step_s, catch_up=catch_up)
            self._judge(B, act)
        if self.trace is not None:
            self._trace(B, k, tokens, step_s, extra if k else 0, pred, act, tree)

    def _learn_row_s(self, excess_s: float, rows: int):
        """Pool a catch-up step's time beyond steady state into seconds per drafter row (see PRIOR_ROWS)."""
        sums = self._row_sums
        sums[0], sums[1] = sums[0] + excess_s, sums[1] + rows
        if sums[1] > ROW_MEMORY:
            sums[0], sums[1] = sums[0] / 2, sums[1] / 2
        self.row_s = sums[0] / sums[1]

    def _predicted(self, B: int, k: int, tree: bool = False) -> tuple:
        """(seconds, tokens) the model expected of this step, from what choose() left in `last`."""
        last = self.last
        if last.get("batch_size") != B or "expected_tokens" not in last or last.get("k_model") is None:
            return None, None
        secs = float(self._cost_of(tree).predict(B)[k]) + last.get("catch_up_rows", 0) * self.row_s if k else \
            float(last["step_time_s"][0])          # K = 0: what the choice assumed (measured plain, if any)
        return secs, float(last["expected_tokens"][k])

    def _trace(self, B, k, tokens, step_s, extra, pred, act, tree=False):
        last, (pred_s, pred_tok) = self.last, pred
        rec = {"event": "step", "step": self.guard.stats["steps"], "batch_size": B, "k": k,
               "k_model": last.get("k_model"), "forced": last.get("forced"), "settled": bool(last.get("settled")),
               "catch_up_rows": extra,
               "pred_step_s": r6(pred_s) if pred_s is not None else None, "step_s": r6(step_s),
               "pred_tokens": r6(pred_tok) if pred_tok is not None else None, "tokens": tokens,
               "plain_step_s": r6(self.guard.plain_s(B)) if self.guard.log_scale is not None else None,
               "alpha": r6(self.acc.global_alpha()), "trusted": B in self.trusted, "probing": self.probing == B,
               "tree": tree}
        if "step_time_s" in last:
            rec["per_k"] = {"step_s": r6(last["step_time_s"]), "tokens": r6(last["expected_tokens"])}
        if act:
            rec["guard"] = act
        self.trace.write(rec)

    def describe(self) -> dict:
        d = {**super().describe(), **self.acc.summary(), "cost_model_updates": self.cost.updates,
             "cost_model": shown_path(self.cost.meta.get("path")), "guard": self.guard.describe(),
             "trusted_batch_sizes": sorted(self.trusted), **{f"probes_{k}": v for k, v in self.probe_stats.items()},
             **(self.tree.describe() if self.tree is not None else {})}
        for key, v in self.last.items():
            d[key] = [round(float(x), 6) for x in v] if hasattr(v, "tolist") else v
        return d
