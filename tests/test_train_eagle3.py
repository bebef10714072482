"""EAGLE-3 TTT trainer: the unrolled training forward gives the logits of peagle's Eagle3Proposer."""
import pytest
import torch
from heads import head_config, propose_capturing_logits, random_target_states, training_head

from peagle.heads.model import DrafterHead
from peagle.train.head_forward import ttt_forward
from peagle.train.mask import MaskTable


def test_ttt_unroll_matches_inference_proposer(tiny_dirs):
    from peagle.drafters.eagle3 import Eagle3Proposer
    from peagle.models.llama import Transformer
    target = Transformer.from_pretrained(tiny_dirs["llama"])
    head = training_head(tiny_dirs["llama"], parallel=False)
    head.eval()
    m, K = 11, 5
    x, aux = random_target_states(target, head.aux_ids, m + K + 2, seed=3)
    drafts, seen = propose_capturing_logits(Eagle3Proposer(head, K, 64), head, aux, x, m)
    inf = [s.reshape(-1, s.shape[-1])[-1] for s in seen]          # logits of draft 1..K
    # ground truth after x_m := the drafts, so teacher forcing feeds exactly what inference fed
    x[0, m + 1: m + K] = drafts[0, : K - 1]
    n = x.shape[1]
    q = torch.arange(n - 1)
    pos = q.clone()
    table = MaskTable(8)
    C = table.doc_causal(torch.zeros(n - 1, dtype=torch.long))
    past, hidden = None, head.combine(aux[0, : n - 1])
    with torch.no_grad():
        for k in range(K):
            ids = x[0, (q + 1 + k).clamp(max=n - 1)]
            normed, pre, past = ttt_forward(head, ids[None], hidden[None], (pos + k)[None],
                                            table.eagle3(C, k)[None, None], past)
            hidden = pre[0]
            tr = head.draft_logits(normed[0, m - 1])
            assert torch.allclose(tr, inf[k], atol=1e-4), (k, float((tr - inf[k]).abs().max()))


def test_structured_ttt_equals_dense(tiny_dirs):
    """The elementwise diagonal-extension attention gives the dense-mask SDPA's loss and gradients."""
    from peagle.train.eagle3_loss import row_step, step_counts
    torch.manual_seed(0)
    head = DrafterHead(head_config(tiny_dirs["llama"], layers=2, parallel=False, draft_vocab=256))
    g = torch.Generator().manual_seed(5)
    docs = (20, 31, 14)
    n = sum(docs)
    ids = torch.randint(5, 500, (n,), generator=g)
    row = {"ids": ids, "doc": torch.cat([torch.full((L,), j) for j, L in enumerate(docs)]),
           "pos": torch.cat([torch.arange(L) for L in docs]), "lmask": torch.rand(n, generator=g) < 0.8,
           "aux": torch.randn(n, 3 * 64, generator=g), "tlogp": torch.log_softmax(2 * torch.randn(n, 256, generator=g), -1),
           "label": torch.where(ids < 256, ids, torch.full_like(ids, -1))}
    counts = step_counts(row, 5)
    out = []
    for dense, by_document in ((True, False), (False, True), (False, False)):
        head.zero_grad(set_to_none=True)
        st = row_step(head, row, MaskTable(8), 5, counts, dense=dense, by_document=by_document)
        out.append((st, {k: p.grad.clone() for k, p in head.named_parameters() if p.grad is not None}))
    sa, ga = out[0]
    for sb, gb in out[1:]:   # step 0 one document at a time, then under the mask
        assert torch.allclose(sa["ce"], sb["ce"], atol=1e-4) and torch.equal(sa["correct"], sb["correct"])
        assert max(float((ga[k] - gb[k]).abs().max()) for k in ga) < 1e-5


def _row(n_docs=(20, 31, 14), vocab=256, seed=5):
    g = torch.Generator().manual_seed(seed)
    n = sum(n_docs)
    ids = torch.randint(5, 500, (n,), generator=g)
    return {"ids": ids, "doc": torch.cat([torch.full((L,), j) for j, L in enumerate(n_docs)]),
            "pos": torch.cat([torch.arange(L) for L in n_docs]), "lmask": torch.rand(n, generator=g) < 0.8,
            "aux": torch.randn(n, 3 * 64, generator=g),
            "tlogp": torch.log_softmax(2 * torch.randn(n, vocab, generator=g), -1),
            "label": torch.where(ids < vocab, ids, torch.full_like(ids, -1))}


