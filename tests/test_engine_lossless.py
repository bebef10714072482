"""Greedy losslessness: speculative outputs are token-identical to plain decoding.

Random heads exercise the real drafter code paths (they reject most drafts); an oracle proposer that
proposes the true continuation with random corruption exercises ragged acceptance, full-block bonus
tokens, and EOS / max-token stops landing inside an accepted block."""
import pytest
import torch
from fakes import FakeProposer, ScriptedK, install_proposer

from peagle import LLM, SamplingParams
from peagle.models import quant_ext


def prompts(n, seed, lo=1, hi=40):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g)
    return [{"prompt_token_ids": torch.randint(5, 500, (int(k),), generator=g).tolist()} for k in lens]


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


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


SCRIPT = [3, 0, 0, 1, 5, 0, 2, 4]      # K per decode step, cycling; 0 = a plain step (the drafter catches up later)


class DrafterFeed:
    """Records the drafter rows the engine feeds (prefill and propose) and checks the row invariant: each
    request's rows are contiguous from position 0 (no gap, no repeat: K = 0 steps are caught up), hold the
    request's tokens shifted by one, and end right before its newest token."""

    def __init__(self, engine):
        self.e, self.fed, self.aux, self.calls = engine, {}, {}, []
        self.first = {}                  # request id -> "prefill" or "propose" (prompt deferred to the catch-up)
        p = engine.proposer
        prefill, propose = p.prefill, p.propose

        def rec_prefill(batch):
            for i in range(batch.ids.shape[0]):
                r = engine.running[batch.b0 + i]
                self._check(r, batch, i, len(r.prompt_token_ids) - 1)
            return prefill(batch)

        def rec_propose(batch, k=None):
            self.calls.append(k)
            for i, r in enumerate(batch.requests):
                self._check(r, batch, i, int(batch.n_real[i]), newest=True)
            return propose(batch, k)
        p.prefill, p.propose = rec_prefill, rec_propose
        propose_tree = getattr(p, "propose_tree", None)
        if propose_tree is not None:
            def rec_tree(batch, k, topk, nodes):          # tree steps: the same context as a chain step's
                for i, r in enumerate(batch.requests):
                    self._check(r, batch, i, int(batch.n_real[i]), newest=True)
                return propose_tree(batch, k, topk, nodes)
            p.propose_tree = rec_tree

    def _check(self, r, batch, i, n, newest=False):
        start, all_ids = int(batch.start[i]), r.all_ids
        self.first.setdefault(r.request_id, "propose" if newest else "prefill")
        assert start == self.fed.get(r.request_id, 0), (r.request_id, start, self.fed.get(r.request_id))
        assert batch.ids[i, :n].tolist() == all_ids[start + 1:start + 1 + n]
        if newest:
            assert start + n == len(all_ids) - 1
        for j in range(n):
            self.aux.setdefault(r.request_id, {})[start + j] = batch.aux[i, j].clone()
        self.fed[r.request_id] = start + n

    def check_aux(self, requests):
        """The fed target states equal a fresh full forward of each request's tokens (position by position)."""
        t = self.e.target
        for r in requests:
            x = torch.tensor([r.prompt_token_ids + r.output_ids])
            _, aux = t.forward(x, t.new_cache(1, x.shape[1] + 8), 0, torch.zeros(1, dtype=torch.long), self.e.aux_ids)
            for pos, a in self.aux[r.request_id].items():
                assert torch.allclose(a, aux[0, pos], atol=1e-4, rtol=1e-4), (r.request_id, pos)


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_k_changing_mid_request_greedy_identical_and_drafter_catches_up(target, heads, method):
    ps = prompts(16, seed=11, lo=2, hi=50)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = ids(LLM(target).generate(ps, sp))
    llm = LLM(target, speculative_config=spec(heads[method], 5, method == "peagle"), max_num_seqs=5)
    e = llm.engine
    e.k_policy = policy = ScriptedK(5, SCRIPT)
    feed = DrafterFeed(e)
    reqs = []
    add = e.add_request
    e.add_request = lambda *a, **kw: reqs.append(add(*a, **kw)) or reqs[-1]
    assert ids(llm.generate(ps, sp)) == ref
    feed.check_aux(reqs)
    m = llm.get_metrics()
    steps = m["num_steps_per_k"]
    assert all(steps[k] > 0 for k in set(SCRIPT)) and steps[0] > 0
    assert feed.calls == [k for _, k, _ in policy.observed if k]          # K = 0: the drafter does not run
    assert set(feed.first.values()) == {"prefill", "propose"}               # admitted before K = 0: prompt deferred
    assert m["num_draft_tokens"] == sum(b * k for b, k, _ in policy.observed)
    assert m["num_accepted_tokens"] == sum(sum(a) for _, _, a in policy.observed)
    assert m["k_policy"]["mode"] == "scripted"


