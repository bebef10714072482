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


def test_a_build_takes_the_packed_layout_by_its_signature():
    """This build's float-activation product takes pack_a8's layout (its AVX-512 path reads it); a build from
    before has no such argument, though its description says "packed by 8" (the F32 layout)."""
    from types import SimpleNamespace

    from lab.measure.kernel_ab import takes_packed
    from peagle.models import quant_ext
    ext = quant_ext.get()
    if ext is not None:
        assert takes_packed(ext)

    def old():
        """qlinear(arg0: torch.Tensor, arg1: torch.Tensor, arg2: int, arg3: int, arg4: int, arg5: int) -> torch.Tensor

        y = x @ W^T, W in GGUF blocks (Q4_0/Q4_1/Q8_0) or float32 packed by 8 (F32), batch-invariant"""
    assert not takes_packed(SimpleNamespace(qlinear=old))
