"""Greedy LLM.generate equals transformers generate(do_sample=False), token for token."""
import pytest
import torch

from peagle import LLM, SamplingParams
from tiny import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf_generate(tiny_dirs, family):
    import transformers as tf
    path = tiny_dirs[family]
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(1, 50, (20,), generator=g)]
    want = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                              pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
        want.append(out[0, len(p):].tolist())
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(path)
    batch8 = [o.outputs[0].token_ids for o in LLM(path, max_num_seqs=8).generate([{"prompt_token_ids": p} for p in prompts], sp)]
    batch1 = [llm.generate({"prompt_token_ids": p}, sp)[0].outputs[0].token_ids for p in prompts[:10]]
    assert batch8 == want
    assert batch1 == want[:10]
