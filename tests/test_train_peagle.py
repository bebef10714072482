"""P-EAGLE trainer: COD / mask invariants, partitioned == flat gradients, and train == inference logits."""
import pytest
import torch
from heads import propose_capturing_logits, random_target_states, training_head

from peagle.models import quant_ext
from peagle.train import peagle_loss
from peagle.train.cod import sample_cod, supervised
from peagle.train.mask import MaskTable
from peagle.train.peagle_loss import draft_forward, make_elements, row_step

K = 8


def random_row(n=90, docs=(30, 25, 35), T=64, Vd=256, seed=0, mask_p=0.7):
    g = torch.Generator().manual_seed(seed)
    assert sum(docs) == n
    doc = torch.cat([torch.full((L,), j) for j, L in enumerate(docs)])
    pos = torch.cat([torch.arange(L) for L in docs])
    lmask = torch.rand(n, generator=g) < mask_p
    ids = torch.randint(5, 500, (n,), generator=g)
    return {"ids": ids, "doc": doc, "pos": pos, "lmask": lmask, "aux": torch.randn(n, 3 * T, generator=g),
            "tlogp": torch.log_softmax(3 * torch.randn(n, Vd, generator=g), -1),
            "label": torch.where(ids < Vd, ids, torch.full_like(ids, -1))}


@pytest.fixture(scope="module")
def head(tiny_dirs):
    return training_head(tiny_dirs["llama"])


def test_cod_invariants():
    row = random_row(seed=1)
    gen = torch.Generator().manual_seed(0)
    a, d = sample_cod(row["doc"], row["lmask"], K, 0.7, 0.2, gen)
    n = len(row["ids"])
    assert bool((d[:-1] <= d[1:]).all()), "depth-major order"
    assert torch.equal(a[d == 0], torch.arange(n - 1))
    kept = set(zip(a.tolist(), d.tolist()))
    assert len(kept) == len(a)
    for q, k in kept:
        if k > 0:
            assert (q, k - 1) in kept, "depth-d only where its depth-(d-1) predecessor exists"
    deep = d > 0
    assert bool(supervised(a[deep], d[deep], row["doc"], row["lmask"]).all())
    assert bool((row["doc"][(a + d + 2)[deep]] == row["doc"][a[deep]]).all()), "rollout stays in its document"
    counts = torch.bincount(d, minlength=K)
    seeds = int(supervised(torch.arange(n - 1), torch.zeros(n - 1, dtype=torch.long), row["doc"], row["lmask"]).sum())
    for k in range(1, K):
        assert counts[k] <= max(0, seeds - k) * max(0.7 ** k, 0.2) + 1e-9


def test_mask_rules():
    row = random_row(seed=2)
    a, d = sample_cod(row["doc"], row["lmask"], K, 0.9, 0.5, torch.Generator().manual_seed(1))
    t = MaskTable(16)  # grows on demand
    M = t.peagle(t.doc_causal(row["doc"]), a, d)
    doc = row["doc"][a]
    for i in range(len(a)):
        for j in range(len(a)):
            exp = bool(doc[i] == doc[j]) and ((d[j] == 0 and a[j] <= a[i]) or (a[j] == a[i] and d[j] <= d[i]))
            assert bool(M[i, j]) == exp
    # no element sees another document or a future anchor
    assert not bool((M & (doc[:, None] != doc[None, :])).any())
    assert not bool((M & (a[None, :] > a[:, None])).any())
    assert bool(M.diagonal().all())


def test_element_positions(head):
    from peagle.train.peagle_loss import element_inputs
    row = random_row(seed=3)
    el = make_elements(row, K, gen=torch.Generator().manual_seed(2))
    ids, hidden, pos = element_inputs(head, row, el["anchor"], el["depth"])
    a, d = el["anchor"], el["depth"]
    assert torch.equal(pos, row["pos"][a] + d), "positions = anchor + depth (within the document)"
    assert bool((ids[d > 0] == head.mask_token_id).all())
    assert torch.equal(ids[d == 0], row["ids"][a[d == 0] + 1])


def _grads(head, seg_len, by_document=True, dtype=None):
    row, row2 = random_row(seed=4), random_row(n=60, docs=(20, 40), seed=5)
    t = MaskTable(128)
    els = [make_elements(r, K, gen=torch.Generator().manual_seed(i)) for i, r in enumerate((row, row2))]
    denom = float(sum(int(e["sup"].sum()) for e in els))
    head.zero_grad(set_to_none=True)
    st = [row_step(head, r, e, t, K, denom, seg_len, by_document=by_document, autocast_dtype=dtype)
          for r, e in zip((row, row2), els)]
    return {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}, st


