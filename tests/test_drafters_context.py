"""peagle/drafters/context.py: the drafter's per-row backlog buffer grows by doubling, never past the longest a
row can get (the drafter cache's max_len), and keeps its contents."""
import torch

from peagle.drafters.context import DraftContext


def test_the_backlog_buffer_doubles_up_to_the_longest_row_only():
    """K = 0 steps grow a row's backlog by one entry each: the buffer doubled without a bound (1,152 entries per
    row, and its [rows, width, 3H] aux, for a 1,024-token context in a probe). Negative control: without a bound
    it still doubles past it."""
    ctx = DraftContext("cpu")
    ctx.max_width = 1024
    ctx.ensure(2, 600, aux_dim=4, aux_dtype=torch.float32)
    ctx.ids[1, 599] = 7
    for w in range(601, 1025):
        ctx.ensure(2, w)
    assert ctx.width == 1024 and ctx.ids.shape == (2, 1024) and ctx.aux.shape == (2, 1024, 4)
    assert ctx.ids[1, 599] == 7
    free = DraftContext("cpu")
    free.ensure(2, 600)
    free.ensure(2, 601)
    assert free.width == 1200
