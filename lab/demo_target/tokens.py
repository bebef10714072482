"""Token data of the demo-target trainer: the corpus tokenized once into uint16 memmaps, packed rows of
``seq`` tokens, the interleaved code/chat row order, held-out rows and the held-out loss.

Invariants: every document is followed by token 0 (EOS, also the separator) and the stream starts with one;
the row order is a pure function of (row counts, seed) — code and chat rows alternate while both last — so
a resumed run sees exactly the rows an uninterrupted one would; held-out rows come only from the held-out
split (documents never in training).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from peagle.data.corpus import read_jsonl_texts

from .tokenizer import EOS_ID

SOURCES = ("code", "chat")


# ----------------------------------------------------------------- data
def tokenize_corpus(corpus_dir: Path, tok_dir: Path, out_dir: Path, log=print) -> dict[str, Path]:
    """Tokenize every ``{source}.{split}.jsonl`` into ``{source}.{split}.bin``
    (uint16; a 0 before and after each document)."""
    from tokenizers import Tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    tk = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    paths = {}
    for src in SOURCES:
        for split in ("train", "heldout"):
            name = f"{src}.{split}"
            dst = out_dir / f"{name}.bin"
            paths[name] = dst
            if dst.exists():
                continue
            t0 = time.time()
            tmp = dst.with_suffix(".tmp")
            n = 0
            with open(tmp, "wb") as f:
                f.write(np.array([EOS_ID], dtype=np.uint16).tobytes())
                n += 1
                batch: list[str] = []

                def flush():
                    nonlocal n
                    for enc in tk.encode_batch(batch, add_special_tokens=False):
                        ids = np.asarray(enc.ids + [EOS_ID], dtype=np.uint16)
                        f.write(ids.tobytes())
                        n += len(ids)
                    batch.clear()

                for text in read_jsonl_texts(corpus_dir / f"{name}.jsonl"):
                    batch.append(text)
                    if len(batch) >= 256:
                        flush()
                flush()
            os.replace(tmp, dst)
            log(f"tokenized {name}: {n:,} tokens in {time.time() - t0:.0f}s")
    return paths


def load_tokens(path: Path) -> np.ndarray:
    return np.memmap(path, dtype=np.uint16, mode="r")


def row_order(n_rows: dict[str, int], seed: int) -> np.ndarray:
    """Interleave shuffled code and chat rows: array of (source_idx, row_idx)."""
    rng = np.random.default_rng(seed)
    perms = [rng.permutation(n_rows[s]) for s in SOURCES]
    m = min(len(p) for p in perms)
    inter = np.empty((2 * m, 2), dtype=np.int64)
    inter[0::2, 0], inter[0::2, 1] = 0, perms[0][:m]
    inter[1::2, 0], inter[1::2, 1] = 1, perms[1][:m]
    rest = [np.stack([np.full(len(p) - m, i), p[m:]], 1) for i, p in enumerate(perms)]
    return np.concatenate([inter] + rest)


def get_rows(tokens: list[np.ndarray], order: np.ndarray, start: int, count: int, seq: int):
    import torch

    rows = []
    for k in range(start, start + count):
        s, r = order[k % len(order)]
        rows.append(np.asarray(tokens[s][r * seq:(r + 1) * seq], dtype=np.int64))
    return torch.from_numpy(np.stack(rows))


def heldout_rows(tokens: np.ndarray, n_rows: int, seq: int) -> np.ndarray:
    """Up to ``n_rows`` evenly spaced 512-token rows of a held-out stream."""
    total = len(tokens) // seq
    idx = np.linspace(0, total - 1, num=min(n_rows, total)).astype(np.int64)
    return np.stack([np.asarray(tokens[i * seq:(i + 1) * seq], dtype=np.int64) for i in idx])


# ---------------------------------------------------------------- eval
def eval_loss(model, rows: np.ndarray, device, batch: int = 16) -> float:
    import torch

    model.eval()
    tot, cnt = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(rows), batch):
            x = torch.from_numpy(rows[i:i + batch]).to(device)
            logits = model(input_ids=x).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
            tot += loss.item()
            cnt += x[:, 1:].numel()
    model.train()
    return tot / cnt


def unigram_loss(train_counts: np.ndarray, rows: np.ndarray) -> float:
    """Cross-entropy (nats) of the add-one-smoothed training unigram distribution
    on the same predicted tokens as :func:`eval_loss`."""
    p = (train_counts + 1.0) / (train_counts.sum() + len(train_counts))
    return float(-np.log(p[rows[:, 1:].reshape(-1)]).mean())
