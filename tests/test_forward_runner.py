"""peagle/csrc/forward.cpp (the C++ layer runner of quantized targets): a forward through it gives the same logits,
auxiliary states and KV cache, bit for bit, as the per-op Python loop it replaces (llama.Transformer's
_forward_fused), for plain steps, verify blocks, ragged prefills and tree masks; it is really the path taken;
and it stays off where it does not apply."""
from __future__ import annotations

import pytest
import torch

from peagle.models import quant_ext

EXT = quant_ext.get()
pytestmark = pytest.mark.skipif(EXT is None or not hasattr(EXT, "LayerStack"), reason="needs the built extension")


def _run(t, runner: bool, steps):
    """steps: (tokens [B,T], b0, start [B], kwargs) applied in order to one cache -> outputs and the cache."""
    t.runner = runner
    c = t.new_cache(3, 64)
    outs = [t.forward(tok, c, b0, start, **kw) for tok, b0, start, kw in steps]
    return outs, c


def _tree(TreeAttn, parents, start):
    """A TreeAttn of per-row parent lists (-1: the root) for blocks starting at start [B]."""
    B, W = len(parents), len(parents[0])
    anc = torch.zeros(B, W, W, dtype=torch.bool)
    depth = torch.zeros(B, W, dtype=torch.long)
    for b, ps in enumerate(parents):
        for i in range(W):
            j = i
            while j >= 0:
                anc[b, i, j] = True
                depth[b, i] += j != i
                j = ps[j]
    return TreeAttn(pos=start[:, None] + depth, base=start, anc=anc)


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


@pytest.mark.parametrize("quantization", ["q4a8", "q8a8", "q4", "q8", "none"])
def test_runner_matches_the_python_loop_bit_for_bit(qtarget, quantization, monkeypatch):
    from peagle.models import llama
    from peagle.tree import TreeAttn
    t = llama.Transformer.from_pretrained(qtarget, quantization=quantization)
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randint(5, 500, s, generator=g)
    tree = _tree(TreeAttn, [[-1, 0, 0, 1], [-1, 0, 1, 2]], torch.tensor([30, 21]))
    steps = [
        (r(2, 30), 0, torch.tensor([0, 0]), dict(span=30, s0=0)),                 # prefill, one slice
        (r(1, 21), 2, torch.tensor([0]), dict(aux_ids=(0, 1, 2))),                # another row, aux states
        (r(2, 1), 0, torch.tensor([30, 21]), dict(span=31)),                      # ragged decode (mask)
        (r(1, 1), 0, torch.tensor([31]), dict(span=32, s0=31, aux_ids=(2, 1))),   # plain step, no mask
        (r(2, 4), 0, torch.tensor([30, 21]), dict(span=34, tree=tree)),           # trees
        (r(2, 5), 0, torch.tensor([31, 22]), dict(logits_at=torch.tensor([4, 2]), span=36)),   # verify block
    ]
    ref, cref = _run(t, False, steps)
    assert t._layer_stack() is None
    with monkeypatch.context() as m:                 # the runner must not fall back to the Python ops
        m.setattr(llama, "cached_attention", lambda *a, **k: pytest.fail("the Python loop ran"))
        got, cgot = _run(t, True, steps)
    assert t._layer_stack() is not None and t._layer_stack().act8 == quantization.endswith("a8")
    for (lg, ax), (lg2, ax2) in zip(ref, got):
        assert torch.equal(lg, lg2) and _same(ax, ax2)
    for i in range(t.cfg.num_hidden_layers):
        assert torch.equal(cref.k[i], cgot.k[i]) and torch.equal(cref.v[i], cgot.v[i])
    # negative control: one layer's norm weight scaled by 1 % changes the runner's output
    t2 = llama.Transformer.from_pretrained(qtarget, quantization=quantization)
    t2.layers[1].ln2.mul_(1.01)
    bad, _ = _run(t2, True, steps)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(bad, got))


@pytest.mark.skipif(EXT is None or not EXT.has_avx2(), reason="needs the built extension on an AVX2 CPU")
@pytest.mark.parametrize("quantization", ["q4a8", "q8", "none"])
def test_runner_scalar_and_avx2_paths_agree_bit_for_bit(qtarget, quantization):
    """The runner built on the scalar kernels (impl 1) computes the AVX2 runner's bits (a verify block with a
    mask after a prefill)."""
    from peagle.models import llama
    t = llama.Transformer.from_pretrained(qtarget, quantization=quantization)
    g = torch.Generator().manual_seed(4)
    x = t.embed[torch.randint(5, 500, (1, 20), generator=g)]
    outs = []
    for impl in (0, 1):
        st = llama._target_stack(t, impl)
        c = t.new_cache(1, 32)
        ctx = llama.BlockCtx(t.rope, torch.tensor([0]), 20)
        outs.append(st.run.forward(x, c.k, c.v, ctx.cos, ctx.sin, ctx.pos_w, ctx.mask, 0, ctx.S, [1]) + c.k + c.v)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_runner_stays_off_where_it_does_not_apply(qtarget, monkeypatch):
    from peagle.models import llama
    from peagle.models.quant import QuantStack
    t = llama.Transformer.from_pretrained(qtarget, quantization="q4a8")
    t.layers[0].o_w = QuantStack([t.layers[0].o_w])     # a mixed-type projection: the Python loop runs it
    assert t._layer_stack() is None
    monkeypatch.setattr(llama, "F32_KERNEL", False)       # float32 through torch's products: no runner
    f = llama.Transformer.from_pretrained(qtarget, quantization="none")
    assert not f.fused and not f.f32_kernel and f._layer_stack() is None


