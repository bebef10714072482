"""A drafter head's greedy pass in one extension call (peagle/csrc/draft_pass.cpp, DrafterHead.greedy_pass): the
drafts, the prenorm output and the KV cache bit-identical to the Python path it replaces (_forward_cached +
draft_logits + greedy + to_target), for P-EAGLE's mask rows and EAGLE-3's later passes; the engine's drafts and
outputs the same with the call and without it; refusals; and where it does not apply, None."""
import pytest
import torch
from heads import save_random_head

from peagle.cache import KVCache
from peagle.heads.model import DrafterHead
from peagle.models import quant_ext
from peagle.models.llama import Transformer
from peagle.sampling import greedy

EXT = quant_ext.get()
needs_ext = pytest.mark.skipif(EXT is None or not hasattr(EXT, "DraftHead"), reason="needs the built extension")


def make(qtarget, tmp_path, parallel, quantization):
    t = Transformer.from_pretrained(qtarget)
    hd = save_random_head(qtarget, str(tmp_path / f"h{parallel}"), layers=2, parallel=parallel, draft_vocab=256)
    head = DrafterHead.from_pretrained(hd, t.cfg, target_embed=t.embed)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():                  # norms of their own (a random head's are ones: a swap would not show)
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    head.prepare_inference(quantization=quantization)
    x = torch.randint(5, 500, (1, 30), generator=torch.Generator().manual_seed(5))
    _, aux = t.forward(x, t.new_cache(1, 64), 0, torch.zeros(1, dtype=torch.long), head.aux_ids)
    return head, x, aux


def context(head, x, aux, n):
    """A drafter cache holding rows 0..n-1 (the Python path's prefill)."""
    c = KVCache(2, head.config.num_key_value_heads, head.config.head_dim, 64, 1, lens=False)
    with torch.no_grad():
        head._forward_cached(x[:, 1:n + 1], head.combine(aux[:, :n]), c, 0, torch.tensor([0]), span=n, s0=0)
    return c


def python_pass(head, ids, hidden, n_mask, c, start, first, fc=True):
    """The Python path: the block's rows (mask rows appended), the cached pass, the LM head's argmax, d2t."""
    with torch.no_grad():
        hid = head.combine(hidden) if fc else hidden
        if n_mask:
            m = head.combine(head.mask_hidden.reshape(1, -1))[0]
            ids = torch.cat([ids, torch.full((1, n_mask), head.mask_token_id)], 1)
            hid = torch.cat([hid, m.expand(1, n_mask, -1)], 1)
        normed, pre = head._forward_cached(ids, hid, c, 0, torch.tensor([start]), span=start + ids.shape[1], s0=start)
        return head.to_target(greedy(head.draft_logits(normed[:, first:]))), pre


@needs_ext
@pytest.mark.parametrize("quantization", ["q8", "q4a8"])
def test_one_call_pass_gives_the_python_paths_bits(qtarget, tmp_path, quantization):
    """P-EAGLE: 3 real rows + 4 mask rows; EAGLE-3: a first pass of 3 rows, then a pass over its own prenorm (fc
    off): drafts, prenorm and the cache's new entries bit-identical to the Python path; negative control: layer 0's
    embedding norm scaled by 1 % is seen in the prenorm."""
    for parallel in (True, False):
        head, x, aux = make(qtarget, tmp_path, parallel, quantization)
        assert head._pass is not None
        n, T = 20, 3
        ids, hid, n_mask = x[:, n + 1:n + 1 + T], aux[:, n:n + T], 4 if parallel else 0
        c_ref, c_got = context(head, x, aux, n), context(head, x, aux, n)
        ref = python_pass(head, ids, hid, n_mask, c_ref, n, T - 1)
        got = head.greedy_pass(ids, hid, n_mask, c_got, 0, torch.tensor([n]), n + T + n_mask, n, T - 1)
        assert got[0].shape == (1, n_mask + 1)
        for r, g in zip(ref, got):
            assert torch.equal(r, g), (parallel, quantization, r, g)
        W = n + T + n_mask
        for layer in range(2):
            assert torch.equal(c_ref.k[layer][:, :, :W], c_got.k[layer][:, :, :W])
            assert torch.equal(c_ref.v[layer][:, :, :W], c_got.v[layer][:, :, :W])
        if not parallel:                      # EAGLE-3's next pass: the previous draft with its prenorm, no fc
            tok, g = got[0], got[1][:, T - 1:]
            ref2 = python_pass(head, tok, g, 0, c_ref, n + T, 0, fc=False)
            got2 = head.greedy_pass(tok, g, 0, c_got, 0, torch.tensor([n + T]), n + T + 1, n + T, 0, fc=False)
            for r, g2 in zip(ref2, got2):
                assert torch.equal(r, g2)
        w = head.layers[0].input_layernorm.weight          # the call reads the head's weights (no copies)
        with torch.no_grad():
            w.mul_(1.01)
        try:
            worse = head.greedy_pass(ids, hid, n_mask, context(head, x, aux, n), 0, torch.tensor([n]), n + T + n_mask,
                                     n, T - 1)
        finally:
            with torch.no_grad():
                w.div_(1.01)
        assert not torch.equal(worse[1], ref[1])


