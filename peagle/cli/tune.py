"""`peagle tune MODEL --speculative-config JSON`: measure this machine and write vLLM's
`num_speculative_tokens_per_batch_size` for the head, as a speculative config ready to pass to vLLM (how:
peagle/autok/tune.py)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from ..autok.factory import chain_of, cost_model_for, k_max_for
from ..autok.tune import best_k_per_batch, best_kind_per_batch, best_two_level, expected_tokens, ranges
from ..data.benchmarks import encode_prompt, load_dataset
from ..device import add_arguments
from ..errors import PeagleError
from ..llm import DEFAULT_MODEL, LLM, measuring_engines
from ..sampling import SamplingParams
from ..spec_config import parse_spec_config


def add_parser(sub):
    p = sub.add_parser("tune", help="measure this machine and write vLLM's num_speculative_tokens_per_batch_size",
                       description="Measures step costs (draft + verify, K = 0..k_max, batch sizes up to "
                                   "--max-num-seqs) and the head's acceptance on a few prompts, then writes the "
                                   "speculative config with the best K per batch-size range, ready for vLLM "
                                   "(--speculative-config).")
    p.add_argument("model", nargs="?", default=None,
                   help="target HF directory (default: the default target, SmolLM2-135M-Instruct; or --model, as "
                        "the other commands take it)")
    p.add_argument("--model", dest="model_opt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--speculative-config", required=True,
                   help='the head: {"method": "eagle3", "model": DIR, "num_speculative_tokens": "auto" or K_MAX, '
                        '"parallel_drafting": ...}')
    p.add_argument("--max-num-seqs", type=int, default=128, help="largest batch size the schedule covers")
    p.add_argument("--dataset", default="mtbench", help="prompts for the acceptance: mtbench, humaneval, speed")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--output-len", type=int, default=128)
    add_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--any-k", action="store_true",
                   help="P-EAGLE heads: any K per batch size (a vLLM with PR #45695); default: each batch size "
                        "uses 0 or one K, the largest, which vLLM <= 0.32 runs correctly")
    p.add_argument("--out", default=None, help="write the speculative config JSON here (default: stdout)")
    p.set_defaults(func=run)


def run(a) -> int:
    if a.threads is not None and a.threads < 1:
        raise PeagleError(f"--threads must be >= 1, got {a.threads}")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.max_num_seqs < 1 or a.num_prompts < 1 or a.output_len < 1:
        raise PeagleError("--max-num-seqs, --num-prompts and --output-len must be >= 1")
    if a.out and not os.path.isdir(os.path.dirname(os.path.abspath(a.out))):
        raise PeagleError(f"--out {a.out}: its directory does not exist (checked before measuring)")
    if a.out and os.path.isdir(a.out):
        raise PeagleError(f"--out {a.out} is a directory: give the config file's path (checked before measuring)")
    if a.model and a.model_opt and a.model != a.model_opt:
        raise PeagleError(f"two targets: {a.model} and --model {a.model_opt}")
    model = a.model or a.model_opt or DEFAULT_MODEL
    spec = parse_spec_config(a.speculative_config)
    if spec is None:
        raise PeagleError("--speculative-config names no head")
    try:
        with open(os.path.join(spec.model, "config.json")) as f:
            head_cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PeagleError(f"cannot read the head's config: {e}") from None
    k_max = k_max_for(spec, head_cfg)
    # tune writes vLLM's chain schedule: it measures chains (trees, if asked for, beside them)
    # float weights: the schedule is for vLLM, which serves the float model
    llm = LLM(model, dtype=a.dtype, device=a.device, seed=a.seed, speculative_config=_fixed(spec, k_max, trees=False),
              max_num_seqs=min(a.num_prompts, 16), quantization="none")
    eng = llm.engine
    prompts = [encode_prompt(llm.tokenizer, eng.target.cfg.vocab_size, p) for p in load_dataset(a.dataset, a.num_prompts)]
    prompts = [p for p in prompts if len(p) + a.output_len < eng.max_model_len]
    if not prompts:
        raise PeagleError(f"no {a.dataset} prompt fits the context with --output-len {a.output_len}")
    e = _expected_tokens(llm, prompts, a.output_len, k_max)
    cost = cost_model_for(eng.target, measuring_engines(eng.target, eng.proposer.head, chain_of(spec), k_max), spec.name, k_max,
                          a.max_num_seqs, model, spec.model, eng.target.dtype)
    two_level = spec.parallel_drafting and not a.any_k
    if two_level:
        k_top, ks = best_two_level(e, cost, a.max_num_seqs)
    else:
        k_top, ks = k_max, best_k_per_batch(e, cost, a.max_num_seqs)
    sched = ranges(ks)
    out = dict(spec.as_dict(), num_speculative_tokens=k_top, num_speculative_tokens_per_batch_size=sched)
    out.pop("max_num_speculative_tokens", None)
    out.pop("auto_k", None)                          # auto K's knobs: peagle's
    for key in ("draft_sampling", "eagle_topk", "num_draft_tokens"):
        out.pop(key, None)                           # peagle's keys: the config is for vLLM
    print(f"peagle tune: {spec.name} head {spec.model}, K 0..{k_max}; acceptance on {len(prompts)} {a.dataset} "
          f"prompts: E[tokens/step | K] = {[round(float(x), 2) for x in e]}", file=sys.stderr)
    for s, t, k in sched:
        b = (s + t) // 2
        gain = float(e[k] / cost.predict(b)[k] * cost.predict(b)[0])
        print(f"  batch {s}-{t}: K={k}  (at B={b}: {gain:.2f}x plain decoding, estimated)", file=sys.stderr)
    if two_level:
        print(f"peagle tune: parallel drafting: K is 0 or {k_top} per batch size (vLLM <= 0.32 keeps "
              "num_speculative_tokens mask slots whatever the step's K, vLLM PR #45695; --any-k lifts this)",
              file=sys.stderr)
    tree_spec = spec.tree(k_max)
    if tree_spec is not None:
        _print_tree_choice(a, llm, model, spec, k_max, prompts, e, cost)
    text = json.dumps(out)
    if a.out:
        replaced = " (replacing the file that was there)" if os.path.exists(a.out) else ""
        with open(a.out, "w") as f:
            f.write(text + "\n")
        print(f"peagle tune: wrote {a.out}{replaced}; serve with: vllm serve {model} --speculative-config \"$(cat {a.out})\"",
              file=sys.stderr)
    else:
        print(text)
    return 0



def _fixed(spec, k_max: int, trees: bool) -> dict:
    """The config measured: K fixed at k_max, no schedule or auto knobs; token-tree keys only with trees."""
    cfg = dict(spec.as_dict(), num_speculative_tokens=k_max)
    drop = ("max_num_speculative_tokens", "num_speculative_tokens_per_batch_size", "auto_k") + \
        (() if trees else ("eagle_topk", "num_draft_tokens"))
    for key in drop:
        cfg.pop(key, None)
    return cfg


def _expected_tokens(llm, prompts, output_len: int, k_max: int):
    """E[tokens per step | K] for K = 0..k_max from greedy generation on the prompts."""
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=output_len))
    return expected_tokens(llm.get_metrics()["acceptance_rate_per_pos"][:k_max])


def _print_tree_choice(a, llm, model, spec, k_max, prompts, e_chain, chain_cost):
    """Token trees in the config: measure the trees' acceptance (same prompts, same loaded target) and step costs,
    then print what peagle's engine would run per batch-size range: plain, chain K or tree K (vLLM's config stays
    chains)."""
    tree_llm = llm.with_speculative_config(_fixed(spec, k_max, trees=True))
    eng = tree_llm.engine
    e_tree = _expected_tokens(tree_llm, prompts, a.output_len, k_max)
    tree_cost = cost_model_for(eng.target, measuring_engines(eng.target, eng.proposer.head, spec, k_max),
                               spec.cost_name, k_max, a.max_num_seqs, model, spec.model, eng.target.dtype)
    kinds = best_kind_per_batch((e_chain, chain_cost), (e_tree, tree_cost), a.max_num_seqs)
    print(f"peagle tune: token trees {spec.eagle_topk}x{eng.tree.nodes}: E[tokens/step | depth] = "
          f"{[round(float(x), 2) for x in e_tree]}; peagle's engine per batch size (not vLLM's):", file=sys.stderr)
    for start, end, (kind, k) in ranges(kinds):
        print(f"  batch {start}-{end}: {kind}" + (f" K={k}" if k else ""), file=sys.stderr)
