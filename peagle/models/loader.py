"""Which implementation runs a target directory: ``native`` (peagle's own Llama-family kernels: llama, mistral,
qwen2, qwen3) or ``transformers`` (any AutoModelForCausalLM through :mod:`peagle.models.hf_target`).
``auto`` takes native where the config is one it runs exactly, transformers otherwise.  Both expose the same
target interface (cfg, new_cache, forward, final_logits, embed / lm_head / norm)."""
from __future__ import annotations

import os

from ..errors import PeagleError
from .config import ModelConfig
from .hf_target import HFTarget
from .llama import Transformer

BACKENDS = ("auto", "native", "transformers")


def native_refusal(path: str) -> str | None:
    """Why the native target cannot run this directory (None: it can)."""
    try:
        ModelConfig.from_dir(path)
    except PeagleError as e:
        return str(e)
    return None


def resolve_backend(path: str, backend: str = "auto") -> str:
    if backend not in BACKENDS:
        raise PeagleError(f"--target-backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend != "auto":
        return backend
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise PeagleError(f"no config.json in {path}" if os.path.isdir(path) else f"model directory not found: {path}")
    return "native" if native_refusal(path) is None else "transformers"


def load_target(path: str, dtype=None, backend: str = "auto", device="cpu"):
    """The target for an HF directory; raises PeagleError with the reason when the chosen backend cannot run it."""
    import torch
    dtype = dtype or torch.float32
    kind = resolve_backend(path, backend)
    if kind == "native":
        why = native_refusal(path)
        if why is not None:
            raise PeagleError(f"{why}; --target-backend transformers runs any transformers causal LM")
        return Transformer.from_pretrained(path, dtype, device)
    return HFTarget.from_pretrained(path, dtype, device)



def add_backend_argument(p):
    """--target-backend for every command that loads a target."""
    p.add_argument("--target-backend", choices=BACKENDS, default="auto",
                   help="target implementation: native (Llama family), transformers (any AutoModelForCausalLM), "
                        "auto = native where it applies (default)")
