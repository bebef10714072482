"""Which implementation runs a target directory: ``native`` (peagle's own Llama-family kernels: llama, mistral,
qwen2, qwen3) or ``transformers`` (any AutoModelForCausalLM through :mod:`peagle.models.hf_target`).
``auto`` takes native where the config is one it runs exactly, transformers otherwise.  Both expose the same
target interface (cfg, new_cache, forward, final_logits, embed / lm_head / norm)."""
from __future__ import annotations

import os

from ..errors import PeagleError
from ..paths import missing_hint
from .config import ModelConfig
from .files import is_head_dir, safetensors_files
from .hf_target import HFTarget
from .llama import Transformer
from .quant import QUANTIZATIONS

BACKENDS = ("auto", "native", "transformers")


def native_refusal(path: str) -> str | None:
    """Why the native target cannot run this directory (None: it can): its config, or no safetensors weights
    (the transformers backend reads .bin checkpoints too)."""
    try:
        ModelConfig.from_dir(path)
    except PeagleError as e:
        return str(e)
    if not safetensors_files(path):
        return f"no *.safetensors weights in {path}"
    return None


def resolve_backend(path: str, backend: str = "auto") -> str:
    if backend not in BACKENDS:
        raise PeagleError(f"--target-backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if path.endswith(".gguf") and os.path.isfile(path):
        return "native" if backend == "auto" else backend  # a GGUF file: only the native target reads it
    if os.path.isfile(path):
        raise PeagleError(f"{path} is a file, not a model directory (give the directory that holds config.json, "
                          "or a .gguf file)")
    if is_head_dir(path):
        raise PeagleError(f"{path} is a drafter head, not a target model: give it as the speculative config's "
                          "\"model\" and the target it was trained for as the model")
    if backend != "auto":
        return backend
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise PeagleError(f"no config.json in {path}" if os.path.isdir(path)
                          else f"model directory not found: {path}{missing_hint(path)}")
    return "native" if native_refusal(path) is None else "transformers"


def resolve_quantization(path: str, quantization: str, kind: str, dtype, device) -> tuple[str, str]:
    """(quantization, why) for "auto": where the model IS a GGUF file's quantized blocks (a .gguf path, or a
    directory converted from one peagle can find, like the default target: its float32 weights are only their
    dequantization) and the C++ kernels run here with AVX2 on a float32 CPU target, those blocks with 8-bit
    activations (q4a8 / q8a8: the fastest plain decoding measured, docs/benchmarks/cpu-step.md); else "none"
    (float weights). Anything else is returned as given. why: what auto's choice means for this model, said at
    start-up ("" where there is nothing to say: explicit choices, and plain float weights running as they are)."""
    import torch

    from . import quant_ext
    from .gguf_target import block_family, source_gguf
    if quantization != "auto":
        return quantization, ""
    if kind != "native" or dtype != torch.float32 or torch.device(device).type != "cpu":
        return "none", ""                              # not a float32 native target on the CPU
    src = path if path.endswith(".gguf") else source_gguf(path)
    family = block_family(src) if src else None
    if family is None:
        return "none", ""                              # float weights: no quantized GGUF blocks behind it
    ext = quant_ext.get()
    if ext is None or not ext.has_avx2():
        return "none", (f"the C++ kernels do not run here ({quant_ext.why_not() or 'no AVX2'}); float32 weights, "
                        f"whose output differs from {family}a8's")
    return family + "a8", (f"{os.path.basename(src)}'s blocks with 8-bit activations: the fastest plain decoding "
                           "measured on AVX2 and AVX-512 CPUs")


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


def resolve_kv_cache_dtype(kv_cache_dtype: str, quantization: str, dtype) -> tuple[str, str]:
    """(the KV cache's element type, why auto chose it or ''): auto = bfloat16 for a target with 8-bit activations
    (q8a8 / q4a8: llama.cpp's arithmetic, whose own cache is 16-bit too; the extension's attention widens bfloat16
    keys and values exactly as it reads them), else the target's dtype ('auto' stays)."""
    import torch

    from .quant import quantizes_activations
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise PeagleError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto" and quantizes_activations(quantization) and dtype == torch.float32:
        return "bfloat16", ("an 8-bit-activation target: keys and values rounded to bfloat16, half the bytes each "
                            "step's attention reads; --kv-cache-dtype float32 keeps them in float32")
    return kv_cache_dtype, ""


def load_target(path: str, dtype=None, backend: str = "auto", device="cpu", quantization: str = "none",
                kv_cache_dtype: str = "auto"):
    """The target for an HF directory (or, native only, a GGUF file); raises PeagleError with the reason when the
    chosen backend cannot run it. quantization: none / q8 / q4 / q8a8 / q4a8 (native only: peagle/models/quant.py)
    or auto (resolve_quantization; a quantized choice is printed to stderr). kv_cache_dtype (vLLM's word): auto =
    bfloat16 for an 8-bit-activation target, else the target's dtype (resolve_kv_cache_dtype; a bfloat16 choice is
    printed to stderr); float32; bfloat16 (native only) stores keys and values rounded to bfloat16, half the bytes
    a float32 step's attention reads (every cache the target makes: plain and speculative decoding alike)."""
    import sys

    import torch

    from .quant import check_quantization
    dtype = dtype or torch.float32
    kind = resolve_backend(path, backend)
    if quantization == "auto":
        quantization, why = resolve_quantization(path, quantization, kind, dtype, device)
        if why:
            print(f"peagle: quantization auto -> {quantization} ({why})", file=sys.stderr, flush=True)
    quantization = check_quantization(quantization)
    kv_cache_dtype, kv_why = resolve_kv_cache_dtype(kv_cache_dtype, quantization, dtype)
    if kv_cache_dtype == "float32" and dtype != torch.float32:
        raise PeagleError(f"--kv-cache-dtype float32 needs a float32 target, not {str(dtype).replace('torch.', '')}")
    if kind == "native":
        if path.endswith(".gguf"):
            t = Transformer.from_gguf(path, dtype, device, quantization=quantization)
        else:
            why = native_refusal(path)
            if why is not None:
                raise PeagleError(f"{why}; --target-backend transformers runs any transformers causal LM")
            t = Transformer.from_pretrained(path, dtype, device, quantization=quantization)
        if kv_why:
            print(f"peagle: kv cache dtype auto -> {kv_cache_dtype} ({kv_why})", file=sys.stderr, flush=True)
        if kv_cache_dtype == "bfloat16" and dtype != torch.bfloat16:
            t.kv_dtype = torch.bfloat16
            t.precision += ", bfloat16 KV cache"      # what `peagle serve` and the bench reports print
        return t
    if quantization != "none":
        raise PeagleError(f"--quantization {quantization} needs the native target (Llama family)")
    if kv_cache_dtype == "bfloat16":
        raise PeagleError(f"--kv-cache-dtype {kv_cache_dtype} needs the native target (Llama family)")
    return HFTarget.from_pretrained(path, dtype, device)


def add_quantization_argument(p, default: str = "auto"):
    """--quantization for every command that runs a target (data and training commands default to none)."""
    p.add_argument("--quantization", choices=QUANTIZATIONS + ("auto",), default=default,
                   help="quantization of the native target's projections (vLLM's word): q8 = Q8_0, "
                        "q4 = Q4_1 blocks of 32 (a GGUF file's or the default target's Q4_0/Q4_1/Q8_0 blocks as "
                        "stored), activations float32; q8a8 / q4a8: the same weights, activations quantized to 8 "
                        "bits per block (llama.cpp's arithmetic); none = float weights; auto = q4a8 for a model that "
                        "is a GGUF file's Q4 blocks (the default target) where the C++ kernels run, else none "
                        f"(default: {default})")



def add_kv_cache_argument(p):
    """--kv-cache-dtype for the commands that decode (generate, serve, bench)."""
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the KV cache's element type (vLLM's option): auto = bfloat16 for an 8-bit-activation target "
                        "(q8a8, q4a8: the default target's auto quantization), else the target's dtype; bfloat16 = "
                        "keys and values rounded to bfloat16, half the bytes a long context's attention reads (native "
                        "target; outputs then differ from a float32 cache's; plain and speculative decoding still "
                        "agree); float32 keeps them in float32 (default: auto)")


def add_backend_argument(p):
    """--target-backend for every command that loads a target."""
    p.add_argument("--target-backend", choices=BACKENDS, default="auto",
                   help="target implementation: native (Llama family), transformers (any AutoModelForCausalLM), "
                        "auto = native where it applies (default)")
