"""Drafter training end to end on a tiny target: loss falls, per-depth accuracy rises, the saved head
loads in the engine and decoding with it stays token-identical to plain decoding."""
import json
import os

import pytest
import torch

from peagle import LLM, SamplingParams
from peagle.cli import train as cli
from peagle.train.data import load_docs, write_shard


@pytest.fixture(scope="module")
def tiny_data(tiny_dirs, tmp_path_factory):
    """Documents = random 6-token prompts + the tiny target's own greedy continuation (the 'regenerated'
    assistant tokens carry the loss mask)."""
    d = tmp_path_factory.mktemp("tdata")
    target = tiny_dirs["llama"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (6,), generator=g).tolist() for _ in range(48)]
    outs = LLM(target).generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    rows = [(p + o.outputs[0].token_ids, [0] * len(p) + [1] * len(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]
    write_shard(str(d / "shard-00000.safetensors"), rows[:24])
    write_shard(str(d / "shard-00001.safetensors"), rows[24:])
    assert len(load_docs(str(d))) == 48
    return target, str(d), prompts


def _train(target, data, out, method, steps, extra=(), quiet=True):
    args = ["--method", method, "--target", target, "--data", data, "--out", out, "--layers", "1",
            "--draft-vocab", "384", "--max-tokens", "192", "--steps", str(steps), "--lr", "3e-3",
            "--warmup", "5", "--log-every", "10", "--ckpt-every", "0", *(["--quiet"] if quiet else []),
            "--threads", "1", *extra]
    cli.main(args)
    with open(os.path.join(out, "train_log.jsonl")) as f:
        return [json.loads(x) for x in f]


@pytest.mark.parametrize("method,K", [("peagle", 4), ("eagle3", 3)])
def test_training_improves_and_head_is_lossless(tiny_data, tmp_path, method, K):
    target, data, prompts = tiny_data
    out = str(tmp_path / method)
    # the tiny target has no tokenizer, so no <|mask|>: the mask token is given explicitly
    flag = ["--depths", str(K), "--mask-token", "4"] if method == "peagle" else ["--ttt-steps", str(K)]
    log = _train(target, data, out, method, 160, flag)
    first, last = log[0], log[-1]
    assert last["loss"] < 0.5 * first["loss"], (first, last)
    for k in range(K):
        assert last["acc"][k] > first["acc"][k] + 0.1, (k, first["acc"], last["acc"])
    # the head loads (validated), drafts something useful, and decoding stays lossless
    spec = {"method": "eagle3", "model": out, "num_speculative_tokens": K, "parallel_drafting": method == "peagle"}
    ps = [{"prompt_token_ids": p} for p in prompts[:4]]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(target).generate(ps, sp)]
    llm = LLM(target, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, sp)] == ref
    assert llm.get_metrics()["mean_acceptance_length"] > 1.5


def test_init_continues_a_head_and_reads_several_data_dirs(tiny_data, tmp_path, monkeypatch):
    """--init starts from an existing head (its weights, config and draft vocabulary); --data takes a comma
    list of datagen directories; a head of the other method is refused; the head's training record names
    --init and --data without absolute paths."""
    from safetensors.torch import load_file

    from peagle.errors import PeagleError
    target, data, _ = tiny_data
    monkeypatch.chdir(tmp_path)
    first = str(tmp_path / "first")
    log0 = _train(target, data, first, "eagle3", 60, ["--ttt-steps", "2"])
    cont = str(tmp_path / "cont")
    log1 = _train(target, f"{data},{data}", cont, "eagle3", 10,
                  ["--ttt-steps", "2", "--init", first, "--draft-vocab", "100", "--layers", "3"])
    assert log1[0]["loss"] < 0.7 * log0[0]["loss"], (log0[0], log1[0])   # starts where the first run got to
    a, b = load_file(os.path.join(first, "model.safetensors")), load_file(os.path.join(cont, "model.safetensors"))
    assert torch.equal(a["d2t"], b["d2t"])                # draft vocabulary and layers of --init, not 100 / 3
    with open(os.path.join(cont, "config.json")) as f:
        info = json.load(f)
    assert info["draft_vocab_size"] == 384 and info["peagle"]["layers"] == info["num_hidden_layers"] == 1
    assert info["peagle"]["init"] == "first"                # relative to the working directory
    assert not any(os.path.isabs(d) for d in info["peagle"]["data"].split(","))
    assert info["peagle"]["docs"] == 2 * len(load_docs(data))
    with pytest.raises(PeagleError, match="parallel"):
        _train(target, data, str(tmp_path / "bad"), "peagle", 2, ["--init", first])


