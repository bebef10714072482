"""The files of an HF model directory (a target's or a head's): ``config.json`` and its tensors.  Every
reading of such a directory in peagle goes through here (the native target loader, heads, the demo target's
warm restart).

Invariants: reading accepts sharded safetensors (``model.safetensors.index.json``), ``model.safetensors``, any
``*.safetensors`` and ``pytorch_model.bin`` as a fallback (:func:`load_tensors`); nothing here converts,
validates or writes files (:func:`open_permissions` and :func:`plain_mode` only set finished files' modes)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def _umask() -> int:
    """The process's umask: read from /proc where Linux shows it (os.umask can only read it by setting it, and a
    thread creating a file in between would get mode 0666), else through os.umask."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0)
    os.umask(umask)
    return umask


def plain_mode(path: str | os.PathLike) -> None:
    """A file safetensors wrote (mode 0600): the mode a plain open would give under the process's umask, so
    another user (a vLLM server, a training job) can read it."""
    os.chmod(path, 0o666 & ~_umask())


def open_permissions(path: str | os.PathLike) -> None:
    """A directory written through tempfile.mkdtemp (mode 0700) and its files (safetensors writes 0600): the
    modes a plain mkdir / open would give under the process's umask, so a server run by another user (vLLM)
    can read what peagle wrote."""
    os.chmod(path, 0o777 & ~_umask())
    for f in os.scandir(path):
        if f.is_file(follow_symlinks=False):
            plain_mode(f.path)


# config keys only a drafter head has (peagle's and vLLM's flat layout, the speculators layout); a target's
# config.json has none of them
HEAD_KEYS = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "eagle_config",
             "speculators_model_type", "speculators_config", "peagle")


def is_head_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a drafter head (its config.json has a head's keys), not a target model."""
    try:
        cfg = read_config(Path(path))
    except Exception:  # noqa: BLE001 - unreadable or missing: not a head
        return False
    return isinstance(cfg, dict) and any(k in cfg for k in HEAD_KEYS)


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


def iter_safetensors(files: Iterable[Path], want: Callable[[str], bool] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the files whose name ``want`` accepts (all if None), as stored.
    Tensors are read one at a time, when reached."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if want is None or want(k):
                    yield k, sf.get_tensor(k)


def load_tensors(path: str | os.PathLike, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of an HF dir (single or sharded safetensors; pytorch_model.bin as a fallback)."""
    want = set(names) if names is not None else None
    files = safetensors_files(path)
    if files:
        return dict(iter_safetensors(files, None if want is None else want.__contains__))
    binf = Path(path) / "pytorch_model.bin"
    if binf.exists():
        sd = torch.load(binf, map_location="cpu", weights_only=True)
        return {k: v for k, v in sd.items() if want is None or k in want}
    raise FileNotFoundError(f"no model.safetensors (or *.safetensors / pytorch_model.bin) in {path}")
