"""Training helpers shared by the trainer tests: tiny regenerated data and a few steps' losses."""
from __future__ import annotations

import argparse
import os

import torch

from peagle import LLM, SamplingParams
from peagle.train import cli
from peagle.train.data import write_shard


def make_tiny_data(target: str, out: str, n: int = 16, seed: int = 0):
    """n documents = random 6-token prompts + the tiny target's greedy continuation (loss mask on it)."""
    os.makedirs(out, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 500, (6,), generator=g).tolist() for _ in range(n)]
    outs = LLM(target).generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    rows = [(p + o.outputs[0].token_ids, [0] * len(p) + [1] * len(o.outputs[0].token_ids))
            for p, o in zip(prompts, outs)]
    write_shard(os.path.join(out, "shard-00000.safetensors"), rows)
    return target, out


def trainer_losses(target, data, out, method, extra=(), steps: int = 6) -> list[dict]:
    """The per-step records of `steps` optimizer steps of a fresh Trainer (2 rows of 192 tokens per step)."""
    from peagle.train.loop import Trainer
    ap = argparse.ArgumentParser()
    cli.add_arguments(ap)
    a = ap.parse_args(["--method", method, "--target", target, "--data", data, "--out", out, "--layers", "1",
                       "--draft-vocab", "384", "--max-tokens", "192", "--batch-rows", "2", "--steps", str(steps),
                       "--ckpt-every", "0", "--quiet", "--threads", "1", "--device", "cpu", *extra])
    a.max_docs = None
    t = Trainer(a)
    return [t.train_step(s) for s in range(steps)]
