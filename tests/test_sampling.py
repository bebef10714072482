"""greedy(): every greedy token peagle emits or drafts. Its CPU kernel (peagle/csrc/argmax.cpp, each vector path) gives
torch's max(-1).indices on rows built to break an argmax: ties (the first maximum wins), NaNs (the first NaN
wins), all -inf, +inf, lengths around the vector widths; and a negative control: the last maximum instead of the
first is told apart by these rows."""
import pytest
import torch

from peagle.models import quant_ext
from peagle.sampling import greedy

EXT = quant_ext.get()
IMPLS = ([1] + ([2] if EXT.has_avx2() else []) + ([3] if EXT.has_avx512() else [])) if EXT is not None else []
LENGTHS = [1, 2, 15, 16, 31, 32, 33, 63, 64, 65, 127, 129, 1000, 49152, 49153]


def hard_rows(V: int, seed: int) -> torch.Tensor:
    """[6, V]: plain, ties of small integers, sparse NaNs, all -inf, +inf ties, a maximum in the last element."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, V, generator=g)
    x[1] = torch.randint(-2, 3, (V,), generator=g).float()
    x[2, torch.rand(V, generator=g) < 0.02] = float("nan")
    x[3] = float("-inf")
    x[4, torch.rand(V, generator=g) < 0.3] = float("inf")
    x[5, -1] = 100.0
    return x


def last_max(x: torch.Tensor) -> torch.Tensor:
    """The negative control: the last index of the maximum (NaN-free rows)."""
    V = x.shape[-1]
    return V - 1 - x.flip(-1).max(-1).indices


@pytest.mark.skipif(EXT is None, reason="the C++ extension is not built (make setup)")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("V", LENGTHS)
def test_kernel_gives_torchs_indices(impl, V):
    for seed in range(3):
        x = hard_rows(V, seed)
        assert torch.equal(EXT.argmax_last(x, impl), x.max(-1).indices), (impl, V, seed)


@pytest.mark.skipif(EXT is None, reason="the C++ extension is not built (make setup)")
@pytest.mark.parametrize("impl", IMPLS)
def test_a_lone_nan_is_found_at_every_position(impl):
    """Row i holds one NaN, at i: the argmax is i wherever that falls -- first lanes, the last element of the
    vector passes (index 31 / 63 / 127: the bound of first_nan's search, which hard_rows' sparse NaNs never hit)
    and the scalar tail."""
    g = torch.Generator().manual_seed(5)
    for V in (32, 33, 64, 65, 128, 130):
        x = torch.randn(V, V, generator=g)
        x[torch.arange(V), torch.arange(V)] = float("nan")
        assert torch.equal(EXT.argmax_last(x, impl), torch.arange(V)), (impl, V)
        assert torch.equal(x.max(-1).indices, torch.arange(V))


@pytest.mark.skipif(EXT is None, reason="the C++ extension is not built (make setup)")
def test_ties_tell_first_from_last():
    x = hard_rows(1000, 0)[1:2]                      # integer ties
    assert not torch.equal(last_max(x), x.max(-1).indices)
    assert torch.equal(EXT.argmax_last(x), x.max(-1).indices)


def test_greedy_keeps_shapes_and_any_layout():
    x = torch.randn(2, 3, 4, 100)
    assert torch.equal(greedy(x), x.max(-1).indices)
    t = x.transpose(1, 2)                            # not contiguous
    assert torch.equal(greedy(t), t.max(-1).indices)
    assert greedy(torch.randn(0, 7)).shape == (0,)
    assert torch.equal(greedy(x.double()), x.double().max(-1).indices)   # other dtypes: torch's path


@pytest.mark.skipif(EXT is None, reason="the C++ extension is not built (make setup)")
def test_rows_split_over_threads_change_nothing():
    x = hard_rows(49152, 1).repeat(3, 1)           # 18 rows: parallel_for splits them
    assert torch.equal(EXT.argmax_last(x), x.max(-1).indices)


@pytest.mark.parametrize("kw", [dict(stop=[5]), dict(stop=5), dict(temperature="0.5"), dict(temperature=float("nan")),
                                dict(top_p=float("inf")), dict(max_tokens="5"), dict(seed="abc"), dict(top_k=-5),
                                dict(top_k=2.5), dict(stop_token_ids="5"),
                                # values that silently meant something else: "false" was true (EOS ignored),
                                # n=True passed as 1
                                dict(ignore_eos="false"), dict(n=True)])
def test_sampling_params_refuse_what_they_cannot_mean(kw):
    from peagle.errors import PeagleError
    from peagle.sampling import SamplingParams
    with pytest.raises(PeagleError):
        SamplingParams(**kw)


def test_sampling_params_keep_what_vllm_accepts():
    from peagle.sampling import SamplingParams
    p = SamplingParams(temperature=0, top_k=-1, stop="x", stop_token_ids=(3,), seed=7, max_tokens=None)
    assert (p.top_k, p.stop, p.stop_token_ids, p.greedy) == (0, ["x"], [3], True)


def _reference_probs(logits, temperature, top_k, top_p):
    """The OpenAI / vLLM sampling rules written out per row in plain Python (float64): temperature, then the
    top_k largest logits (ties at the k-th kept), then the smallest set of most probable tokens whose mass
    reaches top_p (the token crossing top_p kept; ties taken in index order), renormalised."""
    import math
    out = []
    for row in logits.tolist():
        x = [v / temperature for v in row]
        if 0 < top_k < len(x):
            kth = sorted(x, reverse=True)[top_k - 1]
            x = [v if v >= kth else -math.inf for v in x]
        m = max(x)
        e = [math.exp(v - m) for v in x]
        p = [v / sum(e) for v in e]
        if top_p < 1.0:
            keep, mass = set(), 0.0
            for i in sorted(range(len(p)), key=lambda i: -p[i]):      # stable: index order among ties
                if mass >= top_p:
                    break
                keep.add(i)
                mass += p[i]
            p = [v if i in keep else 0.0 for i, v in enumerate(p)]
        out.append([v / sum(p) for v in p])
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0),
                                                     (0.9, 0, 0.8), (0.6, 7, 0.5), (2.0, 0, 0.3)])
def test_probs_from_logits_against_the_rules_written_out(temperature, top_k, top_p):
    """The chi-square tests of sampling take their expected distribution from probs_from_logits itself, so a
    wrong temperature (logits * T) or a top-p cut that drops the crossing token passed them all (a mutation
    review): here an independent reference, per row and batched with per-row tensors, and hand-checked sets."""
    from peagle.sampling import probs_from_logits
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=g) * 3
    want = _reference_probs(logits, temperature, top_k, top_p)
    got = probs_from_logits(logits, temperature, top_k, top_p).double()
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
    n = logits.shape[0]
    per_row = probs_from_logits(logits, torch.full((n, 1), temperature), torch.full((n, 1), top_k),
                                torch.full((n, 1), top_p)).double()
    assert torch.allclose(per_row, want, atol=1e-6)


def test_top_p_keeps_the_token_that_crosses_it():
    from peagle.sampling import probs_from_logits
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert (probs_from_logits(logits, 1.0, 0, 0.7) > 0).tolist() == [[True, True, False, False]]   # 0.5 + 0.3
    assert (probs_from_logits(logits, 1.0, 0, 0.5) > 0).tolist() == [[True, False, False, False]]  # 0.5 reaches it
    assert (probs_from_logits(logits, 1.0, 0, 0.81) > 0).tolist() == [[True, True, True, False]]
    assert (probs_from_logits(logits, 1.0, 2, 1.0) > 0).tolist() == [[True, True, False, False]]   # top_k


def test_top_p_from_the_top_tokens_gives_the_full_sorts_bits(monkeypatch):
    """Top-p on the CPU takes a row's nucleus from its top 128 or 1024 tokens where it ends inside them: the same
    bits as sorting all V (no NUCLEUS sizes), row by row whatever the other rows, for peaked rows (nuclei of ~20
    and ~100 tokens: the two sizes), a flat one whose nucleus is larger than 1024 (sorted in full), ties
    straddling the cut (and 301 across the first size's boundary), a row with top_p 1 and top-k before top-p;
    and only the rows that need it are sorted in full. Against the rules written out too."""
    from peagle import sampling
    g = torch.Generator().manual_seed(12)
    V = 3000
    peaked = torch.randn(V, generator=g) * 4
    flat = torch.randn(V, generator=g) * 0.05
    ties = torch.randn(V, generator=g) * 4
    ties[torch.argsort(ties, descending=True)[3:40]] = ties.max() - 1.0    # 37 equal logits below the top 3
    medium = torch.randn(V, generator=g) * 1.5
    wide = torch.randn(V, generator=g) - 30.0
    wide[torch.randperm(V, generator=g)[:301]] = 0.0             # 301 equal logits across the topk boundary 128
    logits = torch.stack([peaked, flat, ties, peaked.flip(0), ties.flip(0), medium, wide])
    top_p = torch.tensor([[0.9], [0.95], [0.8], [1.0], [0.6], [0.9], [0.9]])
    full_rows = []
    sort_all = sampling._sort_all
    monkeypatch.setattr(sampling, "_sort_all", lambda x: full_rows.append(x.shape[0]) or sort_all(x))
    got = sampling.probs_from_logits(logits, 0.8, 0, top_p)
    assert full_rows == [1]                                     # the flat row only
    monkeypatch.setattr(sampling, "NUCLEUS", ())
    want = sampling.probs_from_logits(logits, 0.8, 0, top_p)
    assert torch.equal(got, want)
    for i in range(7):                                          # alone: the same bits as in the batch
        monkeypatch.setattr(sampling, "NUCLEUS", (128, 1024))
        assert torch.equal(sampling.probs_from_logits(logits[i:i + 1], 0.8, 0, top_p[i:i + 1]), got[i:i + 1])
        ref = _reference_probs(logits[i:i + 1], 0.8, 0, float(top_p[i]))
        assert torch.allclose(got[i:i + 1].double(), ref, atol=1e-6)
    kept = (got > 0).sum(-1).tolist()
    assert kept[0] < 128 < kept[5] < 1024 < kept[1] and kept[3] == V and 3 < kept[2] < 40 and 3 < kept[4] < 40, kept
    assert 128 < kept[6] < 301                                  # the cut inside the ties: index order decides
    k = sampling.probs_from_logits(logits, 0.8, 50, 0.9)        # top-k then top-p
    assert torch.allclose(k.double(), _reference_probs(logits, 0.8, 50, 0.9), atol=1e-6)


@pytest.mark.parametrize("u,want", [(0.0, 1), (0.4999, 1), (0.5, 2), (1 - 2.0**-40, 2)])
def test_sample_rows_takes_the_first_token_whose_running_sum_exceeds_u(monkeypatch, u, want):
    """Inverse CDF with the uniform u set: zeros at both ends never drawn (u = 0, u just under 1), p need not be
    normalised (the same token for p and 4p), the boundary u = p(1) goes to the next token; shapes [N, ..., V]."""
    from peagle.sampling import sample_rows
    monkeypatch.setattr(torch, "rand", lambda *size, generator=None, dtype=None, device=None:
                        torch.full(size[0] if size and isinstance(size[0], tuple) else size, u, dtype=dtype))
    p = torch.tensor([0.0, 0.5, 0.5, 0.0])
    for probs in (p[None], 4 * p[None], p.expand(2, 3, 4)):
        got = sample_rows(probs, [None] * probs.shape[0])
        assert got.shape == probs.shape[:-1] and bool((got == want).all()), (probs.shape, got)
