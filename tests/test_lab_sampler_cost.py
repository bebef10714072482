"""lab/measure/sampler_cost.py: its previous sampler (the reference the report times peagle's against) draws what
peagle's does, and a whole (tiny) run reports both tables with every case."""
import torch
from test_sampling_lossless import chi2_pvalue

from lab.measure import sampler_cost
from peagle.sampling import probs_from_logits, sample_rows


def test_the_previous_sampler_gives_peagles_probabilities_and_distribution():
    """At SmolLM2's vocabulary size, peaked and flat rows: the previous top-p (every logit sorted) keeps the same
    tokens as peagle's (the top 128 / 1024 first), but for a token at the cut of a flat row (the mass before it
    within the previous one's float32 drift of top_p: it sums the sorted probabilities in float32, peagle in
    float64), with the same probabilities to float rounding; and both draws follow p (chi-square over 4,000 draws of a
    6-token distribution); a draw from the wrong p fails."""
    g = torch.Generator().manual_seed(2)
    rows = torch.cat([torch.randn(6, 49152, generator=g) * s for s in (6.0, 2.0, 0.2)])
    for T, tp in ((0.7, 1.0), (0.7, 0.9), (1.0, 0.95)):
        old, new = sampler_cost.previous_probs(rows, T, tp), probs_from_logits(rows, T, 0, tp)
        assert ((old > 0) ^ (new > 0)).sum(-1).max() <= 1 and torch.equal(old[:12] > 0, new[:12] > 0)
        assert torch.allclose(old, new, atol=1e-6 + 2 / 40000, rtol=1e-4)     # flat rows keep ~41,000 tokens
    p = torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.07, 0.03]])
    gen = torch.Generator().manual_seed(5)
    old = torch.tensor([int(sampler_cost.previous_sample(p, gen)) for _ in range(4000)])
    new = sample_rows(p.expand(4000, -1).contiguous(), [gen] * 4000)
    for draws in (old, new):
        assert chi2_pvalue(torch.bincount(draws, minlength=6).double(), p[0].double())[0] > 1e-3
    assert chi2_pvalue(torch.bincount(new, minlength=6).double(), p[0].flip(0).double())[0] < 1e-6


def test_a_tiny_run_reports_every_case(target, capsys):
    assert sampler_cost.main(["--model", target, "--tokens", "24", "--rounds", "2", "--rows", "4"]) == 0
    out = capsys.readouterr().out
    for case in ("greedy", *sampler_cost.CASES):
        assert f"| {case} |" in out
    assert "Regenerate: `OMP_NUM_THREADS=2 .venv/bin/python lab/measure/sampler_cost.py" in out
