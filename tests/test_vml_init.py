"""peagle/vml_init.py: in fresh processes on 2 threads, torch's first large MKL vector-math call after `import peagle`
and an MKL matrix product gives the bits of its second call, and every process the same bits.

The race it guards against shows in some processes only (on a 2-core Intel Xeon VM without the warm-up: 1 to 3
of 10-12 fresh processes per variant of lab/measure/vml_first_call.py's script, which this test runs), so one
process proves little: the test runs PROCESSES of them (about 4 s each, mostly importing torch and peagle).
Negative control, run by hand there: with the warm-up call removed from peagle/vml_init.py this test failed 3 of
3 runs."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lab.measure.vml_first_call import EXP

PROCESSES = 6
SCRIPT = EXP.format(imp="\nimport peagle")   # an MKL matrix product, then a float64 exp of 528,384 values twice
CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


@pytest.mark.skipif(len(CPUS) < 2, reason="the race needs 2 threads on 2 CPUs")
def test_first_vector_math_call_matches_later_ones_in_every_process():
    env = dict(os.environ, OMP_NUM_THREADS="2")
    seen = []
    for _ in range(PROCESSES):
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        differing, digest = out.stdout.split()
        seen.append((int(differing), digest))
    assert all(d == 0 for d, _ in seen), f"first call's bits differ from the second's: {seen}"
    assert len({h for _, h in seen}) == 1, f"processes disagree: {seen}"
