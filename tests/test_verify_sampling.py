"""Draft sampling ("draft_sampling": "sample"): drafts drawn from the drafter's q and verified with min(1, p/q)
and the (p - q)+ residual keep the output distribution exact -- checked by chi-square against the exact target
distribution, with negative controls (a verifier without the residual, a verifier given the wrong q) that must
fail the same test -- and greedy rows are token-identical to plain decoding."""
import pytest
import torch
from heads import save_random_head
from test_sampling_lossless import V, chi2_pvalue, exact_joint, sample_counts
from tiny import save_tiny

import peagle.engine as engine_mod
from peagle import LLM, SamplingParams
from peagle.drafters.base import DraftBatch
from peagle.errors import PeagleError
from peagle.sampling import make_generator, probs_from_logits, sample_rows
from peagle.spec_config import parse_spec_config
from peagle.verify import SampledRows, verify_sampled

SPS = {0.7: dict(temperature=0.7, top_k=6, top_p=0.95), 1.0: dict(temperature=1.0, top_k=7, top_p=0.9)}


def no_residual(logits, drafts, s, q=None):
    """WRONG on purpose: accepts with min(1, p/q) but resamples a rejection from p instead of (p - q)+."""
    if q is None:                                            # no drafts (prefill), or argmax drafts
        return verify_sampled(logits, drafts, s)
    S, K1, _ = logits.shape
    p = probs_from_logits(logits, s.temperature, s.top_k, s.top_p)                      # [S,K+1,V]
    u = torch.stack([torch.rand(K1 - 1, generator=g, dtype=torch.float64) for g in s.gens])
    pd = p[:, :-1].gather(-1, drafts[..., None])[..., 0].double()                       # [S,K]
    qd = q.gather(-1, drafts[..., None])[..., 0].double()
    acc = (u * qd <= pd).long().cumprod(1).sum(1)                                        # [S]
    rows = torch.arange(S)
    emitted = sample_rows(p[rows, acc], s.gens)
    toks = torch.cat([drafts, emitted[:, None]], 1)
    toks[rows, acc] = emitted
    return acc, toks


def wrong_q(logits, drafts, s, q=None):
    """WRONG on purpose: verifies with a q the drafts were not drawn from (q^2 renormalised: q at half the
    temperature, as if the drafter's temperature were forgotten). (Ignoring q -- verifying sampled drafts as
    one-hot drafts -- would NOT be wrong: that is exact for a draft drawn any way, it only accepts less.)"""
    return verify_sampled(logits, drafts, s, None if q is None else q ** 2 / (q ** 2).sum(-1, keepdim=True))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """test_sampling_lossless's 8-token target with 4 layers (a head needs 3 distinct aux layers)."""
    return save_tiny("llama", str(tmp_path_factory.mktemp("v8") / "m"), vocab=V, hidden=32, layers=4, seed=3)


@pytest.fixture(scope="module")
def small_heads(small, tmp_path_factory):
    d = tmp_path_factory.mktemp("v8heads")
    # EAGLE-3 with a 4-token draft vocabulary (target ids 0, 2, 4, 6): q is zero on the other half
    return {"peagle": save_random_head(small, str(d / "p"), layers=1, seed=1),
            "eagle3": save_random_head(small, str(d / "e"), layers=1, seed=2, parallel=False, draft_vocab=4)}


def sample_llm(target, head, method, k, seed=1, mode="sample", rows=128):
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": k, "parallel_drafting": method == "peagle",
            "draft_sampling": mode}
    return LLM(target, seed=seed, max_num_seqs=rows, speculative_config=spec)


@pytest.mark.parametrize("temp", [0.7, 1.0])
@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_sampled_drafts_give_the_exact_distribution(small, small_heads, method, k, temp):
    sp = SPS[temp]
    llm = sample_llm(small, small_heads[method], method, k, seed=10 * k + int(10 * temp))
    joint, _ = exact_joint(llm, sp)
    p, stat, df = chi2_pvalue(sample_counts(llm, sp), joint)
    m = llm.get_metrics()
    assert 0.1 < m["draft_acceptance_rate"] < 0.9, m       # both the accept and the residual paths are exercised
    assert p > 1e-3, (stat, df, m)


@pytest.mark.parametrize("wrong", [no_residual, wrong_q])
@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_wrong_verifier_fails_the_same_test(small, small_heads, monkeypatch, method, wrong):
    sp = SPS[1.0]
    monkeypatch.setattr(engine_mod, "verify_sampled", wrong)
    llm = sample_llm(small, small_heads[method], method, 3, seed=5)
    joint, _ = exact_joint(llm, sp)
    p, stat, df = chi2_pvalue(sample_counts(llm, sp), joint)
    assert p < 1e-6, (stat, df)


