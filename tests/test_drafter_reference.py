"""The single cached P-EAGLE pass (and EAGLE-3's K passes) equal a reference computed without any cache:
the whole sequence plus the draft rows through the drafter at once under a plain causal mask."""
import os

import pytest
import torch
from heads import save_random_head

from peagle.drafters.base import DraftBatch
from peagle.drafters.eagle3 import Eagle3Proposer
from peagle.drafters.peagle import PEagleProposer
from peagle.heads.model import DrafterHead
from peagle.models.llama import Transformer


def setup(tiny_dirs, tmp_path, parallel):
    t = Transformer.from_pretrained(tiny_dirs["llama"])
    hd = save_random_head(tiny_dirs["llama"], str(tmp_path / "h"), layers=2, parallel=parallel, draft_vocab=256)
    head = DrafterHead.from_pretrained(hd, t.cfg)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(5, 500, (1, 30), generator=g)
    _, aux = t.forward(x, t.new_cache(1, 64), 0, torch.zeros(1, dtype=torch.long), head.aux_ids)
    return t, head, x, aux


def reference(head, x, aux, n, K, parallel):
    """Drafts for 'the new token is x[n]' from scratch: rows (x[q+1], fc(aux[q])) for q < n, then K-1 mask rows
    (P-EAGLE) or K-1 autoregressive rows (EAGLE-3, each with the previous row's prenorm output)."""
    with torch.no_grad():
        ids = x[:, 1:n + 1]
        hid = head.combine(aux[:, :n])
        if parallel:
            m = head.combine(head.mask_hidden.reshape(1, 1, -1)).expand(1, K - 1, -1)
            ids = torch.cat([ids, torch.full((1, K - 1), head.mask_token_id)], 1)
            hid = torch.cat([hid, m], 1)
            T = ids.shape[1]
            normed, _ = head(ids, hid, torch.arange(T)[None], ctx_mask=torch.ones(T, T, dtype=torch.bool).tril())
            return head.to_target(head.draft_logits(normed[0, n - 1:]).argmax(-1))
        drafts = []
        for _ in range(K):
            T = ids.shape[1]
            normed, pre = head(ids, hid, torch.arange(T)[None], ctx_mask=torch.ones(T, T, dtype=torch.bool).tril())
            d = head.to_target(head.draft_logits(normed[0, -1]).argmax(-1))
            drafts.append(d)
            ids = torch.cat([ids, d.view(1, 1)], 1)
            hid = torch.cat([hid, pre[:, -1:]], 1)
        return torch.stack(drafts)


def run_scaled(w, factor, fn):
    """fn() with the weight w scaled by factor (restored after): the negative controls' changed head."""
    with torch.no_grad():
        w.mul_(factor)
    try:
        return fn()
    finally:
        with torch.no_grad():
            w.div_(factor)


def run_cached(prop, x, aux, steps, ks=None, host=False):
    """steps: list of n (the index of the new token) with increasing n: step 1 prefills the context,
    later steps add the accepted rows (ragged), overwriting the stale mask / draft KV of the step before.
    ks: the K of each step (default the proposer's); a jump of many rows is the catch-up after K = 0 steps.
    host: the engine's host-side facts (span, s0: one row, all its rows real) with each step's batch."""
    out, done = [], 0
    for i, n in enumerate(steps):
        if i == 0 and n > 1:
            prop.prefill(DraftBatch(x[:, 1:n], aux[:, :n - 1], torch.zeros(1, dtype=torch.long), torch.tensor([n - 1])))
            done = n - 1
        rows = slice(done, n)
        facts = {"span": n, "s0": done} if host else {}
        out.append(prop.propose(DraftBatch(x[:, done + 1:n + 1], aux[:, rows], torch.tensor([done]),
                                           torch.tensor([n - done]), **facts), ks[i] if ks else None))
        done = n
    return out


@pytest.mark.parametrize("host", [False, True])   # True: the engine's one-row path (mask rows appended)
def test_peagle_single_pass_matches_uncached_reference(tiny_dirs, tmp_path, host):
    t, head, x, aux = setup(tiny_dirs, tmp_path, True)
    K = 5
    prop = PEagleProposer(head, K, 128)
    steps = [12, 15, 16, 21]           # accepted 2, 0, 4 drafts between steps
    for n, got in zip(steps, run_cached(prop, x, aux, steps, host=host)):
        ref = reference(head, x, aux, n, K, True)
        assert torch.equal(got[0], ref), (n, got, ref)


