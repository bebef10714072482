"""`peagle export` (vLLM flat + speculators layouts, peagle/heads/export.py) and the export / import CLI: round
trips, refusals that list every problem and keep what exists, notes on version-dependent fields."""
from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
from headfiles import MASK, NKV, H, V, head, make_config, make_tensors, same_tensors, write_head, write_target
from safetensors.torch import load_file

from peagle.cli import export as export_cli
from peagle.cli import import_ as import_cli
from peagle.heads.export import export_head
from peagle.heads.format import HeadValidationError, validate_head
from peagle.heads.importer import import_head
from peagle.heads.io import load_head_dir, save_head_dir


@pytest.fixture
def target(tmp_path):
    return write_target(tmp_path / "target")


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_vllm_export_import_round_trip(tmp_path, target, method, draft_vocab):
    src, cfg = head(tmp_path, method=method, draft_vocab=draft_vocab, max_position_embeddings=128,
                    mask_token_id=MASK if method == "peagle" else None)
    cfg.pop("mask_token_id")
    notes = []
    out = export_head(src, tmp_path / "vllm", "vllm", target_dir=target, notes=notes)
    ocfg, ots = load_head_dir(tmp_path / "vllm")
    assert ocfg == out
    assert ocfg["architectures"] == ["LlamaForCausalLMEagle3"] and ocfg["model_type"] == "llama"
    assert ocfg["max_position_embeddings"] == 1024  # raised to the target's
    assert "mask_token_id" not in ocfg
    assert ocfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert not any(k.startswith("model.") for k in ots)
    assert not any(f.startswith("tokenizer") for f in os.listdir(tmp_path / "vllm"))
    if method == "peagle":
        assert ocfg["ptd_token_id"] == ocfg["pard_token"] == MASK
        assert ots["mask_hidden"].shape == (1, 1, 3 * H)
    else:
        assert "mask_hidden" not in ots and "ptd_token_id" not in ocfg
    if draft_vocab is None:  # vLLM refuses d2t on a full-vocabulary head
        assert "d2t" not in ots and "t2d" not in ots
    else:
        assert ots["d2t"].dtype == torch.int64 and ots["t2d"].dtype == torch.bool
    assert validate_head(ocfg, ots, json.load(open(os.path.join(target, "config.json")))) == []

    icfg, its = import_head(tmp_path / "vllm", tmp_path / "native", target_dir=target)
    same_tensors(its, load_file(os.path.join(src, "model.safetensors")))
    for k, v in cfg.items():
        if k not in ("max_position_embeddings", "peagle"):
            assert icfg[k] == v, k
    assert icfg["peagle"]["method"] == method


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_speculators_export_fields_and_round_trip(tmp_path, target, method):
    src, cfg = head(tmp_path, method=method, layers=1)
    out = export_head(src, tmp_path / "spec", "speculators", target_dir=target, num_speculative_tokens=7)
    on_disk = json.load(open(tmp_path / "spec" / "config.json"))
    assert on_disk == out
    par = method == "peagle"
    assert out["speculators_model_type"] == ("peagle" if par else "eagle3")
    assert out["architectures"] == (["PEagleSpeculator"] if par else ["Eagle3Speculator"])
    assert out["norm_before_residual"] is False  # explicit: the eagle3 speculators default is True
    assert out["draft_vocab_size"] == V and out["target_hidden_size"] == H
    assert out["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    tl = out["transformer_layer_config"]
    assert tl["model_type"] == "llama" and tl["hidden_size"] == H and tl["num_hidden_layers"] == 1
    assert tl["vocab_size"] == V and tl["num_key_value_heads"] == NKV and tl["rope_theta"] == 10000.0
    assert "ptd_token_id" not in tl and "eagle_aux_hidden_state_layer_ids" not in tl
    sc = out["speculators_config"]
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 7}]
    assert sc["verifier"]["name_or_path"] == os.path.realpath(target)
    assert sc["verifier"]["architectures"] == ["LlamaForCausalLM"]
    if par:
        assert out["mask_token_id"] == MASK
    else:
        assert "mask_token_id" not in out
    icfg, its = import_head(tmp_path / "spec", None, target_dir=target)
    same_tensors(its, load_file(os.path.join(src, "model.safetensors")))
    assert icfg["peagle"]["method"] == method and icfg["peagle"]["train_depths"] == 4
    assert icfg.get("ptd_token_id") == (MASK if par else None)
    assert icfg["num_hidden_layers"] == 1 and icfg["norm_before_residual"] is False


def _refused(tmp_path, target, cfg, ts, needle):
    src = write_head(tmp_path / "bad", cfg, ts)
    out = tmp_path / "out"
    for fmt in ("vllm", "speculators"):
        with pytest.raises(HeadValidationError) as e:
            export_head(src, out, fmt, target_dir=target)
        assert needle in str(e.value)
        assert not out.exists()  # nothing written
    return str(e.value)


