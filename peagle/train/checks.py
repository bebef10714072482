"""Checks the training-data commands (datagen, hidden-states, train) share, made before the target loads:
where a run may write (--out), that its data came from its target, and that a failed run leaves no empty
--out behind."""
from __future__ import annotations

import contextlib
import json
import os
import sys

from ..errors import PeagleError
from ..models.files import CONFIG_NAME, is_head_dir, read_config
from ..paths import REPO

# the config.json fields that tell two models apart (a copy of a model, or the same one by another path, agrees)
IDENTITY = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def check_out(out: str, target: str, flag: str = "--out") -> None:
    """A run's output directory: never a file, the target's directory, or another model's (a config.json that
    is not a head's: a head would replace its weights, data would lie among its files)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise PeagleError(f"{flag} {out} exists and is not a directory")
    if os.path.isdir(target) and os.path.isdir(out) and os.path.samefile(out, target):
        raise PeagleError(f"{flag} {out} is the target's directory")
    if os.path.isfile(os.path.join(out, CONFIG_NAME)) and not is_head_dir(out):
        raise PeagleError(f"{flag} {out} holds a model (its config.json is not a drafter head's): give another "
                          "directory")


@contextlib.contextmanager
def out_dir(out: str):
    """Around a run that creates `out` (and its missing parents): when the run fails, the directories it created
    and left empty are removed, so a failed run leaves nothing to clean up (a resumable one keeps its files)."""
    top, p = None, os.path.abspath(out)
    while not os.path.exists(p):
        top, p = p, os.path.dirname(p)
    try:
        yield
    except BaseException:
        if top is not None:
            p = os.path.abspath(out)
            while True:
                try:
                    os.rmdir(p)                   # only an empty directory
                except OSError:
                    break
                if p == top:
                    break
                p = os.path.dirname(p)
        raise


def recorded_model(data: str) -> str | None:
    """The target a data directory was made with: a datagen run's prompts.json settings.model, or a hidden-state
    cache's hidden_states.json model (None where it records none)."""
    for name, get in (("prompts.json", lambda j: j.get("settings", {}).get("model")),
                      ("hidden_states.json", lambda j: j.get("model"))):
        fn = os.path.join(data, name)
        if os.path.isfile(fn):
            try:
                with open(fn) as f:
                    return get(json.load(f))
            except (OSError, ValueError, AttributeError):
                return None
    return None


def model_identity(path: str) -> dict | None:
    """The defining config.json fields of a model directory (a multimodal one's text_config), or None where
    there is no config.json to read (a GGUF file, a directory gone)."""
    if not os.path.isfile(os.path.join(path, CONFIG_NAME)):
        return None
    try:
        cfg = read_config(path)
    except (OSError, ValueError):
        return None
    text = cfg.get("text_config") or {}
    return {k: cfg.get(k, text.get(k)) for k in IDENTITY}


def _locate(recorded: str) -> str | None:
    """The recorded model's path here: as written (absolute, or relative to the working directory), else
    relative to peagle's checkout (where peagle writes portable paths from)."""
    for p in (recorded, os.path.join(REPO, recorded)):
        if os.path.exists(p):
            return p
    return None


def check_data_model(data: str, target: str, flag: str, target_label: str | None = None) -> None:
    """PeagleError when a data directory (several: comma-separated) was made by another model than `target`:
    its token ids and states mean nothing to this target. Paths may differ (relative, absolute, a copy): the
    models' config.json fields decide. A recorded model that is no longer here is not checked (a note says so)."""
    for d in data.split(","):
        rec = recorded_model(d)
        if not rec:
            continue
        where = _locate(rec)
        if where is None:
            print(f"note: {d} was made by {rec}, not found here: not checked against {flag} {target}",
                  file=sys.stderr)
            continue
        if os.path.exists(target) and os.path.samefile(where, target):
            continue
        mine, theirs = model_identity(target), model_identity(where)
        if mine is None or theirs is None or mine == theirs:
            continue
        diff = ", ".join(f"{k} {theirs[k]} vs {mine[k]}" for k in IDENTITY if theirs[k] != mine[k])
        raise PeagleError(f"{d} was made by {rec}, but {flag} is {target_label or target} ({diff}): give "
                          f"{flag} {rec}, or data made by this target")
