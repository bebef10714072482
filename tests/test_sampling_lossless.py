"""Sampling losslessness: the first tokens sampled through speculative decoding follow the exact target
distribution (chi-square goodness of fit at thousands of samples), and a deliberately wrong verifier fails."""
import itertools

import pytest
import torch
from fakes import FakeProposer, ScriptedK, install_proposer
from tiny import save_tiny

import peagle.engine as engine_mod
from peagle import LLM, SamplingParams
from peagle.sampling import probs_from_logits, sample_from

V, PROMPT, N = 8, [3, 5, 1, 6], 5000
SP = dict(temperature=0.9, top_p=0.95, top_k=0)


class TableProposer(FakeProposer):
    """Drafts d1 = table[last], d2 = table[d1], ...: a deterministic drafter whose drafts are often right."""

    def __init__(self, k, table):
        super().__init__(k)
        self.table = table

    def propose(self, batch, k=None):
        last = torch.tensor([r.all_ids[-1] for r in batch.requests])
        out = []
        for _ in range(k or self.k):
            last = self.table[last]
            out.append(last)
        return torch.stack(out, 1)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return save_tiny("llama", str(tmp_path_factory.mktemp("v8") / "m"), vocab=V, hidden=32, layers=2, seed=3)


def exact_joint(llm, sp=SP):
    """P(t1,t2,t3) under the processed target distribution (sampling parameters sp), by enumeration."""
    t = llm.engine.target
    seqs = [PROMPT + list(c) for c in itertools.product(range(V), repeat=2)]
    x = torch.tensor(seqs)
    logits, _ = t.forward(x, t.new_cache(len(seqs), 16), 0, torch.zeros(len(seqs), dtype=torch.long))
    p = probs_from_logits(logits, sp["temperature"], sp["top_k"], sp["top_p"])  # [64, 6, V]
    p1 = p[0, len(PROMPT) - 1]
    joint = torch.zeros(V, V, V)
    for i, (a, b) in enumerate(itertools.product(range(V), repeat=2)):
        joint[a, b] = p1[a] * p[i, len(PROMPT), b] * p[i, len(PROMPT) + 1]
    return joint.flatten().double(), p


def chi2_pvalue(counts, probs):
    exp = probs * counts.sum()
    big = exp >= 5
    obs_c = torch.cat([counts[big], counts[~big].sum()[None]])
    exp_c = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = exp_c > 0
    stat = (((obs_c - exp_c) ** 2) / exp_c)[keep].sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2)), stat, df


def sample_counts(llm, sp=SP, n=N):
    ps = [{"prompt_token_ids": PROMPT}] * n
    outs = llm.generate(ps, SamplingParams(max_tokens=3, ignore_eos=True, **sp))
    c = torch.zeros(V ** 3, dtype=torch.float64)
    for o in outs:
        a, b, d = o.outputs[0].token_ids
        c[a * V * V + b * V + d] += 1
    return c


def spec_llm(path, table, k=2, seed=1, policy=None):
    return install_proposer(LLM(path, seed=seed, max_num_seqs=128), TableProposer(k, table), k, policy)


def table_for(llm):
    t = llm.engine.target
    x = torch.tensor([PROMPT + [v] for v in range(V)])
    logits, _ = t.forward(x, t.new_cache(V, 8), 0, torch.zeros(V, dtype=torch.long))
    return logits[:, -1].argmax(-1)


def wrong_verifier(logits, drafts, rows, q=None):
    """A deliberately wrong verifier: on rejection it resamples from p (not p - q); rows: verify.SampledRows."""
    probs = probs_from_logits(logits, rows.temperature, rows.top_k, rows.top_p)
    acc, toks = [], []
    for b, gen in enumerate(rows.gens):
        out = []
        for i in range(drafts.shape[1]):
            d = int(drafts[b, i])
            if torch.rand((), generator=gen, dtype=torch.float64) <= probs[b, i, d]:
                out.append(d)
                continue
            out.append(int(sample_from(probs[b, i:i + 1], gen)[0]))
            break
        else:
            out.append(int(sample_from(probs[b, -1:], gen)[0]))
        acc.append(len(out) - 1)
        toks.append(out + [0] * (drafts.shape[1] + 1 - len(out)))
    return torch.tensor(acc), torch.tensor(toks)


def test_plain_sampling_matches_exact_distribution(small):
    llm = LLM(small, seed=0, max_num_seqs=128)
    joint, _ = exact_joint(llm)
    p, stat, df = chi2_pvalue(sample_counts(llm), joint)
    assert p > 1e-3, (stat, df)


def test_unseeded_requests_draw_no_small_seeds_numbers(small):
    """The engine's n-th unseeded request drew the numbers of seed = n, so a user's seed=n repeated another
    request's sample. Negative control: one seed twice gives one output."""
    llm = LLM(small, seed=0)
    sp, ps = dict(temperature=1.0, max_tokens=16, ignore_eos=True), [{"prompt_token_ids": PROMPT}]
    unseeded = [o.outputs[0].token_ids for o in llm.generate(ps * 3, SamplingParams(**sp))]
    seeded = [llm.generate(ps, SamplingParams(seed=n, **sp))[0].outputs[0].token_ids for n in range(3)]
    assert llm.generate(ps, SamplingParams(seed=1, **sp))[0].outputs[0].token_ids == seeded[1]
    assert all(u != s for u, s in zip(unseeded, seeded)), (unseeded, seeded)


