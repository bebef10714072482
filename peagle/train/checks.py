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
from ..paths import find_portable

# the config.json fields that tell two models apart (a copy of a model, or the same one by another path, agrees)
IDENTITY = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def check_ranges(args, at_least_1=(), at_least_0=()) -> None:
    """PeagleError naming the first flag below its floor (a NaN too), before anything loads; a name `args` lacks
    is not checked."""
    for floor, names in ((1, at_least_1), (0, at_least_0)):
        for name in names:
            v = getattr(args, name, floor)
            if not v >= floor:
                raise PeagleError(f"--{name.replace('_', '-')} must be {'at least 1' if floor else '>= 0'}, got {v}")


def data_dir_problem(d: str) -> str | None:
    """Why `d` is not a data directory (missing, or a file: a shard or JSON given instead of its directory), or
    None."""
    if os.path.isdir(d):
        return None
    if os.path.exists(d):
        return f"--data {d} is a file: give the directory `peagle datagen` or `peagle hidden-states` wrote"
    return f"data directory not found: {d}"


def check_data_dirs(data: str) -> None:
    """PeagleError for the first of the comma-separated --data directories that is not one, before anything
    loads."""
    for d in data.split(","):
        if (why := data_dir_problem(d)) is not None:
            raise PeagleError(why)


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


def recorded(data: str) -> tuple[str | None, str | None, dict | None]:
    """What a data directory says made it: (kind, model path, model config fields). kind "tokens" for a datagen
    run (prompts.json), "states" for a hidden-state cache (hidden_states.json), None where neither is there;
    the fields (`model_config`, written since these checks exist) are None in older directories."""
    for kind, name, get in (("tokens", "prompts.json", lambda j: j.get("settings", {}).get("model")),
                            ("states", "hidden_states.json", lambda j: j.get("model"))):
        fn = os.path.join(data, name)
        if os.path.isfile(fn):
            try:
                with open(fn) as f:
                    j = json.load(f)
                return kind, get(j), j.get("model_config")
            except (OSError, ValueError, AttributeError):
                return None, None, None
    return None, None, None


def config_identity(cfg: dict) -> dict:
    """The fields of a config.json dict that tell two models apart (a multimodal one's from its text_config)."""
    text = cfg.get("text_config") or {}
    return {k: cfg.get(k, text.get(k)) for k in IDENTITY}


def model_identity(path: str) -> dict | None:
    """config_identity of a model directory, or None where there is no config.json to read (a GGUF file, a
    directory gone)."""
    if not os.path.isfile(os.path.join(path, CONFIG_NAME)):
        return None
    try:
        return config_identity(read_config(path))
    except (OSError, ValueError):
        return None


# what must agree with the target: a hidden-state cache holds that very model's states; token shards only need
# its tokenizer (the answers may come from another model of the family: --responses original, a larger sibling)
MUST_AGREE = {"states": IDENTITY, "tokens": ("vocab_size",)}


def check_data_model(data: str, target: str, flag: str, target_label: str | None = None,
                     data_flag: str = "--data") -> None:
    """PeagleError when a data directory (several: comma-separated) cannot serve `target`: a hidden-state cache
    of another model, or token ids of another tokenizer. The recorded config fields decide (else the recorded
    model's config.json, found by its path); where neither is here, a note says it was not checked."""
    mine = model_identity(target)
    for d in data.split(","):
        kind, rec, theirs = recorded(d)
        if kind is None or mine is None or not (rec or theirs):
            continue
        if theirs is None:
            where = find_portable(rec)
            if where is not None and os.path.exists(target) and os.path.samefile(where, target):
                continue
            theirs = model_identity(where) if where is not None else None
        if theirs is None:
            print(f"note: {d} was made by {rec}, whose config is not found here: not checked against {flag} "
                  f"{target}", file=sys.stderr)
            continue
        diff = ", ".join(f"{k} {theirs.get(k)} vs {mine[k]}" for k in MUST_AGREE[kind] if theirs.get(k) != mine[k])
        if not diff:
            continue
        what = "hidden states are another model's" if kind == "states" else "token ids are another tokenizer's"
        hint = (f"give {flag} {rec or 'the model that made it'}, or data made by this target"
                if data_flag == "--data" else f"give another {data_flag}")
        raise PeagleError(f"{d} was made by {rec or 'another model'} but {flag} is {target_label or target}: its "
                          f"{what} ({diff}); {hint}")
