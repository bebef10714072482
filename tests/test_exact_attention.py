"""Exact attention (quant.attend_exact, peagle/csrc/attend_*): against float64 SDPA, block- and batch-invariant (a
query's output the same bits alone or inside any block), the generic / AVX2 / AVX-512 builds bit-identical, and
so a q4a8 target gives a token the same bits in a plain step as in a verify block or a tree in a ragged batch."""
import pytest
import torch

from peagle.models import quant as Q
from peagle.models import quant_ext

EXT = quant_ext.get()
ATT_IMPLS = ([1] + ([2] if EXT.has_avx2() else []) + ([3] if EXT.has_avx512() else [])) if EXT is not None else []


@pytest.mark.skipif(EXT is None, reason="needs the built extension")
@pytest.mark.parametrize("impl", ATT_IMPLS)
def test_exact_attention_matches_sdpa_and_is_block_invariant(impl):
    """attend_exact vs float64 SDPA (GQA, causal block masks, a random tree-like mask), and a query's output is
    the same bits alone (T=1, no mask, S = its position + 1), inside a block of 4 with a longer span, and next
    to other rows; the generic and AVX2 builds agree bit for bit."""
    import torch.nn.functional as F

    from peagle.models.layers import causal_block_mask
    g = torch.Generator().manual_seed(4)
    B, nh, nkv, hd, S = 3, 6, 2, 40, 37
    k = torch.randn(B, nkv, S + 5, hd, generator=g)[:, :, :S]        # a cache view: strided like the engine's
    v = torch.randn(B, nkv, S + 5, hd, generator=g)[:, :, :S]
    for T, mask in ((1, None), (4, causal_block_mask(torch.tensor([30, 20, 33]), 4, S)),
                    (5, torch.rand(B, 1, 5, S, generator=g) < 0.6)):
        q = torch.randn(B, T, nh, hd, generator=g)
        got = Q.attend_exact(q, k, v, mask, impl)
        if mask is not None:
            mask[..., 0] = True                                         # every query sees a key
            got = Q.attend_exact(q, k, v, mask, impl)
        ref = F.scaled_dot_product_attention(q.transpose(1, 2).double(), k.double(), v.double(), attn_mask=mask,
                                             enable_gqa=True).transpose(1, 2).reshape(B, T, nh * hd)
        assert torch.allclose(got.double(), ref, atol=2e-6), (T, float((got.double() - ref).abs().max()))
        if impl >= 2:
            assert torch.equal(got, Q.attend_exact(q, k, v, mask, 1))
    # invariance: row 1's query at position 21 (second of a block starting at 20)
    q = torch.randn(B, 4, nh, hd, generator=g)
    block = Q.attend_exact(q, k, v, causal_block_mask(torch.tensor([30, 20, 33]), 4, S), impl)
    alone = Q.attend_exact(q[1:2, 1:2], k[1:2, :, :22], v[1:2, :, :22], None, impl)
    assert torch.equal(block[1, 1], alone[0, 0])
    assert not torch.equal(Q.attend_exact(q[1:2, 1:2], k[1:2, :, :23], v[1:2, :, :23], None, impl)[0, 0],
                           alone[0, 0])                                 # negative control: one more key counts


@pytest.mark.skipif(EXT is None or not EXT.has_avx2(), reason="needs the built extension on an AVX2 CPU")
@pytest.mark.parametrize("hd", [64, 128])
def test_blocked_attention_paths_agree_bit_for_bit(hd):
    """hd 64 / 128 take the blocked kernels (queries sharing a kv head in tasks of up to 8; AVX-512: two queries per
    register, eight keys per fold): the same bits as the generic build, with odd and even query counts per task,
    spans that are not multiples of 8 or 16, no mask, causal blocks and a random tree-like mask (a query that
    sees no key gives zeros). Negative control: one key more changes the output."""
    from peagle.models.layers import causal_block_mask
    g = torch.Generator().manual_seed(7)
    for B, T, nh, nkv, S0 in ((1, 1, 9, 3, 263), (2, 8, 9, 3, 37), (1, 3, 4, 2, 16), (3, 5, 6, 6, 9), (1, 16, 9, 3, 5)):
        S = S0 + T
        k = torch.randn(B, nkv, S + 3, hd, generator=g)[:, :, :S]
        v = torch.randn(B, nkv, S + 3, hd, generator=g)[:, :, :S]
        q = torch.randn(B, T, nh, hd, generator=g)
        tree = torch.rand(B, 1, T, S, generator=g) < 0.5
        tree[0, 0, 0] = False                                           # a query that sees nothing
        for mask in (None, causal_block_mask(torch.randint(0, S0 + 1, (B,), generator=g), T, S), tree):
            ref = Q.attend_exact(q, k, v, mask, 1)
            for impl in ATT_IMPLS[1:]:
                assert torch.equal(Q.attend_exact(q, k, v, mask, impl), ref), (B, T, nh, nkv, S0, impl)
        assert not torch.equal(Q.attend_exact(q, k[:, :, :-1], v[:, :, :-1], None, ATT_IMPLS[-1]),
                               Q.attend_exact(q, k, v, None, ATT_IMPLS[-1]))


