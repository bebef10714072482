"""peagle/autok/measure.py's bookkeeping: the grid of batch sizes, passes per batch size, and the time still to
go that the first start prints after each batch size (the measurement itself runs end to end in
test_autok_factory.py)."""
import pytest

from peagle.autok.measure import grid_batch_sizes, passes_for, seconds_left


def test_grid_doubles_up_to_the_largest_batch():
    assert grid_batch_sizes(1) == [1]
    assert grid_batch_sizes(4) == [1, 2, 4]
    assert grid_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_small_batches_get_more_passes():
    assert [passes_for(B, 8) for B in (1, 2, 4, 8, 64)] == [8, 4, 2, 2, 2]


def test_seconds_left_prices_each_larger_batch_by_its_passes_and_rows():
    bs = [1, 2, 4, 8, 16, 32, 64, 128]
    assert seconds_left(bs, 5, 7.2, 8) == pytest.approx(7.2 * (2 + 4))    # after B=32 (2 passes): 64, 128 to go
    # after B=1 (8 passes): B=2 has 4 passes of 2 rows, B=4 2 of 4, then 2 passes each
    assert seconds_left(bs, 0, 1.0, 8) == pytest.approx(1.0 + 1.0 + (8 + 16 + 32 + 64 + 128) / 4)
    assert seconds_left(bs, len(bs) - 1, 40.0, 8) == 0                   # the last: nothing left
    assert seconds_left([1, 2, 4, 100], 2, 4.0, 8) == pytest.approx(100.0)   # a last size off the doubling
