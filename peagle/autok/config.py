"""Auto K's knobs, in one typed config: `AutoKConfig` (the policy) holding a `GuardConfig` (its loss guard).

Set per engine from the speculative config's peagle-only key `"auto_k"` (`{"margin": 0.05, "guard": false}`,
parsed by `AutoKConfig.from_dict`; `peagle tune` and `peagle export` never pass it to vLLM) or, for `peagle
bench`, its `--auto-k JSON` flag. The environment overrides it for A/B runs only (`with_env`):
PEAGLE_AUTOK_GUARD=0 (guard off), PEAGLE_AUTOK_MARGIN=0.05, PEAGLE_AUTOK_PROBE=on|off|fraction,
PEAGLE_AUTOK_TRACE=PATH. How the defaults were measured: docs/benchmarks/auto/README.md."""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..errors import PeagleError
from .trace import ENV as TRACE_ENV

# A K > 0 must be expected to beat plain decoding by this fraction: K > 0 choices realise less than predicted
# (acceptance is estimated right after the counts that made drafting look good).
MARGIN = 0.15
# A K = 0 choice stands this many steps while the batch's requests are unchanged: the estimate barely moves in
# that time and costs a noticeable share of a small target's step.
SETTLE = 16
# Probing up: a K > 0 the model expects within PROBE_TOL of plain decoding is tried for one guard window, and a
# batch size stays trusted while its windows beat plain decoding by KEEP (a window's tokens/s is noisy by ~2 %).
PROBE_TOL, KEEP = 0.10, 0.02

GUARD_ENV, MARGIN_ENV, PROBE_ENV = "PEAGLE_AUTOK_GUARD", "PEAGLE_AUTOK_MARGIN", "PEAGLE_AUTOK_PROBE"
OFF, ON = ("0", "off", "false", "no"), ("1", "on", "true", "yes")


