"""Head files: a head directory is ``config.json`` + ``model.safetensors`` (see :mod:`peagle.heads.format`).

Reading accepts sharded safetensors (``model.safetensors.index.json``), any ``*.safetensors`` and, as a
fallback, ``pytorch_model.bin``.  Nothing here converts or validates."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Mapping

import torch

from .format import CONFIG_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME


def read_config(path: str | os.PathLike) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / CONFIG_NAME
    with open(p) as f:
        return json.load(f)


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    d = Path(path)
    idx = d / WEIGHTS_INDEX_NAME
    if idx.exists():
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [d / f for f in files]
    if (d / WEIGHTS_NAME).exists():
        return [d / WEIGHTS_NAME]
    return sorted(d.glob("*.safetensors"))


def load_tensors(path: str | os.PathLike, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of an HF dir (single or sharded safetensors; pytorch_model.bin as a fallback)."""
    from safetensors import safe_open

    want = set(names) if names is not None else None
    out: dict[str, torch.Tensor] = {}
    files = safetensors_files(path)
    if files:
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    if want is None or k in want:
                        out[k] = sf.get_tensor(k)
        return out
    binf = Path(path) / "pytorch_model.bin"
    if binf.exists():
        sd = torch.load(binf, map_location="cpu", weights_only=True)
        return {k: v for k, v in sd.items() if want is None or k in want}
    raise FileNotFoundError(f"no model.safetensors (or *.safetensors / pytorch_model.bin) in {path}")


def load_head_dir(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, {name: tensor}) of a head directory, as stored (no conversion, no validation)."""
    p = Path(path)
    if not (p / CONFIG_NAME).exists():
        raise FileNotFoundError(f"{p / CONFIG_NAME} not found (a head dir holds config.json + model.safetensors)")
    return read_config(p), load_tensors(p)


def save_head_dir(path: str | os.PathLike, config: Mapping, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write config.json + model.safetensors (contiguous tensors, metadata format=pt)."""
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    with open(p / CONFIG_NAME, "w") as f:
        json.dump(dict(config), f, indent=2, sort_keys=False)
        f.write("\n")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(p / WEIGHTS_NAME),
              metadata={"format": "pt"})

