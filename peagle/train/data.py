"""Training rows on disk: safetensors shards of variable-length documents (input_ids + loss_mask).

shard-NNNNN.safetensors: input_ids int32 [total], loss_mask uint8 [total], offsets int64 [docs+1];
metadata "info" = JSON (source of each doc).  A shard is written atomically (tmp + rename) so a
datagen run resumes by skipping the shards that exist."""
from __future__ import annotations

import bisect
import glob
import json
import math
import os
import random

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import PeagleError
from ..models.files import plain_mode
from .checks import data_dir_problem


def shard_path(out_dir: str, i: int) -> str:
    return os.path.join(out_dir, f"shard-{i:05d}.safetensors")


def write_shard(path: str, docs: list[tuple[list, list]], info: dict | None = None):
    ids = [t for d, _ in docs for t in d]
    mask = [m for _, ms in docs for m in ms]
    offs = [0]
    for d, _ in docs:
        offs.append(offs[-1] + len(d))
    tmp = path + ".tmp"
    save_file({"input_ids": torch.tensor(ids, dtype=torch.int32), "loss_mask": torch.tensor(mask, dtype=torch.uint8),
               "offsets": torch.tensor(offs, dtype=torch.int64)}, tmp,
              metadata={"info": json.dumps(info or {})})
    plain_mode(tmp)                               # safetensors writes 0600: readable like a plain file
    os.replace(tmp, path)


def read_shard(path: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with safe_open(path, "pt") as f:
        ids, mask, offs = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool(), f.get_tensor("offsets")
    return [(ids[offs[i]:offs[i + 1]], mask[offs[i]:offs[i + 1]]) for i in range(len(offs) - 1)]


MIN_SUPERVISED = 2     # a document with fewer supervised tokens trains nothing (and a 1-token row breaks a step)


def usable(doc: tuple[torch.Tensor, torch.Tensor], min_supervised: int = MIN_SUPERVISED) -> bool:
    """Whether a document (token ids, loss mask) has enough supervised tokens to train on."""
    return int(doc[1].sum()) >= min_supervised


def load_docs(data_dir: str, max_docs: int | None = None, min_supervised: int = MIN_SUPERVISED,
              counts: dict | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """All documents of a datagen directory, or of several given as "dir1,dir2" (shards in order); documents
    with < min_supervised assistant tokens are dropped. counts (if given) receives {"read", "skipped"}: the
    documents looked at and those dropped, for the CLI to say (skipped_note)."""
    files = []
    for d in data_dir.split(","):
        found = sorted(glob.glob(os.path.join(d, "shard-*.safetensors")))
        if not found:
            raise PeagleError(data_dir_problem(d) or f"no shard-*.safetensors in {d}")
        files += found
    return [d for _, d in take_usable((d for fn in files for d in read_shard(fn)), max_docs, min_supervised, counts)]


def take_usable(docs, max_docs: int | None = None, min_supervised: int = MIN_SUPERVISED,
                counts: dict | None = None) -> list[tuple[int, tuple]]:
    """(position, document) of the documents (an iterable, read lazily) with >= min_supervised supervised tokens,
    in order, at most max_docs (none read past the last one kept); counts (if given) receives {"read",
    "skipped"}, what skipped_note says."""
    kept, read = [], 0
    for i, d in enumerate(docs):
        read += 1
        if usable(d, min_supervised):
            kept.append((i, d))
        if max_docs and len(kept) >= max_docs:
            break
    if counts is not None:
        counts.update(read=read, skipped=read - len(kept))
    return kept


def skipped_note(read: int, skipped: int, min_supervised: int = MIN_SUPERVISED) -> str | None:
    """The line that says how many documents were left out as too short to train on (None if none were)."""
    if not skipped:
        return None
    return f"{skipped} of {read} documents skipped (< {min_supervised} generated tokens)"


def epoch_rows(lengths: list[int], max_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Deterministic packing of the documents (shuffled by seed+epoch) into rows of <= max_tokens tokens
    (longer documents are truncated to max_tokens and sit alone)."""
    order = list(range(len(lengths)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    rows, cur, used = [], [], 0
    for i in order:
        n = min(lengths[i], max_tokens)
        if cur and used + n > max_tokens:
            rows.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        rows.append(cur)
    return rows


class StepPlan:
    """Optimizer steps over epochs: epoch e packs its own rows (epoch_rows: seed + e) and takes
    max(1, rows // batch_rows) steps of batch_rows consecutive rows (a last partial batch is left out; an epoch
    of fewer rows than batch_rows is one step of them all). Epochs pack into different numbers of rows, so each
    epoch's first step is the sum of the steps before it."""

    def __init__(self, lengths: list[int], max_tokens: int, seed: int, batch_rows: int):
        self.lengths, self.max_tokens, self.seed, self.R = lengths, max_tokens, seed, batch_rows
        self.starts = [0]                      # starts[e]: the first step of epoch e
        self._rows: tuple[int | None, list] = (None, [])

    def rows(self, epoch: int) -> list[list[int]]:
        if self._rows[0] != epoch:
            self._rows = (epoch, epoch_rows(self.lengths, self.max_tokens, self.seed, epoch))
        return self._rows[1]

    def _extend(self) -> None:
        e = len(self.starts) - 1
        self.starts.append(self.starts[-1] + max(1, len(self.rows(e)) // self.R))

    def steps_for(self, epochs: float) -> int:
        """Optimizer steps in the first `epochs` epochs (a fraction of the last one rounded up)."""
        full = int(epochs)
        while len(self.starts) <= full + 1:
            self._extend()
        part = epochs - full                     # 2.2 - 2 = 0.2000000000000002: rounded before the ceiling
        return self.starts[full] + math.ceil(round(part * (self.starts[full + 1] - self.starts[full]), 9))

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, step within it)."""
        while self.starts[-1] <= step:
            self._extend()
        e = bisect.bisect_right(self.starts, step) - 1
        return e, step - self.starts[e]

    def step_rows(self, step: int) -> tuple[int, list[tuple[int, list[int]]]]:
        """(epoch, [(row index, doc ids)]) of one step's global batch."""
        e, p = self.locate(step)
        rows = self.rows(e)
        return e, [(i, rows[i]) for i in range(p * self.R, min((p + 1) * self.R, len(rows)))]