def test_subsampled_unroll_continues_chains_exactly(tiny_dirs):
    """With a ttt_plan, every continued anchor gets exactly the drafter output the full unroll gives it at that
    step (its chain and the step-0 keys are all it reads); dropped anchors are simply absent."""
    from peagle.train.cod import supervised
    from peagle.train.eagle3_loss import row_step, step_counts, ttt_plan
    torch.manual_seed(0)
    head = DrafterHead(head_config(tiny_dirs["llama"], layers=2, parallel=False, draft_vocab=256))
    row, ttt = _row(), 5
    plan = ttt_plan(row, ttt, 0.7, torch.Generator().manual_seed(1))
    n = row["ids"].shape[0]
    for k in range(1, ttt):   # nested, supervised at their step, about keep^k of the step's supervised anchors
        assert set(plan[k].tolist()) <= set(plan[k - 1].tolist())
        s_all = supervised(plan[0], torch.full_like(plan[0], k), row["doc"], row["lmask"])
        assert bool(supervised(plan[k], torch.full_like(plan[k], k), row["doc"], row["lmask"]).all())
        assert len(plan[k]) <= int(s_all.sum() * 0.7 ** k)
    assert 0 < len(plan[1]) < n - 1

    def captured(plan_):
        seen, orig = [], head.draft_logits
        head.draft_logits = lambda x: (seen.append(x.detach().clone()), orig(x))[1]
        try:
            row_step(head, row, MaskTable(8), ttt, step_counts(row, ttt, plan_), plan=plan_, backward=False)
        finally:
            del head.draft_logits
        return seen
    full, sub = captured(None), captured(plan)
    q = torch.arange(n - 1)
    compared = 0
    for k in range(ttt):
        fa = q[supervised(q, torch.full_like(q, k), row["doc"], row["lmask"])]
        pk = plan[k]
        sa = pk[supervised(pk, torch.full_like(pk, k), row["doc"], row["lmask"])]
        rows_full = full[k][torch.searchsorted(fa, sa)]
        assert torch.allclose(sub[k], rows_full, atol=1e-5), k
        if k and len(sa) > 1:     # negative control: the rows of other anchors differ
            assert not torch.allclose(sub[k], full[k][torch.searchsorted(fa, sa).roll(1)], atol=1e-3)
        compared += len(sa)
    assert compared > n


def test_plan_with_a_hole_is_refused(tiny_dirs):
    import pytest

    from peagle.train.eagle3_loss import row_step, step_counts, ttt_plan
    head = DrafterHead(head_config(tiny_dirs["llama"], layers=1, parallel=False, draft_vocab=256))
    row = _row()
    plan = ttt_plan(row, 3, 0.7, torch.Generator().manual_seed(1))
    plan[2] = torch.cat([plan[2], torch.tensor([plan[0][-1]])]).unique()  # an anchor step 1 did not continue
    if set(plan[2].tolist()) <= set(plan[1].tolist()):
        plan[2] = torch.tensor(sorted(set(plan[0].tolist()) - set(plan[1].tolist())))[:1]
    with pytest.raises(ValueError, match="not a subset"):
        row_step(head, row, MaskTable(8), 3, step_counts(row, 3), plan=plan, backward=False)


def test_hard_loss_is_cross_entropy_on_the_drafted_token():
    from peagle.train.head_forward import draft_loss
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 32, generator=g)
    label = torch.tensor([3, -1, 0, 31, 7, -1, 5, 5, 2])
    want = torch.nn.functional.cross_entropy(logits, label, ignore_index=-1, reduction="none")
    rows = torch.arange(9)
    got, top = draft_loss(logits, torch.log_softmax(torch.randn(9, 32, generator=g), -1), rows, label, hard=True)
    assert torch.allclose(got, want, atol=1e-6) and torch.equal(top, logits.argmax(-1))
    soft, _ = draft_loss(logits, torch.log_softmax(logits, -1), rows, label, hard=False)   # KL to itself: 0
    assert float(soft.abs().max()) < 1e-5 and float(got.sum()) > 1


