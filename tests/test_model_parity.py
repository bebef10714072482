"""peagle's native target vs transformers on tiny random models of each supported family, float32 through
peagle's kernels and runner (the CPU default where the extension is built) and through torch's products."""
import pytest
import torch
from tiny import FAMILIES

from peagle.models import llama, quant_ext
from peagle.models.llama import Transformer


def hf(path):
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("layout", ["io", "dual"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_aux_match_transformers_batched_with_padding(tiny_dirs, family, layout, kernel, monkeypatch):
    path = tiny_dirs[family]
    monkeypatch.setattr(llama, "F32_KERNEL", kernel)
    ref, ours = hf(path), Transformer.from_pretrained(path, layout=layout)
    assert ours.dual_layout == (layout == "dual")
    assert ours.f32_kernel == (kernel and quant_ext.get() is not None)
    g = torch.Generator().manual_seed(1)
    lens = [3, 17, 40, 9]
    T = max(lens)
    toks = torch.randint(3, 512, (len(lens), T), generator=g)
    cache = ours.new_cache(len(lens), 128)
    aux_ids = (0, 2, 4)
    logits, aux = ours.forward(toks, cache, 0, torch.zeros(len(lens), dtype=torch.long), aux_ids=aux_ids)
    for b, n in enumerate(lens):  # padding after a row's real tokens must not change its real logits
        with torch.no_grad():
            out = ref(toks[b:b + 1, :n], output_hidden_states=True)
        assert (logits[b, :n] - out.logits[0]).abs().max() < 1e-4
        hs = torch.cat([out.hidden_states[i][0] for i in aux_ids[:2]], -1)
        assert (aux[b, :n, : hs.shape[-1]] - hs).abs().max() < 1e-4
        # id 4 = L is the residual after the last layer: HF normalises it, so compare through the norm
        last = torch.nn.functional.rms_norm(aux[b, :n, -ours.cfg.hidden_size:], (ours.cfg.hidden_size,),
                                            ours.norm, ours.cfg.rms_norm_eps)
        assert (last - out.hidden_states[4][0]).abs().max() < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cache_append_rollback_reappend_equals_fresh_prefill(tiny_dirs, family):
    m = Transformer.from_pretrained(tiny_dirs[family])
    g = torch.Generator().manual_seed(2)
    toks = torch.randint(3, 512, (2, 30), generator=g)
    z = torch.zeros(2, dtype=torch.long)
    fresh, _ = m.forward(toks, m.new_cache(2, 64), 0, z)
    c = m.new_cache(2, 64)
    m.forward(toks[:, :20], c, 0, z)
    junk = torch.randint(3, 512, (2, 6), generator=g)        # speculative block that gets rejected
    m.forward(junk, c, 0, torch.tensor([20, 20]))
    c.truncate(0, 20)
    c.truncate(1, 20)                                        # roll back, then re-append the real tokens
    a, _ = m.forward(toks[:, 20:25], c, 0, torch.tensor([20, 20]))
    b, _ = m.forward(toks[:, 25:], c, 0, torch.tensor([25, 25]))
    assert (torch.cat([a, b], 1) - fresh[:, 20:]).abs().max() < 1e-4
    # ragged rows: row 1 rolled back further than row 0, one block each
    c2 = m.new_cache(2, 64)
    m.forward(toks[:, :20], c2, 0, z)
    st = torch.tensor([20, 12])
    blk = torch.stack([toks[0, 20:28], toks[1, 12:20]])
    out, _ = m.forward(blk, c2, 0, st)
    assert (out[0] - fresh[0, 20:28]).abs().max() < 1e-4
    assert (out[1] - fresh[1, 12:20]).abs().max() < 1e-4


def test_bfloat16_runs_and_is_close(tiny_dirs):
    m32 = Transformer.from_pretrained(tiny_dirs["llama"])
    m16 = Transformer.from_pretrained(tiny_dirs["llama"], dtype=torch.bfloat16)
    toks = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(3))
    z = torch.zeros(1, dtype=torch.long)
    a, _ = m32.forward(toks, m32.new_cache(1, 32), 0, z)
    b, _ = m16.forward(toks, m16.new_cache(1, 32), 0, z)
    # relative to the logits' spread (the tiny model's probabilities are all ~1/512: a softmax bound held even
    # against the vocabulary reversed); bfloat16 keeps 8 bits of mantissa
    err = lambda x: ((x.float() - a).abs().max() / a.std()).item()
    print(f"bfloat16 error {err(b):.4f} of the logits' spread; reversed vocabulary {err(b.flip(-1)):.4f}")
    assert err(b) < 0.1 and err(b.flip(-1)) > 1.0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_final_logits_of_the_last_residual_are_transformers_logits(tiny_dirs, family):
    """final_logits (the training teacher's logits, from aux id L: the residual before the final norm) equal
    transformers' logits, over the whole vocabulary and over a subset of rows (qwen2: a tied LM head)."""
    path = tiny_dirs[family]
    ours = Transformer.from_pretrained(path)
    L = ours.cfg.num_hidden_layers
    toks = torch.randint(3, 512, (1, 9), generator=torch.Generator().manual_seed(4))
    _, aux = ours.forward(toks, ours.new_cache(1, 16), 0, torch.zeros(1, dtype=torch.long), aux_ids=(L,))
    with torch.no_grad():
        want = hf(path)(toks).logits[0]
    assert (ours.final_logits(aux[0]) - want).abs().max() < 1e-4
    rows = torch.tensor([3, 100, 511])
    assert (ours.final_logits(aux[0], rows) - want[:, rows]).abs().max() < 1e-4
