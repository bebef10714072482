"""The loss guard of "auto": speculation is judged by what it delivered, against plain decoding measured on the
same engine, and switched off while it is behind, so auto's worst case is a bounded, stated probing cost.

Invariants:
- The plain reference is a measurement: seconds per K = 0 step of this engine (the clock the policy is told),
  normalised across batch sizes by the measured cost model's K = 0 column (`plain_shape(B)`), averaged
  exponentially (`rate`, log space) over plain samples: K = 0 steps that follow `plain_samples` K = 0 steps in a
  row. Steps with K > 0 never move it (the cost model's machine-wide scale follows every step, so it drifts with
  speculation's own cost; the guard does not use it), nor do the first K = 0 steps after them.
- Why not the K = 0 steps right after drafting: a step runs slow for a while after anything else, and without
  the drafting plain decoding would soon run at its settled pace. Measured on a 2-core Xeon (SmolLM2 q4a8):
  single K = 0 steps amid K = 1 steps ran 5.2-5.3 ms, K = 0 steps after other K = 0 steps ~3.0: a reference
  taken from the former prices plain decoding too slow and lets auto draft where it loses
  (docs/benchmarks/auto/README.md). The steps after a prefill are slow too (plain decoding's, medians over 12
  requests: 4.84, 4.55, 4.43, 4.18 ... 3.21 ms at the 17th, 2.98 at the 21st, steady 2.76), but plain decoding
  pays them at every request as well, so a K = 0 run that a prefill interrupts keeps counting.
- The first reference (guard on): the first decode steps are K = 0, in blocks of FIRST_BLOCK, until a block's
  median is not PLAIN_GAIN faster than the block's before it (plain decoding has settled), or `plain_max` steps
  (below 2 x FIRST_BLOCK that cap alone ends it); it is the faster of the last two blocks' medians (one block
  slower than the one before it -- a held-up stretch, a new prompt's prefill -- does not set it; with fewer
  steps, the median of the last FIRST_BLOCK, or of all). The slow start after a prefill or any pause in the weight
  stream lasts ~30-40 steps (docs/benchmarks/slow-start.md: a 256-token prompt's first 8 steps ~1.3x, the
  next 8 ~1.15-1.2x the settled pace): blocks of 8 compared by their medians wait for it, where "4 in a row none 2 %
  faster than the fastest before them" stopped inside it (5.44 ms against ~4.5 settled, in a trace: auto then
  drafted at a loss for a guard window). A later sample moves the average as if it were at most 1.5x off it
  (SAMPLE_CLIP): one step held up by something else (an 18 ms step among 6 ms ones, seen in a trace) must not
  price plain decoding too slow for the 512 drafting steps until the next sample, as a mean did. After
  `refresh` drafting steps without a plain sample, K = 0 is forced until there is one (`plain_samples` + 1
  steps: 1 % of the steps while drafting never stops, with the defaults). With the guard off nothing is forced:
  the reference starts at the first plain sample.
- Speculation is judged on K > 0 steps, in windows. A step of B rows that produced n tokens in s seconds would
  have taken p = n / B x plain(B) seconds without drafting; its excess is x = (s - p) / plain(B) plain steps. A
  window ends after `window` such steps (passed if sum p / sum s >= min_speedup, else failed) or, from
  `min_steps` steps on, as soon as sum x > budget + z x sd(x) x sqrt(steps) (failed early; the sd term keeps
  one long rejected block of a good drafter from ending it). A catch-up step (the drafter fed the rows K = 0
  steps skipped; AutoK says which) stays out of the window: its one-off cost is the probe's, in `catch_up_s`.
- A failed window forces K = 0 for backoff x 2^failures decode steps (at most max_backoff), then the policy
  chooses freely again: a probe. A passed window takes one off `failures` (not all: a lucky window of a losing
  drafter must not bring the probes back to the shortest spacing).
- Deterministic: a decision depends only on earlier steps' (B, K, tokens, seconds).

Worst case, for a drafter that never helps (every K > 0 step costs r plain steps and yields one token at batch
size 1; `bound()` runs the guard on exactly that): a probe drafts at most n = min(window, max(min_steps,
floor(budget / (r - 1)) + 1)) steps before it fails, losing n x (r - 1) plain steps, plus the drafter's
catch-up of the rows skipped meanwhile (rows of requests that ended during the fallback are never caught up);
AutoK's own acceptance estimate often stops drafting sooner. With the defaults (window 32, budget 4, min_steps
3, backoff 64 .. 2048):

    r (K > 0 step / plain step)        1.5     2      3      5
    K > 0 steps before the fallback     9      5      3      3
    time lost over 1,000 steps        1.8 %  2.4 %  3.0 %  6.0 %
    time lost over 4,000 steps        0.7 %  0.8 %  0.9 %  1.8 %
    time lost over 100,000 steps      0.24%  0.27%  0.32%  0.64%

(after the first plain steps; probes after 64, 128, ..., 2048 K = 0 steps, then every 2048)."""
from __future__ import annotations

