"""One-pass data generation (peagle/train/selfgen.py): the answers equal the engine's greedy decoding, the
recorded hidden states equal a separate extraction of the finished sequence (every position, the last token's
included), and continuous batching with fewer rows than prompts changes neither. Negative control: states
recorded one position off do not pass the comparison."""
from __future__ import annotations

import torch

from peagle.engine import Engine
from peagle.models.llama import Transformer
from peagle.sampling import SamplingParams
from peagle.train.features import layer_states
from peagle.train.selfgen import generate_with_states


def _prompts(n=7):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 400, (int(L),), generator=g).tolist() for L in torch.randint(2, 20, (n,), generator=g)]


def _run(target, prompts, batch, max_new=12):
    L = target.cfg.num_hidden_layers
    got = {}
    res = generate_with_states(target, prompts, max_new, eos={2}, layer_ids=(1, L), batch=batch,
                               state_dtype=torch.float32, emit=lambda i, ids, m, h: got.__setitem__(i, (ids, m, h)))
    return res, got


def test_answers_equal_engine_greedy_and_states_equal_extraction(tiny_dirs):
    target = Transformer.from_pretrained(tiny_dirs["llama"])
    prompts = _prompts()
    res, got = _run(target, prompts, batch=3)           # fewer rows than prompts: rows are refilled
    assert res["samples"] == len(prompts) == len(got)
    eng = Engine(target, max_num_seqs=8, max_model_len=64)
    reqs = [eng.add_request(i, p, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[2]))
            for i, p in enumerate(prompts)]
    while eng.has_unfinished():
        eng.step()
    L = target.cfg.num_hidden_layers
    seqs = [got[i][0] for i in range(len(prompts))]
    ref = dict(layer_states(target, seqs, (1, L)))
    for i, (p, r) in enumerate(zip(prompts, reqs)):
        ids, mask, h = got[i]
        assert ids[: len(p)].tolist() == p and ids[len(p):].tolist() == r.output_ids
        assert mask.tolist() == [0] * len(p) + [1] * len(r.output_ids)
        assert h.shape == (len(ids), 2, target.cfg.hidden_size)
        want = ref[i].view(len(ids), 2, -1)
        torch.testing.assert_close(h, want, atol=1e-4, rtol=1e-4)
        # negative control: the same states shifted by one position are not the sequence's states
        assert not torch.allclose(h[1:], want[:-1], atol=1e-3)


def test_batch_size_does_not_change_the_data(tiny_dirs):
    target = Transformer.from_pretrained(tiny_dirs["llama"])
    prompts = _prompts(5)
    _, a = _run(target, prompts, batch=1)
    _, b = _run(target, prompts, batch=5)
    for i in range(len(prompts)):
        assert torch.equal(a[i][0], b[i][0])
        torch.testing.assert_close(a[i][2], b[i][2], atol=1e-4, rtol=1e-4)