def test_runner_refuses_bad_positions(qtarget):
    from peagle.models import llama
    t = llama.Transformer.from_pretrained(qtarget, quantization="q4a8")
    st = t._layer_stack()
    x = torch.zeros(1, 1, t.cfg.hidden_size)
    c = t.new_cache(1, 16)
    cos = torch.zeros(1, 1, t.cfg.head_dim)
    with pytest.raises(RuntimeError, match="outside the cache"):
        st.run.forward(x, c.k, c.v, cos, cos, torch.tensor([[16]]), None, 0, 1, [])
    with pytest.raises(RuntimeError, match="one k and one v cache per layer"):
        st.run.forward(x, c.k[:1], c.v[:1], cos, cos, torch.tensor([[0]]), None, 0, 1, [])


@pytest.fixture(scope="module")
def hd96_target(tmp_path_factory):
    """A tiny llama of one 96-wide head (kv 1, every width a multiple of 32): float32 1 / sqrt(96) is not the
    rounded 96 ** -0.5 (the qtarget's 16 and SmolLM2's 64 are powers of 4, where every formula agrees)."""
    from tiny import save_tiny
    return save_tiny("llama", str(tmp_path_factory.mktemp("hd96") / "llama"), hidden=96, heads=1, kv=1, layers=2,
                     intermediate_size=128)


def test_runner_scales_scores_by_the_python_head_dim_power(hd96_target):
    """The runner's attention scale is Python's hd ** -0.5 rounded to float32 (quant.attend_exact's), so a head
    size where 1 / sqrtf(hd) is one ulp off (96) still gives the loop's bits. Negative control: the two scales
    differ here."""
    import numpy as np

    from peagle.models import llama
    assert np.float32(96 ** -0.5) != np.float32(1) / np.sqrt(np.float32(96))
    t = llama.Transformer.from_pretrained(hd96_target, quantization="q8")
    assert t.cfg.head_dim == 96
    g = torch.Generator().manual_seed(5)
    steps = [(torch.randint(5, 500, (1, 12), generator=g), 0, torch.tensor([0]), dict(span=12, s0=0)),
             (torch.randint(5, 500, (1, 3), generator=g), 0, torch.tensor([12]), dict(span=15))]
    (ref, cref), (got, cgot) = _run(t, False, steps), _run(t, True, steps)
    assert t._layer_stack() is not None
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ref, got))
    assert all(torch.equal(a, b) for a, b in zip(cref.k + cref.v, cgot.k + cgot.v))


def test_runner_keeps_one_aux_slot_per_repeated_layer(hd96_target):
    """aux_ids naming a layer twice give it one slot, as the Python loop's `i in aux_ids` does (aux [B, T, distinct
    layers * H], in layer order); counting the repeat left an unwritten slot in the runner's aux."""
    from peagle.models import llama
    t = llama.Transformer.from_pretrained(hd96_target, quantization="q8")
    steps = [(torch.randint(5, 500, (2, 6), generator=torch.Generator().manual_seed(6)), 0, torch.tensor([0, 0]),
              dict(span=6, s0=0, aux_ids=(2, 0, 2, 0)))]
    (ref, _), (got, _) = _run(t, False, steps), _run(t, True, steps)
    assert ref[0][1].shape == (2, 6, 2 * 96)
    assert torch.equal(ref[0][0], got[0][0]) and torch.equal(ref[0][1], got[0][1])


@pytest.mark.skipif(EXT is None or not EXT.has_avx512(), reason="needs a CPU with AVX-512 VNNI")
@pytest.mark.parametrize("quantization", ["q4", "q8"])
def test_a_weight_only_runner_reads_the_packed_layout(qtarget, quantization):
    """The layer runner hands a weight-only projection its pack_a8 layout (the AVX-512 path's): two layers' o
    projections given each other's layout give another output (negative control of the bits test above, which
    the AVX2 path alone would also pass)."""
    from peagle.models import llama
    from peagle.models import quant as Q
    steps = [(torch.randint(5, 500, (1, 6), generator=torch.Generator().manual_seed(4)), 0, torch.tensor([0]),
              dict(span=6, s0=0))]
    before = {q: EXT.avx512_min_rows(q, False) for q in (Q.Q4_1, Q.Q8_0)}
    try:
        for q in before:
            EXT.set_avx512_min_rows(q, False, 1)        # the AVX-512 path at every row count
        t = llama.Transformer.from_pretrained(qtarget, quantization=quantization)
        ref, _ = _run(t, True, steps)
        t2 = llama.Transformer.from_pretrained(qtarget, quantization=quantization)
        a, b = t2.layers[0].o_w, t2.layers[1].o_w
        a._packed, b._packed = b.packed_a8(EXT), a.packed_a8(EXT)
        bad, _ = _run(t2, True, steps)
    finally:
        for q, rows in before.items():
            EXT.set_avx512_min_rows(q, False, rows)
    assert t._layer_stack() is not None and not t._layer_stack().act8
    assert not torch.equal(ref[0][0], bad[0][0])