@needs_ext
def test_engine_drafts_and_outputs_the_same_with_and_without_the_call(qtarget, tmp_path):
    """One request at a time (the engine's one-row steps, where the call runs), P-EAGLE and EAGLE-3 at K = 1 and 3:
    every step's drafts and the outputs equal the Python path's, and the outputs plain decoding's."""
    from peagle import LLM, SamplingParams
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 500, (int(n),), generator=g).tolist() for n in (5, 17)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(qtarget, quantization="q4a8")
    ref = [plain.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids for p in prompts]
    for parallel in (True, False):
        hd = save_random_head(qtarget, str(tmp_path / f"e{parallel}"), layers=2, parallel=parallel)
        for k in (1, 3):
            seen = {}
            for on in (True, False):
                llm = LLM(qtarget, quantization="q4a8", speculative_config={
                    "method": "eagle3", "model": hd, "num_speculative_tokens": k, "parallel_drafting": parallel})
                prop, calls = llm.engine.proposer, []
                if not on:
                    prop.head._pass = None
                orig_pass = prop.head.greedy_pass
                prop.head.greedy_pass = lambda *a, **kw: calls.append(orig_pass(*a, **kw)) or calls[-1]
                orig = prop.propose
                drafts = []
                prop.propose = lambda b, kk=None: drafts.append(orig(b, kk)) or drafts[-1]
                outs = [llm.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids for p in prompts]
                assert outs == ref, (parallel, k, on)
                seen[on] = drafts
                assert any(r is not None for r in calls) == on and calls    # the call ran, or (off) never did
            assert len(seen[True]) == len(seen[False]) > 0
            assert all(torch.equal(a, b) for a, b in zip(seen[True], seen[False])), (parallel, k)


@needs_ext
def test_call_refuses_bad_blocks(qtarget, tmp_path):
    head, x, aux = make(qtarget, tmp_path, True, "q4a8")
    c = context(head, x, aux, 10)
    start = torch.tensor([10])
    with pytest.raises(RuntimeError, match="ids"):            # two rows: the call takes one
        head.greedy_pass(x[:, 11:13].repeat(2, 1), aux[:, 10:12].repeat(2, 1, 1), 0, c, 0, start, 12, 10, 1)
    with pytest.raises(RuntimeError, match="hidden"):         # fc on a hidden already H wide
        head.greedy_pass(x[:, 11:13], torch.zeros(1, 2, head.config.hidden_size), 0, c, 0, start, 12, 10, 1)
    with pytest.raises(RuntimeError, match="first"):
        head.greedy_pass(x[:, 11:13], aux[:, 10:12], 0, c, 0, start, 12, 10, 2)


def test_no_call_where_it_does_not_apply(qtarget, tmp_path, monkeypatch):
    """A float head (quantization none) and a build without DraftHead: no call (None), and the proposer drafts
    through the Python path."""
    from peagle.drafters.base import DraftBatch
    from peagle.drafters.peagle import PEagleProposer
    head, x, aux = make(qtarget, tmp_path, True, "none")
    assert head._pass is None
    c = context(head, x, aux, 10)
    assert head.greedy_pass(x[:, 11:12], aux[:, 10:11], 0, c, 0, torch.tensor([10]), 11, 10, 0) is None
    if EXT is not None:
        class NoDraftHead:
            def __getattr__(self, name):
                if name == "DraftHead":
                    raise AttributeError(name)
                return getattr(EXT, name)
        assert head._draft_pass(NoDraftHead()) is None
    prop = PEagleProposer(head, 2, 64)
    prop.prefill(DraftBatch(x[:, 1:11], aux[:, :10], torch.zeros(1, dtype=torch.long), torch.tensor([10])))
    d = prop.propose(DraftBatch(x[:, 11:12], aux[:, 10:11], torch.tensor([10]), torch.tensor([1]), span=11, s0=10))
    assert d.shape == (1, 2)
