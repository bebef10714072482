"""Head files (peagle/heads/io.py) read and written directly: what save_head_dir puts on disk (safetensors
metadata, key order, non-contiguous tensors), that a failed write leaves no temporary file or directory behind
and keeps what was there, which directories check_head_src / check_head_out / replace_head_dir accept, and the
errors that name a wrong path."""
from __future__ import annotations

import json
import os

import pytest
import torch
from headfiles import make_config, make_tensors, same_tensors, target_config, write_head
from safetensors import safe_open
from safetensors.torch import save_file

from peagle.heads.io import (
    NotAHeadError,
    check_head_out,
    check_head_src,
    load_head_dir,
    replace_head_dir,
    save_head_dir,
)


def _model_dir(path, layers: int, prefix: str = "model.", **cfg) -> str:
    """A directory with a config.json without a head's keys and one weight per decoder layer."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(target_config(num_hidden_layers=layers, **cfg), f)
    save_file({f"{prefix}layers.{i}.mlp.up_proj.weight": torch.zeros(2, 2) for i in range(layers)} |
              {"fc.weight": torch.zeros(2, 4)}, os.path.join(path, "model.safetensors"))
    return str(path)


def test_saved_weights_carry_pt_metadata_and_config_key_order(tmp_path):
    """transformers (and vLLM through it) refuse a model.safetensors without metadata format=pt; a trained head
    is saved with sorted config keys (DrafterHead.save), a converted one keeps the order it was given; the file
    ends with a newline."""
    cfg = make_config()
    ts = make_tensors(cfg)
    save_head_dir(tmp_path / "a", cfg, ts)
    with safe_open(str(tmp_path / "a" / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    text = (tmp_path / "a" / "config.json").read_text()
    assert text.endswith("}\n") and list(json.loads(text)) == list(cfg)
    save_head_dir(tmp_path / "b", cfg, ts, sort_keys=True)
    text = (tmp_path / "b" / "config.json").read_text()
    assert list(json.loads(text)) == sorted(cfg) != list(cfg)
    c, t = load_head_dir(tmp_path / "b")
    assert c == cfg
    same_tensors(t, ts)


def test_non_contiguous_tensors_are_saved(tmp_path):
    """safetensors refuses a non-contiguous tensor (a transposed weight, a slice of a fused one): save_head_dir
    makes each contiguous, and the values read back are the ones given."""
    cfg = make_config()
    ts = make_tensors(cfg)
    w = torch.randn(3 * 32, 32, generator=torch.Generator().manual_seed(1))
    ts["fc.weight"] = w.T                                   # [H, 3H], not contiguous
    ts["norm.weight"] = torch.randn(32, 2)[:, 0]            # a strided slice
    assert not ts["fc.weight"].is_contiguous() and not ts["norm.weight"].is_contiguous()
    save_head_dir(tmp_path / "h", cfg, ts)
    same_tensors(load_head_dir(tmp_path / "h")[1], ts)


def test_a_failed_write_leaves_no_temporary_files_and_keeps_the_old_head(tmp_path):
    """A write that fails half-way (here a config value JSON cannot hold) must leave neither a `.NAME.tmp` file
    in the head directory nor a `.OUT.tmp-*` directory beside it, and the head already there stays readable."""
    cfg = make_config()
    ts = make_tensors(cfg)
    out = tmp_path / "out"
    save_head_dir(out, cfg, ts)
    bad = dict(cfg, not_json={1, 2})                        # a set: json.dump fails after the file is opened
    with pytest.raises(TypeError):
        save_head_dir(out, bad, ts)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert load_head_dir(out)[0] == cfg
    with pytest.raises(TypeError):
        replace_head_dir(out, bad, ts, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"] and load_head_dir(out)[0] == cfg


def test_replace_head_dir_replaces_only_when_asked_and_makes_parents(tmp_path):
    """replace_head_dir is the Python API's last guard: an existing head is replaced only with overwrite=True
    (whoever calls it without check_head_out first); a new output directory's missing parents are created."""
    cfg = make_config()
    ts = make_tensors(cfg)
    out = tmp_path / "a" / "b" / "head"
    replace_head_dir(out, cfg, ts)
    assert load_head_dir(out)[0] == cfg
    (out / "train_log.jsonl").write_text("{}\n")
    cfg2 = make_config(method="eagle3")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        replace_head_dir(out, cfg2, make_tensors(cfg2))
    assert (out / "train_log.jsonl").exists() and load_head_dir(out)[0] == cfg
    replace_head_dir(out, cfg2, make_tensors(cfg2), overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"] and load_head_dir(out)[0] == cfg2


def test_a_file_or_a_directory_without_config_is_named_as_such(tmp_path):
    """A head is a directory: a file given as one (its model.safetensors, its config.json) is NotADirectoryError
    saying so, not '.../config.json not found'; a directory without config.json says which file is missing."""
    cfg = make_config()
    src = write_head(tmp_path / "h", cfg, make_tensors(cfg))
    f = os.path.join(src, "model.safetensors")
    for call in (load_head_dir, check_head_src):
        with pytest.raises(NotADirectoryError, match="is not a directory"):
            call(f)
    os.remove(os.path.join(src, "config.json"))
    with pytest.raises(FileNotFoundError, match=r"config\.json not found \(a head dir holds"):
        load_head_dir(src)


def test_check_head_src_refuses_a_model_of_several_layers_only(tmp_path):
    """A target model (a config without a head's keys, weights of several decoder layers: two are enough) is
    NotAHeadError; a one-layer directory without a head's keys (an EAGLE-1 style head, whose config is a plain
    Llama one) is still read as a head."""
    with pytest.raises(NotAHeadError, match="2 decoder layers"):
        check_head_src(_model_dir(tmp_path / "two", 2))
    check_head_src(_model_dir(tmp_path / "one", 1, prefix=""))
    check_head_src(_model_dir(tmp_path / "one-prefixed", 1))


def test_check_head_out_refuses_a_dangling_symlink(tmp_path):
    """A symlink to nothing is not an absent output directory: writing through it would create a head wherever
    the link points. Refused, as a file is; an absent or empty directory is accepted."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError, match="not a directory"):
        check_head_out(link)
    check_head_out(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    check_head_out(tmp_path / "empty")
