"""Head files: a head directory is ``config.json`` + ``model.safetensors`` (see :mod:`peagle.heads.format`),
read through :mod:`peagle.models.files` as every HF directory is.

Invariants: nothing here converts or validates.  Every write is atomic: a file is written under a temporary
name and renamed, and :func:`replace_head_dir` swaps a whole directory in one rename, so a reader never sees a
half-written head.  Files get the modes a plain open() gives under the umask (a vLLM server run as another user
reads them).  An existing head is replaced only when asked (``overwrite``), and never by itself."""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Mapping

import torch

from ..models.files import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    is_head_dir,
    load_tensors,
    open_permissions,
    plain_mode,
    read_config,
    safetensors_files,
)


class NotAHeadError(ValueError):
    """The directory given as a head holds a target model (a causal LM), not a drafter head."""


def _existing_dir(path: str | os.PathLike) -> Path:
    """path as a Path; FileNotFoundError if absent, NotADirectoryError if a file (a head is a directory)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist")
    if not p.is_dir():
        raise NotADirectoryError(f"{p} is not a directory (a head dir holds config.json + model.safetensors)")
    return p


def load_head_dir(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, {name: tensor}) of a head directory, as stored (no conversion, no validation)."""
    p = _existing_dir(path)
    if not (p / CONFIG_NAME).exists():
        raise FileNotFoundError(f"{p / CONFIG_NAME} not found (a head dir holds config.json + model.safetensors)")
    return read_config(p), load_tensors(p)


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(str(tmp))
        plain_mode(tmp)                   # safetensors writes 0600: a head is read by vLLM, maybe as another user
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


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_head_src(path: str | os.PathLike) -> None:
    """Raise unless ``path`` may be read as a head: FileNotFoundError (absent), NotADirectoryError (a file),
    NotAHeadError (a target model: a config without a head's keys over weights of several decoder layers), so
    that the error names the mistake rather than listing the tensors a head lacks."""
    p = _existing_dir(path)
    if is_head_dir(p) or not (p / CONFIG_NAME).is_file():
        return
    try:
        from safetensors import safe_open
        layers = set()
        for f in safetensors_files(p):
            with safe_open(str(f), framework="pt") as sf:     # the header only: no tensor is read
                layers.update(int(m.group(1)) for k in sf.keys() if (m := _LAYER.search(k)))
        cfg = read_config(p)
    except Exception:  # noqa: BLE001 - unreadable: left to load_head_dir's own error
        return
    if len(layers) > 1:
        arch = ", ".join(cfg.get("architectures") or []) if isinstance(cfg, dict) else ""
        raise NotAHeadError(f"{p} holds a model{f' ({arch})' if arch else ''} with {len(layers)} decoder layers, "
                            "not a drafter head: give the head's directory (--target takes the model)")


def check_head_out(out_dir: str | os.PathLike, overwrite: bool = False, src: str | os.PathLike | None = None
                   ) -> None:
    """Raise FileExistsError unless ``out_dir`` may receive a head: absent, an empty directory, or (overwrite)
    a head directory. Never the source head ``src`` itself (after symlinks) or a directory holding it, a
    target model's directory, any other non-empty one, or a file."""
    out = Path(out_dir)
    if src is not None:
        o, s = out.resolve(), Path(src).resolve()
        if o == s:
            raise FileExistsError(f"{out} is the source head itself: give another output directory")
        if o in s.parents:
            raise FileExistsError(f"{out} holds the source head {src}: give another output directory")
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if not any(out.iterdir()):
        return
    if not is_head_dir(out):
        raise FileExistsError(f"{out} exists and is not a drafter head's directory (a model's, or other files); "
                              "refusing to replace it: give a new or empty directory")
    if not overwrite:
        raise FileExistsError(f"{out} exists (--force, overwrite=True in Python, replaces it)")


def replace_head_dir(out_dir: str | os.PathLike, config: Mapping, tensors: Mapping[str, torch.Tensor],
                     overwrite: bool = False) -> None:
    """Write a head into a temporary directory beside ``out_dir``, then rename it into place; an existing
    non-empty ``out_dir`` is replaced only if it is a head directory and ``overwrite`` (check_head_out)."""
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