def synthetic_rows(n, temp, top_k, top_p, seed=0):
    """n sampled rows with one parameter set, each with its own generator (as the engine builds them)."""
    col = torch.full((n, 1, 1), temp)
    return SampledRows(list(range(n)), torch.arange(n), col, top_k, top_p,
                       [make_generator(seed * 1_000_003 + i) for i in range(n)])


def check_positions(acc, toks, p, exact: bool):
    """The token at each position j among the rows reaching it (acc >= j) against p_j [K+1,V] by chi-square:
    every position passes (exact) or one fails clearly (a wrong verifier); never a token outside p's support."""
    K, Vs = p.shape[0] - 1, p.shape[1]
    assert (acc == K).sum() > 100, acc.float().mean()                           # deep positions are reached
    pvals = []
    for j in range(K + 1):
        counts = torch.bincount(toks[acc >= j, j], minlength=Vs).double()
        assert torch.all(counts[p[j] == 0] == 0), (j, counts)
        pvals.append(chi2_pvalue(counts, p[j])[0])
    assert (min(pvals) > 1e-4) if exact else (min(pvals) < 1e-6), pvals


@pytest.mark.parametrize("verifier,exact", [(verify_sampled, True), (no_residual, False), (wrong_q, False)])
def test_every_draft_position_emits_p(verifier, exact):
    """The verifier alone at K = 7, every position: fixed target logits and draft distributions (q puts mass
    where top-k / top-p leave p none, and none on the last token). Among rows that reach position j, the token
    there (accepted draft or residual sample) follows p_j; the wrong verifiers break that."""
    n, K, Vs = 12000, 7, 6
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, K + 1, Vs, generator=g).expand(n, -1, -1)           # [n,K+1,V]
    s = synthetic_rows(n, 0.8, 5, 0.95)
    p = probs_from_logits(logits[:1], 0.8, 5, 0.95)[0].double()                 # [K+1,V] what must come out
    q = torch.softmax(logits[0, :K] + torch.randn(K, Vs, generator=g), -1)    # near p, not p
    q[:, Vs - 1] = 0                                                            # outside the "draft vocabulary"
    q = (q / q.sum(-1, keepdim=True)).expand(n, -1, -1)                         # [n,K,V]
    drafts = sample_rows(q, s.gens)                                             # [n,K], drawn with each row's gen
    acc, toks = verifier(logits, drafts, s, q)
    check_positions(acc, toks, p, exact)


def under_accept(logits, drafts, s, q=None):
    """WRONG on purpose: argmax mode accepting d with probability 0.9 p(d) (the rejection's p without d is
    right): 10 % too few acceptances bias every position against its draft."""
    S, K1, V = logits.shape
    p = probs_from_logits(logits, s.temperature, s.top_k, s.top_p)                      # [S,K+1,V]
    u = torch.stack([torch.rand(K1 - 1, generator=g, dtype=torch.float64) for g in s.gens])
    pd = p[:, :-1].gather(-1, drafts[..., None])[..., 0].double()                       # [S,K]
    acc = (u < 0.9 * pd).long().cumprod(1).sum(1)                                       # [S]
    rows = torch.arange(S)
    dist = p[rows, acc]
    d_at = drafts[rows, acc.clamp(max=K1 - 2)]
    dist = torch.where((acc < K1 - 1)[:, None] & (torch.arange(V) == d_at[:, None]), 0.0, dist)
    emitted = sample_rows(dist, s.gens)
    toks = torch.cat([drafts, emitted[:, None]], 1)
    toks[rows, acc] = emitted
    return acc, toks


@pytest.mark.parametrize("verifier,exact", [(verify_sampled, True), (under_accept, False)])
def test_argmax_mode_every_draft_position_emits_p(verifier, exact):
    """The argmax mode (q = None) alone at K = 5: drafts that are each row's own fixed tokens (as a drafter's
    argmax is, whatever p says), accepted with p(d), rejections resampled from p without d. Among rows that
    reach position j the token there follows p_j; accepting 10 % too rarely breaks that."""
    n, K, Vs = 12000, 5, 6
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, K + 1, Vs, generator=g).expand(n, -1, -1)           # [n,K+1,V]
    s = synthetic_rows(n, 0.8, 5, 0.95, seed=1)
    p = probs_from_logits(logits[:1], 0.8, 5, 0.95)[0].double()                 # [K+1,V] what must come out
    drafts = p[:K].argmax(-1).expand(n, -1).clone()                             # [n,K] the likeliest: accepted often
    drafts[::3] = torch.randint(0, Vs, (len(range(0, n, 3)), K), generator=g)   # and a third anywhere (p may be 0)
    acc, toks = verifier(logits, drafts, s, None)
    check_positions(acc, toks, p, exact)