def test_eagle3_k_passes_match_uncached_reference(tiny_dirs, tmp_path):
    t, head, x, aux = setup(tiny_dirs, tmp_path, False)
    K = 4
    prop = Eagle3Proposer(head, K, 128)
    steps = [9, 13, 14, 18]
    for n, got in zip(steps, run_cached(prop, x, aux, steps)):
        ref = reference(head, x, aux, n, K, False)
        assert torch.equal(got[0], ref), (n, got, ref)


@pytest.mark.parametrize("host", [False, True])
def test_runtime_k_changes_and_catch_up_match_uncached_reference(tiny_dirs, tmp_path, host):
    """K chosen per step (1..built K; the mask slots / AR passes sized per step), and a catch-up of 8 rows after
    K = 0 steps: every draft block equals the from-scratch reference at that step's K."""
    steps, ks = [10, 13, 14, 22, 25, 26], [5, 2, 1, 4, 3, 5]
    for parallel, cls in ((True, PEagleProposer), (False, Eagle3Proposer)):
        t, head, x, aux = setup(tiny_dirs, tmp_path / str(parallel), parallel)
        prop = cls(head, 5, 128)
        for n, k, got in zip(steps, ks, run_cached(prop, x, aux, steps, ks, host=host)):
            assert got.shape == (1, k)
            ref = reference(head, x, aux, n, k, parallel)
            assert torch.equal(got[0], ref), (parallel, n, k, got, ref)


def test_fused_ops_path_of_quantized_heads_matches_the_torch_ops(tiny_dirs, tmp_path):
    """With a quantized target the head's cached pass runs the extension's fused ops (_forward_cached_fused):
    on the same Q8_0 weights it gives what the torch ops give, to float rounding (the RMSNorm sums and the
    attention's order differ in the last bits); negative control: a norm weight changed by 5 % is seen."""
    import pytest

    from peagle.cache import KVCache
    from peagle.models import quant_ext
    if quant_ext.get() is None:
        pytest.skip("needs the built extension")
    t, head, x, aux = setup(tiny_dirs, tmp_path, True)
    for quantization in ("q8", "q4a8"):
        head.prepare_inference(quantization=quantization)
        assert head._fused_ops
        hid = head.combine(aux)

        def run(fused):
            head._fused_ops = fused
            c = KVCache(2, head.config.num_key_value_heads, head.config.head_dim, 64, 1, lens=False)
            with torch.no_grad():
                a = head._forward_cached(x[:, :20], hid[:, :20], c, 0, torch.tensor([0]))
                b = head._forward_cached(x[:, 20:23], hid[:, 20:23], c, 0, torch.tensor([20]))
            return [torch.cat([n, p], -1) for n, p in (a, b)]
        ref, got = run(False), run(True)
        for r, g in zip(ref, got):
            assert torch.allclose(r, g, rtol=1e-3, atol=1e-3 * float(r.abs().max())), (quantization, (r - g).abs().max())
        bad = run_scaled(head.layers[1].post_attention_layernorm.weight, 1.05, lambda: run(True))
        assert not torch.allclose(ref[1], bad[1], rtol=1e-3, atol=1e-3 * float(ref[1].abs().max()))


