"""peagle.models.layers: the few-row products' layout and what it lets attention use."""
import pytest
import torch
from torch.profiler import profile

from peagle.models import layers, llama
from peagle.models.layers import OI_MAX_ROWS, Weight, mm
from peagle.models.llama import Transformer


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, OI_MAX_ROWS + 1])
def test_dual_weight_products_are_exact_and_row_major(rows, pack, monkeypatch):
    """Every path: x @ W_io (1 row, prefill), W_oi @ x^T, oneDNN's packed weights from 8 rows (PACK off: none)."""
    monkeypatch.setattr(layers, "PACK", pack)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 40, generator=g)
    x = torch.randn(1, rows, 40, generator=g)
    wt = Weight(w, dual=True)
    assert (wt.pk is not None) == (pack and torch.backends.mkldnn.is_available()) and wt.oi is not None
    y = mm(x, wt)
    xt = torch.randn(1, 40, rows, generator=g).transpose(1, 2)        # a non-contiguous input (strides 1, rows)
    assert torch.allclose(mm(xt, wt), xt @ w.t(), atol=1e-5)
    assert torch.allclose(mm(x, wt.to(torch.float32)), x @ w.t(), atol=1e-5)   # a moved copy keeps its layouts
    assert torch.allclose(y, x @ w.t(), atol=1e-5)
    # W_oi @ x^T yields a column-major result; handed on as is, every later op (rope, the residual adds)
    # inherits its strides and SDPA falls back from its fused kernel to the unfused one
    assert y.is_contiguous()


def _attention_kernels(model, T):
    cache = model.new_cache(1, 64)
    model.forward(torch.arange(3, 23)[None], cache, 0, torch.tensor([0]), span=20, s0=0)
    with profile() as p:
        model.forward(torch.arange(3, 3 + T)[None], cache, 0, torch.tensor([20]), span=20 + T, s0=20)
    return {e.key for e in p.key_averages() if "scaled_dot_product" in e.key}


@pytest.mark.parametrize("T", [2, 4])
def test_verification_block_takes_the_fused_attention_kernel(tiny_dirs, T, monkeypatch):
    """A verify block of T tokens in the two-layout target on torch's products (the path off the CPU float32
    kernels, e.g. a GPU's) reaches SDPA's fused CPU kernel, as one token does."""
    monkeypatch.setattr(llama, "F32_KERNEL", False)
    model = Transformer.from_pretrained(tiny_dirs["llama"], layout="dual")
    kernels = _attention_kernels(model, T)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in kernels
    assert "aten::_scaled_dot_product_attention_math" not in kernels


def test_negative_control_a_column_major_query_takes_the_unfused_kernel():
    q = torch.randn(1, 9, 64, 2).transpose(-1, -2)          # [1,9,2,64], last-dim stride 2
    k = v = torch.randn(1, 3, 20, 64)
    mask = torch.ones(1, 1, 2, 20, dtype=torch.bool)
    with profile() as p:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert "aten::_scaled_dot_product_attention_math" in {e.key for e in p.key_averages()}


@pytest.mark.parametrize("decode", [False, True])
def test_sliding_window_at_exactly_window_plus_one_keys_matches_transformers(tmp_path, decode):
    """Span = window + 1 is the first span with a key outside a query's window (key 0 for the query at position
    window): a 9-token prefill, or a one-token step after 8, on a window-8 Mistral equals transformers' logits."""
    import transformers as tf
    from tiny import save_tiny
    path = save_tiny("mistral", str(tmp_path / "mistral-sw"), sliding_window=8)
    m = Transformer.from_pretrained(path)
    ids = torch.randint(3, 512, (1, 9), generator=torch.Generator().manual_seed(8))
    cache = m.new_cache(1, 16)
    if decode:
        m.forward(ids[:, :8], cache, 0, torch.zeros(1, dtype=torch.long), span=8, s0=0)
        got, _ = m.forward(ids[:, 8:], cache, 0, torch.tensor([8]), span=9, s0=8)
    else:
        got, _ = m.forward(ids, cache, 0, torch.zeros(1, dtype=torch.long), span=9, s0=0)
    with torch.no_grad():
        want = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits
    assert torch.allclose(got[0, -1], want[0, -1], atol=1e-4), (got[0, -1] - want[0, -1]).abs().max()


@pytest.mark.parametrize("kernel", [True, False])
def test_a_loose_span_hides_stale_keys_past_a_one_token_step(tiny_dirs, kernel, monkeypatch):
    """span is only an upper bound of max(start) + T (BlockCtx): a one-token step at s0 with a span past s0 + 1
    reads the slots of a rejected block that still hold its keys, and must mask them (only span == s0 + 1 may
    run without a mask): the same logits as with the exact span."""
    monkeypatch.setattr(llama, "F32_KERNEL", kernel)
    m = Transformer.from_pretrained(tiny_dirs["llama"])
    g = torch.Generator().manual_seed(3)
    ctx, junk, tok = (torch.randint(3, 512, (1, n), generator=g) for n in (20, 6, 1))
    c = m.new_cache(1, 64)
    m.forward(ctx, c, 0, torch.tensor([0]), span=20, s0=0)

    def step(span):
        m.forward(junk, c, 0, torch.tensor([20]), span=26, s0=20)       # a rejected block: stale keys 20..25
        return m.forward(tok, c, 0, torch.tensor([20]), span=span, s0=20)[0]
    exact, loose = step(21), step(26)
    assert torch.allclose(loose, exact, atol=1e-5), (loose - exact).abs().max()


@pytest.mark.parametrize("B,T,span,s0,limit,window", [
    (1, 1, 41, 40, None, None),       # a plain step: no mask
    (1, 2, 42, 40, None, None),       # a 2-token verify
    (3, 4, 30, None, None, None),     # rows at other starts
    (2, 3, 70, None, 64, None),       # positions past the cache's end: clamped
    (2, 5, 50, None, None, 8),        # a sliding window
])
def test_block_ctx_in_one_call_equals_the_torch_ops(B, T, span, s0, limit, window, monkeypatch):
    """BlockCtx's positions, rope rows and mask from the extension's one call (block_ctx) are those of the torch
    ops, in every case BlockCtx distinguishes; the torch ops' mask itself is checked against the rule (a mask that
    hid the query's own key, or showed the next, would differ)."""
    from peagle.models import quant_ext
    if quant_ext.get() is None or not hasattr(quant_ext.get(), "block_ctx"):
        pytest.skip("the C++ extension is not built (make setup)")
    rope = layers.Rope(16, 10000.0, None, 128)
    start = torch.tensor([62 if limit else 40, 25, 7][:B]) if s0 is None else torch.full((B,), s0)
    one = layers.BlockCtx(rope, start, T, 0, span, s0, limit, window)
    monkeypatch.setattr(quant_ext, "get", lambda: None)
    ops = layers.BlockCtx(rope, start, T, 0, span, s0, limit, window)
    for name in ("pos", "pos_w", "cos", "sin"):
        assert torch.equal(getattr(one, name), getattr(ops, name)), name
    assert (one.mask is None) == (ops.mask is None) == (B == 1 and T == 1)
    assert one.S == ops.S and (limit is None or (one.pos_w < limit).all() and (one.pos >= limit).any())
    if ops.mask is not None:
        assert torch.equal(one.mask, ops.mask)
        keys, q = torch.arange(one.S), one.pos[..., None]
        want = (keys <= q) & ((keys > q - window) if window else True)
        assert torch.equal(ops.mask[:, 0], want)
