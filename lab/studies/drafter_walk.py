"""Where a parallel (P-EAGLE) head's acceptance is lost: teacher-forced drafts at every anchor vs the anchors the
engine actually drafts from.

Invariant checked on the way: walking the teacher-forced drafts the way the engine walks (start after the
prompt, accept the agreeing prefix m, next anchor m + 1 tokens later) must reproduce the engine's measured
acceptance on the same greedy outputs; a gap would mean the inference proposer drafts something other than what
the training forward computes.

    python lab/studies/drafter_walk.py --target models/demo-target --head models/demo-target-peagle \\
        --dataset humaneval --prompts 20 --k 7

Prints: per-depth accuracy over all anchors of the generated text, the chain (cumulative) acceptance over all
anchors, the simulated engine walk, and the engine's own figures.
"""
from __future__ import annotations

import argparse
import shlex
import sys

import torch


def anchor_table(target, head, prompt: list[int], out: list[int], K: int) -> dict[int, list[bool]]:
    """anchor -> [draft k agrees with the greedy output, k = 1..K] for anchors with a full rollout."""
    from peagle.train.cod import sample_cod
    from peagle.train.mask import MaskTable
    from peagle.train.peagle_loss import draft_forward
    x = torch.tensor(prompt + out)[None]
    L, P = x.shape[1], len(prompt)
    _, aux = target.forward(x, target.new_cache(1, L + 8), 0, torch.zeros(1, dtype=torch.long), aux_ids=head.aux_ids)
    row = {"ids": x[0], "doc": torch.zeros(L, dtype=torch.long), "pos": torch.arange(L),
           "lmask": torch.arange(L) >= P, "aux": aux[0]}
    a, d = sample_cod(row["doc"], row["lmask"], K, full=True)
    normed = draft_forward(head, row, a, d, MaskTable(L))
    pred = head.to_target(head.draft_logits(normed).argmax(-1))
    ok = pred == x[0][(a + d + 2).clamp(max=L - 1)]
    table: dict[int, list] = {}
    for ai, di, oi in zip(a.tolist(), d.tolist(), ok.tolist()):
        if ai >= P - 1 and ai + K + 1 < L:
            table.setdefault(ai, [None] * K)[di] = oi
    return {ai: v for ai, v in table.items() if None not in v}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="models/demo-target")
    ap.add_argument("--head", default="models/demo-target-peagle")
    ap.add_argument("--dataset", default="humaneval", choices=["humaneval", "mtbench"])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from peagle import LLM, SamplingParams
    from peagle.bench.runner import Bench
    from peagle.data.benchmarks import load_dataset
    from peagle.heads.model import DrafterHead
    from peagle.models.llama import Transformer
    K = a.k
    target = Transformer.from_pretrained(a.target)
    head = DrafterHead.from_pretrained(a.head, target.cfg, parallel=True, target_embed=target.embed).eval()
    enc = Bench(a.target, {})
    prompts = [list(enc.encode(p)) for p in load_dataset(a.dataset, a.prompts)]
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    plain = LLM(a.target, quantization="none")
    outs = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    hit, chain, n = torch.zeros(K), torch.zeros(K), 0
    walk_pos, walk_steps = torch.zeros(K), 0
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            table = anchor_table(target, head, p, list(o), K)
            for v in table.values():
                n += 1
                hit += torch.tensor(v, dtype=torch.float)
                chain += torch.tensor(v, dtype=torch.float).cumprod(0)
            ai = len(p) - 1
            while ai in table:
                m = 0
                while m < K and table[ai][m]:
                    m += 1
                walk_steps += 1
                walk_pos[:m] += 1
                ai += m + 1
    llm = LLM(a.target, quantization="none", speculative_config={"method": "eagle3", "model": a.head, "num_speculative_tokens": K,
                                            "parallel_drafting": True})
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    m = llm.get_metrics()
    fmt = lambda xs: " / ".join(f"{float(x):.3f}" for x in xs)
    print(f"# {a.dataset}, first {len(prompts)} prompts, K = {K}, greedy, {a.max_tokens} tokens; {n} anchors")
    print(f"per-depth accuracy, all anchors:        {fmt(hit / n)}")
    print(f"chain acceptance, all anchors:          {fmt(chain / n)}  (length {1 + float(chain.sum()) / n:.3f})")
    print(f"teacher-forced engine walk:             {fmt(walk_pos / walk_steps)}  "
          f"(length {1 + float(walk_pos.sum()) / walk_steps:.3f})")
    print(f"engine:                                 {fmt(m['acceptance_rate_per_pos'])}  "
          f"(length {m['mean_acceptance_length']:.3f}; greedy identical: {got == outs})")
    print("command: python lab/studies/drafter_walk.py " + shlex.join(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
