"""Cleaning of the demo target's Python corpus.

Invariants: every function here is deterministic (no RNG, no clock), works on
text only, and never adds text that was not in the input file — it removes
(license headers, near-duplicate files) or extracts (function examples).

* :func:`strip_license_header` drops a leading ``#`` comment block or module
  docstring that is a license / copyright notice (it teaches the model nothing
  but boilerplate and is repeated verbatim across thousands of files);
* :func:`near_duplicates` finds files whose 3-line shingles overlap by a
  Jaccard similarity ≥ ``threshold`` (MinHash + LSH banding), so vendored
  copies and versioned forks of one file count once;
* :func:`function_examples` extracts functions with a docstring and a real
  body as stand-alone, dedented documents (``def f(...):\\n    \"\"\"doc\"\"\"\\n
  body``): the shape of HumanEval-style prompts, favoured in training by
  adding them beside the whole files.
"""

from __future__ import annotations

import ast
import hashlib
import re
import textwrap

import numpy as np

LICENSE_RE = re.compile(r"copyright|licen[sc]e|all rights reserved|permission is hereby granted|spdx", re.I)


def strip_license_header(text: str) -> str:
    """Remove a leading license comment block / license docstring (after an
    optional shebang and encoding line)."""
    lines = text.splitlines(keepends=True)
    head = []
    i = 0
    while i < len(lines) and i < 2 and (lines[i].startswith("#!") or re.match(r"#.*coding[:=]", lines[i])):
        head.append(lines[i])
        i += 1
    j = i
    while j < len(lines) and (lines[j].lstrip().startswith("#") or not lines[j].strip()):
        j += 1
    if j > i and LICENSE_RE.search("".join(lines[i:j])):
        return "".join(head + lines[j:])
    # A module docstring that is (mostly) a license notice.
    rest = "".join(lines[i:])
    m = re.match(r'\s*(?:[rRuU]?)("""|\'\'\')(.*?)\1[ \t]*\n', rest, re.S)
    if m and LICENSE_RE.search(m.group(2)) and len(LICENSE_RE.findall(m.group(2))) >= 2:
        return "".join(head) + rest[m.end():].lstrip("\n")
    return text


def _shingles(text: str, width: int = 3) -> np.ndarray:
    norm = [re.sub(r"\s+", " ", l).strip() for l in text.splitlines()]
    norm = [l for l in norm if l and not l.startswith("#")]
    if len(norm) < width:
        norm = norm + [""] * (width - len(norm))
    hs = {int.from_bytes(hashlib.blake2b("\n".join(norm[k:k + width]).encode(), digest_size=8).digest(), "little")
          for k in range(len(norm) - width + 1)}
    return np.fromiter(hs, dtype=np.uint64, count=len(hs))


def minhash(text: str, n_hash: int = 32, seed: int = 0) -> np.ndarray:
    """MinHash signature of ``text``'s 3-line shingles (``n_hash`` uint64)."""
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 2 ** 61 - 1, size=n_hash, dtype=np.uint64) | np.uint64(1)
    b = rng.integers(0, 2 ** 61 - 1, size=n_hash, dtype=np.uint64)
    sh = _shingles(text)
    with np.errstate(over="ignore"):
        return (sh[None, :] * a[:, None] + b[:, None]).min(axis=1)


def near_duplicates(texts: list[str], threshold: float = 0.8, bands: int = 8, n_hash: int = 32) -> set[int]:
    """Indices of texts that nearly duplicate an earlier one (estimated
    Jaccard similarity of their shingle sets ≥ ``threshold``)."""
    rows = n_hash // bands
    sigs = [minhash(t, n_hash) for t in texts]
    buckets: dict[tuple, list[int]] = {}
    dup: set[int] = set()
    for i, s in enumerate(sigs):
        cands = set()
        keys = [(band, s[band * rows:(band + 1) * rows].tobytes()) for band in range(bands)]
        for k in keys:
            cands.update(buckets.get(k, ()))
        if any(float((sigs[j] == s).mean()) >= threshold for j in cands):
            dup.add(i)
            continue
        for k in keys:
            buckets.setdefault(k, []).append(i)
    return dup


def function_examples(text: str, min_body_lines: int = 2, max_lines: int = 60) -> list[str]:
    """Stand-alone functions with a docstring and a body of at least
    ``min_body_lines`` statement lines (methods are dedented to column 0)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
            continue
        doc = ast.get_docstring(node, clean=False)
        if not doc or len(node.body) < 2 or node.end_lineno is None:
            continue
        first, last = node.lineno - 1, node.end_lineno
        if last - first > max_lines:
            continue
        body_start = node.body[1].lineno - 1
        if last - body_start < min_body_lines:
            continue
        src = textwrap.dedent("\n".join(lines[first:last]))
        if src.startswith(("def ", "async def ")):
            out.append(src + "\n")
    return out
