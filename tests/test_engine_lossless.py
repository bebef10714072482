"""Greedy losslessness: speculative outputs are token-identical to plain decoding.

Random heads exercise the real drafter code paths (they reject most drafts); an oracle proposer that
proposes the true continuation with random corruption exercises ragged acceptance, full-block bonus
tokens, and EOS / max-token stops landing inside an accepted block."""
import pytest
import torch

from heads import save_random_head
from peagle import LLM, SamplingParams
from peagle.drafters.base import Proposer


def prompts(n, seed, lo=1, hi=40):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g)
    return [{"prompt_token_ids": torch.randint(5, 500, (int(k),), generator=g).tolist()} for k in lens]


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def target(tiny_dirs):
    return tiny_dirs["llama"]


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("heads")
    return {"peagle": save_random_head(target, str(d / "p"), layers=2),
            "eagle3": save_random_head(target, str(d / "e"), layers=1, parallel=False, draft_vocab=256)}


def spec(head, k, parallel):
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, "parallel_drafting": parallel}


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
@pytest.mark.parametrize("k,batch", [(1, 3), (2, 16), (3, 1), (5, 3), (7, 16), (10, 3), (4, 128)])
def test_random_heads_greedy_identical(target, heads, method, k, batch):
    ps = prompts(batch, seed=k * 100 + batch, hi=30 if batch == 128 else 60)
    sp = SamplingParams(temperature=0, max_tokens=12 if batch == 128 else 24, ignore_eos=True)
    ref = ids(LLM(target).generate(ps, sp))
    # batch 16 runs with 5 rows: requests join and leave mid-run (continuous batching, cache row moves)
    llm = LLM(target, speculative_config=spec(heads[method], k, method == "peagle"),
              max_num_seqs=5 if batch == 16 else 128)
    out = ids(llm.generate(ps, [SamplingParams(temperature=0, max_tokens=sp.max_tokens - (i % 7), ignore_eos=True)
                                for i in range(batch)]))
    ref = [r[: sp.max_tokens - (i % 7)] for i, r in enumerate(ref)]
    assert out == ref
    m = llm.get_metrics()
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] == k * m["num_drafts"]


class OracleProposer(Proposer):
    """Proposes the reference continuation, corrupting each draft with probability `noise`."""

    def __init__(self, k, ref, noise, seed=0):
        self.k, self.ref, self.noise = k, ref, noise
        self.g = torch.Generator().manual_seed(seed)
        self.head = type("H", (), {"aux_ids": ()})()
        self.cache = type("C", (), {"ensure_rows": lambda s, n: None, "move_row": lambda s, a, b: None})()

    def prefill(self, batch):
        pass

    def propose(self, batch):
        out = []
        for r in batch.requests:
            full = self.ref[tuple(r.prompt_token_ids)]
            n = len(r.output_ids)
            d = (full[n:n + self.k] + [7] * self.k)[: self.k]
            d = [t if torch.rand((), generator=self.g) > self.noise else (t + 1) % 500 for t in d]
            out.append(d)
        return torch.tensor(out)


def oracle_llm(target, ref, k, noise, seed=0):
    llm = LLM(target)
    e = llm.engine
    e.proposer, e.k = OracleProposer(k, ref, noise, seed), k
    e.aux_ids = ()
    e.metrics.__init__(k)
    e.cache = e.target.new_cache(1, e.max_model_len + 3 * k + 8)
    return llm


@pytest.mark.parametrize("k,noise,batch", [(1, 0.3, 3), (3, 0.0, 16), (5, 0.2, 16), (7, 0.1, 128), (10, 0.05, 3)])
def test_oracle_ragged_acceptance_and_stops_inside_blocks(target, k, noise, batch):
    ps = prompts(batch, seed=7 + k)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = LLM(target)
    full = ids(base.generate(ps, long))
    ref = {tuple(p["prompt_token_ids"]): f for p, f in zip(ps, full)}
    # max-token stops at odd lengths and EOS at a token that occurs mid-output
    for max_tokens in (13, 29):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        want = ids(base.generate(ps, sp))
        llm = oracle_llm(target, ref, k, noise)
        got = ids(llm.generate(ps, sp))
        assert got == want
        m = llm.get_metrics()
        if noise == 0.0:
            assert m["mean_acceptance_length"] > 1 + 0.5 * k
        assert m["num_accepted_tokens"] > 0
    eos = full[0][len(full[0]) // 2]          # a token in the middle of the first output
    sp = SamplingParams(temperature=0, max_tokens=40)
    base.engine.eos = {eos}
    want = ids(base.generate(ps, sp))
    assert want[0][-1] == eos and len(want[0]) < 40
    llm = oracle_llm(target, ref, k, noise)
    llm.engine.eos = {eos}
    assert ids(llm.generate(ps, sp)) == want