class OracleProposer(FakeProposer):
    """Proposes the reference continuation, corrupting each draft with probability `noise`."""

    def __init__(self, k, ref, noise, seed=0):
        super().__init__(k)
        self.ref, self.noise = ref, noise
        self.g = torch.Generator().manual_seed(seed)

    def propose(self, batch, k=None):
        k, out = k or self.k, []
        for r in batch.requests:
            full = self.ref[tuple(r.prompt_token_ids)]
            n = len(r.output_ids)
            d = (full[n:n + k] + [7] * k)[: k]
            d = [t if torch.rand((), generator=self.g) > self.noise else (t + 1) % 500 for t in d]
            out.append(d)
        return torch.tensor(out)


def oracle_llm(target, ref, k, noise, seed=0, policy=None):
    return install_proposer(LLM(target), OracleProposer(k, ref, noise, seed), k, policy)


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


def test_oracle_with_k_changing_mid_request(target):
    """High acceptance with K switching every step (0 included): full blocks, bonus tokens and stops inside
    blocks of different sizes stay identical to plain decoding."""
    ps = prompts(16, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=29, ignore_eos=True)
    base = LLM(target)
    full = ids(base.generate(ps, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    ref = {tuple(p["prompt_token_ids"]): f for p, f in zip(ps, full)}
    llm = oracle_llm(target, ref, 6, 0.05, policy=ScriptedK(6, [6, 0, 2, 0, 0, 4, 1]))
    assert ids(llm.generate(ps, sp)) == [f[:29] for f in full]
    assert llm.get_metrics()["mean_acceptance_length"] > 2


@pytest.mark.skipif(quant_ext.get() is None, reason="needs the built extension (exact attention)")
@pytest.mark.parametrize("quantization", ["none", "q4"])
def test_a_prompt_prefills_to_the_same_bits_whatever_prompts_come_with_it(target, quantization):
    """A block longer than exact attention covers attends through SDPA, whose sums follow the padded length: a
    30-token prompt admitted beside a 100-token one got other first-token logits than alone (1e-6 apart) -- and
    plain and speculative runs admit prompts in other groups (their requests finish at other steps). Such a
    block is prefilled prompt by prompt now: bit-identical logits and cache rows."""
    eng = LLM(target, quantization=quantization).engine
    assert eng.target.exact_attention and eng.target.exact_max_t is not None
    g = torch.Generator().manual_seed(3)
    short, long_ = torch.randint(5, 500, (30,), generator=g), torch.randint(5, 500, (100,), generator=g)
    eng._ensure_rows(2)
    alone, _ = eng._prefill_forward(short[None], [30], torch.tensor([30]), 0)
    k_alone = eng.cache.k[0][0, :, :30].clone()
    toks = torch.zeros(2, 100, dtype=torch.long)
    toks[0], toks[1, :30] = long_, short
    both, _ = eng._prefill_forward(toks, [100, 30], torch.tensor([100, 30]), 0)
    assert torch.equal(both[1], alone[0]) and torch.equal(eng.cache.k[0][1, :, :30], k_alone)
    # negative control: the padded block in one forward (what the engine did) gives other bits
    z = torch.zeros(2, dtype=torch.long)
    padded, _ = eng.target.forward(toks, eng.cache, 0, z, (), logits_at=torch.tensor([99, 29]), span=100, s0=0)
    assert not torch.equal(padded[1], alone[0])


def test_admission_prefills_the_drafter_only_when_the_coming_batch_drafts(target, heads):
    """Admission feeds the drafter a prompt only if the batch it joins (running + admitted + waiting, at most
    max_num_seqs) drafts under the schedule; otherwise the prompt waits for the catch-up (no wasted prefill)."""
    ps = prompts(6, seed=5, lo=2, hi=30)
    sps = [SamplingParams(temperature=0, max_tokens=4 + 4 * i, ignore_eos=True) for i in range(6)]
    ref = ids(LLM(target).generate(ps, sps))
    sched = [[1, 2, 5], [3, 4, 0], [5, 8, 3]]          # a batch of 3-4 rows plain; 6 (unclamped) would draft
    llm = LLM(target, max_num_seqs=4, speculative_config=spec(heads["peagle"], 5, True)
              | {"num_speculative_tokens_per_batch_size": sched})
    e, p = llm.engine, llm.engine.proposer
    e.prefill_token_budget = 1                         # one prompt admitted per step: the waiting ones count
    add, prefill, seen = p.add_requests, p.prefill, []

    def rec_add(*a, **kw):
        drafts = e.k_policy.k_for(min(len(e.running) + len(e.waiting), e.max_num_seqs)) > 0
        seen.append([drafts, False])
        return add(*a, **kw)
    p.add_requests = rec_add
    p.prefill = lambda batch: seen[-1].__setitem__(1, True) or prefill(batch)
    assert ids(llm.generate(ps, sps)) == ref
    assert ids(llm.generate(ps[:2], sps[:2])) == ref[:2]    # a batch of 2: drafts, prompts prefilled
    assert all(drafts == fed for drafts, fed in seen), seen
    assert {d for d, _ in seen} == {True, False}
