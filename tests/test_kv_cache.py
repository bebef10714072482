"""A bfloat16 KV cache (loader.load_target's kv_cache_dtype; `--kv-cache-dtype bfloat16`): every kernel reads it
as a float32 cache holding the same rounded values (exact attention on each path, the RoPE write, the tree
compaction), the C++ layer runner gives the Python loop's bits on it, and speculative decoding on it -- chains
and trees -- gives plain decoding's tokens on the same cache."""
from __future__ import annotations

import pytest
import torch

from peagle import LLM, SamplingParams
from peagle.errors import PeagleError
from peagle.models import quant_ext

EXT = quant_ext.get()
needs_ext = pytest.mark.skipif(EXT is None, reason="needs the built extension")


def impls():
    """The attention paths this CPU runs: generic, AVX2, AVX-512."""
    if EXT is None:
        return []
    return [1] + ([2] if EXT.has_avx2() else []) + ([3] if EXT.has_avx512() else [])


@needs_ext
@pytest.mark.parametrize("impl", impls())
@pytest.mark.parametrize("B,T,S,masked", [(1, 1, 300, False), (2, 8, 97, True), (3, 3, 700, True), (1, 1, 33, True)])
def test_attention_reads_bfloat16_as_its_float32_values(impl, B, T, S, masked):
    g = torch.Generator().manual_seed(B * 1000 + S)
    q, k, v = (torch.randn(*s, generator=g) for s in ((B, T, 9, 64), (B, 3, S, 64), (B, 3, S, 64)))
    mask = (torch.rand(B, 1, T, S, generator=g) > 0.3) if masked else None
    kb, vb = k.bfloat16(), v.bfloat16()
    got = EXT.attend_exact(q, kb, vb, mask, 0.125, impl)
    assert torch.equal(got, EXT.attend_exact(q, kb.float(), vb.float(), mask, 0.125, impl))
    # negative control: the unrounded values give other bits
    assert not torch.equal(got, EXT.attend_exact(q, k, v, mask, 0.125, impl))
    if impl > 1:                                        # and every path the generic one's bits
        assert torch.equal(got, EXT.attend_exact(q, kb, vb, mask, 0.125, 1))


@needs_ext
def test_attention_refuses_mixed_cache_types():
    q, k = torch.randn(1, 1, 3, 64), torch.randn(1, 1, 8, 64)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        EXT.attend_exact(q, k, k.bfloat16(), None, 0.125, 0)


@needs_ext
def test_rope_write_rounds_as_torch_does():
    B, T, nh, nkv, hd = 2, 3, 9, 3, 64
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(B, T, (nh + 2 * nkv) * hd, generator=g)
    cos, sin = torch.randn(B, T, hd, generator=g), torch.randn(B, T, hd, generator=g)
    pos = torch.tensor([[4, 5, 6], [0, 1, 2]])
    kc = torch.zeros(3, nkv, 16, hd)
    vc, kb, vb = torch.zeros_like(kc), kc.bfloat16(), kc.bfloat16()
    q = EXT.rope_kv(qkv, cos, sin, kc, vc, 1, pos, nh, nkv)
    assert torch.equal(q, EXT.rope_kv(qkv, cos, sin, kb, vb, 1, pos, nh, nkv))
    assert torch.equal(kb, kc.bfloat16()) and torch.equal(vb, vc.bfloat16()) and kb.abs().sum() > 0


@needs_ext
def test_tree_compaction_moves_bfloat16_entries():
    from peagle.cache import KVCache
    from peagle.tree import compact_kv
    caches = []
    for dtype in (torch.float32, torch.bfloat16):
        c = KVCache(2, 3, 64, 32, rows=2, dtype=dtype)
        g = torch.Generator().manual_seed(2)
        for store in (c.k, c.v):
            for t in store:
                t.copy_(torch.randn(t.shape, generator=g))
        caches.append(c)
    before = caches[1].k[0].clone()
    start, path = torch.tensor([3, 5]), torch.tensor([[0, 2, 5, 5], [0, 1, 3, 3]])
    for c in caches:
        compact_kv(c, 0, start, path)
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        assert torch.equal(a.bfloat16(), b)
    assert torch.equal(caches[1].k[0][0, :, 4], before[0, :, 5]) and not torch.equal(caches[1].k[0], before)


