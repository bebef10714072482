"""`peagle tune`: the per-batch-size schedule from measured costs and acceptance, written as a speculative
config vLLM's rules accept (checked by our parser, which applies vLLM 0.32's schedule validation)."""
import json

import numpy as np
from heads import save_random_head

from peagle.autok.costmodel import CostModel
from peagle.autok.tune import best_k_per_batch, best_kind_per_batch, best_two_level, expected_tokens, ranges
from peagle.spec_config import parse_spec_config


def test_schedule_from_costs_and_acceptance():
    e = expected_tokens([0.9, 0.8, 0.6, 0.3])            # P(accepted >= i)
    assert np.allclose(e, [1.0, 1.9, 2.7, 3.3, 3.6])
    # verification nearly free at B=1, each draft token costs a lot at B=32
    cost = CostModel([1, 32], [[10e-3 + 1e-3 * k for k in range(5)], [30e-3 + 40e-3 * k for k in range(5)]])
    ks = best_k_per_batch(e, cost, 32)
    for b, k in enumerate(ks, 1):
        rate = e / cost.predict(b)
        assert rate[k] == rate.max()
    assert ks[0] == 4 and ks[-1] == 0 and ks == sorted(ks, reverse=True)
    sched = ranges(ks)
    assert sched[0][0] == 1 and sched[-1][1] == 32
    assert all(a[1] + 1 == b[0] and a[2] != b[2] for a, b in zip(sched, sched[1:]))
    assert [k for s, t, k in sched for _ in range(s, t + 1)] == ks


def test_two_level_schedule_for_parallel_heads():
    """Each batch size uses 0 or one k (vLLM <= 0.32 with parallel drafting), the k with the most expected
    speedup summed over batch sizes; the free schedule of the same costs has more levels (the control)."""
    e = expected_tokens([0.9, 0.8, 0.6, 0.3])
    cost = CostModel([1, 32], [[10e-3 + 1e-3 * k for k in range(5)], [30e-3 + 40e-3 * k for k in range(5)]])
    free = best_k_per_batch(e, cost, 32)
    assert len(set(free) - {0}) > 1
    k, ks = best_two_level(e, cost, 32)
    assert set(ks) <= {0, k} and k in ks

    def total(kk, sched):
        return sum(e[x] / cost.predict(b)[x] / (e[0] / cost.predict(b)[0]) for b, x in enumerate(sched, 1))
    for other in range(1, 5):                                 # no other level does better
        alt = [other if e[other] / cost.predict(b)[other] > e[0] / cost.predict(b)[0] else 0 for b in range(1, 33)]
        assert total(k, ks) >= total(other, alt) - 1e-12
    assert total(k, ks) <= total(None, free) + 1e-12          # never above the free schedule


def test_tree_chain_or_plain_per_batch_size():
    """Trees accept more but verify more positions: they win where verification is nearly free (small batches),
    chains further up, plain decoding where drafting costs more than it yields; each choice is the argmax."""
    e_chain, e_tree = expected_tokens([0.4, 0.1, 0.02]), expected_tokens([0.7, 0.3, 0.1])
    chain = CostModel([1, 32], [[10e-3 + 0.5e-3 * k for k in range(4)], [30e-3 + 4e-3 * k for k in range(4)]])
    tree = CostModel([1, 32], [[10e-3 + 1e-3 * k for k in range(4)], [30e-3 + 40e-3 * k for k in range(4)]])
    kinds = best_kind_per_batch((e_chain, chain), (e_tree, tree), 32)
    for b, (kind, k) in enumerate(kinds, 1):
        rates = {("plain", 0): e_chain[0] / chain.predict(b)[0]}
        for name, e, c in (("chain", e_chain, chain), ("tree", e_tree, tree)):
            rates.update({(name, j): e[j] / c.predict(b)[j] for j in range(1, 4)})
        assert rates[(kind, k)] == max(rates.values())
    assert kinds[0][0] == "tree" and {kd for kd, _ in kinds} >= {"tree", "chain"}
    assert best_kind_per_batch((e_chain, chain), (expected_tokens([0.0] * 3), tree), 32)[0][0] != "tree"  # control


def test_tune_cli_writes_a_vllm_ready_config(tiny_dirs, tmp_path, capsys, monkeypatch):
    from peagle.cli import main
    tgt = tiny_dirs["llama"]
    head = save_random_head(tgt, str(tmp_path / "h"), layers=1)
    out = str(tmp_path / "spec.json")
    spec = json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": "auto",
                       "max_num_speculative_tokens": 3, "parallel_drafting": True})
    rc = main(["tune", tgt, "--speculative-config", spec, "--max-num-seqs", "6", "--num-prompts", "2",
               "--output-len", "8", "--dataset", "humaneval", "--out", out])
    assert rc == 0
    with open(out) as f:
        cfg = json.load(f)
    assert set(cfg) == {"method", "model", "num_speculative_tokens", "parallel_drafting",
                        "num_speculative_tokens_per_batch_size"}
    k = cfg["num_speculative_tokens"]
    assert 1 <= k <= 3 and cfg["model"] == head and cfg["parallel_drafting"] is True
    sched = parse_spec_config(cfg).num_speculative_tokens_per_batch_size
    assert sched[0][0] == 1 and sched[-1][1] == 6 and all(x in (0, k) for _, _, x in sched)   # two levels
    err = capsys.readouterr().err
    assert "batch 1-" in err and f"wrote {out}; serve with" in err
    rc = main(["tune", tgt, "--speculative-config", spec, "--max-num-seqs", "6", "--num-prompts", "2",
               "--output-len", "8", "--dataset", "humaneval", "--out", out, "--any-k"])
    with open(out) as f:
        cfg = json.load(f)
    assert rc == 0 and cfg["num_speculative_tokens"] == 3            # any K up to the maximum
    assert f"wrote {out} (replacing the file that was there)" in capsys.readouterr().err
    capsys.readouterr()
    tree_spec = json.dumps({**json.loads(spec), "eagle_topk": 2, "num_draft_tokens": 4})
    import peagle.cli.tune as tune_cli
    made = []
    real = tune_cli.measuring_engines
    monkeypatch.setattr(tune_cli, "measuring_engines", lambda t, h, s, k: made.append(s) or real(t, h, s, k))
    rc = main(["tune", tgt, "--speculative-config", tree_spec, "--max-num-seqs", "6", "--num-prompts", "2",
               "--output-len", "8", "--dataset", "humaneval", "--out", out])
    # vLLM's schedule from chain steps (tree steps were measured and cached as the chain's), the trees beside
    assert [s.tree(3) is None for s in made] == [True, False]
    with open(out) as f:
        cfg = json.load(f)
    err = capsys.readouterr().err
    assert rc == 0 and "eagle_topk" not in cfg and "num_draft_tokens" not in cfg       # vLLM's config: chains
    assert "token trees 2x4" in err and "peagle's engine per batch size" in err and "batch 1-" in err
