"""`peagle convert-gguf FILE OUT`: a Llama-family GGUF file into a Hugging Face directory (the conversion:
peagle/models/gguf.py)."""
from __future__ import annotations

import argparse

from ..models import gguf
from ..models.gguf import convert


def add_parser(sub):
    p = sub.add_parser("convert-gguf", help="convert a Llama-family GGUF file into a Hugging Face directory",
                       description=gguf.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="the .gguf file")
    p.add_argument("out", help="output directory (written atomically)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=run)


def run(a):
    info = convert(a.file, a.out, a.force)
    print(f"wrote {a.out}: {info['tensors']} tensors, {info['parameters'] / 1e6:.1f} M parameters (float32); "
          f"sha256 gguf {info['gguf_sha256'][:16]}…, safetensors {info['safetensors_sha256'][:16]}…")
    return 0
