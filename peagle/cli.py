"""`peagle` command line. Each subcommand lives in its own module, imported only when used:
the module exposes add_parser(subparsers), which registers a parser with set_defaults(func=handler)."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from .errors import PeagleError

COMMANDS = {
    "generate": ("peagle.generate_cmd", "generate text (plain or speculative), streaming to stdout"),
    "serve": ("peagle.server.cli", "OpenAI-compatible server (vLLM's --speculative-config)"),
    "bench": ("peagle.bench.cli", "benchmarks: baseline vs EAGLE-3 vs P-EAGLE"),
    "tune": ("peagle.tune_cmd", "measure this machine and write vLLM's num_speculative_tokens_per_batch_size"),
    "datagen": ("peagle.train.datagen", "regenerate assistant turns with the target (drafter training data)"),
    "hidden-states": ("peagle.train.hidden_states", "extract the target's hidden states for drafter training"),
    "train": ("peagle.train.cli", "train an EAGLE-3 or P-EAGLE drafter head"),
    "export": ("peagle.heads.export", "export a head in vLLM's flat or the speculators layout"),
    "import": ("peagle.heads.importer", "import a published head into peagle's layout"),
    "convert-gguf": ("peagle.models.gguf", "convert a Llama-family GGUF file into a Hugging Face directory"),
}


# commands whose module owns its whole argument parsing: main(argv) gets everything after the command name
PASSTHROUGH = {"train-target": "peagle.target.train", "eval-target": "peagle.target.evaluate_target"}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="peagle", description="Lossless speculative decoding with EAGLE-3 and P-EAGLE.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    for name in PASSTHROUGH:
        sub.add_parser(name, help=f"see `peagle {name} --help`")
    for name, (mod, help_) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_)
            continue
        m = importlib.import_module(mod)
        m.add_parser(sub)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    cmd = next((a for a in argv if not a.startswith("-")), None)
    if cmd in PASSTHROUGH:
        rest = argv[argv.index(cmd) + 1:]
        try:
            return int(importlib.import_module(PASSTHROUGH[cmd]).main(rest) or 0)
        except PeagleError as e:
            print(f"peagle: error: {e}", file=sys.stderr)
            return 1
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
        print("peagle: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
