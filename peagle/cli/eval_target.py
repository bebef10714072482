"""`peagle eval-target`: evaluate a demo target (its evaluator owns the flags: peagle/demo_target/evaluate_target.py)."""
from __future__ import annotations

from ..demo_target.evaluate_target import main as evaluate_main


def main(argv) -> int:
    return evaluate_main(argv)
