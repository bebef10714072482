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

from ..models.files import CONFIG_NAME, WEIGHTS_NAME, load_tensors, read_config


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
    sd = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    _atomic(p / WEIGHTS_NAME, lambda fn: save_file(sd, fn, metadata={"format": "pt"}))

    def write_config(fn):
        with open(fn, "w") as f:
            json.dump(dict(config), f, indent=2, sort_keys=sort_keys)
            f.write("\n")
    _atomic(p / CONFIG_NAME, write_config)


def replace_head_dir(out_dir: str | os.PathLike, config: Mapping, tensors: Mapping[str, torch.Tensor],
                     overwrite: bool = True) -> None:
    """Write a head into a temporary directory beside ``out_dir``, then rename it into place; an existing
    ``out_dir`` is replaced only if it is a head directory (or empty)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_head_dir(tmp, config, tensors)
        if out.exists():
            if not overwrite:
                raise FileExistsError(f"{out} exists")
            if (out / CONFIG_NAME).exists() or not any(out.iterdir()):
                shutil.rmtree(out)
            else:
                raise FileExistsError(f"{out} exists and is not a head directory; refusing to replace it")
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
