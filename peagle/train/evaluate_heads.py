"""Evaluate trained heads with peagle's engine: acceptance length (K drafts per step) on MT-Bench (first
turn, chat template) and HumanEval (raw prompts), prompts encoded exactly as `peagle bench` encodes them,
greedy token identity against plain decoding, and batch-1 decode speed on a few prompts.

    .venv/bin/python -m peagle.train.evaluate_heads --target models/demo-target \\
        --head eagle3=models/demo-target-eagle3 --head peagle=models/demo-target-peagle --k 7 --out eval.json
"""
from __future__ import annotations

import argparse
import json
import time

from ..data.benchmarks import encode_prompt, load_dataset
from ..llm import LLM
from ..sampling import SamplingParams
from ..spec_config import speculative_config


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--head", action="append", default=[], help="name=DIR (name peagle* = parallel drafting)")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--mtbench", type=int, default=80)
    ap.add_argument("--humaneval", type=int, default=164)
    ap.add_argument("--speed-prompts", type=int, default=6, help="prompts per dataset timed at batch 1")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--quantization", default="none", help="the target's (none: float32, as the heads were "
                    "trained against; see peagle/models/quant.py)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    heads = dict(h.split("=", 1) for h in a.head)
    plain = LLM(a.target, quantization=a.quantization)
    vocab = plain.engine.target.cfg.vocab_size
    data = {ds: [encode_prompt(plain.tokenizer, vocab, p) for p in load_dataset(ds, n or None)]
            for ds, n in (("mtbench", a.mtbench), ("humaneval", a.humaneval))}
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    res = {"k": a.k, "max_tokens": a.max_tokens, "datasets": {}}
    refs = {}
    for ds, ps in data.items():
        t0 = time.time()
        outs = plain.generate([{"prompt_token_ids": p} for p in ps], sp)
        refs[ds] = [o.outputs[0].token_ids for o in outs]
        res["datasets"][ds] = {"prompts": len(ps), "plain_batch_s": round(time.time() - t0, 1),
                               "tokens": sum(map(len, refs[ds]))}
        print(ds, res["datasets"][ds], flush=True)
    llms = {}
    for name, d in heads.items():
        spec = speculative_config(d, a.k, name.startswith("peagle"))
        llm = llms[name] = LLM(a.target, speculative_config=spec, quantization=a.quantization)
        for ds, ps in data.items():
            llm.reset_metrics()
            t0 = time.time()
            outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp)
            got = [o.outputs[0].token_ids for o in outs]
            m = llm.get_metrics()
            r = {"acceptance_length": round(m["mean_acceptance_length"], 3),
                 "acceptance_per_pos": [round(x, 3) for x in m["acceptance_rate_per_pos"]],
                 "identical": got == refs[ds], "mismatched_prompts": sum(x != y for x, y in zip(got, refs[ds])),
                 "batch_s": round(time.time() - t0, 1)}
            res["datasets"][ds][name] = r
            print(ds, name, r, flush=True)
    # batch-1 decode speed on a few prompts per dataset
    if a.speed_prompts:
        sp1 = SamplingParams(temperature=0, max_tokens=a.max_tokens)
        for ds, ps in data.items():
            sub = ps[: a.speed_prompts]
            for name, llm in [("plain", plain)] + list(llms.items()):
                t0, n = time.time(), 0
                for p in sub:
                    n += len(llm.generate([{"prompt_token_ids": p}], sp1)[0].outputs[0].token_ids)
                res["datasets"][ds].setdefault("batch1_tok_s", {})[name] = round(n / (time.time() - t0), 1)
            print(ds, "batch-1 tok/s", res["datasets"][ds]["batch1_tok_s"], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
