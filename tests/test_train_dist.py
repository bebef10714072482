"""Slow: torchrun 2-process training == single-process training on the same global batch, and a killed +
--resume'd run ends with the same weights as an uninterrupted run."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from peagle import LLM, SamplingParams
from peagle.train.data import write_shard

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data(tiny_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("ddata")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 500, (6,), generator=g).tolist() for _ in range(32)]
    outs = LLM(tiny_dirs["llama"]).generate([{"prompt_token_ids": p} for p in prompts],
                                            SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    write_shard(str(d / "shard-00000.safetensors"),
                [(p + o.outputs[0].token_ids, [0] * len(p) + [1] * len(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)])
    return tiny_dirs["llama"], str(d)


def args(target, data, out, method, steps, *extra):
    return ["train", "--method", method, "--target", target, "--data", data, "--out", out, "--layers", "2",
            "--draft-vocab", "384", "--max-tokens", "96", "--batch-rows", "2", "--steps", str(steps),
            "--lr", "2e-3", "--warmup", "3", "--log-every", "1", "--quiet", "--threads", "1",
            "--depths", "4", "--ttt-steps", "3", "--segment-len", "24",
            "--mask-token", "4", *extra]                          # the tiny target has no tokenizer


def run(argv, torchrun=0):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    if torchrun:
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", str(torchrun),
               "--master-port", "29533", "-m", "peagle.cli", *argv]
    else:
        cmd = [sys.executable, "-m", "peagle.cli", *argv]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)


def log(out):
    with open(os.path.join(out, "train_log.jsonl")) as f:
        return [json.loads(x) for x in f]


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_torchrun_matches_single_process(data, tmp_path, method):
    target, d = data
    a, b = str(tmp_path / "single"), str(tmp_path / "ddp")
    r1 = run(args(target, d, a, method, 8))
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = run(args(target, d, b, method, 8), torchrun=2)
    assert r2.returncode == 0, r2.stderr[-3000:]
    la, lb = log(a), log(b)
    assert [x["step"] for x in la] == [x["step"] for x in lb]
    for x, y in zip(la, lb):
        assert abs(x["loss"] - y["loss"]) <= 1e-4 * max(1.0, abs(x["loss"])), (x, y)
        assert x["n"] == y["n"]
    wa, wb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    worst = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    assert worst < 1e-4, worst


def test_kill_and_resume_gives_same_weights(data, tmp_path):
    target, d = data
    a, b = str(tmp_path / "full"), str(tmp_path / "killed")
    assert run(args(target, d, a, "peagle", 12, "--ckpt-every", "4")).returncode == 0
    r = run(args(target, d, b, "peagle", 12, "--ckpt-every", "4", "--kill-at-step", "6"))
    assert r.returncode == 17 and not os.path.exists(os.path.join(b, "model.safetensors"))
    r = run(args(target, d, b, "peagle", 12, "--ckpt-every", "4", "--resume"))
    assert r.returncode == 0, r.stderr[-3000:]
    wa, wb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    la, lb = log(a), log(b)
    assert la[-1]["loss"] == lb[-1]["loss"]
