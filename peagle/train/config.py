"""TrainConfig: everything one drafter training run reads, in one typed object.

Built once from the CLI (`TrainConfig.from_namespace`), read by the training loop as `cfg.<field>`, and saved
in every checkpoint (`asdict`), so a resumed run can say what it was started with. Defaults are the CLI's."""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields

from ..errors import PeagleError
from .checks import check_ranges


@dataclass
class TrainConfig:
    method: str                              # "eagle3" | "peagle"
    target: str
    data: str                                # datagen shards (comma-separated dirs) or a hidden-state cache
    out: str
    target_backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"                      # a dtype other than float32: the head's autocast compute dtype
    # the head
    layers: int = 1
    intermediate_size: int | None = None
    draft_vocab: int | None = 4096           # None: the full vocabulary
    aux_ids: list | None = None
    mask_token: int | None = None
    share_embedding: bool = False
    init: str | None = None
    init_from_eagle3: str | None = None
    # the objective
    depths: int = 8                          # P-EAGLE parallel depths
    ttt_steps: int = 7                       # EAGLE-3 test-time-training unroll
    decay: float = 0.8
    ttt_keep: float = 1.0                    # EAGLE-3: fraction continued per unroll step (keep^k; 1 = all)
    loss: str = "kl"                         # "kl" to the target's distribution | "hard" on the drafted token
    cod_r: float = 0.7
    cod_rmin: float = 0.2
    segment_len: int = 1024    # P-EAGLE anchors per segment: fewer segments cost less CPU (train-cost.md)
    # data and schedule
    max_tokens: int = 2048
    batch_rows: int = 1
    epochs: float = 1.0
    steps: int = 0
    max_minutes: float = 0.0
    max_docs: int | None = None
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: float = 0.03
    weight_decay: float = 0.0
    clip: float = 1.0
    seed: int = 0
    # running
    save_dtype: str = "fp32"
    threads: int = 0
    feature_cache: str | None = None
    ckpt_every: int = 50
    log_every: int = 10
    resume: bool = False
    quiet: bool = False
    kill_at_step: int = 0                    # test hook: exit after this step's checkpoint

    @classmethod
    def from_namespace(cls, a: argparse.Namespace) -> "TrainConfig":
        """From `peagle train`'s parsed flags; flags the config has no field for are an error."""
        names = {f.name for f in fields(cls)}
        extra = set(vars(a)) - names - {"func", "command"}
        if extra:
            raise TypeError(f"TrainConfig has no field for {sorted(extra)}")
        cfg = cls(**{k: v for k, v in vars(a).items() if k in names})
        if cfg.draft_vocab == 0:
            cfg.draft_vocab = None
        cfg.max_docs = cfg.max_docs or None
        cfg.check()
        return cfg

    def check(self) -> None:
        """PeagleError naming the first flag out of its range (before anything loads)."""
        check_ranges(self, ("layers", "depths", "ttt_steps", "max_tokens", "batch_rows", "log_every"),
                     ("lr", "steps", "max_minutes", "warmup", "weight_decay", "clip", "threads", "segment_len",
                      "ckpt_every"))
        if self.max_docs is not None and self.max_docs < 0:
            raise PeagleError(f"--max-docs must be >= 0 (0 = all), got {self.max_docs}")
        if not (self.epochs > 0 or self.steps > 0):
            raise PeagleError(f"--epochs must be > 0 (or --steps given), got {self.epochs}: nothing would be trained")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise PeagleError(f"--draft-vocab must be >= 1 (0: the full vocabulary), got {self.draft_vocab}")
        for name in ("min_lr_ratio", "ttt_keep"):
            if not 0 <= getattr(self, name) <= 1:
                raise PeagleError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return asdict(self)