@dataclass(frozen=True)
class GuardConfig:
    """The loss guard's settings (peagle/autok/guard.py explains each and states the worst case they bound)."""
    enabled: bool = True        # False: windows are still judged (for the trace) but never force K = 0
    window: int = 32            # K > 0 steps judged together against plain decoding
    budget: float = 4.0         # plain steps a window may fall behind (beyond its noise) before it fails early
    min_speedup: float = 1.0    # a window passes at this speedup over plain decoding
    backoff: int = 64           # K = 0 steps after the first failed window, doubling per failure ...
    max_backoff: int = 2048     # ... up to this
    refresh: int = 512          # drafting steps without a plain sample before K = 0 is forced until there is one
    rate: float = 0.25          # weight of a new plain sample in the plain reference's average (log space)
    plain_samples: int = 4      # a K = 0 step is a plain sample after this many K = 0 steps in a row; the first
    plain_max: int = 64         # steps are K = 0 until a block of 8 is not 2 % faster than the one before (at most
                                # plain_max; below 16 that cap alone: guard.py)
    min_steps: int = 3          # steps before a window may fail early
    z: float = 1.0              # noise allowance of the early stop, in standard deviations

    def __post_init__(self):
        for f in fields(self):                   # JSON values: a bool is a bool, an int an int, a float finite
            v, want = getattr(self, f.name), type(f.default)
            ok = isinstance(v, bool) if want is bool else (
                isinstance(v, int) and not isinstance(v, bool) if want is int else
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
            if not ok:
                raise ValueError(f"guard.{f.name} must be {want.__name__ if want is not float else 'a finite number'}, "
                                 f"got {v!r}")
        if min(self.window, self.backoff, self.refresh, self.plain_samples) < 1 \
                or self.min_steps < 2 or self.max_backoff < self.backoff or self.budget <= 0 \
                or self.plain_max <= self.plain_samples or not 0 < self.rate <= 1 or self.z < 0 \
                or self.min_speedup <= 0:
            raise ValueError("guard: window, backoff, refresh, plain_samples >= 1, min_steps >= 2, budget > 0, "
                             "max_backoff >= backoff, plain_max > plain_samples, 0 < rate <= 1, z >= 0, "
                             "min_speedup > 0")


@dataclass(frozen=True)
class AutoKConfig:
    """What `"num_speculative_tokens": "auto"` may be told (peagle/autok/auto.py: what each does)."""
    margin: float = MARGIN                 # a K > 0 must beat plain decoding by this fraction to be chosen
    settle: int = SETTLE                   # steps a K = 0 choice stands for an unchanged batch (1: every step)
    horizon: int = 64                      # the most steps a drafter catch-up is amortised over
    default_max_tokens: int = 256          # a request's token budget when it sets none (for that amortisation)
    refine: bool = True                    # refine the cost model from every step's wall time
    probe_tol: float | None = None         # probing up: None (off) or how far below plain a K > 0 may be expected
    keep: float = KEEP                     # the speedup a trusted batch size's windows must keep
    trace: Any = None                      # a path (appended to) or an open text file: the per-step trace
    guard: GuardConfig = field(default_factory=GuardConfig)

    def __post_init__(self):
        if not (isinstance(self.margin, (int, float)) and 0 <= self.margin < 10):
            raise ValueError(f"margin must be a fraction >= 0 (e.g. 0.05), got {self.margin!r}")
        if self.settle < 1 or self.horizon < 1 or self.default_max_tokens < 1:
            raise ValueError("settle, horizon and default_max_tokens must be >= 1")
        if self.probe_tol is not None and not 0 <= self.probe_tol < 1:
            raise ValueError("probe_tol must be in [0, 1) or None")
        if not 0 <= self.keep < 10:
            raise ValueError(f"keep must be a fraction >= 0 (e.g. 0.02), got {self.keep!r}")
        if not isinstance(self.guard, GuardConfig):
            raise ValueError(f"guard must be a GuardConfig, got {type(self.guard).__name__}")

    @property
    def probing(self) -> float | None:
        """probe_tol as the policy uses it: probing needs the guard (its windows judge, its early stop bounds)."""
        return self.probe_tol if self.guard.enabled else None

    @classmethod
    def from_dict(cls, d: dict | None) -> AutoKConfig:
        """The speculative config's "auto_k" object (JSON values; "guard": true/false or an object of GuardConfig
        fields). Anything else is a one-line PeagleError naming the key."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise PeagleError(f"auto_k must be a JSON object, got {d!r}")
        kinds = {"margin": (int, float), "settle": int, "horizon": int, "default_max_tokens": int, "refine": bool,
                 "probe_tol": (int, float, type(None)), "keep": (int, float), "trace": (str, type(None)),
                 "guard": (bool, dict)}
        unknown = set(d) - set(kinds)
        if unknown:
            raise PeagleError(f"unknown auto_k key(s): {', '.join(sorted(unknown))} (known: {', '.join(sorted(kinds))})")
        for key, v in d.items():
            if not isinstance(v, kinds[key]) or (isinstance(v, bool) and kinds[key] is not bool and key != "guard"):
                raise PeagleError(f"auto_k.{key} has the wrong type: {v!r}")
        kw = dict(d)
        g = kw.pop("guard", True)
        try:
            kw["guard"] = GuardConfig(enabled=g) if isinstance(g, bool) else _guard_from_dict(g)
            return cls(**kw)
        except (TypeError, ValueError) as e:
            raise PeagleError(f"auto_k: {e}") from None

    def as_dict(self) -> dict:
        """The settings that differ from the defaults, as from_dict reads them (an open trace file is left out)."""
        base, out = AutoKConfig(), {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "guard":
                g = {k: x for k, x in asdict(v).items() if x != getattr(base.guard, k)}
                if g:
                    out["guard"] = False if g == {"enabled": False} else g
            elif v != getattr(base, f.name) and (f.name != "trace" or isinstance(v, (str, os.PathLike))):
                out[f.name] = os.fspath(v) if f.name == "trace" else v
        return out

    def with_env(self, env=None) -> AutoKConfig:
        """This config with the A/B overrides of the environment applied (unset variables change nothing)."""
        env = os.environ if env is None else env
        cfg = self
        g = env.get(GUARD_ENV, "").strip().lower()
        if g:
            cfg = replace(cfg, guard=replace(cfg.guard, enabled=g not in OFF))
        margin = _fraction(env, MARGIN_ENV, 0.0, 10.0, "a fraction >= 0 (e.g. 0.05)")
        if margin is not None:
            cfg = replace(cfg, margin=margin)
        p = env.get(PROBE_ENV, "").strip().lower()
        if p in OFF:
            cfg = replace(cfg, probe_tol=None)
        elif p in ON:
            cfg = replace(cfg, probe_tol=PROBE_TOL)
        elif p:
            cfg = replace(cfg, probe_tol=_fraction(env, PROBE_ENV, 0.0, 1.0, "on, off or a fraction in (0, 1) (e.g. 0.1)")
                          or None)
        if env.get(TRACE_ENV):
            cfg = replace(cfg, trace=env[TRACE_ENV])
        return cfg


def _guard_from_dict(d: dict) -> GuardConfig:
    unknown = set(d) - {f.name for f in fields(GuardConfig)}
    if unknown:
        raise ValueError(f"unknown guard key(s): {', '.join(sorted(unknown))}")
    return GuardConfig(**d)


def _fraction(env, name: str, lo: float, hi: float, accepted: str) -> float | None:
    """$name as a float in [lo, hi); unset or empty: None; anything else is a one-line PeagleError."""
    v = env.get(name, "").strip()
    if not v:
        return None
    try:
        x = float(v)
    except ValueError:
        x = math.nan
    if not lo <= x < hi:
        raise PeagleError(f"{name} must be {accepted}, got {v!r}")
    return x