def test_export_refuses_missing_mask_hidden(tmp_path, target):
    cfg = make_config()
    ts = make_tensors(cfg)
    del ts["mask_hidden"]
    _refused(tmp_path, target, cfg, ts, "missing tensor mask_hidden")


def test_export_refuses_wrong_aux_ids(tmp_path, target):
    cfg = make_config(aux=(1, 2, 8))
    msg = _refused(tmp_path, target, cfg, make_tensors(cfg), "out of range")
    assert "4 layers" in msg


def test_export_refuses_wrong_fc_and_vocab_and_unknown(tmp_path, target):
    cfg = make_config(vocab_size=V + 1)
    ts = make_tensors(make_config())
    ts["fc.weight"] = torch.zeros(H, H)
    ts["extra.bias"] = torch.zeros(2)
    msg = _refused(tmp_path, target, cfg, ts, "fc.weight")
    assert "!= target vocab_size" in msg and "unknown tensor extra.bias" in msg
    assert "embed_tokens.weight has shape" in msg  # [V, H] vs vocab V+1


def test_export_lists_every_problem_at_once(tmp_path, target):
    cfg = make_config(aux=(1, 2, 9))
    ts = make_tensors(cfg)
    del ts["mask_hidden"], ts["norm.weight"]
    with pytest.raises(HeadValidationError) as e:
        export_head(write_head(tmp_path / "bad", cfg, ts), tmp_path / "o", target_dir=target)
    assert len(e.value.problems) == 3
    assert "3 problem(s)" in str(e.value)


def test_export_keeps_existing_dir_when_refused(tmp_path, target):
    good, _ = head(tmp_path, "good")
    export_head(good, tmp_path / "o", target_dir=target)
    cfg = make_config()
    ts = make_tensors(cfg)
    del ts["mask_hidden"]
    with pytest.raises(HeadValidationError):          # even when asked to replace it
        export_head(write_head(tmp_path / "bad", cfg, ts), tmp_path / "o", target_dir=target, overwrite=True)
    assert "mask_hidden" in load_head_dir(tmp_path / "o")[1]


def test_export_drops_conflicting_mask_token_id(tmp_path):
    src, _ = head(tmp_path, mask_token_id=MASK + 2)
    notes = []
    out = export_head(src, tmp_path / "o", notes=notes)
    assert "mask_token_id" not in out and out["ptd_token_id"] == MASK
    assert any("conflicting mask_token_id" in n for n in notes)


def test_speculators_export_needs_a_verifier(tmp_path):
    src, _ = head(tmp_path)
    with pytest.raises(HeadValidationError, match="--target"):
        export_head(src, tmp_path / "o", "speculators")


def _cli(argv):
    ap = argparse.ArgumentParser(prog="peagle")
    sp = ap.add_subparsers(dest="cmd", required=True)
    export_cli.add_parser(sp)
    import_cli.add_parser(sp)
    a = ap.parse_args(argv)
    return a.func(a)


def test_cli_export_import(tmp_path, target, capsys):
    src, _ = head(tmp_path)
    assert _cli(["export", src, str(tmp_path / "v"), "--target", target, "-k", "5"]) == 0
    out = capsys.readouterr().out
    assert "vllm serve" in out and '"parallel_drafting": true' in out and '"num_speculative_tokens": 5' in out
    assert _cli(["export", src, str(tmp_path / "s"), "--format", "speculators", "--target", target]) == 0
    assert json.load(open(tmp_path / "s" / "config.json"))["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"] == 4  # the head's train_depths
    assert _cli(["import", str(tmp_path / "s"), str(tmp_path / "n"), "--target", target]) == 0
    assert "method=peagle" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["export", "import"])
def test_cli_refusal_exit_code(tmp_path, target, capsys, command):
    """An invalid head: exit status 2 (docs/vllm-parity.md), every problem listed, in peagle's error format
    (`peagle: error: ...`, as every other command's; it was a bare `error: ...`)."""
    cfg = make_config(aux=(1, 2, 9))
    src = write_head(tmp_path / "bad", cfg, make_tensors(cfg))
    assert _cli([command, src, str(tmp_path / "o"), "--target", target]) == 2
    err = capsys.readouterr().err
    assert err.startswith("peagle: error: ") and "out of range" in err and "nothing written" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("k", ["0", "-1", "33", "99", "x"])
def test_cli_export_checks_k_as_a_flag(tmp_path, target, capsys, k):
    """-k 0 was reported as an invalid head ("num_speculative_tokens must be a positive integer") and -k 99 was
    written, though peagle and its spec config cap K at 32: now argparse refuses the flag by name."""
    src, _ = head(tmp_path)
    with pytest.raises(SystemExit) as e:
        _cli(["export", src, str(tmp_path / "o"), "--target", target, "-k", k])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "-k/--num-speculative-tokens" in err and "1..32" in err and "not a valid" not in err, err
    assert not (tmp_path / "o").exists()
    assert _cli(["export", src, str(tmp_path / "o"), "--target", target, "-k", "32"]) == 0


