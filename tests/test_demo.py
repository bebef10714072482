"""`make demo`'s thread choice: two torch threads only when the CPUs are idle now (busy_cpus), not when the
1-minute load average still counts the set-up that just finished."""
import subprocess
import sys

from peagle.demo import busy_cpus


def test_a_spinning_process_counts_as_one_busy_cpu():
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 3\nwhile time.time() < t: pass"])
    try:
        busy = busy_cpus(0.8)
    finally:
        spin.kill()
        spin.wait()
    assert busy >= 0.8                      # the spinner alone keeps one CPU busy: the demo would use 1 thread