def test_layer_runner_gives_the_python_loops_bits(tiny_dirs, tmp_path):
    """A quantized target's head runs its layers in the C++ runner (peagle/csrc/forward.cpp, layer 0 reading its 2H
    input): normed and prenorm outputs and the KV cache bit-identical to _forward_cached_fused's Python loop, for
    a prompt block and a verify-sized block after it; negative control: a norm weight changed by 1 % is seen."""
    import pytest

    from peagle.cache import KVCache
    from peagle.models import quant_ext
    if quant_ext.get() is None or not hasattr(quant_ext.get(), "LayerStack"):
        pytest.skip("needs the built extension")
    from peagle.models.tiny import save_tiny
    # every projection of the head in blocks of 32 (the tiny target's intermediate size, 144, is not)
    tiny = {"llama": save_tiny("llama", str(tmp_path / "t"), intermediate_size=128)}
    t, head, x, aux = setup(tiny, tmp_path, True)
    for quantization in ("q8", "q4a8"):
        head.prepare_inference(quantization=quantization)
        stack = head._stack
        assert stack is not None and stack.act8 == quantization.endswith("a8")
        hid = head.combine(aux)

        def run(runner):
            head._stack = stack if runner else None
            c = KVCache(2, head.config.num_key_value_heads, head.config.head_dim, 64, 1, lens=False)
            with torch.no_grad():
                a = head._forward_cached(x[:, :20], hid[:, :20], c, 0, torch.tensor([0]))
                b = head._forward_cached(x[:, 20:23], hid[:, 20:23], c, 0, torch.tensor([20]))
            return [t for pair in (a, b) for t in pair] + [c.k[1][:, :, :23], c.v[1][:, :, :23]]
        ref, got = run(False), run(True)
        for r, g in zip(ref, got):
            assert torch.equal(r, g), (quantization, (r - g).abs().max())
        bad = run_scaled(head.layers[1].post_attention_layernorm.weight, 1.01, lambda: run(False))
        assert not torch.equal(got[2], bad[2])
        head._stack = stack


def test_drafts_are_target_ids_through_the_stored_d2t(tiny_dirs, tmp_path):
    """A head with a 256-token draft vocabulary (every 2nd target id) proposes target ids: draft index i becomes
    i + d2t[i] with d2t as stored in the head's file (vLLM's draft_id_to_target_id), for both kinds of head."""
    from heads import propose_capturing_logits
    from safetensors.torch import load_file
    for parallel, cls in ((True, PEagleProposer), (False, Eagle3Proposer)):
        t, head, x, aux = setup(tiny_dirs, tmp_path / str(parallel), parallel)
        d2t = load_file(str(tmp_path / str(parallel) / "h" / "model.safetensors"))["d2t"]
        assert bool((d2t != 0).any())
        drafts, seen = propose_capturing_logits(cls(head, 3, 64), head, aux, x, 12)
        idx = torch.cat([lg.reshape(-1, lg.shape[-1]) for lg in seen]).argmax(-1)
        assert drafts.flatten().tolist() == (idx + d2t[idx]).tolist(), (parallel, drafts, idx)
        assert all(d % 2 == 0 for d in drafts.flatten().tolist())


def test_fused_ops_path_follows_norm_before_residual(tiny_dirs, tmp_path):
    """A head with norm_before_residual (speculators' eagle3 default: layer 0's residual is hidden_norm(h)) under
    a quantized target: the fused ops' pass gives the torch ops' pass, which differs from the same head's with
    the flag off (the control)."""
    import json

    from peagle.cache import KVCache
    from peagle.models import quant_ext
    if quant_ext.get() is None:
        pytest.skip("needs the built extension")
    t = Transformer.from_pretrained(tiny_dirs["llama"])
    outs = {}
    for nbr in (False, True):
        hd = save_random_head(tiny_dirs["llama"], str(tmp_path / f"h{nbr}"), layers=2, draft_vocab=256)
        with open(os.path.join(hd, "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(hd, "config.json"), "w") as f:
            json.dump({**cfg, "norm_before_residual": nbr}, f)
        head = DrafterHead.from_pretrained(hd, t.cfg)
        x = torch.randint(5, 500, (1, 20), generator=torch.Generator().manual_seed(5))
        _, aux = t.forward(x, t.new_cache(1, 32), 0, torch.zeros(1, dtype=torch.long), head.aux_ids)
        head.prepare_inference(quantization="q8")
        hid = head.combine(aux)

        def run(fused):
            head._fused_ops = fused
            c = KVCache(2, head.config.num_key_value_heads, head.config.head_dim, 64, 1, lens=False)
            with torch.no_grad():
                return torch.cat(head._forward_cached(x, hid, c, 0, torch.tensor([0])), -1)
        ref, got = run(False), run(True)
        assert torch.allclose(ref, got, rtol=1e-3, atol=1e-3 * float(ref.abs().max())), (nbr, (ref - got).abs().max())
        outs[nbr] = ref
    assert not torch.allclose(outs[False], outs[True], rtol=1e-3, atol=1e-3 * float(outs[False].abs().max()))