@pytest.mark.parametrize("seg,block", [(16, 128), (33, 128), (33, 5), (90, 3)])
def test_partitioned_equals_flat(head, seg, block, monkeypatch):
    """seg: anchors per segment; block: deep elements per attention block (deep_blocks; 3 and 5 make many
    blocks, some spanning two documents)."""
    monkeypatch.setattr(peagle_loss, "DEEP_BLOCK", block)
    gf, sf = _grads(head, 0)
    for by_document in (True, False):   # attention one document at a time / masked over every depth-0 key
        gp, sp = _grads(head, seg, by_document)
        assert gf.keys() == gp.keys() and "mask_hidden" in gf and "embed_tokens.weight" in gf
        worst = max(float((gf[k] - gp[k]).abs().max()) for k in gf)
        assert worst <= 1e-5, worst
        for a, b in zip(sf, sp):
            assert abs(a["kl"] - b["kl"]) < 1e-3 and torch.equal(a["total"], b["total"])
    assert int(sf[0]["total"][K - 1]) > 0 or int(sf[0]["total"][3]) > 0


@pytest.mark.parametrize("cut", ["start", "end"])
def test_a_deep_block_window_cut_short_changes_the_gradient(head, cut, monkeypatch):
    """Negative control of the blocked deep attention: each block's depth-0 window one key short at either
    end (the mask's column dropped with it) gives other gradients than the flat pass."""
    gf, _ = _grads(head, 0)
    real = peagle_loss.deep_blocks

    def short(*args):
        out = []
        for s, e, ctx, m in real(*args):
            keep = torch.ones(m.shape[1], dtype=torch.bool)
            keep[0 if cut == "start" else ctx.stop - ctx.start - 1] = False
            out.append((s, e, slice(ctx.start + (cut == "start"), ctx.stop - (cut == "end")), m[:, keep]))
        return out
    monkeypatch.setattr(peagle_loss, "DEEP_BLOCK", 5)
    monkeypatch.setattr(peagle_loss, "deep_blocks", short)
    gp, _ = _grads(head, 33)
    assert max(float((gf[k] - gp[k]).abs().max()) for k in gf) > 1e-4


def _rel(ga, gb):
    return max(float((ga[k].float() - gb[k].float()).abs().max() / gb[k].float().abs().max()) for k in gb)


@pytest.mark.skipif(quant_ext.avx512() is None,
                    reason="train_attention's kernel needs the extension on an AVX-512 CPU")
def test_partitioned_bf16_blocks_equal_the_masked_attention(head, monkeypatch):
    """Under bfloat16 autocast the by-document path runs train_attention's kernel over many blocks that share
    depth-0 key slices (gradients summed in place): its gradients equal the masked SDPA over every depth-0 key
    within bfloat16 rounding. Negative control: every block's window one key short at its start."""
    monkeypatch.setattr(peagle_loss, "DEEP_BLOCK", 5)
    ref, _ = _grads(head, 33, by_document=False, dtype=torch.bfloat16)
    got, _ = _grads(head, 33, by_document=True, dtype=torch.bfloat16)
    assert got.keys() == ref.keys()
    real = peagle_loss.deep_blocks

    def short(*args):
        return [(s, e, slice(ctx.start + 1, ctx.stop), m[:, 1:]) for s, e, ctx, m in real(*args)]
    monkeypatch.setattr(peagle_loss, "deep_blocks", short)
    bad, _ = _grads(head, 33, by_document=True, dtype=torch.bfloat16)
    assert _rel(got, ref) < 0.03 < _rel(bad, ref)


def test_doc_causal_attend_is_the_masked_attention():
    """One causal SDPA per document equals SDPA under the doc-causal mask (GQA, 3 documents); a wrong split
    (the spans of another packing) does not."""
    from peagle.models.layers import attend
    from peagle.train.head_forward import doc_causal_attend, doc_spans
    g = torch.Generator().manual_seed(3)
    doc = torch.cat([torch.full((L,), j) for j, L in enumerate((7, 12, 5))])
    q, k, v = torch.randn(1, 24, 4, 8, generator=g), torch.randn(1, 2, 24, 8, generator=g), torch.randn(1, 2, 24, 8, generator=g)
    spans = doc_spans(doc)
    assert spans == [(0, 7), (7, 19), (19, 24)]
    mask = MaskTable(32).doc_causal(doc)[None, None]
    ref = attend(q, k, v, mask)
    assert torch.allclose(doc_causal_attend(q, k, v, spans), ref, atol=1e-6)
    assert not torch.allclose(doc_causal_attend(q, k, v, [(0, 12), (12, 24)]), ref, atol=1e-3)


