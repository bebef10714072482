"""Where a decode step's time goes outside the C++ calls, and why that part costs what it does.

Greedy decoding of one request on the default target (q4a8 unless --quantization says otherwise): plain, P-EAGLE and
EAGLE-3 at --ks, and P-EAGLE at the first K with fixed drafts instead of the drafter's pass (what that pass costs
the target's own calls, beside its own time), bare and with a busy-wait of --pause-ms in its place (whether that
cost follows the pass's bytes or its length). Per engine step, the wall time split into the C++ calls that carry the
weights (the target's layers in one call, its LM head; the drafter's layers, its fc and LM head, or its whole greedy
pass in one call) and the rest (Python and torch's small ops: positions, masks, embedding, verification,
bookkeeping): timers wrap those calls in the running engine, so the split sums to the step. Then the cost of one
such small-op sequence (verify_greedy on a 2-position block, 5 torch ops) warm in a loop against right after a plain
step, when the step's weight stream (~96 MB for SmolLM2 q4a8) has evicted the caches; and the part outside the C++
calls with three sequences of small ops as one extension call each or as torch ops (the engine's greedy verification
and advance, verify_greedy_advance's impl=-1 form; BlockCtx's facts without the extension's block_ctx; a drafter
pass, its LM head and argmax, DrafterHead.greedy_pass, or the head's Python path). Configurations alternate over
--rounds, each measured after --settle seconds of its own untimed decoding; medians.

    OMP_NUM_THREADS=2 .venv/bin/python lab/measure/step_glue.py --out docs/benchmarks/step-glue.md
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import types

import torch

import peagle.engine as engine_mod

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.measure.precision import cpu_flags, write_report
from peagle.llm import DEFAULT_EAGLE3_HEAD, DEFAULT_MODEL, DEFAULT_PEAGLE_HEAD, LLM
from peagle.models import layers as layers_mod
from peagle.models import quant_ext
from peagle.sampling import SamplingParams
from peagle.spec_config import speculative_config
from peagle.verify import verify_greedy, verify_greedy_advance

FORMS = ("all as torch ops", "verify one call", "+ BlockCtx one call", "+ drafter pass one call")
FORMS_AS = {"all as torch ops": (False, False, False), "verify one call": (True, False, False),
            "+ BlockCtx one call": (True, True, False), "+ drafter pass one call": (True, True, True)}
PASS = "drafter pass (one call)"
_passes: dict = {}                 # head -> its timed one-call pass (use_forms switches it on and off)
NO_PASS = "P-EAGLE K={}, no drafter pass"   # the run of without_drafter_pass
PAUSE = "P-EAGLE K={}, a {:g} ms pause instead"   # the same with a busy-wait where the pass was
FIXED_DRAFT = 42                              # its every draft (a token id: acceptance ~0, output unchanged)
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests."


class _TimedRun:
    """A layer stack's runner whose forward adds its wall time to acc[name]."""

    def __init__(self, run, acc: dict, name: str):
        self.run, self.acc, self.name = run, acc, name

    def forward(self, *args):
        t0 = time.perf_counter()
        out = self.run.forward(*args)
        self.acc[self.name] = self.acc.get(self.name, 0.0) + time.perf_counter() - t0
        return out


class _TimedPass:
    """A head's one-call greedy pass (DrafterHead.greedy_pass) whose pass_ adds its wall time to acc[PASS]; the
    layer runner it is handed goes to the extension unwrapped."""

    def __init__(self, dp, acc: dict):
        self.dp, self.acc = dp, acc

    def pass_(self, run, *args):
        t0 = time.perf_counter()
        out = self.dp.pass_(run.run if isinstance(run, _TimedRun) else run, *args)
        self.acc[PASS] = self.acc.get(PASS, 0.0) + time.perf_counter() - t0
        return out


def instrument(llm: LLM, acc: dict) -> None:
    """Timers around the engine's C++ calls: layer runners (target, drafter), the drafter's one-call pass and
    every quantized product made through layers.qmm (the LM heads, the drafter's fc)."""
    eng = llm.engine
    stack = eng.target._layer_stack()
    if stack is None:
        raise SystemExit("the target has no C++ layer runner here (no kernels, or a float target without them)")
    heads = [] if eng.proposer is None else [getattr(eng.proposer.head, "_stack", None)]
    for st, name in [(stack, "target layers")] + [(h, "drafter layers") for h in heads if h is not None]:
        if not isinstance(st.run, _TimedRun):          # engines share the target (and may share a head)
            st.run = _TimedRun(st.run, acc, name)
    head = None if eng.proposer is None else eng.proposer.head
    if head is not None and getattr(head, "_pass", None) is not None and not isinstance(head._pass, _TimedPass):
        head._pass = _passes[head] = _TimedPass(head._pass, acc)