def test_peagle_needs_a_mask_token(tiny_data, tmp_path):
    """No <|mask|> in the target (the tiny one has no tokenizer) and no --mask-token: refused, never assumed."""
    from peagle.errors import PeagleError
    target, data, _ = tiny_data
    with pytest.raises(PeagleError, match="mask-token"):
        _train(target, data, str(tmp_path / "p"), "peagle", 2)


def test_init_from_eagle3_starts_peagle_from_a_trained_eagle3_head(tiny_data, tmp_path):
    """--init-from-eagle3: fc, first layer, norm, lm_head, embeddings and draft vocabulary are the EAGLE-3 head's;
    the extra layer starts as an identity (zero output projections) and mask_hidden at zero; the warm start
    drafts depth 1 better than a cold start from its first logged steps."""
    from safetensors.torch import load_file

    from peagle.errors import PeagleError
    target, data, _ = tiny_data
    e3 = str(tmp_path / "e3")
    _train(target, data, e3, "eagle3", 60, ["--ttt-steps", "2"])
    flags = ["--depths", "3", "--mask-token", "4", "--layers", "2"]
    copy = str(tmp_path / "copy")
    _train(target, data, copy, "peagle", 1, flags + ["--init-from-eagle3", e3, "--lr", "0"])
    a, b = load_file(os.path.join(e3, "model.safetensors")), load_file(os.path.join(copy, "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not any(k.startswith("layers.1.") for k in a)
    assert all(float(b[k].abs().max()) == 0 for k in b if k.startswith("layers.1.") and k.endswith(
        ("o_proj.weight", "down_proj.weight")))
    assert float(b["mask_hidden"].abs().max()) == 0
    warm = _train(target, data, str(tmp_path / "warm"), "peagle", 10, flags + ["--init-from-eagle3", e3])
    cold = _train(target, data, str(tmp_path / "cold"), "peagle", 10, flags)
    assert warm[0]["loss"] < 0.5 * cold[0]["loss"] and warm[0]["acc"][0] > cold[0]["acc"][0] + 0.1, (warm[0], cold[0])
    with pytest.raises(PeagleError, match="--method peagle"):
        _train(target, data, str(tmp_path / "bad"), "eagle3", 1, ["--init-from-eagle3", e3])


def _trainer(target, data, out, method, extra=()):
    import argparse

    from peagle.train.loop import Trainer
    ap = argparse.ArgumentParser()
    cli.add_arguments(ap)
    a = ap.parse_args(["--method", method, "--target", target, "--data", data, "--out", out, "--layers", "1",
                       "--draft-vocab", "384", "--max-tokens", "192", "--batch-rows", "2", "--steps", "8",
                       "--ckpt-every", "0", "--quiet", "--threads", "1", "--device", "cpu", *extra])
    a.max_docs = None
    return Trainer(a)


@pytest.mark.parametrize("method,extra", [("peagle", ["--depths", "3", "--mask-token", "4", "--segment-len", "64"]),
                                          ("peagle", ["--depths", "3", "--mask-token", "4", "--segment-len", "0"]),
                                          ("eagle3", ["--ttt-steps", "3"]),
                                          ("eagle3", ["--ttt-steps", "3", "--ttt-keep", "0.7", "--loss", "hard"]),
                                          ("peagle", ["--depths", "3", "--mask-token", "4", "--loss", "hard"])])
def test_training_step_creates_no_tensor_without_an_explicit_device(tiny_data, tmp_path, method, extra):
    """Training follows its device: with torch.set_default_device("meta") active, any tensor a training step
    creates without an explicit device lands on "meta" and the first op mixing it with the run's tensors
    raises.  The first step runs normally (it creates the optimizer state); the next ones under meta must
    train exactly as without the trap (same loss as an identical trainer run normally)."""
    target, data, _ = tiny_data
    a, b = (_trainer(target, data, str(tmp_path / n), method, extra) for n in ("a", "b"))
    assert a.train_step(0)["loss"] == b.train_step(0)["loss"]
    torch.set_default_device("meta")
    try:
        got = [a.train_step(s) for s in (1, 2)]
    finally:
        torch.set_default_device(None)
    want = [b.train_step(s) for s in (1, 2)]
    assert [g["loss"] for g in got] == [w["loss"] for w in want]
    assert all(torch.equal(g["correct"], w["correct"]) and g["correct"].device.type == "cpu" for g, w in zip(got, want))


def test_the_meta_trap_catches_a_tensor_made_without_a_device(tiny_data, tmp_path, monkeypatch):
    """Negative control for the test above: COD sampling's arange made without its device fails under meta."""
    import peagle.train.cod as cod
    target, data, _ = tiny_data
    t = _trainer(target, data, str(tmp_path / "t"), "peagle", ["--depths", "3", "--mask-token", "4"])
    t.train_step(0)

    class TorchWithoutDevice:  # cod's torch, whose arange forgets the device it is given
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def arange(*s, device=None, **k):
            return torch.arange(*s, **k)
    monkeypatch.setattr(cod, "torch", TorchWithoutDevice())
    torch.set_default_device("meta")
    try:
        with pytest.raises((RuntimeError, NotImplementedError)):
            t.train_step(1)
    finally:
        torch.set_default_device(None)


def test_a_head_that_shares_the_target_embedding_stores_none_and_stays_lossless(tiny_data, tmp_path):
    from safetensors import safe_open

    from peagle.errors import PeagleError
    from peagle.heads.model import DrafterHead
    from peagle.models.llama import Transformer
    target, data, prompts = tiny_data
    out = str(tmp_path / "pe")
    _train(target, data, out, "peagle", 4, ["--depths", "3", "--mask-token", "4", "--share-embedding"])
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" not in f.keys() and "mask_hidden" in f.keys()
    t = Transformer.from_pretrained(target)
    with pytest.raises(PeagleError, match="shares the target's"):
        DrafterHead.from_pretrained(out, t.cfg)
    head = DrafterHead.from_pretrained(out, t.cfg, target_embed=t.embed)
    assert torch.equal(head.embed_tokens.weight, t.embed) and not head.embed_tokens.weight.requires_grad
    spec = {"method": "eagle3", "model": out, "num_speculative_tokens": 3, "parallel_drafting": True}
    ps = [{"prompt_token_ids": p} for p in prompts[:3]]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(target).generate(ps, sp)]
    assert [o.outputs[0].token_ids for o in LLM(target, speculative_config=spec).generate(ps, sp)] == ref
    # a warm start from it shares too
    _train(target, data, str(tmp_path / "pe2"), "peagle", 2, ["--depths", "3", "--mask-token", "4", "--init", out])
    with safe_open(os.path.join(str(tmp_path / "pe2"), "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" not in f.keys()


def test_start_up_line_says_why_auto_chose_the_head_dtype(tiny_data, tmp_path, capsys):
    """--dtype auto on a CPU: bfloat16 for the head exactly where the CPU has AMX-BF16, and the line says so."""
    from peagle.device import cpu_amx_bf16
    target, data, _ = tiny_data
    _train(target, data, str(tmp_path / "h"), "eagle3", 2, quiet=False)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("train eagle3:"))
    amx = cpu_amx_bf16()
    assert ("head compute bfloat16" in line) == amx and ("head compute float32" in line) == (not amx)
    assert ("auto: AMX-BF16 tiles" if amx else "auto: no AMX-BF16") in line


def test_ctrl_c_saves_the_step_and_resume_continues_without_duplicate_logs(tiny_data, tmp_path, monkeypatch,
                                                                          capsys):
    """A Ctrl-C (SIGINT to this process during step 4) lets that step finish, saves a checkpoint and the head,
    and says how to resume; a rerun without --resume is refused (it would start over on the checkpoint); with
    --resume it ends at the total, each step logged once."""
    import signal

    from peagle.cli import main
    from peagle.train.loop import Trainer
    target, data, _ = tiny_data
    out = str(tmp_path / "h")
    args = ["train", "--method", "eagle3", "--target", target, "--data", data, "--out", out, "--layers", "1",
            "--draft-vocab", "384", "--max-tokens", "192", "--steps", "8", "--log-every", "1", "--ckpt-every", "100",
            "--quiet", "--threads", "1"]
    step = Trainer.train_step

    def interrupted_step(self, s):
        r = step(self, s)
        if s == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return r
    monkeypatch.setattr(Trainer, "train_step", interrupted_step)
    assert main(args) == 130
    err = capsys.readouterr().err
    assert "stopped at step 4 of 8" in err and "--resume" in err
    assert torch.load(os.path.join(out, "checkpoint", "ckpt.pt"), weights_only=False)["step"] == 4
    assert os.path.isfile(os.path.join(out, "config.json"))               # a usable head at step 4
    monkeypatch.setattr(Trainer, "train_step", step)
    assert main(args) == 1 and "--resume continues it" in capsys.readouterr().err
    # a resume with another seed or batch would train other rows in another order: refused, naming them
    assert main(args + ["--resume", "--seed", "7", "--batch-rows", "2"]) == 1
    err = capsys.readouterr().err
    assert "--seed 7 (checkpoint: 0)" in err and "--batch-rows 2 (checkpoint: 1)" in err
    assert main(args + ["--resume", "--data", data + "," + data]) == 1
    assert "other documents" in capsys.readouterr().err
    assert main(args + ["--resume"]) == 0
    with open(os.path.join(out, "train_log.jsonl")) as f:
        steps = [json.loads(x)["step"] for x in f]
    assert steps == list(range(1, 9))


def test_the_learning_rate_warms_up_then_anneals_from_one_to_its_floor():
    """Trainer.lr_factor: 1.0 when warm-up ends, min_lr_ratio at the end, the cosine's midpoint halfway (a
    mutation review: the cosine run over the whole run, so lr jumped down after warm-up, passed every test)."""
    import math
    import types

    from peagle.train.loop import Trainer
    me = types.SimpleNamespace(warm=10, total=110, cfg=types.SimpleNamespace(min_lr_ratio=0.1))
    w = 10 / 110
    assert Trainer.lr_factor(me, 10, w) == pytest.approx(1.0)
    assert Trainer.lr_factor(me, 110, 1.0) == pytest.approx(0.1)
    assert Trainer.lr_factor(me, 60, w + (1 - w) / 2) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 2)) / 2)
    assert Trainer.lr_factor(me, 5, 5 / 110) < 1.0                          # still warming up


@pytest.mark.parametrize("key", ["max_tokens", "segment_len", "batch_rows", "lr", "warmup", "seed", "epochs",
                                 "method", "layers", "draft_vocab", "depths", "cod_r", "loss"])
def test_a_resume_with_other_data_order_or_schedule_is_refused(key):
    """A resumed run must be the run it continues: settings that change the head, the packing and order of the
    data or the schedule are refused, naming the flag (a mutation review: max_tokens left out of the checked
    keys let a resume with other packing through)."""
    from peagle.errors import PeagleError
    from peagle.train.resume import check_resume
    cfg = {k: 1 for k in ("method", "layers", "draft_vocab", "depths", "cod_r", "loss", "max_tokens",
                          "segment_len", "batch_rows", "epochs", "lr", "warmup", "seed")}
    ck = {"config": dict(cfg), "data": {"fingerprint": "f"}}
    check_resume(ck, dict(cfg), "f", "ckpt")                                   # the same run: fine
    with pytest.raises(PeagleError, match="--" + key.replace("_", "-")) as e:
        check_resume(ck, dict(cfg, **{key: 2}), "f", os.path.join("out", "checkpoint"))
    assert "--init out and a new --out" in str(e.value)                     # the way to go on from that head
