"""The sweep: datasets x concurrency x {baseline, eagle3 K.., peagle K..} (+ HF peers at c=1), one JSON."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
import time

import torch

from ..data.benchmarks import load_dataset
from ..device import cpuinfo
from ..errors import PeagleError
from ..paths import CHECKOUT, REPO, portable_path, portable_settings
from ..sampling import SamplingParams
from ..spec_config import DEFAULT_DRAFT_SAMPLING
from .online import OnlineServer, run_online
from .runner import Bench, HFPeer

PATH_SETTINGS = ("model", "eagle3_head", "peagle_head", "out", "notes", "from_json")


def machine_info() -> dict:
    cpu = cpuinfo("model name") or platform.processor() or ""
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "mem_gib": mem,
            "loadavg_at_start": load, "platform": platform.platform()}


def versions() -> dict:
    import transformers
    if not CHECKOUT:         # an installed peagle: its version (a git call would name whatever repository holds it)
        from importlib.metadata import PackageNotFoundError, version
        try:
            v = version("peagle")
        except PackageNotFoundError:
            v = None
        return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
                "peagle_version": v, "peagle_commit": None, "peagle_dirty": None}
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "peagle_commit": commit, "peagle_dirty": dirty}


def configs(methods, ks, trees=()):
    """(method label, K) of every run; trees ("4x8": eagle_topk x num_draft_tokens) add "peagle+tree4x8" runs
    (K = the trees' depth bound, or "auto": tree, chain or plain per step) for every drafter method and K."""
    out = [("baseline", 0)] if "baseline" in methods else []
    for m in ("eagle3", "peagle"):
        if m in methods:
            out += [(m, k) for k in ks]
            out += [(f"{m}+tree{t}", k) for t in trees for k in ks]
    return out


def run_order(cfgs, reverse: bool, ref_every: int) -> list:
    """One repeat's runs: the baseline first (the identity reference), the others in order or reversed
    (repeats alternate, spreading drift), and with ref_every > 0 the baseline again after every ref_every of
    them and at the end, so every run has baseline runs close in time (summary.paced)."""
    rest = cfgs[:0:-1] if reverse else cfgs[1:]
    if ref_every <= 0:
        return cfgs[:1] + rest
    out = cfgs[:1]
    for i in range(0, len(rest), ref_every):
        out += rest[i:i + ref_every] + cfgs[:1]
    return out


def run_sweep(a, log=print, on_dataset=None) -> dict:
    """a: the parsed CLI namespace (see cli.py). Returns the results dict (JSON-ready); on_dataset(res) is
    called after each dataset (the CLI writes partial results there)."""
    t_start, t_origin = time.time(), time.perf_counter()
    heads = {"eagle3": a.eagle3_head, "peagle": a.peagle_head}
    bench = Bench(a.model, heads, a.dtype, a.seed, max(a.concurrency), getattr(a, "remeasure", False), a.device,
                  getattr(a, "compile", False), getattr(a, "target_backend", "auto"),
                  getattr(a, "draft_sampling", DEFAULT_DRAFT_SAMPLING), getattr(a, "auto_k", None),
                  quantization=getattr(a, "quantization", "none"), kv_cache_dtype=getattr(a, "kv_cache_dtype", "auto"))
    log(f"target: {getattr(bench.target, 'precision', str(bench.dtype).replace('torch.', ''))}")
    if getattr(a, "quantization", None) == "auto":        # the report's command names what ran
        a.quantization = bench.quantization
        a.command = a.command.replace("--quantization auto", f"--quantization {bench.quantization}")
    # transformers runs float weights and a float32 KV cache: other settings' tokens could not be compared
    why = None
    if bench.quantization != "none":
        why = f"transformers runs float weights, this sweep {bench.quantization} (--quantization none runs them)"
    elif bench.kv_cache_dtype == "bfloat16":
        why = f"transformers keeps a float32 KV cache, this sweep {bench.kv_cache_dtype}"
    if a.peers and why:
        log(f"peers {','.join(a.peers)} skipped: {why} (their tokens could not be compared)")
        a.peers = []
    methods = list(a.methods)
    if "baseline" not in methods:
        methods.insert(0, "baseline")               # the identity check and the speedups need it
    trees = getattr(a, "trees", None) or []
    if trees and a.mode != "offline":
        raise PeagleError("--trees runs offline only (peagle serve takes trees through its speculative config)")
    cfgs = configs(methods, a.ks, trees)
    params = SamplingParams(temperature=a.temperature, max_tokens=a.output_len, ignore_eos=a.ignore_eos,
                            seed=None)
    greedy = a.temperature == 0
    res = {"meta": {"command": a.command, "started_utc": _dt.datetime.utcnow().isoformat(timespec="seconds") + "Z",
                    "machine": machine_info(), "versions": versions(),
                    "device": str(bench.device), "dtype": str(bench.dtype).replace("torch.", ""),
                    "model": portable_path(a.model), "heads": {m: portable_path(d) for m, d in heads.items()},
                    "settings": portable_settings(vars(a), PATH_SETTINGS, drop=("func", "command"))},
           "datasets": {}, "runs": [], "peers": []}
    for m in ("eagle3", "peagle"):
        if m in methods:
            bench.head(m)                             # fail early on a missing/mismatched head
            res["meta"].setdefault("head_configs", {})[m] = {k: bench.head(m).cfg.get(k) for k in (
                "num_hidden_layers", "hidden_size", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids")}

    online, offline = a.mode in ("online", "both"), a.mode in ("offline", "both")
    # warm-up every engine kind once (first-call allocations, kernels)
    for m, k in (cfgs if offline else []):
        bench.run(m, k, 1, [bench.encode(load_dataset("mtbench", 1)[0])[:32]],
                  SamplingParams(temperature=a.temperature, max_tokens=8, ignore_eos=True), 256)

    batches = {}                                      # (dataset, c) -> (prompt ids, offline baseline outputs)
    for ds in a.datasets:
        prompts = load_dataset(ds, a.num_prompts, a.humaneval_format, a.mtbench_turns, a.seed)
        enc, kept, skipped = [], [], 0
        for p in prompts:
            ids = bench.encode(p)
            if len(ids) > a.max_prompt_len:
                skipped += 1
                continue
            enc.append(ids)
            kept.append(p)
        if not enc:
            raise PeagleError(f"{ds}: no prompt fits --max-prompt-len {a.max_prompt_len}")
        if ds == "mtbench" and a.mtbench_turns == 2:
            enc, kept = _second_turns(bench, kept, enc, a, log)
        mlen = max(map(len, enc)) + a.output_len + 8
        cats = {}
        for p in kept:
            cats[p.category] = cats.get(p.category, 0) + 1
        res["datasets"][ds] = {"n_prompts": len(enc), "n_skipped_too_long": skipped, "categories": cats,
                               "prompt_tokens_mean": sum(map(len, enc)) / len(enc),
                               "ids": [p.id for p in kept], "kinds": sorted({p.kind for p in kept}),
                               "categories_per_prompt": [p.category for p in kept]}
        res["datasets"][ds]["max_model_len"] = mlen
        base_c1 = None
        for ci, c in enumerate(a.concurrency):
            n_req = max(len(enc), c) if a.fill_concurrency else len(enc)
            batch = [enc[i % len(enc)] for i in range(n_req)]
            batches[(ds, c)] = (batch, None)
            if not offline:
                continue
            ref = None
            for rep in range(a.repeats):
                for m, k in run_order(cfgs, (ci + rep) % 2 == 1, getattr(a, "ref_every", 0)):
                    t0 = time.time()
                    r = bench.run(m, k, c, batch, params, mlen)
                    r["t_mid"] = round(time.perf_counter() - r["wall_s"] / 2 - t_origin, 3)   # for summary.paced
                    outs = r.pop("_outputs")
                    if m == "baseline" and ref is None:
                        ref = outs
                        batches[(ds, c)] = (batch, outs)
                        if c == min(a.concurrency):
                            base_c1 = (c, outs)
                            res["datasets"][ds]["samples"] = [
                                {"id": kept[i].id, "category": kept[i].category, "output": bench.decode(outs[i])[:600]}
                                for i in range(min(3, len(outs)))]
                    r["identity"] = bench.identity(batch, outs, ref) if greedy else {"ok": None, "note": "sampling"}
                    r.update(dataset=ds, repeat=rep)
                    res["runs"].append(r)
                    idt = r["identity"]
                    log(f"[{ds} c={c} rep={rep}] {m:8s} K={k}: {r['output_tok_s']:8.1f} tok/s  "
                        f"AL={r['metrics']['mean_acceptance_length']:.2f}  "
                        f"TTFT={r['ttft_ms']['mean']:.0f}ms TPOT={r['tpot_ms']['mean']:.1f}ms  "
                        f"draft={r['timing']['draft_ms_per_step']:.1f}ms verify={r['timing']['verify_ms_per_step']:.1f}ms"
                        f"  same={idt.get('identical', '-')}/{idt.get('n', '-')}  ({time.time() - t0:.0f}s)")
        if a.peers and base_c1 is not None and offline:
            peer_ids = enc[: a.peer_prompts]
            hf = HFPeer(a.model, bench.dtype, bench.device)
            for name, pld in [("hf", 0), ("hf-pld", a.pld_tokens)]:
                if name not in a.peers:
                    continue
                r = hf.run(name, peer_ids, a.output_len, a.ignore_eos, a.temperature, pld)
                outs = r.pop("_outputs")
                r["identity"] = (bench.identity(peer_ids, outs, base_c1[1][: len(peer_ids)]) if greedy
                                 else {"ok": None, "note": "sampling"})
                r["dataset"] = ds
                res["peers"].append(r)
                log(f"[{ds} c=1] {name:8s} pld={pld}: {r['output_tok_s']:8.1f} tok/s  "
                    f"same={r['identity'].get('identical', '-')}/{r['identity'].get('n', '-')}")
            del hf
        if on_dataset is not None and offline:       # online only: nothing has run yet (the online sweep reports)
            on_dataset(res)
    if online:
        res["online_runs"] = []
        _online_sweep(a, bench, cfgs, batches, res, log, on_dataset)
    if bench.costs:                                   # the step-cost models K "auto" used (measured or cached)
        res["meta"]["autok_cost_models"] = {m: {k: v for k, v in cm.to_json().items() if k != "path"}
                                            for m, cm in bench.costs.items()}
    res["meta"]["finished_utc"] = _dt.datetime.utcnow().isoformat(timespec="seconds") + "Z"
    res["meta"]["duration_s"] = time.time() - t_start
    return res


def _second_turns(bench, kept, enc, a, log):
    """MT-Bench both turns: turn-2 prompts carry the model's own greedy (baseline) first answer."""
    from dataclasses import replace
    log("mtbench: generating first answers for turn 2 ...")
    outs = bench.run("baseline", 0, min(8, len(enc)), enc,
                     SamplingParams(temperature=0, max_tokens=a.output_len), max(map(len, enc)) + a.output_len + 8)
    outs = outs["_outputs"]
    enc2, kept2 = list(enc), list(kept)
    for p, o in zip(kept, outs):
        if not p.second_turn:
            continue
        msgs = p.messages + [{"role": "assistant", "content": bench.decode(o)},
                             {"role": "user", "content": p.second_turn}]
        q = replace(p, id=p.id + "-t2", messages=msgs)
        ids = bench.encode(q)
        if len(ids) <= a.max_prompt_len:
            enc2.append(ids)
            kept2.append(q)
    return enc2, kept2


def _online_sweep(a, bench, cfgs, batches, res, log, on_dataset):
    """Every (method, K) as its own `peagle serve` subprocess; all datasets and concurrencies against it.
    Greedy outputs are checked against the offline baseline's (or, online only, the online baseline's)."""
    mlen = max(d["max_model_len"] for d in res["datasets"].values())
    refs = {key: ref for key, (_, ref) in batches.items()}
    greedy = a.temperature == 0
    for m, k in cfgs:
        t0 = time.time()
        with OnlineServer(a.model, m, k, bench.heads_dirs.get(m), max(a.concurrency), mlen, a.dtype, a.seed,
                          a.device, getattr(a, "compile", False), bench.backend, bench.quantization, a.threads,
                          getattr(a, "draft_sampling", DEFAULT_DRAFT_SAMPLING), getattr(a, "auto_k", None),
                          bench.kv_cache_dtype) as srv:
            log(f"[online] {m} K={k}: peagle serve at {srv.url} (up in {time.time() - t0:.0f}s)")
            run_online(srv, m, k, 1, [batches[next(iter(batches))][0][0][:32]], 8, a.temperature, True)  # warm-up
            for (ds, c), (batch, _) in batches.items():
                t1 = time.time()
                r = run_online(srv, m, k, c, batch, a.output_len, a.temperature, a.ignore_eos)
                outs = r.pop("_outputs")
                ok_outs = [o if o is not None else [] for o in outs]          # a failed request: no tokens
                if m == "baseline" and refs.get((ds, c)) is None:
                    refs[(ds, c)] = ok_outs
                r["identity"] = (bench.identity(batch, ok_outs, refs[(ds, c)]) if greedy
                                 else {"ok": None, "note": "sampling"})
                r.update(dataset=ds, repeat=0)
                res["online_runs"].append(r)
                log(f"[online {ds} c={c}] {m:8s} K={k}: {r['output_tok_s']:8.1f} tok/s  "
                    f"AL={r['metrics']['mean_acceptance_length']:.2f}  TTFT={r['ttft_ms']['mean'] or 0:.0f}ms "
                    f"TPOT={r['tpot_ms']['mean'] or 0:.1f}ms  errors={len(r['errors'])}  "
                    f"same={r['identity'].get('identical', '-')}/{r['identity'].get('n', '-')}  ({time.time() - t1:.0f}s)")
        if on_dataset is not None:
            on_dataset(res)
