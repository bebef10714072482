"""`peagle` command line: one module per subcommand in this package, named after it (``peagle hidden-states``
-> ``peagle/cli/hidden_states.py``; a Python keyword gets a trailing underscore: ``import`` -> ``import_.py``),
imported only when used.  A module holds the command's argument parsing and dispatch only; what the command
does lives with its concept (peagle/server/, peagle/bench/, peagle/train/, peagle/heads/, ...).

A module exposes add_parser(subparsers), which registers a parser with set_defaults(func=handler).  The demo
target's trainer and evaluator are lab code, not subcommands: ``python -m lab.demo_target.train`` / ``.evaluate_target``."""
from __future__ import annotations

import argparse
import importlib
import keyword
import os
import sys

from ..errors import PeagleError

COMMANDS = {
    "generate": "generate text (plain or speculative), streaming to stdout",
    "serve": "OpenAI-compatible server (vLLM's --speculative-config)",
    "bench": "benchmarks: baseline vs EAGLE-3 vs P-EAGLE",
    "tune": "measure this machine and write vLLM's num_speculative_tokens_per_batch_size",
    "datagen": "regenerate assistant turns with the target (drafter training data)",
    "hidden-states": "extract the target's hidden states for drafter training",
    "train": "train an EAGLE-3 or P-EAGLE drafter head",
    "export": "export a head in vLLM's flat or the speculators layout",
    "import": "import a published head into peagle's layout",
    "convert-gguf": "convert a Llama-family GGUF file into a Hugging Face directory",
    "setup": "build the C++ kernels and convert the default target (what `make setup` does)",
}


def int_arg(x: str, lo: int, hi: int | None = None) -> int:
    """An integer flag's value in lo..hi (hi None: no bound), else argparse's one-line error naming the flag:
    checked at the command line, before any model loads."""
    try:
        v = int(x)
    except ValueError:
        v = None
    if v is None or v < lo or (hi is not None and v > hi):
        raise argparse.ArgumentTypeError(f"an integer {'>= %d' % lo if hi is None else f'in {lo}..{hi}'}, got {x!r}")
    return v


def module_name(command: str) -> str:
    """The module of a subcommand: its name with '-' -> '_' (a Python keyword gets a trailing '_')."""
    name = command.replace("-", "_")
    return f"{__name__}.{name}_" if keyword.iskeyword(name) else f"{__name__}.{name}"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    from .. import __version__
    ap = argparse.ArgumentParser(prog="peagle", description="Lossless speculative decoding with EAGLE-3 and P-EAGLE.")
    ap.add_argument("--version", action="version", version=f"peagle {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_ in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_)
            continue
        importlib.import_module(module_name(name)).add_parser(sub)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    cmd = next((a for a in argv if not a.startswith("-")), None)
    ap = build_parser(cmd if cmd in COMMANDS else None)
    args = ap.parse_args(argv)
    if not getattr(args, "func", None):
        ap.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except PeagleError as e:
        print(f"peagle: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\npeagle: interrupted", file=sys.stderr)
        return 130
