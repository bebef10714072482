"""Test helpers around the tiny models of peagle.models.tiny (re-exported here for the tests)."""
from __future__ import annotations

import os

import torch

from peagle.models.tiny import (  # noqa: F401 - re-exported for the tests
    CHATML,
    FAMILIES,
    SERVE_SPECIALS,
    make_tiny_tokenizer,
    save_tiny,
    save_tiny_text_model,
    save_tiny_tokenizer,
    tiny_config,
)


def hf_greedy(path: str, prompts: list, max_new_tokens: int) -> list:
    """transformers' own greedy generate(), one prompt at a time (no padding): the reference outputs."""
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        with torch.no_grad():
            o = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
        out.append(o[0, len(p):].tolist())
    return out


def write_greedy_shard(target: str, out_dir: str, n: int = 24, prompt_len: int = 6, gen: int = 40, seed: int = 0) -> str:
    """A datagen-format directory of n random prompts + the target's own greedy continuation (loss on it)."""
    from peagle import LLM, SamplingParams
    from peagle.train.data import shard_path, write_shard
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 400, (prompt_len,), generator=g).tolist() for _ in range(n)]
    outs = LLM(target).generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True))
    rows = [(p + o.outputs[0].token_ids, [0] * len(p) + [1] * len(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]
    os.makedirs(out_dir, exist_ok=True)
    write_shard(shard_path(out_dir, 0), rows)
    return out_dir
