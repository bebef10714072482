"""`peagle serve` output tokens/s through the official openai client, for one or more checkouts side by side in
one run (rounds alternate the checkouts): each server is the default target (its default quantization), plain
or with a P-EAGLE head, and gets the same streaming greedy requests of --max-tokens tokens (EOS ignored): --prompts
one after the other (c=1), then --prompts x 4 with --clients in flight.

    # this checkout against the one before the engine loop moved to the thread that builds the engine:
    git worktree add /tmp/before 53b1f49 && ln -s $PWD/models/smollm2-135m-instruct /tmp/before/models/ \\
        && ln -s $PWD/build /tmp/before/build
    OMP_NUM_THREADS=2 .venv/bin/python lab/measure/serve_speed.py --repos /tmp/before,. --out docs/benchmarks/serve-speed.md

Each server is `python -m peagle.cli serve` run in its checkout's directory (that checkout's peagle;
peagle.client.launch), on a free port, stopped before the next starts.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.measure.precision import cpu_flags, write_report
from peagle.client import launch, stop

PROMPTS = ["Write a short story about the ocean.", "Explain prime numbers to a child.",
           "List three facts about the moon.", "Describe a jazz band in one paragraph.",
           "Write a poem about winter mornings.", "Give advice related to learning to cook.",
           "What is interesting about desert plants?", "Summarize what you know about the first computer."]


def checkout_name(repo: str, paths: tuple = ()) -> str:
    """The checkout's short commit, "+ changes" where its tracked files (under `paths`, if given) differ from it."""
    git = ["git", "-C", repo]
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no", "--", *paths],
                           capture_output=True, text=True).stdout.strip()
    return (head or os.path.basename(repo)) + (" + changes" if dirty else "")


def measure(url: str, prompts: list, max_tokens: int, clients: int) -> tuple[float, float]:
    """(tokens/s at c=1, tokens/s with `clients` in flight) over streaming greedy completions."""
    from openai import OpenAI
    c = OpenAI(base_url=url + "/v1", api_key="none", timeout=600)
    model = c.models.list().data[0].id

    def one(prompt: str) -> int:
        """The request's completion tokens (a chunk may carry several: accepted drafts, a slow client's backlog)."""
        n = None
        for ch in c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
            if ch.usage is not None:
                n = ch.usage.completion_tokens
        return n
    one(prompts[0])                                                   # warm-up
    t0 = time.perf_counter()
    n1 = sum(one(p) for p in prompts)
    t1 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        n2 = sum(ex.map(one, prompts * 4))
    t2 = time.perf_counter()
    return n1 / (t1 - t0), n2 / (t2 - t1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repos", default=".", help="comma-separated checkouts (each with the default target set up)")
    ap.add_argument("--head", default="models/smollm2-135m-instruct-peagle", help="P-EAGLE head, relative to a repo")
    ap.add_argument("--k", default="1", help="the head's K: a number or auto (chosen per step)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    repos = [os.path.abspath(r) for r in a.repos.split(",")]
    prompts = (PROMPTS * (a.prompts // len(PROMPTS) + 1))[: a.prompts]
    k = a.k if a.k == "auto" else int(a.k)
    specs = {"plain": "none", f"P-EAGLE K={k}": json.dumps({"method": "eagle3", "model": a.head,
                                                            "num_speculative_tokens": k, "parallel_drafting": True})}
    got = {(r, s): [] for r in repos for s in specs}
    for rnd in range(a.rounds):
        for r in repos if rnd % 2 == 0 else repos[::-1]:
            for s, spec in specs.items():
                p, url = launch(None, spec, a.clients, timeout=600, cwd=r)
                try:
                    got[(r, s)].append(measure(url, prompts, a.max_tokens, a.clients))
                finally:
                    stop(p)
                print(f"round {rnd}: {r} {s}: c=1 {got[(r, s)][-1][0]:.1f}, c={a.clients} {got[(r, s)][-1][1]:.1f} "
                      "tok/s", flush=True)
    names = {r: checkout_name(r) for r in repos}
    lines = [f"# `peagle serve` tokens/s, checkouts side by side ({cpu_flags()}, "
             f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})", "",
             f"Default target, its default quantization; streaming greedy completions of {a.max_tokens} tokens (EOS "
             f"ignored), official openai client on the same machine; c=1: {len(prompts)} requests one after the "
             f"other; c={a.clients}: {4 * len(prompts)} requests, {a.clients} in flight. Median of {a.rounds} rounds "
             "(rounds alternate the checkouts); ratios: against the first checkout's same server, and against the "
             "same checkout's plain server.", "",
             f"| checkout | server | c=1 tok/s | c={a.clients} tok/s | c=1 vs first | c={a.clients} vs first | "
             f"c=1 vs plain | c={a.clients} vs plain |", "|---|---|---|---|---|---|---|---|"]
    med = {key: [statistics.median(x[i] for x in v) for i in (0, 1)] for key, v in got.items()}
    for s in specs:
        for r in repos:
            m, first, plain = med[(r, s)], med[(repos[0], s)], med[(r, "plain")]
            lines.append(f"| {names[r]} | {s} | {m[0]:.1f} | {m[1]:.1f} | "
                         + " | ".join(f"{m[i] / ref[i]:.2f}x" for ref in (first, plain) for i in (0, 1)) + " |")
    return write_report(lines, "OMP_NUM_THREADS=2 .venv/bin/python lab/measure/serve_speed.py", argv, a.out)


if __name__ == "__main__":
    sys.exit(main())
