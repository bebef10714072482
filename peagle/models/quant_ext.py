"""The C++ kernels of peagle/csrc/ (quantized linears, fused small ops; shipped with the package): built once by
`make setup` or `peagle setup` (this module's `main`) through torch.utils.cpp_extension into build/peagle_quant/
under peagle's home (paths.HOME: the checkout, when peagle runs from one), loaded from there at run time.
Nothing is compiled implicitly at import: without a build (or with PEAGLE_QUANT_EXT=0), :func:`get` returns None
and peagle/models/quant.py's torch fallback runs.

A build records a hash of its sources, flags and torch version; a stale build (sources changed since) is not
loaded (the set-up command rebuilds it)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys

from ..paths import HOME, SETUP_COMMAND

NAME = "peagle_quant"
CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
SOURCES = ("bindings.cpp", "ops.cpp", "quant_scalar.cpp", "quant_avx2.cpp", "quant_a8_avx2.cpp",
           "quant_a8_vnni256.cpp", "quant_avx512.cpp", "quant_f_avx512.cpp", "quant_amx.cpp", "attend_generic.cpp",
           "attend_avx2.cpp", "attend_avx512.cpp", "draft_kl_avx2.cpp", "draft_kl_avx512.cpp", "train_attn_avx512.cpp",
           "train_scores_amx.cpp", "transpose_avx512.cpp", "train_ops_avx512.cpp")
# compiled inside bindings.cpp (one translation unit for the files that include torch's headers), and headers
BINDING_SOURCES = ("quant.cpp", "forward.cpp", "argmax.cpp", "draft_pass.cpp", "draft_kl.cpp", "train_attn.cpp",
                   "train_ops.cpp", "transpose.cpp")
HEADERS = BINDING_SOURCES + (
    "ops.h", "quant_kernels.h", "quant_avx2_inline.h", "quant_a8_ymm.h", "quant_avx512_inline.h", "attend_impl.h",
    "attend_blocked.h",
    "exp16_inline.h", "exp1_inline.h", "exp_consts.h", "draft_kl.h", "bf16_inline.h", "train_attn.h", "transpose.h",
    "train_ops.h", "amx_inline.h")
BUILD_DIR = os.path.join(HOME, "build", NAME)
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")   # no contraction: the kernels' fma are explicit
LDFLAGS = ("-fopenmp",)
STAMP = "peagle-build.json"

_mod = None
_why: str | None = None
_tried = False


def source_hash() -> str:
    import torch
    h = hashlib.sha256()
    for f in SOURCES + HEADERS:
        with open(os.path.join(CSRC, f), "rb") as fh:
            h.update(f.encode() + b"\0" + fh.read())
    h.update(" ".join(CFLAGS + LDFLAGS).encode() + torch.__version__.encode())
    return h.hexdigest()


def build(verbose: bool = False):
    """Compile (ninja, the system C++ compiler) and load; returns the module. Raises on a failed build."""
    from torch.utils.cpp_extension import load
    os.makedirs(BUILD_DIR, exist_ok=True)
    mod = load(name=NAME, sources=[os.path.join(CSRC, f) for f in SOURCES], extra_cflags=list(CFLAGS),
               extra_ldflags=list(LDFLAGS), build_directory=BUILD_DIR, verbose=verbose)
    with open(os.path.join(BUILD_DIR, STAMP), "w") as f:
        json.dump({"sources_sha256": source_hash()}, f)
    return mod


def _load():
    if os.environ.get("PEAGLE_QUANT_EXT", "1") == "0":
        return None, "disabled by PEAGLE_QUANT_EXT=0"
    so = os.path.join(BUILD_DIR, NAME + ".so")
    stamp = os.path.join(BUILD_DIR, STAMP)
    if not (os.path.isfile(so) and os.path.isfile(stamp)):
        return None, f"not built (`{SETUP_COMMAND}` builds it)"
    try:
        with open(stamp) as f:
            if json.load(f).get("sources_sha256") != source_hash():
                return None, f"its build is stale (peagle/csrc/ changed since: `{SETUP_COMMAND}` rebuilds it)"
        import torch  # noqa: F401 - the extension links against torch's libraries
        spec = importlib.util.spec_from_file_location(NAME, so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod, None
    except Exception as e:  # noqa: BLE001 - any failure to load means: use the fallback
        return None, f"failed to load ({type(e).__name__}: {e})"


def get():
    """The loaded extension module, or None (then :func:`why_not` says why)."""
    global _mod, _why, _tried
    if not _tried:
        _mod, _why = _load()
        _tried = True
    return _mod


def avx512():
    """The loaded extension when this CPU runs its AVX-512 paths (the training kernels' only path), else None."""
    m = get()
    return m if m is not None and m.has_avx512() else None


def why_not() -> str | None:
    get()
    return _why


def describe() -> str:
    """One line for start-up messages: which kernels run."""
    m = get()
    if m is None:
        return f"torch fallback (C++ kernels {why_not()})"
    kind = "AVX-512+VNNI, AVX2+FMA" if m.has_avx512() else "AVX2+FMA" if m.has_avx2() else "scalar"
    if m.has_amx():
        kind = "AMX-INT8, " + kind
    return f"C++ kernels ({kind})"


def main(argv=None) -> int:
    """`make setup`'s and `peagle setup`'s build step: build (or find current) and say which vector paths the CPU
    has; a failed build is a warning and exit status 0 (the torch fallback runs)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        m = build(verbose="-v" in argv)
        print(f"built {NAME} into {BUILD_DIR} (AVX2: {m.has_avx2()}, "
              f"AVX-512: {m.has_avx512()}, AMX: {m.has_amx()})")
    except Exception as e:  # noqa: BLE001 - a failed build is a warning: the torch fallback runs
        print(f"warning: the C++ kernels did not build ({type(e).__name__}: {str(e)[-2000:]}); "
              "peagle uses its torch fallback for quantized weights", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