def test_zero_residual_falls_back_to_p():
    """A rejection whose residual (p - q)+ is zero everywhere (q >= p at every token: p == q up to rounding in
    a real run; here q = 1.5 p so that it happens often) emits from p, never a token p rules out (a zero
    residual sampled as it is emits token 0, which top-k leaves out of p here)."""
    n, Vs = 4000, 6
    logits = torch.tensor([[[-9.0, 0.5, 1.0, 0.0, 2.0, -1.0]] * 2]).expand(n, -1, -1)   # [n,2,V]
    s = synthetic_rows(n, 1.0, 4, 1.0, seed=2)
    p = probs_from_logits(logits[:1], 1.0, 4, 1.0)[0].double()                  # [2,V], p(0) = p(5) = 0
    q = (1.5 * p[:1].float()).expand(n, -1, -1)                                 # [n,1,V]
    drafts = sample_rows(p[:1].float().expand(n, -1, -1), s.gens)              # [n,1]
    acc, toks = verify_sampled(logits, drafts, s, q)
    rejected = acc == 0
    assert 0.2 < rejected.float().mean() < 0.45                                 # P(reject) = 1 - 1/1.5
    counts = torch.bincount(toks[rejected, 0], minlength=Vs).double()
    assert torch.all(counts[p[0] == 0] == 0), counts
    assert chi2_pvalue(counts, p[0])[0] > 1e-4, counts


def test_argmax_mode_leaves_no_q_and_sample_mode_q_is_over_the_target_vocabulary(small, small_heads):
    llm = sample_llm(small, small_heads["eagle3"], "eagle3", 3)
    prop, head = llm.engine.proposer, llm.engine.proposer.head
    rows = synthetic_rows(2, 1.0, 0, 1.0)
    normed = torch.randn(3, 2, head.cfg["hidden_size"])
    sampled = SampledRows([0, 2], torch.tensor([0, 2]), rows.temperature, 0, 1.0, rows.gens)
    ids, q = prop.pick(normed, sampled)
    assert q.shape == (2, 2, V) and torch.allclose(q.sum(-1), torch.ones(2, 2))
    assert torch.all(q[..., 1::2] == 0) and torch.all(ids % 2 == 0)        # draft vocabulary: target ids 0, 2, 4, 6
    argmax = head.to_target(head.draft_logits(normed).argmax(-1))
    assert torch.equal(ids[1], argmax[1])                                   # the greedy row drafts the argmax
    prop.draft_sampling = "argmax"
    ids, q = prop.pick(normed, sampled)
    assert q is None and torch.equal(ids, argmax)
    batch = DraftBatch(torch.tensor([[3]]), torch.zeros(1, 1, 3 * head.cfg["target_hidden_size"]),
                       torch.tensor([0]), torch.tensor([1]), sampled=sampled)
    prop.propose(batch, 3)
    assert batch.q is None


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_greedy_rows_unchanged_in_sample_mode(tiny_dirs, tmp_path_factory, method):
    """Greedy and sampled requests share the batches; the greedy ones equal plain greedy decoding."""
    target = tiny_dirs["llama"]
    d = tmp_path_factory.mktemp("heads")
    head = save_random_head(target, str(d / method), layers=1, parallel=method == "peagle",
                            draft_vocab=None if method == "peagle" else 256)
    g = torch.Generator().manual_seed(7)
    ps = [{"prompt_token_ids": torch.randint(5, 500, (int(n),), generator=g).tolist()}
          for n in torch.randint(2, 30, (10,), generator=g)]
    sps = [SamplingParams(temperature=0 if i % 2 == 0 else 0.8, top_k=20 * (i % 3), max_tokens=20, ignore_eos=True)
           for i in range(10)]
    ref = [o.outputs[0].token_ids for o in LLM(target).generate(ps, SamplingParams(temperature=0, max_tokens=20,
                                                                                   ignore_eos=True))]
    llm = sample_llm(target, head, method, 4, rows=4)             # requests join and leave mid-run
    out = [o.outputs[0].token_ids for o in llm.generate(ps, sps)]
    assert [o for i, o in enumerate(out) if i % 2 == 0] == [r for i, r in enumerate(ref) if i % 2 == 0]
    assert llm.get_metrics()["num_drafts"] > 0


def test_spec_config_draft_sampling():
    base = {"method": "eagle3", "model": "h", "num_speculative_tokens": 3}
    assert parse_spec_config(base).draft_sampling == "sample"                   # the default (measured)
    assert "draft_sampling" not in parse_spec_config(base).as_dict()            # the vLLM dict stays vLLM's
    s = parse_spec_config({**base, "draft_sampling": "argmax"})
    assert s.draft_sampling == "argmax" and parse_spec_config(s.as_dict()) == s
    with pytest.raises(PeagleError, match="draft_sampling"):
        parse_spec_config({**base, "draft_sampling": "random"})
