"""Which HumanEval prompt format makes the target write realistic code: raw completion or the chat template?

For the first --num-prompts HumanEval problems, greedy --max-tokens continuations in both formats:
* raw: the prompt continued as text; the completion is cut at HumanEval's stop sequences and
  prompt + completion must parse with `ast`;
* chat: the prompt in a user turn ("Complete the following Python function ..."); the code is the first
  ```python block of the answer (else the whole answer) and must parse (alone or after the prompt).
Reports the parse rate, the share of answers that contain a `return`/code at all, and the repetition rate
(fraction of generated tokens that extend an 8-gram already in the output; lower is better).

    .venv/bin/python lab/studies/humaneval_format.py --num-prompts 40
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.demo_target.evaluate_target import repetition_rate
from peagle import LLM, SamplingParams
from peagle.data.benchmarks import encode_prompt, load_humaneval
from peagle.llm import DEFAULT_MODEL

STOPS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert "]


def parses(src: str) -> bool:
    try:
        ast.parse(src)
        return True
    except (SyntaxError, ValueError):
        return False


def repetition(ids, n=8) -> float:
    """The share of the output's n-grams that occurred earlier in it (repetition_rate counts them)."""
    rep, _ = repetition_rate(list(ids), n)
    return rep / max(len(ids) - n + 1, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--show", type=int, default=1, help="print this many examples per format")
    a = ap.parse_args(argv)
    print("Regenerate: `.venv/bin/python " + " ".join([os.path.relpath(__file__)] + list(
        sys.argv[1:] if argv is None else argv)) + "`")
    llm = LLM(a.model, max_num_seqs=8, quantization="none")
    V = llm.engine.target.cfg.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    rows = []
    for fmt in ("raw", "chat"):
        ps = load_humaneval(fmt)[: a.num_prompts]
        raws = load_humaneval("raw")[: a.num_prompts]
        outs = llm.generate([{"prompt_token_ids": encode_prompt(llm.tokenizer, V, p)} for p in ps], sp)
        ok = has_code = 0
        reps = []
        for p, r, o in zip(ps, raws, outs):
            text = o.outputs[0].text
            reps.append(repetition(o.outputs[0].token_ids))
            if fmt == "raw":
                cut = min([text.find(s) for s in STOPS if s in text] or [len(text)])
                body = text[:cut]
                good = parses(r.text + body) and body.strip() != ""
                code = "return" in body or "=" in body
            else:
                m = re.search(r"```(?:python)?\n(.*?)(```|$)", text, re.S)
                code_txt = m.group(1) if m else text
                good = code_txt.strip() != "" and (parses(code_txt) or parses(r.text + code_txt))
                code = bool(m) or "return" in text
            ok += good and code
            has_code += code
            if a.show and p is ps[0]:
                print(f"\n--- {fmt} example ({p.id}) ---\n{text[:500]}\n")
        n = len(ps)
        rows.append((fmt, n, ok / n, has_code / n, sum(reps) / n))
    print("| format | prompts | parses with `ast` and has code | contains code | 8-gram repetition |")
    print("|---|---|---|---|---|")
    for fmt, n, ok, code, rep in rows:
        print(f"| {fmt} | {n} | {100 * ok:.0f}% | {100 * code:.0f}% | {100 * rep:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
