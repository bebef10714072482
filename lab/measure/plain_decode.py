"""Plain (non-speculative) decoding: peagle's engine vs transformers `generate` on the same weights.

--target-backend transformers times peagle's transformers-backed target (the one GPT-OSS, Qwen3-MoE, Gemma 3/4
and any other AutoModelForCausalLM run on) against the same model's own generate(): goal <= 1.3x generate's
time, i.e. peagle / transformers tok/s >= 0.77.  The default (auto) is the native target for Llama-family models.

Greedy, exactly --max-tokens new tokens per prompt (EOS ignored on both sides), batch 1 (prompts one after
another) and batch 8 (one batch of 8 prompts of mixed lengths; transformers pads on the left). The runs
are interleaved (peagle, HF, peagle, HF, ...) and the median of --repeats is reported, with the ratio side
by side and whether the greedy tokens agree.

    .venv/bin/python lab/measure/plain_decode.py                   # the demo target (a random one of its shape if absent)
    .venv/bin/python lab/measure/plain_decode.py --model DIR --repeats 5 --json out.json
    .venv/bin/python lab/measure/plain_decode.py --device cuda      # both sides on the GPU (bfloat16 unless --dtype)
    .venv/bin/python lab/measure/plain_decode.py --model DIR --target-backend transformers
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.demo_target.model import target_or_random
from peagle import LLM, SamplingParams
from peagle.data.benchmarks import load_dataset
from peagle.llm import DEFAULT_MODEL
from peagle.models.loader import add_backend_argument


def prompts(llm, n: int, max_len: int) -> list:
    """Mixed-length prompts: HumanEval (raw) and MT-Bench (chat) alternately, as the benchmark encodes them."""
    from peagle.data.benchmarks import encode_prompt
    ps = [p for pair in zip(load_dataset("humaneval", n), load_dataset("mtbench", n)) for p in pair]
    out = [encode_prompt(llm.tokenizer, llm.engine.target.cfg.vocab_size, p)[-max_len:] for p in ps]
    return out[:n]


class HF:
    def __init__(self, model, device=torch.device("cpu"), dtype=torch.float32):
        from transformers import AutoModelForCausalLM
        self.device = device
        self.m = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
        self.pad = self.m.generation_config.pad_token_id
        if self.pad is None:
            self.pad = 0

    @torch.no_grad()
    def generate(self, batch: list, n: int) -> list:
        L = max(map(len, batch))
        x = torch.full((len(batch), L), self.pad, dtype=torch.long)
        mask = torch.zeros_like(x)
        for i, ids in enumerate(batch):
            x[i, L - len(ids):] = torch.tensor(ids)
            mask[i, L - len(ids):] = 1
        out = self.m.generate(x.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=self.pad, eos_token_id=None)
        return out[:, L:].tolist()


def measure(llm, hf, ps: list, batches: list, prompts_b1: int, max_tokens: int, repeats: int):
    """Interleaved runs (peagle, HF, HF, peagle, ...): batch 1 = ps[:prompts_b1] one after another, batch b =
    one batch of ps[:b]. Returns ({(engine, b): [tok/s per repeat]}, {b: prompts with the same greedy tokens})."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run_peagle(b):
        groups = [[p] for p in ps[:prompts_b1]] if b == 1 else [ps[:b]]
        outs, t0 = [], time.perf_counter()
        for g in groups:
            outs += [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": x} for x in g], sp)]
        return sum(map(len, outs)) / (time.perf_counter() - t0), outs

    def run_hf(b):
        groups = [[p] for p in ps[:prompts_b1]] if b == 1 else [ps[:b]]
        outs, t0 = [], time.perf_counter()
        for g in groups:
            outs += hf.generate(g, max_tokens)
        return sum(map(len, outs)) / (time.perf_counter() - t0), outs

    run_peagle(1), run_hf(1)                              # warm-up
    tps = {(e, b): [] for e in ("peagle", "hf") for b in batches}
    same = {}
    for r in range(repeats):
        for b in batches:
            order = [("peagle", run_peagle), ("hf", run_hf)]
            if r % 2:
                order.reverse()
            res = {}
            for name, fn in order:
                t, outs = fn(b)
                tps[(name, b)].append(t)
                res[name] = outs
            same[b] = sum(x == y for x, y in zip(res["peagle"], res["hf"]))
    return tps, same


def parse(ap, argv, script: str):
    """Common options (--threads, --json, --device, --dtype), parsed; prints the regenerating command."""
    from peagle.device import add_arguments
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    add_arguments(ap)
    a = ap.parse_args(argv)
    print("Regenerate: `.venv/bin/python " + " ".join([os.path.relpath(script)] + list(
        sys.argv[1:] if argv is None else argv)) + "`")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(a.threads or os.cpu_count() or 1)
    return a


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompts-b1", type=int, default=4, help="prompts run one after another at batch 1")
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    add_backend_argument(ap)
    a = parse(ap, argv, __file__)
    model = target_or_random(a.model, os.path.join(tempfile.gettempdir(), "peagle-plain-decode"))
    llm = LLM(model, max_num_seqs=max(int(b) for b in a.batches.split(",")), device=a.device, dtype=a.dtype,
              target_backend=a.target_backend, quantization="none")           # float32, as transformers runs
    hf = HF(model, llm.device, llm.dtype)
    batches = [int(b) for b in a.batches.split(",")]
    ps = prompts(llm, max(max(batches), a.prompts_b1), a.max_prompt_len)
    tps, same = measure(llm, hf, ps, batches, a.prompts_b1, a.max_tokens, a.repeats)
    med = {k: statistics.median(v) for k, v in tps.items()}
    cfg = llm.engine.target.cfg
    print(f"\nPlain greedy decoding, {a.max_tokens} new tokens per prompt, median of {a.repeats} interleaved runs; "
          f"model {os.path.basename(model.rstrip('/'))} ({cfg.num_hidden_layers} layers, width {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}), {llm.engine.target.backend} target, {llm.device} "
          f"{str(llm.dtype).replace('torch.', '')}, "
          f"{torch.get_num_threads()} threads; batch 1 = {a.prompts_b1} prompts in turn, batch b = one batch of b "
          f"prompts (lengths {[len(p) for p in ps[:max(batches)]]})\n")
    print("| batch | peagle tok/s | transformers tok/s | peagle ÷ transformers | same greedy tokens |")
    print("|---|---|---|---|---|")
    for b in batches:
        n = a.prompts_b1 if b == 1 else b
        print(f"| {b} | {med[('peagle', b)]:.1f} | {med[('hf', b)]:.1f} | {med[('peagle', b)] / med[('hf', b)]:.2f}× "
              f"| {same[b]}/{n} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": vars(a), "model": model, "threads": torch.get_num_threads(),
                       "tok_s": {f"{e}/b{b}": v for (e, b), v in tps.items()},
                       "median_tok_s": {f"{e}/b{b}": v for (e, b), v in med.items()}, "same": same}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
