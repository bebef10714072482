"""`peagle train-target`: train the demo target (its trainer owns the flags: peagle/demo_target/train.py)."""
from __future__ import annotations

from ..demo_target.train import main as train_main


def main(argv) -> int:
    return train_main(argv)