def test_sampling_with_k_changing_mid_request_matches_exact_distribution(small):
    """K switches every step (0 = plain sampling step, 1, 3, 2): the three tokens still follow the target."""
    base = LLM(small, seed=0)
    joint, _ = exact_joint(base)
    policy = ScriptedK(3, [0, 3, 1, 0, 2])
    llm = spec_llm(small, table_for(base), k=3, seed=4, policy=policy)
    p, stat, df = chi2_pvalue(sample_counts(llm), joint)
    m = llm.get_metrics()
    assert all(n > 0 for n in m["num_steps_per_k"]), m["num_steps_per_k"]     # K = 0, 1, 2, 3 all used
    assert 0.1 < m["draft_acceptance_rate"] < 0.95
    assert p > 1e-3, (stat, df, m)


def test_speculative_sampling_matches_exact_distribution_and_wrong_verifier_fails(small, monkeypatch):
    base = LLM(small, seed=0)
    joint, _ = exact_joint(base)
    table = table_for(base)
    llm = spec_llm(small, table)
    p, stat, df = chi2_pvalue(sample_counts(llm), joint)
    m = llm.get_metrics()
    assert 0.1 < m["draft_acceptance_rate"] < 0.95          # both accept and reject paths are exercised
    assert p > 1e-3, (stat, df, m)

    monkeypatch.setattr(engine_mod, "verify_sampled", wrong_verifier)
    p_bad, stat, df = chi2_pvalue(sample_counts(spec_llm(small, table, seed=2)), joint)
    assert p_bad < 1e-6, (stat, df)


def test_top_k_beyond_any_vocabulary_is_off():
    assert SamplingParams(top_k=10 ** 30).top_k == 0 and SamplingParams(top_k=2 ** 31 - 1).top_k == 2 ** 31 - 1


def test_top_p_below_float32_keeps_the_top_token():
    """A top_p that rounds to 0 in float32 (e.g. 1e-320 from a client) keeps the most likely token instead of
    dropping every token (which gave NaN probabilities and a failed request)."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    per_row = torch.tensor([[1e-320], [1e-45]], dtype=torch.float32)          # the batched verifier's form
    for top_p in (1e-320, 1e-45, 1e-9, per_row):
        p = probs_from_logits(logits, 1.0, 0, top_p)
        assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])), top_p


def test_greedy_is_argmax_ties_nan_and_inf_included():
    """sampling.greedy (max(-1).indices on the CPU) gives torch.argmax's index on rows full of ties, NaNs, infs
    and -0.0, at the vocabulary sizes the engine sees. Negative control: taking the last maximum instead (the
    reversed row's argmax) differs on these rows, so a tie-breaking change would be caught."""
    from peagle.sampling import greedy
    g = torch.Generator().manual_seed(0)
    last_differs = 0
    for trial in range(600):
        n = [7, 300, 8192, 49152][trial % 4]
        x = torch.randint(-3, 4, (3, n), generator=g).float()
        if trial % 3 == 0:
            x[torch.rand(3, n, generator=g) < 0.01] = float("nan")
        if trial % 5 == 0:
            x[torch.rand(3, n, generator=g) < 0.01] = float("inf")
        if trial % 7 == 0:
            x[torch.rand(3, n, generator=g) < 0.1] = -0.0
        assert torch.equal(greedy(x), x.argmax(-1)), trial
        assert torch.equal(greedy(x[:, None]), x[:, None].argmax(-1))
        assert torch.equal(greedy(x[:1]), x[:1].argmax(-1))                # one row: the c = 1 engine
        last = n - 1 - x.flip(-1).argmax(-1)
        last_differs += not torch.equal(last, x.argmax(-1))
    assert last_differs > 500


@pytest.mark.parametrize("spec", [None, "peagle"])
def test_a_seeded_request_draws_the_same_batched_as_alone(spec):
    """A seeded request's output does not depend on the requests batched with it (under a fixed K): each row
    draws from its own generator. The checks before compared a request with itself or two engines sharing the
    same code, so rows given each other's generators passed them (a mutation review)."""
    from peagle.llm import DEMO_PEAGLE_HEAD, DEMO_TARGET
    cfg = None if spec is None else {"method": "eagle3", "model": DEMO_PEAGLE_HEAD, "num_speculative_tokens": 3,
                                     "parallel_drafting": True}
    llm = LLM(DEMO_TARGET, speculative_config=cfg)
    prompts = ["Once upon a time", "def add(a, b):", "The weather today"]
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=s, ignore_eos=True) for s in (11, 22, 33)]
    alone = [llm.generate([p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert together == alone
    assert len({tuple(t) for t in alone}) == 3
