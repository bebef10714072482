"""`peagle generate`: one prompt, tokens streamed to stdout, tokens/s (and spec metrics) at the end."""
from __future__ import annotations

import json
import sys
import time

from ..compile import add_argument
from ..detok import IncrementalDetokenizer
from ..device import add_arguments
from ..errors import PeagleError
from ..llm import LLM
from ..models.loader import add_backend_argument, add_kv_cache_argument, add_quantization_argument
from ..sampling import SamplingParams
from ..spec_config import parse_spec_config


def add_parser(sub):
    p = sub.add_parser("generate", help="generate text from a prompt, streaming to stdout")
    p.add_argument("--model", default=None, help="HF model directory (default: the default target, SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    add_arguments(p)
    add_argument(p)
    add_backend_argument(p)
    add_quantization_argument(p)
    add_kv_cache_argument(p)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--speculative-config", default=None,
                   help='vLLM JSON, e.g. \'{"method": "eagle3", "model": DIR, "num_speculative_tokens": 7, '
                        '"parallel_drafting": true}\'')
    p.set_defaults(func=run)


def run(args) -> int:
    parse_spec_config(args.speculative_config)   # fail fast on a bad config or sampling flag, before loading weights
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        max_tokens=args.max_tokens, seed=args.seed)
    # one request: batches of one (K "auto" then measures its step costs at batch size 1 only, ~2 s, not up
    # to 128, ~1 min; a cost cache measured for more batch sizes covers it)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, compile=args.compile, seed=args.seed or 0,
              speculative_config=args.speculative_config, max_num_seqs=1,
              max_model_len=args.max_model_len, target_backend=args.target_backend,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    if args.chat:
        ids = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        if llm.tokenizer is None:
            raise PeagleError(f"{llm.model} has no tokenizer")
        ids = llm.tokenizer(args.prompt)["input_ids"]        # with the tokenizer's special tokens, as LLM.generate
    eng, tok = llm.engine, llm.tokenizer
    req = eng.add_request("cli", ids, sp, args.prompt)
    room = eng.max_model_len - len(ids)               # the engine stops there (finish_reason "length"), as vLLM's LLM
    if args.max_tokens > room:
        print(f"peagle: --max-tokens {args.max_tokens}: the context ({eng.max_model_len}) leaves {room} after the "
              f"{len(ids)}-token prompt", file=sys.stderr)
    # what runs, once the input is accepted (a rejected input stays one error line)
    print(f"[target: {getattr(llm.engine.target, 'precision', str(llm.dtype).replace('torch.', ''))}]", file=sys.stderr)
    t0 = time.perf_counter()
    detok = IncrementalDetokenizer(tok, sp.stop)      # shows no partial character, nothing a stop string may cut
    while eng.has_unfinished():
        for o in eng.step():
            sys.stdout.write(detok.finish(req.stop_text_at, o.new_token_ids) if o.finished else
                             detok.add(o.new_token_ids))
            sys.stdout.flush()
    dt = time.perf_counter() - t0
    n = len(req.output_ids)
    sys.stdout.write("\n")
    # the wait for the first token (the prompt's prefill) apart from the decoding rate after it
    first = req.first_token_time - t0 if req.first_token_time is not None else dt
    after = f", then {(n - 1) / (dt - first):.1f} tokens/s" if n > 1 and dt > first else ""
    print(f"[{n} tokens in {dt:.2f} s: {n / dt:.1f} tokens/s; first token after {first * 1e3:.0f} ms "
          f"({len(ids)}-token prompt){after}; finish_reason={req.finish_reason}]", file=sys.stderr)
    if llm.spec is not None:
        m = llm.get_metrics()
        print(f"[{llm.spec.name} K={llm.spec.k_label}: mean acceptance length "
              f"{m['mean_acceptance_length']:.2f}, per-position acceptance "
              f"{[round(x, 2) for x in m['acceptance_rate_per_pos']]}, prefill {m['prefill_time_s']:.2f} s, "
              f"draft {m['draft_time_s']:.2f} s, verify {m['verify_time_s']:.2f} s]", file=sys.stderr)
        print(json.dumps({"metrics": m}), file=sys.stderr)
    return 0
