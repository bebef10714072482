"""lab/measure/kernel_ab.py's placement: each build's copies load as often early as late, and every round starts
at another copy (a target loaded second ran faster on one VM, whichever build it was)."""
from lab.measure.kernel_ab import placement_order, rotated


def test_each_build_loads_as_often_early_as_late():
    for n in (2, 4, 6):
        order = placement_order(["base", "this"], n)
        assert sorted(order) == sorted((b, i) for b in ("base", "this") for i in range(n))   # every copy once
        pos = {b: sum(j for j, (name, _) in enumerate(order) if name == b) for b in ("base", "this")}
        assert pos["base"] == pos["this"], order
    # the one-copy-each form the script had before: the base always first
    assert placement_order(["base", "this"], 1) == [("base", 0), ("this", 0)]


def test_rounds_start_at_every_copy_in_turn():
    keys = placement_order(["base", "this"], 2)
    firsts = [rotated(keys, r)[0] for r in range(len(keys))]
    assert sorted(firsts) == sorted(keys)
    assert all(sorted(rotated(keys, r)) == sorted(keys) for r in range(7))
