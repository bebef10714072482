"""EAGLE-3 TTT trainer: the unrolled training forward gives the logits of peagle's Eagle3Proposer."""
import torch
from heads import head_config, propose_capturing_logits, random_target_states

from peagle.heads.model import DrafterHead
from peagle.train.head_forward import ttt_forward
from peagle.train.mask import MaskTable


def test_ttt_unroll_matches_inference_proposer(tiny_dirs):
    from peagle.drafters.eagle3 import Eagle3Proposer
    from peagle.models.llama import Transformer
    target = Transformer.from_pretrained(tiny_dirs["llama"])
    torch.manual_seed(0)
    head = DrafterHead(head_config(tiny_dirs["llama"], layers=2, parallel=False, draft_vocab=256))
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
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
    for dense in (True, False):
        head.zero_grad(set_to_none=True)
        st = row_step(head, row, MaskTable(8), 5, counts, dense=dense)
        out.append((st, {k: p.grad.clone() for k, p in head.named_parameters() if p.grad is not None}))
    (sa, ga), (sb, gb) = out
    assert torch.allclose(sa["ce"], sb["ce"], atol=1e-4) and torch.equal(sa["correct"], sb["correct"])
    assert max(float((ga[k] - gb[k]).abs().max()) for k in ga) < 1e-5