@pytest.mark.skipif(EXT is None or not EXT.has_avx2(), reason="needs the built extension on an AVX2 CPU")
@pytest.mark.parametrize("hd", [64, 128])
def test_blocked_attention_stops_after_the_last_key_a_task_sees(hd):
    """The blocked forms skip the keys after the last one any query of a task (up to 8 queries sharing a kv head) sees:
    a prompt's causal prefill, where each task sees about half the span. The same bits as the generic build (which
    walks each query's visible keys) where the last key is seen by one query of a task only, by the last query
    only, after a long run of hidden keys (keys 0 and S-1 only), or by no query; and the long causal prefill of a
    prompt. Negative control: hiding the one far key changes that query's output."""
    from peagle.models.layers import causal_block_mask
    g = torch.Generator().manual_seed(11)
    B, nh, nkv = 1, 9, 3
    for T, S in ((40, 40), (7, 300), (16, 57)):
        k = torch.randn(B, nkv, S, hd, generator=g)
        v = torch.randn(B, nkv, S, hd, generator=g)
        q = torch.randn(B, T, nh, hd, generator=g)
        far = torch.zeros(B, 1, T, S, dtype=torch.bool)
        far[..., :3] = True
        far[0, 0, T // 2, S - 1] = True                                 # one query of one task sees the last key
        ends = torch.zeros(B, 1, T, S, dtype=torch.bool)
        ends[..., 0] = True
        ends[0, 0, T - 1, S - 1] = True                                 # the last query: keys 0 and S-1 only
        blind = torch.zeros(B, 1, T, S, dtype=torch.bool)               # no query sees a key: zeros
        masks = (causal_block_mask(torch.tensor([S - T]), T, S), far, ends, blind)
        for mask in masks:
            ref = Q.attend_exact(q, k, v, mask, 1)
            for impl in ATT_IMPLS[1:]:
                assert torch.equal(Q.attend_exact(q, k, v, mask, impl), ref), (T, S, impl)
        assert not Q.attend_exact(q, k, v, blind, ATT_IMPLS[-1]).any()
        near = far.clone()
        near[0, 0, T // 2, S - 1] = False
        a, b = (Q.attend_exact(q, k, v, m, ATT_IMPLS[-1]).view(T, nh, hd) for m in (far, near))
        assert not torch.equal(a[T // 2], b[T // 2]) and torch.equal(a[T // 2 + 1:], b[T // 2 + 1:])


@pytest.mark.skipif(EXT is None or not EXT.has_avx2(), reason="needs the built extension on an AVX2 CPU")
def test_a8_target_gives_a_token_the_same_bits_in_any_block(qtarget, summary_note):
    """q4a8 forward: three tokens decoded one at a time as plain decoding does (no mask, s0) give the same
    logits and states, bit for bit, as the same tokens in one 3-token verify block (causal mask), so 8-bit
    rounding cannot tell plain decoding from verification. Negative control: with SDPA's attention instead
    (exact off), they differ on every CPU measured so far; SDPA's kernels differ per CPU, so where they happen
    to agree the control is reported, not failed."""
    from peagle.models.llama import Transformer
    t = Transformer.from_pretrained(qtarget, quantization="q4a8")
    g = torch.Generator().manual_seed(6)
    prompt, nxt = torch.randint(5, 500, (1, 40), generator=g), torch.randint(5, 500, (1, 3), generator=g)

    def prefilled():
        c = t.new_cache(1, 64)
        t.forward(prompt, c, 0, torch.zeros(1, dtype=torch.long), span=40, s0=0)
        c.lens[:1] = 40
        return c

    def both():
        c = prefilled()
        one = [t.forward(nxt[:, j:j + 1], c, 0, torch.tensor([40 + j]), aux_ids=(1, 2), span=41 + j, s0=40 + j)
               for j in range(3)]
        block = t.forward(nxt, prefilled(), 0, torch.tensor([40]), aux_ids=(1, 2), span=43)
        return ([torch.cat([lg[0, 0], ax[0, 0]]) for lg, ax in one],
                [torch.cat([block[0][0, j], block[1][0, j]]) for j in range(3)])
    alone, block = both()
    assert all(torch.equal(x, y) for x, y in zip(alone, block))
    t.exact_attention = False
    alone, block = both()
    if all(torch.equal(x, y) for x, y in zip(alone, block)):
        summary_note("a8 block invariance: SDPA agreed bit for bit on this CPU too (negative control not shown)")


@pytest.mark.skipif(EXT is None or not EXT.has_avx2(), reason="needs the built extension on an AVX2 CPU")
def test_a8_trees_in_ragged_batches_stay_identical(qtarget):
    """q4a8 with an oracle tree proposer (deep accepted paths, KV compaction) in continuous batches of 3
    rows: every output equals plain q4a8 decoding, token for token."""
    from test_engine_lossless import ids, prompts
    from test_trees_engine import OracleTreeProposer, tree_llm

    from peagle import LLM, SamplingParams
    ps = prompts(7, seed=21)
    full = ids(LLM(qtarget, quantization="q4a8").generate(ps, SamplingParams(temperature=0, max_tokens=40,
                                                                             ignore_eos=True)))
    prop = OracleTreeProposer(4, {tuple(p["prompt_token_ids"]): f for p, f in zip(ps, full)}, 0.15, 0)
    llm = tree_llm(qtarget, prop, 4, 3, 12, quantization="q4a8", max_num_seqs=3)
    assert ids(llm.generate(ps, SamplingParams(temperature=0, max_tokens=23, ignore_eos=True))) == \
        [f[:23] for f in full]
    assert llm.get_metrics()["mean_acceptance_length"] > 1.5


@pytest.mark.skipif(EXT is None or not EXT.has_avx2(), reason="needs the built extension on an AVX2 CPU")
@pytest.mark.parametrize("hd", [64, 128])
def test_nan_scores_and_mask_bytes_read_the_same_on_every_path(hd):
    """Every path the same bits where the inputs are odd: a NaN score (the blocked forms' vector max let it
    become the row's max, so their output was the mean of v while the generic path left the key out), and a
    mask byte other than 0 / 1 (a bool tensor viewed from uint8: the blocked forms read 2 as hidden, the generic
    path as visible). Negative control: the NaN key's value row changes nothing, another key's does."""
    g = torch.Generator().manual_seed(9)
    B, T, nh, nkv, S = 1, 3, 6, 2, 37
    q = torch.randn(B, T, nh, hd, generator=g)
    k = torch.randn(B, nkv, S, hd, generator=g)
    v = torch.randn(B, nkv, S, hd, generator=g)
    for j in (0, 3, 8, 16, 36):                                          # lanes of the 8- and 16-wide maxima
        kn = k.clone()
        kn[:, :, j, 0] = float("nan")
        outs = [Q.attend_exact(q, kn, v, None, i) for i in ATT_IMPLS]
        assert all(torch.equal(o, outs[0]) for o in outs), j
        assert not outs[0].isnan().any()
        v2 = v.clone()
        v2[:, :, j] += 1.0
        assert torch.allclose(Q.attend_exact(q, kn, v2, None, 1), outs[0], atol=1e-30)   # the NaN key: ~0 weight
        v2[:, :, (j + 1) % S] += 1.0
        assert not torch.equal(Q.attend_exact(q, kn, v2, None, 1), outs[0])
    m01 = torch.rand(B, 1, T, S, generator=g) < 0.6
    m01[..., 0] = True
    twos = (m01.to(torch.uint8) * 2).view(torch.bool)                   # nonzero bytes that are not 1
    ref = Q.attend_exact(q, k, v, m01, 1)
    for i in ATT_IMPLS:
        assert torch.equal(Q.attend_exact(q, k, v, twos, i), ref), i


def block_and_steps(t, n: int, seed: int):
    """Logits of an n-token block after a 10-token prompt, and of the same tokens as n one-token steps."""
    g = torch.Generator().manual_seed(seed)
    prompt, nxt = torch.randint(5, 500, (1, 10), generator=g), torch.randint(5, 500, (1, n), generator=g)

    def prefilled():
        c = t.new_cache(1, 10 + n + 16)
        t.forward(prompt, c, 0, torch.zeros(1, dtype=torch.long), span=10, s0=0)
        return c
    c = prefilled()
    one = torch.cat([t.forward(nxt[:, j:j + 1], c, 0, torch.tensor([10 + j]), span=11 + j, s0=10 + j)[0][0]
                     for j in range(n)])
    return t.forward(nxt, prefilled(), 0, torch.tensor([10]), span=10 + n)[0][0], one


@pytest.mark.skipif(EXT is None, reason="needs the built extension")
@pytest.mark.parametrize("quantization", ["q8", "q4"])
def test_weight_only_target_65_position_block_same_bits_as_one_at_a_time(qtarget, quantization):
    """A tree's largest verify block (64 nodes + root = 65 positions, llama.EXACT_MAX_T) on a weight-only target
    still attends exactly: each position's logits equal, bit for bit, those of plain one-token steps."""
    from peagle.models.llama import Transformer
    t = Transformer.from_pretrained(qtarget, quantization=quantization)
    assert t.exact_attention
    block, one = block_and_steps(t, 65, 9)
    assert torch.equal(block, one), (block - one).abs().max()


@pytest.mark.skipif(EXT is None or not EXT.has_avx2(), reason="needs the built extension on an AVX2 CPU")
def test_a8_target_attends_exactly_past_the_weight_only_limit(qtarget):
    """8-bit activations turn attention's last bits into other tokens, so an a8 target attends in one fixed order
    in every block, also past llama.EXACT_MAX_T (where weight-only targets take SDPA): an 80-token block after a
    prompt gives each position the bits of plain one-token steps."""
    from peagle.models.llama import EXACT_MAX_T, Transformer
    t = Transformer.from_pretrained(qtarget, quantization="q4a8")
    block, one = block_and_steps(t, EXACT_MAX_T + 15, 10)
    assert torch.equal(block, one), (block - one).abs().max()
