"""Text sources and prompt sets (everything read from outside the repository).

- sources.py:    readers of the external sources (Python files, ShareGPT, MT-Bench) and the shared text helpers
- corpus.py:     the demo target's training corpus built from them; clean.py: its cleaning
- benchmarks.py: benchmark prompts (MT-Bench, HumanEval, SPEED-style mix), also used to evaluate heads
"""