@pytest.mark.parametrize("path", ["avx2", "avx512", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_kl_equals_the_op_by_op_form(dtype, path, monkeypatch):
    """DraftKL (the C++ kernel's AVX2 / AVX-512 path, one pass per element; or torch blocks of KL_CHUNK rows;
    tlogp read through rows) = KL(p || softmax(z)) written op by op on the gathered rows: values, gradients
    (also for a weighted sum) and the greedy id, the first maximum where rows tie; E spans several blocks and
    ends mid-block, V is not a multiple of 16 (the AVX-512 tail). A wrong row index changes both (negative
    control). On a CPU without AVX-512 its path must refuse."""
    from peagle.models import quant_ext
    from peagle.train import head_forward
    from peagle.train.head_forward import KL_CHUNK, draft_loss
    fused = path != "torch"
    monkeypatch.setattr(head_forward, "FUSED_KL", fused)
    monkeypatch.setattr(head_forward, "KL_IMPL", {"avx2": 2, "avx512": 3, "torch": 0}[path])
    g = torch.Generator().manual_seed(1)
    E, V, n = 2 * KL_CHUNK + 5, 72, 11
    z0 = (torch.randn(E, V, generator=g) * 3).to(dtype)
    z0[3, 40] = z0[3, 7] = z0[3].max() + 1                         # ties: the first maximum (7) is the id
    z0[4, 9:] = z0[4, 8] = z0[4].max() + 1
    assert (head_forward._kl_kernel(z0, torch.zeros(1, V)) is not None) == fused   # the path under test runs
    if path == "avx512" and not quant_ext.get().has_avx512():
        with pytest.raises(RuntimeError, match="no AVX-512"):
            draft_loss(z0, torch.log_softmax(torch.randn(n, V), -1), torch.zeros(E, dtype=torch.long), None, False)
        return
    tlogp = torch.log_softmax(torch.randn(n, V, generator=g) * 2, -1)
    rows = torch.randint(0, n, (E,), generator=g)
    w = torch.rand(E, generator=g)

    def op_by_op(z, r):
        logq = torch.log_softmax(z.float(), -1)
        lp = tlogp[r]
        return (lp.exp() * (lp - logq)).sum(-1)

    za, zb = z0.clone().requires_grad_(), z0.clone().requires_grad_()
    got, top = draft_loss(za, tlogp, rows, None, hard=False)
    want = op_by_op(zb, rows)
    (got * w).sum().backward()
    (want * w).sum().backward()
    assert za.grad.dtype == dtype and top.dtype == torch.long
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(za.grad.float(), zb.grad.float(), atol=1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(top, z0.float().argmax(-1))
    other = (rows + 1) % n
    assert not torch.allclose(draft_loss(z0, tlogp, other, None, hard=False)[0], want.detach(), atol=1e-3)


def test_kl_kernel_refuses_rows_outside_the_teacher():
    """The C++ loss reads the teacher through rows: an index past it is an error, not a read out of bounds."""
    from peagle.train import head_forward
    z, t = torch.randn(3, 16), torch.log_softmax(torch.randn(2, 16), -1)
    assert head_forward._kl_kernel(z, t) is not None
    with pytest.raises(RuntimeError, match="rows out of range"):
        head_forward.draft_loss(z, t, torch.tensor([0, 1, 2]), None, hard=False)
    assert head_forward.draft_loss(z, t, torch.tensor([0, 1, 1]), None, hard=False)[0].shape == (3,)


def test_each_ttt_step_weighs_in_as_decay_k_times_its_mean_loss(tiny_dirs, monkeypatch):
    """The unroll's loss is sum_k decay^k * (step k's summed loss / its batch-wide count): built here from the
    per-step losses row_step computes, its gradients must equal row_step's own (a mutation review: every step
    divided by step 0's count, which down-weights deep steps while the logged per-step loss looks right)."""
    import peagle.train.eagle3_loss as e3
    from peagle.train.eagle3_loss import row_step, step_counts
    torch.manual_seed(0)
    head = DrafterHead(head_config(tiny_dirs["llama"], layers=1, parallel=False, draft_vocab=256))
    row, ttt = _row(), 4
    counts = step_counts(row, ttt)
    assert len(set(counts.tolist())) > 1                       # the steps' counts differ
    got = []
    real = e3.draft_loss
    monkeypatch.setattr(e3, "draft_loss", lambda *a: got.append(real(*a)) or got[-1])
    row_step(head, row, MaskTable(8), ttt, counts, backward=False)
    assert len(got) == ttt
    ref = sum(0.8 ** k * ce.sum() / float(counts[k]) for k, (ce, _) in enumerate(got))
    ref.backward()
    want = {k: p.grad.clone() for k, p in head.named_parameters() if p.grad is not None}
    head.zero_grad(set_to_none=True)
    monkeypatch.setattr(e3, "draft_loss", real)
    row_step(head, row, MaskTable(8), ttt, counts, decay=0.8)
    for k, g in want.items():
        assert torch.allclose(dict(head.named_parameters())[k].grad, g, atol=1e-6, rtol=1e-4), k