@needs_ext
@pytest.mark.parametrize("quantization", ["q4a8", "none"])
def test_runner_matches_the_python_loop_on_a_bfloat16_cache(qtarget, quantization, monkeypatch):
    from peagle.models import llama
    t = llama.Transformer.from_pretrained(qtarget, quantization=quantization)
    t.kv_dtype = torch.bfloat16
    g = torch.Generator().manual_seed(3)
    steps = [(torch.randint(5, 500, (2, 20), generator=g), torch.tensor([0, 0]), dict(span=20, s0=0)),
             (torch.randint(5, 500, (2, 1), generator=g), torch.tensor([20, 20]), dict(span=21, s0=20)),
             (torch.randint(5, 500, (2, 4), generator=g), torch.tensor([21, 18]), dict(span=25))]
    outs, caches = [], []
    for runner in (False, True):
        t.runner = runner
        c = t.new_cache(2, 32)
        with monkeypatch.context() as m:
            if runner:                                  # the runner must not fall back to the Python ops
                m.setattr(llama, "cached_attention", lambda *a, **k: pytest.fail("the Python loop ran"))
            outs.append([t.forward(x, c, 0, s, **kw)[0] for x, s, kw in steps])
        caches.append(c)
    assert t._layer_stack() is not None and caches[1].k[0].dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert all(torch.equal(a, b) for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v))
    t.kv_dtype = torch.float32                          # negative control: a float32 cache gives other logits
    c = t.new_cache(2, 32)
    f32 = [t.forward(x, c, 0, s, **kw)[0] for x, s, kw in steps]
    assert not all(torch.equal(a, b) for a, b in zip(f32, outs[1]))


@pytest.fixture(scope="module")
def smollm2():
    from peagle.default_target import ensure
    return ensure(verbose=False)


def test_speculative_decoding_on_a_bfloat16_cache_is_plain_decoding(smollm2):
    """The default target (q4a8 where the kernels run) with P-EAGLE's shipped head: K=3 chains and a 2x6 tree, a
    batch of three prompts of different lengths, greedy -- every token plain decoding's on the same cache."""
    from peagle.llm import DEFAULT_PEAGLE_HEAD
    plain = LLM(smollm2, kv_cache_dtype="bfloat16", max_num_seqs=3)
    assert plain.engine.cache.k[0].dtype == torch.bfloat16 and "bfloat16 KV cache" in plain.engine.target.precision
    prompts = [plain.apply_chat_template([{"role": "user", "content": m}]) for m in
               ("Write a Python function that reverses a list.", "Name three rivers.",
                "Explain, step by step and in detail, how a hash map handles collisions, with an example.")]
    sp = SamplingParams(temperature=0, max_tokens=40)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    head = {"method": "eagle3", "model": DEFAULT_PEAGLE_HEAD, "num_speculative_tokens": 3, "parallel_drafting": True}
    for extra in ({}, {"eagle_topk": 2, "num_draft_tokens": 6}):
        spec = plain.with_speculative_config(head | extra)
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp)] == want
        assert spec.get_metrics()["num_accepted_tokens"] > 0


def test_bad_kv_cache_dtypes_are_refused(smollm2, tiny_dirs):
    with pytest.raises(PeagleError, match="kv_cache_dtype must be one of auto, float32, bfloat16"):
        LLM(smollm2, kv_cache_dtype="fp8")
    with pytest.raises(PeagleError, match="needs the native target"):
        LLM(tiny_dirs["llama"], target_backend="transformers", kv_cache_dtype="bfloat16")


def test_auto_is_bfloat16_for_8_bit_activations_only():
    from peagle.models.loader import resolve_kv_cache_dtype
    for q in ("q4a8", "q8a8"):
        kv, why = resolve_kv_cache_dtype("auto", q, torch.float32)
        assert kv == "bfloat16" and "8-bit-activation" in why
    for q in ("none", "q8", "q4"):
        assert resolve_kv_cache_dtype("auto", q, torch.float32) == ("auto", "")
    assert resolve_kv_cache_dtype("auto", "q4a8", torch.bfloat16) == ("auto", "")
    assert resolve_kv_cache_dtype("float32", "q4a8", torch.float32) == ("float32", "")
    with pytest.raises(PeagleError, match="must be one of"):
        resolve_kv_cache_dtype("fp16", "q4a8", torch.float32)


@needs_ext
def test_the_default_target_runs_a_bfloat16_cache_unless_told_float32(smollm2, capsys):
    auto = LLM(smollm2, quantization="q4a8", max_num_seqs=1)
    assert auto.engine.cache.k[0].dtype == torch.bfloat16 and "bfloat16 KV cache" in auto.engine.target.precision
    assert "kv cache dtype auto -> bfloat16" in capsys.readouterr().err
    f32 = LLM(smollm2, quantization="q4a8", kv_cache_dtype="float32", max_num_seqs=1)
    assert f32.engine.cache.k[0].dtype == torch.float32 and "KV cache" not in f32.engine.target.precision
    assert "kv cache dtype" not in capsys.readouterr().err
    assert LLM(smollm2, quantization="none", max_num_seqs=1).engine.cache.k[0].dtype == torch.float32
    with pytest.raises(PeagleError, match="float32 needs a float32 target"):
        LLM(smollm2, dtype="bfloat16", kv_cache_dtype="float32")