import math
import statistics
from dataclasses import replace

from .config import GuardConfig

FALLBACK, REFRESH = "fallback", "plain_refresh"
PLAIN_GAIN = 0.02      # the first reference is taken once K = 0 steps stop getting this much faster (see above)
FIRST_BLOCK = 8        # ... judged by the medians of blocks of this many steps
SAMPLE_CLIP = math.log(1.5)   # a plain sample moves the average as if at most 1.5x off it (a hiccup: see above)


class Guard:
    def __init__(self, plain_shape, config: GuardConfig | None = None, **settings):
        """plain_shape(B): seconds per K = 0 step at batch size B as measured (the cost model's K = 0 column);
        config: the settings (GuardConfig's defaults if None), any of them overridden by keyword."""
        cfg = replace(config or GuardConfig(), **settings)
        self._shape_fn, self._shapes, self.enabled = plain_shape, {}, cfg.enabled
        self.window, self.budget, self.min_speedup = int(cfg.window), float(cfg.budget), float(cfg.min_speedup)
        self.backoff, self.max_backoff, self.refresh, self.rate = int(cfg.backoff), int(cfg.max_backoff), \
            int(cfg.refresh), cfg.rate
        self.min_steps, self.z = int(cfg.min_steps), float(cfg.z)
        self.plain_samples, self.plain_max = int(cfg.plain_samples), int(cfg.plain_max)
        self.log_scale: float | None = None      # log(plain reference / plain_shape), None before any K = 0 step
        self.first: list | None = [] if cfg.enabled else None   # the first K = 0 steps' logs while taken
        self.in_row = 0                          # K = 0 steps in a row up to the last step
        self.since_plain = 0                     # K > 0 steps since the last plain sample
        self.hold = 0                            # forced K = 0 steps left
        self.fails = 0                           # failed windows, less one per passed window
        self._reset_window()
        self.stats = {"steps": 0, "spec_steps": 0, "fallbacks": 0, "probes_passed": 0, "fallback_steps": 0,
                      "refresh_steps": 0, "excess_s": 0.0, "spec_s": 0.0, "catch_up_steps": 0, "catch_up_s": 0.0}
        self.last_window: dict = {}

    def _reset_window(self):
        self.win_n, self.win_s, self.win_p, self.win_x, self.win_x2 = 0, 0.0, 0.0, 0.0, 0.0

    # ---------------------------------------------------------------- decisions
    def forced(self) -> str | None:
        """Why this step must be K = 0 (FALLBACK: speculation was behind; REFRESH: the plain reference is
        missing or stale), or None: the policy may choose."""
        if not self.enabled:
            return None
        if self.hold > 0:
            return FALLBACK
        if self.log_scale is None or self.first is not None or self.since_plain >= self.refresh:
            return REFRESH
        return None

    def holding(self) -> bool:
        """In a fallback (K = 0 for the coming steps): new prompts need no drafter prefill."""
        return self.enabled and self.hold > 0

    def plain_shape(self, B: int) -> float:
        """plain_shape(B), remembered per batch size (a fallback step computes nothing twice)."""
        v = self._shapes.get(B)
        if v is None:
            v = self._shapes[B] = float(self._shape_fn(B))
        return v

    def plain_s(self, B: int) -> float:
        """The plain reference: seconds of a K = 0 step at batch size B."""
        return self.plain_shape(B) * math.exp(self.log_scale or 0.0)

    # ---------------------------------------------------------------- after a step
    def observe(self, B: int, k: int, tokens: float, seconds: float, catch_up: bool = False) -> dict:
        """Record a decode step: B rows, K drafts each, `tokens` produced in all, its wall time; catch_up: the
        drafter was fed rows skipped by K = 0 steps. Returns what the guard did ({} if nothing)."""
        st = self.stats
        st["steps"] += 1
        if not k and self.forced() == REFRESH:
            st["refresh_steps"] += 1
        if self.hold > 0:
            self.hold -= 1
            st["fallback_steps"] += 1
        if seconds <= 0 or B <= 0:
            return {}
        if not k:
            self._plain(math.log(seconds / max(self.plain_shape(B), 1e-12)))
            return {}
        self.since_plain += 1
        self.in_row = 0
        if catch_up:
            st["catch_up_steps"] += 1
            st["catch_up_s"] += seconds
            return {}
        plain = self.plain_s(B)
        p = tokens / B * plain
        x = (seconds - p) / plain                          # this step's excess, in plain steps
        st["spec_steps"] += 1
        st["spec_s"] += seconds
        st["excess_s"] += seconds - p
        self.win_n += 1
        self.win_s += seconds
        self.win_p += p
        self.win_x += x
        self.win_x2 += x * x
        n = self.win_n
        over = n >= self.min_steps and self.win_x > self.budget + self.z * math.sqrt(
            n * max(0.0, self.win_x2 - self.win_x ** 2 / n) / (n - 1))
        if not (over or n >= self.window):
            return {}
        speedup = self.win_p / self.win_s
        self.last_window = {"steps": n, "speedup": round(speedup, 4), "excess_plain_steps": round(self.win_x, 3)}
        self._reset_window()
        if not over and speedup >= self.min_speedup:
            if self.fails:
                st["probes_passed"] += 1
            self.fails = max(self.fails - 1, 0)   # not reset: a lucky window of a losing drafter keeps it long
            return {"verdict": "passed", **self.last_window}
        if not self.enabled:
            return {"verdict": "failed (guard off)", **self.last_window}
        self.hold = min(self.backoff * 2 ** min(self.fails, 40), self.max_backoff)
        self.fails += 1
        st["fallbacks"] += 1
        return {"verdict": "failed", "fallback_steps": self.hold, **self.last_window}

    def _plain(self, g: float):
        """A K = 0 step's log(seconds / plain_shape): the first reference while it is being taken, then into the
        average if it is a plain sample (see the module docstring)."""
        self.in_row += 1
        first, m, b = self.first, self.plain_samples, FIRST_BLOCK
        if first is not None:
            first.append(g)
            n = len(first)
            self.log_scale = g                     # provisional: every step is K = 0 meanwhile
            if n < self.plain_max and (n < 2 * b or n % b):
                return                             # judged at the cap and at block ends only
            # medians: one held-up step moves them not
            last = statistics.median(first[-b:])
            prev = statistics.median(first[-2 * b:-b]) if n >= 2 * b else None
            if n >= self.plain_max or last > prev + math.log(1 - PLAIN_GAIN):
                self.first, self.since_plain = None, 0
                self.log_scale = last if prev is None else min(last, prev)
        elif self.in_row > m:
            self.since_plain = 0
            if self.log_scale is None:
                self.log_scale = g
            else:
                self.log_scale += self.rate * max(-SAMPLE_CLIP, min(SAMPLE_CLIP, g - self.log_scale))

    # ---------------------------------------------------------------- reporting
    def describe(self) -> dict:
        d = {"enabled": self.enabled, "holding": self.hold, "failures": self.fails,
             "plain_step_s_at_1": round(self.plain_s(1), 7) if self.log_scale is not None else None,
             **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.stats.items()}}
        if self.stats["spec_s"]:           # plain time of the drafted steps' tokens / their time
            d["spec_speedup_vs_plain"] = round(1.0 - self.stats["excess_s"] / self.stats["spec_s"], 4)
        if self.last_window:
            d["last_window"] = self.last_window
        return d

    def settings(self) -> dict:
        return {"enabled": self.enabled, "window": self.window, "budget": self.budget,
                "min_speedup": self.min_speedup, "backoff": self.backoff, "max_backoff": self.max_backoff,
                "refresh": self.refresh, "min_steps": self.min_steps, "z": self.z,
                "rate": self.rate, "plain_samples": self.plain_samples, "plain_max": self.plain_max}


def bound(r: float, steps: int, **settings) -> dict:
    """The guard's worst case, by running it: a policy that always wants to draft, a drafter that never helps
    (each K > 0 step takes r plain steps, r > 1, and yields one token), batch size 1, `steps` decode steps.
    -> {"first_fallback_after": K > 0 steps before the first fallback, "probes": fallbacks after the first,
    "loss": time lost as a fraction of plain decoding's for the same tokens (catch-up excluded)}."""
    g = Guard(lambda B: 1.0, **settings)
    first, spec = None, 0
    for _ in range(steps):
        k = 0 if g.forced() else 1
        spec += k
        g.observe(1, k, 1.0, r if k else 1.0)
        if first is None and g.stats["fallbacks"]:
            first = spec
    return {"first_fallback_after": first, "probes": max(g.stats["fallbacks"] - 1, 0),
            "loss": spec * (r - 1) / steps}