def test_export_notes_version_dependent_aux_ids(tmp_path, target):
    src, _ = head(tmp_path, aux=(2, 3, 4))  # 4 = last layer output of the 4-layer target: vLLM 0.32+ only
    notes = []
    export_head(src, tmp_path / "o", target_dir=target, notes=notes)
    assert any("0..L" in n for n in notes)


def test_peagle_cli_entry_point(tmp_path, target, capsys):
    from peagle.cli import main
    src, _ = head(tmp_path)
    assert main(["export", src, str(tmp_path / "o"), "--format", "speculators", "--target", target, "-k", "2"]) == 0
    assert main(["import", str(tmp_path / "o"), str(tmp_path / "n")]) == 0
    pb = load_head_dir(tmp_path / "n")[0]["peagle"]
    assert pb["train_depths"] == 4 and pb["num_speculative_tokens"] == 2  # trained depth kept, serving K recorded


def test_written_directories_get_the_umasks_modes(tmp_path, target):
    """Heads and conversions are written through tempfile.mkdtemp (0700) and safetensors (0600): under umask
    022 an exported head was unreadable to any other user (a vLLM server run as another one). Now 0755 / 0644,
    and under umask 077 still private."""
    import stat
    src, _ = head(tmp_path, method="peagle", mask_token_id=MASK)
    old = os.umask(0o022)
    try:
        export_head(src, tmp_path / "v1", "vllm", target_dir=target)
        os.umask(0o077)
        export_head(src, tmp_path / "v2", "vllm", target_dir=target)
    finally:
        os.umask(old)
    for d, dmode, fmode in ((tmp_path / "v1", 0o755, 0o644), (tmp_path / "v2", 0o700, 0o600)):
        assert stat.S_IMODE(os.stat(d).st_mode) == dmode
        assert {stat.S_IMODE(os.stat(d / f).st_mode) for f in os.listdir(d)} == {fmode}


def test_export_refuses_a_k_outside_1_to_32(tmp_path, target):
    """A bad num_speculative_tokens is the caller's argument, not a fault of the head (ValueError, not
    HeadValidationError); 33 was accepted."""
    src, _ = head(tmp_path)
    for k in (0, -1, 33, True):
        with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in 1\.\.32") as e:
            export_head(src, tmp_path / "o", target_dir=target, num_speculative_tokens=k)
        assert not isinstance(e.value, HeadValidationError)
        assert not (tmp_path / "o").exists()


def test_export_and_import_replace_a_head_only_when_asked(tmp_path, target):
    """Both replaced an existing head silently (a training run's checkpoint/ and log with it): now only with
    overwrite=True, and never the source head itself, even through a symlink."""
    src, _ = head(tmp_path)
    for name, write in (("export", lambda out, **kw: export_head(src, out, target_dir=target, **kw)),
                        ("import", lambda out, **kw: import_head(src, out, target_dir=target, **kw))):
        out = tmp_path / name
        write(out)
        (out / "train_log.jsonl").write_text("{}\n")
        with pytest.raises(FileExistsError, match=r"--force, overwrite=True in Python, replaces it"):
            write(out)
        assert (out / "train_log.jsonl").exists()
        write(out, overwrite=True)
        assert not (out / "train_log.jsonl").exists() and load_head_dir(out)[1]
    (tmp_path / "link").symlink_to(src)
    before = sorted(os.listdir(src))
    for out in (src, tmp_path / "link", tmp_path):
        with pytest.raises(FileExistsError, match="source head"):
            export_head(src, out, target_dir=target, overwrite=True)
        with pytest.raises(FileExistsError, match="source head"):
            import_head(src, out, target_dir=target, overwrite=True)
    assert sorted(os.listdir(src)) == before


def test_save_head_dir_gives_the_umasks_modes(tmp_path):
    """save_head_dir (what `peagle train` saves a head with) wrote model.safetensors through safetensors (0600):
    a vLLM server run as another user could not read a freshly trained head. Now a plain open()'s modes."""
    import stat
    cfg = make_config()
    ts = make_tensors(cfg)
    old = os.umask(0o022)
    try:
        save_head_dir(tmp_path / "a", cfg, ts)
        os.umask(0o027)
        save_head_dir(tmp_path / "b", cfg, ts)
    finally:
        os.umask(old)
    for d, mode in ((tmp_path / "a", 0o644), (tmp_path / "b", 0o640)):
        for f in ("model.safetensors", "config.json"):
            assert stat.S_IMODE(os.stat(d / f).st_mode) == mode, (d, f)


def test_reexport_keeps_the_served_k_not_the_trained_depth(tmp_path, target):
    """A head served with K = 2 (speculators export), imported back, keeps both its trained depth (4) and its
    served K; exported again without -k it is served with K = 2, as before, not with its depth."""
    src, _ = head(tmp_path)
    export_head(src, tmp_path / "s", "speculators", target_dir=target, num_speculative_tokens=2)
    import_head(tmp_path / "s", tmp_path / "n")
    out = export_head(tmp_path / "n", tmp_path / "s2", "speculators", target_dir=target)
    assert out["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
