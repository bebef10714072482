"""`peagle convert-gguf`: a Llama-family GGUF file -> a standard Hugging Face directory (config.json,
tokenizer files with the chat template, generation_config.json, float32 model.safetensors).

Who does what: the `gguf` package reads and dequantizes the file; transformers' GGUF loader maps llama.cpp's
tensor names to HF names and undoes llama.cpp's permutation of the q/k projection rows; peagle only checks,
writes and records. Invariants:
  * nothing is written unless the whole conversion succeeds: the directory is built next to OUT and renamed
    into place (an existing OUT is refused unless --force);
  * the result is deterministic (same GGUF -> byte-identical model.safetensors), so its sha256 can be pinned;
  * only architectures peagle's native target runs exactly are accepted (llama, mistral, qwen2, qwen3)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

from ..errors import PeagleError
from .files import open_permissions

NATIVE_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def _read(path: str):
    """(config, tokenizer, HF-named float32 tensors) of a GGUF file; PeagleError on anything unreadable."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    if not os.path.isfile(path):
        raise PeagleError(f"GGUF file not found: {path}")
    d, name = os.path.split(os.path.abspath(path))
    try:
        cfg = AutoConfig.from_pretrained(d, gguf_file=name)
    except Exception as e:  # noqa: BLE001 - the readers raise many types (ValueError, struct/numpy, hub validation)
        why = " ".join(str(e).split())[:300]
        raise PeagleError(f"{path} is not a readable GGUF model file ({type(e).__name__}: {why})") from None
    if cfg.model_type not in NATIVE_TYPES:
        raise PeagleError(f"{path}: architecture {cfg.model_type!r} is not supported by convert-gguf "
                          f"(supported: {', '.join(NATIVE_TYPES)})")
    try:
        tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
        with torch.device("meta"):                      # only its parameter names: nothing is allocated
            skeleton = AutoModelForCausalLM.from_config(cfg)
        tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    except Exception as e:  # noqa: BLE001 - as above
        why = " ".join(str(e).split())[:300]
        raise PeagleError(f"{path}: its tensors could not be read ({type(e).__name__}: {why})") from None
    expected = {k for k in skeleton.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(expected - set(tensors))
    if missing:
        raise PeagleError(f"{path} lacks {len(missing)} tensors the model needs (first: {missing[0]})")
    bad = [k for k in expected if tuple(tensors[k].shape) != tuple(skeleton.state_dict()[k].shape)]
    if bad:
        raise PeagleError(f"{path}: tensor {bad[0]} has shape {tuple(tensors[bad[0]].shape)}, the config says "
                          f"{tuple(skeleton.state_dict()[bad[0]].shape)}")
    return cfg, tok, {k: tensors[k].float().contiguous() for k in sorted(expected)}


def check_replaceable(path: str, out: str) -> None:
    """--force replaces a model's directory (config.json) or an empty one, never one holding the GGUF file being
    converted, nor a file."""
    if not os.path.isdir(out):
        raise PeagleError(f"{out} exists and is not a directory")
    if os.path.commonpath([os.path.abspath(path), os.path.abspath(out)]) == os.path.abspath(out):
        raise PeagleError(f"{out} holds {os.path.basename(path)}, the file being converted: write elsewhere")
    if os.listdir(out) and not os.path.isfile(os.path.join(out, "config.json")):
        raise PeagleError(f"{out} is not a model directory (no config.json): --force replaces only a model's")


def convert(path: str, out: str, force: bool = False) -> dict:
    """Convert; returns {"gguf_sha256", "safetensors_sha256", "tensors", "parameters"}."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig
    out = out.rstrip("/")
    if os.path.exists(out):
        if not force:
            raise PeagleError(f"{out} exists (use --force to replace it)")
        check_replaceable(path, out)
    cfg, tok, tensors = _read(path)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    try:
        cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
        for k in ("_name_or_path", "_model_name_or_path"):   # the GGUF's internal name, not a path of ours
            cfg.__dict__.pop(k, None)
        cfg.save_pretrained(tmp)
        GenerationConfig.from_model_config(cfg).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        st = os.path.join(tmp, "model.safetensors")
        save_file(tensors, st, metadata={"format": "pt"})
        info = {"gguf_sha256": sha256_file(path), "safetensors_sha256": sha256_file(st), "tensors": len(tensors),
                "parameters": sum(t.numel() for t in tensors.values())}
        with open(os.path.join(tmp, "conversion.json"), "w") as f:
            json.dump({"source": os.path.basename(path), **info}, f, indent=1)
        open_permissions(tmp)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info
