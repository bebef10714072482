"""The AVX-512 path of the GGUF block types with float activations (peagle/csrc/quant_f_avx512.cpp), which reads
pack_a8's layout: the scalar path's bits in both of its forms (accumulators in registers below L1_MIN_ROWS rows,
in L1 from there), past its row limit, with the layout given or not; a layout of other weights shows it is
the one read; a wrong one is refused. test_quant.py covers every path against the scalar one at more shapes."""
import pytest
import torch
from test_quant import random_blocks

from peagle.models import quant as Q
from peagle.models import quant_ext

EXT = quant_ext.get()
pytestmark = pytest.mark.skipif(EXT is None or not EXT.has_avx512(), reason="needs a CPU with AVX-512 VNNI")
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]


@pytest.mark.parametrize("qtype", TYPES)
def test_the_packed_float_path_gives_the_scalar_bits(qtype):
    """53 outputs (7 groups: three pairs and an odd last group, partial), K = 96 (3 blocks); 1-4 rows in registers
    (tiles of 2 and 1), 5+ through L1 (tiles of 3, 2, 1; 40 and 64 rows in passes of 32), 131 on the AVX2 path
    (past the packed path's 64 rows)."""
    w = random_blocks(qtype, 53, 96, seed=11)
    packed = EXT.pack_a8(w.data, qtype, w.n, w.k)
    g = torch.Generator().manual_seed(2)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 40, 64, 131):
        x = torch.randn(m, w.k, generator=g)
        ref = EXT.qlinear(x, w.data, qtype, w.n, w.k, 1)
        assert torch.equal(EXT.qlinear(x, w.data, qtype, w.n, w.k, 3, packed), ref), m
        assert torch.equal(EXT.qlinear(x, w.data, qtype, w.n, w.k, 3), ref), m   # no layout given: AVX2's path
        assert torch.equal(Q.qmm(x, w, 0), ref), m                                # what a target runs


@pytest.mark.parametrize("qtype", TYPES)
def test_the_packed_float_path_reads_the_layout(qtype):
    """Negative control: the layout of other weights (same shape) gives the other weights' product, not this one's;
    a layout of the wrong shape, or of F32 weights, is refused."""
    w, other = random_blocks(qtype, 24, 64, seed=1), random_blocks(qtype, 24, 64, seed=2)
    for m in (3, 8, 40):                    # registers; L1, one pass and two
        x = torch.randn(m, 64)
        got = EXT.qlinear(x, w.data, qtype, 24, 64, 3, EXT.pack_a8(other.data, qtype, 24, 64))
        assert torch.equal(got, EXT.qlinear(x, other.data, qtype, 24, 64, 1)), m
        assert not torch.equal(got, EXT.qlinear(x, w.data, qtype, 24, 64, 1)), m
    with pytest.raises(RuntimeError, match="not pack_a8"):
        EXT.qlinear(x, w.data, qtype, 24, 64, 3, EXT.pack_a8(w.data[:16].contiguous(), qtype, 16, 64))
    f = random_blocks(Q.F32, 24, 64)
    with pytest.raises(RuntimeError, match="not pack_a8"):
        EXT.qlinear(x, f.data, Q.F32, 24, 64, 3, EXT.pack_a8(w.data, qtype, 24, 64))


def test_a_weight_only_target_keeps_the_layout_where_it_runs():
    """A float-activation block weight's kernel_packed is pack_a8 on an AVX-512 CPU (made once); F32 has none."""
    w = random_blocks(Q.Q4_1, 16, 64)
    p = w.kernel_packed(EXT)
    assert p.numel() > 0 and p is w.kernel_packed(EXT)
    assert random_blocks(Q.F32, 16, 64).kernel_packed(EXT).numel() == 0
