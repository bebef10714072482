"""Head files: a head directory is ``config.json`` + ``model.safetensors`` (see :mod:`peagle.heads.format`),
read through :mod:`peagle.models.files` as every HF directory is.

Invariants: nothing here converts or validates.  Every write is atomic: a file is written under a temporary
name and renamed, and :func:`replace_head_dir` swaps a whole directory in one rename, so a reader never sees a
half-written head."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping

import torch

from ..models.files import CONFIG_NAME, WEIGHTS_NAME, load_tensors, open_permissions, read_config


def load_head_dir(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, {name: tensor}) of a head directory, as stored (no conversion, no validation)."""
    p = Path(path)
    if not (p / CONFIG_NAME).exists():
        raise FileNotFoundError(f"{p / CONFIG_NAME} not found (a head dir holds config.json + model.safetensors)")
    return read_config(p), load_tensors(p)


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_head_dir(path: str | os.PathLike, config: Mapping, tensors: Mapping[str, torch.Tensor],
                  sort_keys: bool = False) -> None:
    """Write model.safetensors (contiguous CPU tensors, metadata format=pt), then config.json, each atomically."""
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    sd, seen = {}, set()
    for k, v in tensors.items():
        t = v.detach().contiguous().cpu()
        ptr = t.untyped_storage().data_ptr()
        sd[k] = t.clone() if ptr in seen else t      # tied tensors (a .bin's shared storage): safetensors refuses
        seen.add(ptr)
    _atomic(p / WEIGHTS_NAME, lambda fn: save_file(sd, fn, metadata={"format": "pt"}))

    def write_config(fn):
        with open(fn, "w") as f:
            json.dump(dict(config), f, indent=2, sort_keys=sort_keys)
            f.write("\n")
    _atomic(p / CONFIG_NAME, write_config)


# config keys only a drafter head has (peagle's and vLLM's flat layout, the speculators layout); a target's
# config.json has none of them
HEAD_KEYS = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "eagle_config",
             "speculators_model_type", "speculators_config", "peagle")


def is_head_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a drafter head (its config.json has a head's keys): what may be replaced."""
    try:
        cfg = read_config(Path(path))
    except Exception:  # noqa: BLE001 - unreadable or missing: not a head
        return False
    return isinstance(cfg, dict) and any(k in cfg for k in HEAD_KEYS)


def check_head_out(out_dir: str | os.PathLike, overwrite: bool = True) -> None:
    """Raise FileExistsError unless ``out_dir`` may receive a head: absent, an empty directory, or (overwrite)
    a head directory. A target model's directory, any other non-empty one, or a file is never replaced."""
    out = Path(out_dir)
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if not any(out.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(f"{out} exists")
    if not is_head_dir(out):
        raise FileExistsError(f"{out} exists and is not a drafter head's directory (a model's, or other files); "
                              "refusing to replace it: give a new or empty directory")


def replace_head_dir(out_dir: str | os.PathLike, config: Mapping, tensors: Mapping[str, torch.Tensor],
                     overwrite: bool = True) -> None:
    """Write a head into a temporary directory beside ``out_dir``, then rename it into place; an existing
    ``out_dir`` is replaced only if it is a head directory or empty (check_head_out)."""
    out = Path(out_dir).resolve()                  # a symlink: the directory it names is replaced, the link kept
    check_head_out(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_head_dir(tmp, config, tensors)
        open_permissions(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