def timed_qmm(acc: dict, vocab: int):
    qmm = layers_mod.qmm

    def run(x, w, impl=0):
        t0 = time.perf_counter()
        out = qmm(x, w, impl)
        name = "target LM head" if vocab in tuple(w.shape) else "drafter fc / LM head"
        acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0
        return out
    return run


def without_drafter_pass(llm: LLM, pause_s: float = 0.0) -> LLM:
    """The engine with every step's drafts one fixed token instead of the drafter's pass: the target verifies
    K + 1 positions and the proposer records what was kept as usual, but nothing of the drafter runs between two
    target forwards (its weights and work out of the step; the outputs stay plain decoding's). pause_s: a
    busy-wait of that long where the pass was (time between two target forwards, no drafter bytes read)."""
    prop = llm.engine.proposer

    def draft(rows, k, *a, **kw):
        t_end = time.perf_counter() + pause_s
        while time.perf_counter() < t_end:
            pass
        return torch.full((len(rows), k), FIXED_DRAFT, dtype=torch.long), None
    prop.draft = draft
    return llm


def decode_split(llm: LLM, ids: list, tokens: int, acc: dict, settle: float = 0.0) -> dict:
    """One request decoded after 8 warm steps: ms per step, in total and per timed call; 'other' the rest. settle:
    seconds of untimed decoding with this engine first (a step right after another engine's turn or an idle spell
    runs slower for a while: docs/benchmarks/cpu-step.md, "Steady steps")."""
    eng = llm.engine
    t_end = time.perf_counter() + settle
    while time.perf_counter() < t_end:
        eng.add_request(f"s{time.perf_counter_ns()}", ids, SamplingParams(temperature=0.0, max_tokens=16,
                                                                            ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
    eng.add_request(f"r{time.perf_counter_ns()}", ids, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                                        ignore_eos=True))
    for _ in range(8):
        eng.step()
    acc.clear()
    n, t0 = 0, time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        n += 1
    wall = (time.perf_counter() - t0) / n * 1e3
    out = {k: v / n * 1e3 for k, v in acc.items()}
    out["other"] = wall - sum(out.values())
    out["step"] = wall
    return out


def cold_vs_warm(llm: LLM, ids: list, reps: int) -> tuple[float, float]:
    """verify_greedy on a [1, 2, V] block: microseconds warm (a loop of it) and right after a plain step."""
    eng = llm.engine
    V = eng.target.cfg.vocab_size
    logits, drafts = torch.randn(1, 2, V), torch.randint(0, V, (1, 1))
    eng.add_request(f"c{time.perf_counter_ns()}", ids, SamplingParams(temperature=0.0, max_tokens=reps + 8,
                                                                        ignore_eos=True))
    for _ in range(8):
        eng.step()
    cold = 0.0
    for _ in range(reps):
        eng.step()
        t0 = time.perf_counter()
        verify_greedy(logits, drafts)
        cold += time.perf_counter() - t0
    while eng.has_unfinished():
        eng.step()
    for _ in range(50):
        verify_greedy(logits, drafts)
    t0 = time.perf_counter()
    for _ in range(reps):
        verify_greedy(logits, drafts)
    return (time.perf_counter() - t0) / reps * 1e6, cold / reps * 1e6


class _NoBlockCtx:
    """The extension without block_ctx: BlockCtx then builds its facts with torch ops (as before that call)."""

    def __init__(self, ext):
        self.ext = ext

    def __getattr__(self, name):
        if name == "block_ctx":
            raise AttributeError(name)
        return getattr(self.ext, name)


def use_forms(verify_one_call: bool, block_ctx_one_call: bool, draft_pass_one_call: bool = True) -> None:
    """The step's greedy verification and advance, BlockCtx's facts and a drafter pass with its LM head and argmax:
    one extension call each, or torch ops (verify_greedy_advance's impl=-1 form; BlockCtx without the extension's
    block_ctx; the head's Python path)."""
    for head, dp in _passes.items():
        head._pass = dp if draft_pass_one_call else None
    engine_mod.verify_greedy_advance = (verify_greedy_advance if verify_one_call
                                        else functools.partial(verify_greedy_advance, impl=-1))
    ext = quant_ext.get()
    layers_mod.quant_ext = quant_ext if block_ctx_one_call or ext is None else types.SimpleNamespace(
        get=lambda: _NoBlockCtx(ext))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--ks", default="1,3", help="K values for P-EAGLE (EAGLE-3 runs the first)")
    p.add_argument("--tokens", type=int, default=200, help="tokens decoded per measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pause-ms", type=float, default=0.55,
                   help="also run the fixed-draft engine with a busy-wait this long where the drafter's pass was "
                        "(about the pass's time: what the pause alone costs the target's calls after it; 0: no row)")
    p.add_argument("--settle", type=float, default=0.5,
                   help="seconds of untimed decoding with each configuration before its measurement (0: none)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    base = LLM(model=a.model, quantization=a.quantization)
    ids = base.get_tokenizer()(PROMPT)["input_ids"]
    ks = [int(k) for k in a.ks.split(",")]
    runs = {"plain": base}
    for k in ks:
        runs[f"P-EAGLE K={k}"] = base.with_speculative_config(speculative_config(DEFAULT_PEAGLE_HEAD, k, True))
    runs[f"EAGLE-3 K={ks[0]}"] = base.with_speculative_config(speculative_config(DEFAULT_EAGLE3_HEAD, ks[0], False))
    first = speculative_config(DEFAULT_PEAGLE_HEAD, ks[0], True)
    runs[NO_PASS.format(ks[0])] = without_drafter_pass(base.with_speculative_config(first))
    if a.pause_ms > 0:
        runs[PAUSE.format(ks[0], a.pause_ms)] = without_drafter_pass(base.with_speculative_config(first),
                                                                     a.pause_ms / 1e3)
    acc: dict = {}
    for llm in runs.values():
        instrument(llm, acc)
    layers_mod.qmm = timed_qmm(acc, base.engine.target.cfg.vocab_size)
    splits: dict = {name: [] for name in runs}
    glue: list = []
    one: dict = {}
    for r in range(a.rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            splits[name].append(decode_split(runs[name], ids, a.tokens, acc, a.settle))
        glue.append(cold_vs_warm(base, ids, 100))
        for name in ("plain", f"P-EAGLE K={ks[0]}"):
            for form in (FORMS if r % 2 == 0 else FORMS[::-1]):
                use_forms(*FORMS_AS[form])
                one.setdefault((name, form), []).append(decode_split(runs[name], ids, a.tokens, acc, a.settle))
            use_forms(True, True, True)
    parts = ["target layers", "target LM head", "drafter layers", "drafter fc / LM head", PASS, "other"]
    lines = [f"# Where a decode step's time goes ({os.path.basename(a.model.rstrip('/'))}, "
             f"{base.engine.target.precision})", "",
             f"CPU: {cpu_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads; one request, "
             f"{a.tokens} greedy tokens per measurement after a {len(ids)}-token prompt and {a.settle:g} s of untimed "
             f"decoding with the same configuration; medians of {a.rounds} alternating rounds (ms per engine step).", "",
             "| decoding | step | " + " | ".join(parts) + " | other ÷ step |",
             "|---|---|" + "---|" * (len(parts) + 1)]
    for name, ss in splits.items():
        med = {k: statistics.median(s.get(k, 0.0) for s in ss) for k in parts + ["step"]}
        lines.append(f"| {name} | {med['step']:.3f} | " + " | ".join(f"{med[k]:.3f}" for k in parts) +
                     f" | {100 * med['other'] / med['step']:.0f} % |")
    lines += ["", f"{NO_PASS.format(ks[0])}: the P-EAGLE engine with each step's drafts a fixed token (acceptance "
              "~0): its target layers and LM head are what a speculative step's target costs without the drafter's "
              "pass between two target forwards."]
    if a.pause_ms > 0:
        lines += ["", f"{PAUSE.format(ks[0], a.pause_ms)}: the same with a busy-wait of {a.pause_ms:g} ms where the "
                  "pass was (no drafter bytes read; counted in 'other'): what a pause of the pass's length alone costs "
                  "the target's calls after it."]
    warm, cold = statistics.median(w for w, _ in glue), statistics.median(c for _, c in glue)
    lines += ["", f"verify_greedy on a 2-position block (5 torch ops): **{warm:.1f} µs warm** in a loop, **{cold:.1f} µs "
              f"right after a plain step** ({cold / warm:.1f}×): the step's weight stream has evicted the code and "
              "data the small ops run on, so each op outside the C++ calls pays cache misses."]
    lines += ["", "The part outside the C++ calls per step (ms, medians; the step's in brackets) with the greedy "
              "verification and advance (`verify_greedy_advance`), BlockCtx's positions, rope rows and mask "
              "(`block_ctx`) and a drafter pass with its fc, norms, LM head and argmax (`greedy_pass`) each as one "
              "extension call or as torch ops (with the drafter's pass in one call its own small ops count in that "
              "call, no longer here: the step's time is the like-for-like figure):", "",
              "| decoding | " + " | ".join(FORMS) + " |", "|---|" + "---|" * len(FORMS)]
    for name in ("plain", f"P-EAGLE K={ks[0]}"):
        cells = [f"{statistics.median(x['other'] for x in one[(name, f)]):.3f} "
                 f"({statistics.median(x['step'] for x in one[(name, f)]):.3f})" for f in FORMS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return write_report(lines, ".venv/bin/python lab/measure/step_glue.py", argv, a.out)


if __name__ == "__main__":
    sys.exit(main())
