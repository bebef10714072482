"""Greedy LLM.generate equals transformers generate(do_sample=False), token for token."""
import pytest
import torch
from tiny import FAMILIES, hf_greedy, save_tiny

from peagle import LLM, SamplingParams


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf_generate(tiny_dirs, family):
    path = tiny_dirs[family]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(1, 50, (20,), generator=g)]
    want = hf_greedy(path, prompts, 16)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(path)
    batch8 = [o.outputs[0].token_ids for o in LLM(path, max_num_seqs=8).generate([{"prompt_token_ids": p} for p in prompts], sp)]
    batch1 = [llm.generate({"prompt_token_ids": p}, sp)[0].outputs[0].token_ids for p in prompts[:10]]
    assert batch8 == want
    assert batch1 == want[:10]


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_mistral_sliding_window_beyond_the_window(tmp_path, backend):
    """Mistral's sliding window (8 here) is honoured: prompts and outputs run far past it, plain (batch 1 and a
    ragged batch of 8) and speculative (rollbacks across the window edge) equal transformers' generate."""
    from heads import save_random_head
    path = save_tiny("mistral", str(tmp_path / "mistral-sw"), sliding_window=8)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(9, 30, (8,), generator=g)]
    want = hf_greedy(path, prompts, 20)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ps = [{"prompt_token_ids": p} for p in prompts]
    assert [o.outputs[0].token_ids for o in LLM(path, target_backend=backend).generate(ps, sp)] == want
    assert LLM(path, target_backend=backend).generate(ps[0], sp)[0].outputs[0].token_ids == want[0]
    head = save_random_head(path, str(tmp_path / "head"), layers=1)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "parallel_drafting": True}
    llm = LLM(path, speculative_config=spec, target_backend=backend)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, sp)] == want
