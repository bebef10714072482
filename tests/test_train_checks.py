"""The training-data checks (peagle/train/checks.py) called directly, for what the CLI tests do not reach: a NaN
flag, every one of several --data directories, out_dir's clean-up after Ctrl-C and its limits (never a directory
it did not create), data or a target whose JSON cannot be read (no check, no traceback), a multimodal config's
identity from its text_config."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from headfiles import target_config, write_target

from peagle.errors import PeagleError
from peagle.train.checks import (
    IDENTITY,
    check_data_dirs,
    check_data_model,
    check_ranges,
    config_identity,
    model_identity,
    out_dir,
    recorded,
)


def test_check_ranges_refuses_nan_and_skips_names_args_lacks():
    """`--lr nan` parses as a float and compares False with everything: refused as below its floor, not passed
    through; a name the args object does not have is not checked (one list serves several commands)."""
    with pytest.raises(PeagleError, match="--lr must be >= 0, got nan"):
        check_ranges(SimpleNamespace(lr=float("nan")), at_least_0=("lr",))
    with pytest.raises(PeagleError, match="--max-tokens must be at least 1, got nan"):
        check_ranges(SimpleNamespace(max_tokens=float("nan")), at_least_1=("max_tokens",))
    check_ranges(SimpleNamespace(lr=0.0, steps=1), at_least_1=("steps", "epochs"), at_least_0=("lr", "max_docs"))


def test_check_data_dirs_checks_every_comma_separated_directory(tmp_path):
    """--data a,b: a missing (or file) directory after the first one is named before anything loads, not found
    later by the loader."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    check_data_dirs(f"{tmp_path / 'a'},{tmp_path / 'b'}")
    with pytest.raises(PeagleError, match=f"data directory not found: {tmp_path / 'nope'}"):
        check_data_dirs(f"{tmp_path / 'a'},{tmp_path / 'nope'}")
    (tmp_path / "f.json").write_text("{}")
    with pytest.raises(PeagleError, match="is a file: give the directory"):
        check_data_dirs(f"{tmp_path / 'a'},{tmp_path / 'b'},{tmp_path / 'f.json'}")


def test_out_dir_removes_only_what_it_created_also_after_ctrl_c(tmp_path):
    """A run stopped by Ctrl-C (KeyboardInterrupt, not an Exception) leaves no empty --out either; an empty
    directory that existed before the run (a parent of --out) is never removed, nor a created one the run wrote
    into; the exception goes on to the caller."""
    (tmp_path / "keep").write_text("")                           # the walk up would stop here at the latest
    (tmp_path / "pre").mkdir()                                   # empty, there before: kept
    out = tmp_path / "pre" / "new" / "sub"
    with pytest.raises(KeyboardInterrupt):
        with out_dir(str(out)):
            out.mkdir(parents=True)
            raise KeyboardInterrupt
    assert sorted(os.listdir(tmp_path)) == ["keep", "pre"] and os.listdir(tmp_path / "pre") == []
    with pytest.raises(RuntimeError, match="boom"):
        with out_dir(str(out)):
            out.mkdir(parents=True)
            (out / "shard-00000.safetensors").write_bytes(b"")   # a resumable run's file: kept
            raise RuntimeError("boom")
    assert os.listdir(out) == ["shard-00000.safetensors"]


def test_unreadable_records_and_configs_are_not_checked_and_do_not_crash(tmp_path, capsys):
    """A prompts.json / hidden_states.json that is not JSON, or not an object, or names no model, and a target
    whose config.json is not JSON: nothing to compare, so no check and no note (the loader reports what is
    broken), rather than a traceback from the check."""
    target = write_target(tmp_path / "target")
    cases = {"prompts.json": ["{not json", "[1, 2]", json.dumps({"items": []})],
             "hidden_states.json": ["{not json", "[1, 2]", json.dumps({"format": "speculators-hs"})]}
    for name, texts in cases.items():
        for i, text in enumerate(texts):
            d = tmp_path / f"{name}-{i}"
            d.mkdir()
            (d / name).write_text(text)
            kind, rec, theirs = recorded(str(d))
            assert rec is None and theirs is None, (name, text)
            check_data_model(str(d), target, "--target")
    assert capsys.readouterr().err == ""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert model_identity(str(broken)) is None
    data = tmp_path / "data"
    data.mkdir()
    (data / "hidden_states.json").write_text(json.dumps({"model": target, "model_config": model_identity(target)}))
    check_data_model(str(data), str(broken), "--target")


def test_a_multimodal_config_is_identified_by_its_text_config(tmp_path):
    """A multimodal model (Gemma 3, Mistral 3) keeps vocab_size, hidden_size, the layer and head counts in its
    text_config: those are its identity, so its data is compared with a text-only copy of it (or refused
    against another model); a top-level field wins over the text_config's."""
    text = target_config()
    mm = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
          "text_config": dict(text, model_type="gemma3_text")}
    ident = config_identity(mm)
    assert ident["model_type"] == "gemma3" and ident["architectures"] == mm["architectures"]
    for k in IDENTITY[2:]:
        assert ident[k] == text[k], k
    target = write_target(tmp_path / "mm")
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(mm, f)
    other = dict(text, vocab_size=text["vocab_size"] + 1)
    data = tmp_path / "data"
    data.mkdir()
    (data / "prompts.json").write_text(json.dumps({"settings": {"model": "<external>/x"}, "model_config":
                                                   config_identity(other)}))
    with pytest.raises(PeagleError, match="another tokenizer's .*vocab_size"):
        check_data_model(str(data), target, "--target")
    (data / "prompts.json").write_text(json.dumps({"settings": {"model": "<external>/x"}, "model_config":
                                                   config_identity(text)}))
    check_data_model(str(data), target, "--target")
