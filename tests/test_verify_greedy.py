"""verify_greedy_advance (peagle/verify.py): greedy verification and the rows' advance in one call. The
extension's call (every vector path) against the torch ops it replaces, on logits built to break it -- integer
ties (the first maximum wins), NaNs, drafts that agree for 0..K positions per row -- with last / lens advanced in
place for the first B rows only; and negative controls: a draft that disagrees one position earlier, and
advancing by the accepted count without the bonus token, are told apart by these rows."""
import pytest
import torch

from peagle.models import quant_ext
from peagle.verify import verify_greedy, verify_greedy_advance

EXT = quant_ext.get()
IMPLS = [-1] + (([1] + ([2] if EXT.has_avx2() else []) + ([3] if EXT.has_avx512() else [])) if EXT is not None else [])


def case(B: int, K: int, V: int, seed: int):
    """logits [B, K+1, V] (row 1: integer ties, row 2: a NaN) and drafts agreeing with the argmax for b % (K+1)
    positions of row b, then one that differs."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g)
    if B > 1:
        logits[1] = torch.randint(-2, 3, (K + 1, V), generator=g).float()
    if B > 2:
        logits[2, 0, V // 3] = float("nan")
    target = logits.max(-1).indices
    drafts = target[:, :K].clone()
    for b in range(B):
        a = b % (K + 1)
        if a < K:
            drafts[b, a] = (drafts[b, a] + 1) % V
    return logits, drafts, target


def advanced(rows: int, B: int, impl: int, logits, drafts):
    last, lens = torch.full((rows,), -7, dtype=torch.long), torch.arange(rows, dtype=torch.long) * 10
    out = verify_greedy_advance(logits, drafts, last, lens, impl)
    return out, last, lens


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B,K,V", [(1, 0, 49152), (1, 1, 49152), (4, 3, 1000), (7, 7, 65), (3, 2, 2)])
def test_one_call_is_verify_greedy_and_the_advance(impl, B, K, V):
    for seed in range(2):
        logits, drafts, target = case(B, K, V, seed)
        acc, toks = verify_greedy(logits, drafts)
        assert torch.equal(toks, target)
        want_acc = torch.tensor([b % (K + 1) for b in range(B)])
        assert torch.equal(acc, want_acc)
        out, last, lens = advanced(B + 2, B, impl, logits, drafts)
        assert torch.equal(out, torch.cat([acc[:, None], toks], 1)), (impl, B, K, V, seed)
        assert torch.equal(last[:B], toks.gather(1, acc[:, None])[:, 0]) and (last[B:] == -7).all()
        assert torch.equal(lens[:B], torch.arange(B) * 10 + acc + 1) and torch.equal(lens[B:], torch.arange(B, B + 2) * 10)


@pytest.mark.skipif(EXT is None, reason="the C++ extension is not built (make setup)")
def test_these_rows_tell_an_early_disagreement_and_a_missing_bonus_token_apart():
    """If a draft disagreed one position earlier, or lens advanced by accepted alone, these rows would show it."""
    logits, drafts, _ = case(4, 3, 1000, 0)
    out, last, lens = advanced(4, 4, 0, logits, drafts)
    early = drafts.clone()
    early[3, 2] += 1                                 # row 3 agreed on all 3 drafts; now only on 2
    out2, _, lens2 = advanced(4, 4, 0, logits, early)
    assert out[3, 0] == 3 and out2[3, 0] == 2 and lens2[3] == lens[3] - 1
    assert not torch.equal(lens, torch.arange(4) * 10 + out[:, 0])     # the bonus token counts


def test_shapes_and_types_are_checked():
    if EXT is None:
        pytest.skip("the C++ extension is not built (make setup)")
    logits, drafts, _ = case(2, 2, 50, 0)
    last, lens = torch.zeros(2, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="last and lens"):
        EXT.verify_greedy_advance(logits, drafts, last, lens, 0)
    with pytest.raises(RuntimeError, match="drafts"):
        EXT.verify_greedy_advance(logits, drafts[:, :1], last, torch.zeros(2, dtype=torch.long), 0)