def test_train_forward_matches_inference_proposer(tiny_dirs, head):
    """The training forward of a depth-0..K-1 rollout gives the draft logits PEagleProposer computes."""
    from peagle.drafters.peagle import PEagleProposer
    from peagle.models.llama import Transformer
    target = Transformer.from_pretrained(tiny_dirs["llama"])
    head = head.eval()
    m, k = 13, 6
    x, aux = random_target_states(target, head.aux_ids, m + k + 3, seed=7)
    # inference: prefill rows 0..m-2 (tokens x1..x_{m-1}), then one step with the new token x_m at position m-1
    _, seen = propose_capturing_logits(PEagleProposer(head, k, 64), head, aux, x, m)
    inf_logits = seen[-1][0]                                   # [k, Vd]
    # training: all depth-0 anchors + the rollout of anchor m-1 (depths 1..k-1)
    n = x.shape[1]
    row = {"ids": x[0], "doc": torch.zeros(n, dtype=torch.long), "pos": torch.arange(n),
           "lmask": torch.ones(n, dtype=torch.bool), "aux": aux[0]}
    a = torch.cat([torch.arange(n - 1), torch.full((k - 1,), m - 1)])
    d = torch.cat([torch.zeros(n - 1, dtype=torch.long), torch.arange(1, k)])
    with torch.no_grad():
        normed = draft_forward(head, row, a, d, MaskTable(64))
        tr_logits = head.draft_logits(normed[torch.cat([torch.tensor([m - 1]), torch.arange(n - 1, n - 1 + k - 1)])])
    assert torch.allclose(tr_logits, inf_logits, atol=1e-4), float((tr_logits - inf_logits).abs().max())


def test_head_norm_under_autocast_is_the_bfloat16_norm():
    """Under bfloat16 autocast a head's RMSNorm gets a bfloat16 input: it must compute torch's fused norm of that
    input with the weight in bfloat16 (mixed dtypes would leave the fused kernel), bit for bit, and stay within
    bf16 rounding of the float32 norm."""
    from peagle.heads.model import RMSNorm
    norm = RMSNorm(64, 1e-5)               # its own norm: the module-wide head fixture stays as it is
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, norm.weight.numel()))
    x = torch.randn(5, norm.weight.numel()).bfloat16()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
    ref = torch.nn.functional.rms_norm(x, (x.shape[-1],), norm.weight.bfloat16(), norm.eps)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)
    f32 = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), norm.weight, norm.eps)
    assert torch.allclose(y.float(), f32, rtol=2 ** -7, atol=1e-3)


def test_bf16_autocast_on_the_heads_device(head):
    """--dtype bf16: autocast on the head's own device (CPU here) computes in bfloat16 and stays close to
    fp32 (the KL differs, so the autocast really ran, but only by bf16 rounding)."""
    row = random_row(seed=7)
    t = MaskTable(128)
    el = make_elements(row, K, gen=torch.Generator().manual_seed(0))
    denom = float(el["sup"].sum())
    f32 = row_step(head, row, el, t, K, denom, 0, backward=False)["kl"]
    b16 = row_step(head, row, el, t, K, denom, 0, backward=False, autocast_dtype=torch.bfloat16)["kl"]
    assert b16 != f32 and abs(b16 - f32) <= 0.05 * abs(f32), (f32, b16)


def test_cod_elements_against_the_rules_written_out():
    """full=True keeps, per depth, exactly the anchors whose whole rollout up to that depth is supervised: the
    target token x[q+d+2] inside the row, in the anchor's document and under the loss mask (a mutation review:
    the mask read at the anchor instead of the target passed test_cod_invariants, which checks through
    supervised() itself). And the sampled counts follow floor(max(0, seeds - d) * max(r^d, r_min))."""
    from peagle.train.cod import cod_sizes
    doc = torch.tensor([0] * 9 + [1] * 7)
    lmask = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1])
    n, K = len(doc), 4

    def ok(q, d):
        t = q + d + 2
        return t < n and doc[t] == doc[q] and bool(lmask[t])
    a, d = sample_cod(doc, lmask, K, full=True)
    got = {k: sorted(a[d == k].tolist()) for k in range(K)}
    want = {0: list(range(n - 1))}
    for k in range(1, K):
        want[k] = [q for q in range(n - 1) if all(ok(q, j) for j in range(1, k + 1))]
    assert {k: v for k, v in got.items() if v} == {k: v for k, v in want.items() if v}
    assert cod_sizes(100, 5, 0.5, 0.2) == [49, 24, 19, 19]          # r^3 = 0.125 < r_min = 0.2 from depth 3
    assert cod_sizes(3, 4, 0.9, 0.1) == [1, 0, 0]


def test_the_teacher_of_an_element_is_the_targets_distribution_before_its_token():
    """Element (q, d) predicts x[q+d+2]: its teacher is the target's distribution at position q+d+1. With the
    draft logits equal to those rows the KL is 0; a teacher one row off (a mutation review: the loss still fell
    and training accuracy rose) is not."""
    import types
    g = torch.Generator().manual_seed(0)
    n, V = 10, 6
    tlogp = torch.log_softmax(torch.randn(n, V, generator=g), -1)
    row = {"label": torch.randint(0, V, (n,), generator=g), "tlogp": tlogp}
    a, d = torch.tensor([0, 1, 2, 0, 3]), torch.tensor([0, 0, 0, 1, 2])
    head = types.SimpleNamespace(draft_logits=lambda x: x)
    acc = [torch.zeros(3), torch.zeros(3)]
    _, total = peagle_loss._kl_stats(head, tlogp[a + d + 1].clone(), row, a, d, 1.0, 3, acc)
    assert abs(total) < 1e-5
    _, off = peagle_loss._kl_stats(head, tlogp[a + d].clone(), row, a, d, 1.0, 3, acc)
    assert off > 1e-2
