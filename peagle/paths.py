"""Paths as written into artifacts that ship (head configs, benchmark results, recorded commands).

Invariant: never an absolute path of the machine that wrote it.  A path under the working directory or under
the repository is written relative to it; any other path as ``<external>/NAME``."""
from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the checkout (site-packages when installed)
# peagle runs from its checkout (the Makefile beside the package), not from an installed copy
CHECKOUT = os.path.isfile(os.path.join(REPO, "Makefile")) and os.path.isfile(os.path.join(REPO, "pyproject.toml"))
# Where peagle keeps what it converts, builds and caches (models/: the default target beside the shipped heads;
# build/: the C++ kernels; bench-out/.cache): the checkout when peagle runs from one (its tracked models/ and
# Makefile stamps are there), else $PEAGLE_HOME, else ~/.cache/peagle (an installed package never writes into
# site-packages). Made absolute and put back into the environment, so processes started elsewhere agree.
USER_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                          "peagle")           # $XDG_CACHE_HOME/peagle, else ~/.cache/peagle
if CHECKOUT:
    HOME = REPO
else:
    HOME = os.path.abspath(os.path.expanduser(os.environ.get("PEAGLE_HOME") or USER_CACHE))
    os.environ["PEAGLE_HOME"] = HOME
# The command that prepares HOME (the default target, the kernels), for messages.
SETUP_COMMAND = "make setup" if CHECKOUT else "peagle setup"


def portable_path(path: str | os.PathLike | None) -> str | None:
    if path is None:
        return None
    p = os.path.abspath(path)
    for base in (os.getcwd(), REPO):
        r = os.path.relpath(p, base)
        if r != ".." and not r.startswith(".." + os.sep):
            return r
    return f"<external>/{os.path.basename(p)}"


def find_portable(path: str) -> str | None:
    """A path portable_path wrote, found here: as written (absolute, or relative to the working directory), else
    relative to peagle's checkout; None where it names nothing here (an <external>/NAME among them)."""
    for p in (path, os.path.join(REPO, path)):
        if os.path.exists(p):
            return p
    return None


def missing_hint(path: str | None) -> str:
    """For a relative path that names nothing from the working directory but does under peagle's home (the
    shipped heads, the default target: `models/...` typed outside the checkout), a hint naming the path that
    exists; else ""."""
    if not path or os.path.isabs(path) or os.path.exists(path):
        return ""
    there = os.path.join(HOME, path)
    if not os.path.exists(there):
        return ""
    return f"; relative paths are read from the working directory: did you mean {there}?"


def portable_paths(paths: str) -> str:
    """A comma-separated list of paths (e.g. --data a,b), each made portable."""
    return ",".join(portable_path(p) for p in paths.split(","))


def portable_settings(settings: dict, path_keys, drop=()) -> dict:
    """A run's settings (e.g. ``vars(args)``) for a results file: the values under ``path_keys`` made portable,
    the keys in ``drop`` left out."""
    return {k: portable_path(v) if k in path_keys else v
            for k, v in settings.items() if k not in drop}
