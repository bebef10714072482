"""Text sources and prompt sets (everything read from outside the repository).

- corpus.py:     the demo target's training corpus (Python sources + ShareGPT chat) and its shared source readers
- benchmarks.py: benchmark prompts (MT-Bench, HumanEval, SPEED-style mix), also used to evaluate heads
"""
