"""SpecMetrics against vLLM's definitions (v1/spec_decode/metrics.py), written out by hand for a known history:
mean acceptance length 1 + accepted / drafts, per-position rate accepted_at_i / drafts, draft acceptance rate
accepted / drafted; and peagle's own: the K used per step (K = 0 steps count) and tree nodes per row."""
import pytest

from peagle.spec_metrics import SpecMetrics


def history(m: SpecMetrics):
    """Four decode steps of a K-max-3 engine: two rows at K = 3, a plain step, one row at K = 2, one at K = 1."""
    for accepted, k in [(3, 3), (1, 3)]:
        m.add_draft(accepted, k)
    m.add_step(3)
    m.add_step(0)
    m.add_draft(0, 2)
    m.add_step(2)
    m.add_draft(1, 1)
    m.add_step(1)


def test_vllm_definitions_on_a_known_history():
    m = SpecMetrics(3)
    history(m)
    d = m.as_dict()
    assert (d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]) == (4, 9, 5)
    assert d["num_accepted_tokens_per_pos"] == [3, 1, 1]       # position i counts drafts accepting > i tokens
    assert d["mean_acceptance_length"] == pytest.approx(1 + 5 / 4)
    assert d["acceptance_rate_per_pos"] == pytest.approx([3 / 4, 1 / 4, 1 / 4])
    assert d["draft_acceptance_rate"] == pytest.approx(5 / 9)
    assert d["num_steps_per_k"] == [1, 1, 1, 1]
    assert d["mean_num_speculative_tokens"] == pytest.approx((0 + 1 + 2 + 3) / 4)   # the plain step counts
    assert "num_tree_rows" not in d and "mean_accepted_per_step" not in d


def test_trees_and_extra_entries():
    m = SpecMetrics(3)
    history(m)
    m.add_tree(7, 2)
    m.add_tree(5, 1)
    m.extra = lambda: {"k_policy": "auto"}
    d = m.as_dict()
    assert (d["num_tree_rows"], d["num_tree_nodes"]) == (3, 12)
    assert d["mean_tree_nodes_per_step"] == pytest.approx(12 / 3)
    assert d["mean_accepted_per_step"] == pytest.approx(5 / 4)
    assert d["k_policy"] == "auto"


def test_empty_and_reset():
    m = SpecMetrics(2)
    d = m.as_dict()
    assert d["mean_acceptance_length"] == 1.0 and d["draft_acceptance_rate"] == 0.0
    assert d["acceptance_rate_per_pos"] == [0.0, 0.0] and d["mean_num_speculative_tokens"] == 0.0
    history_k2 = [(2, 2), (0, 2)]
    for a, k in history_k2:
        m.add_draft(a, k)
    m.add_step(2)
    m.prefill_time_s = 1.0
    m.add_tree(3, 1)
    m.reset()
    assert m.as_dict() == SpecMetrics(2).as_dict()
