"""lab/measure/cpu_step.py: settling decodes untimed for the time asked without moving the cache, and a whole
(tiny) run reports every shape with the settling it did."""
import time

import torch

from lab.measure import cpu_step
from peagle.models.llama import Transformer


def test_settle_decodes_for_the_time_asked_and_leaves_the_cache_lengths(target):
    t = Transformer.from_pretrained(target)
    cache = t.new_cache(1, 24)
    t.forward(torch.randint(3, 500, (1, 8)), cache, 0, torch.zeros(1, dtype=torch.long))
    cache.lens[:] = 8
    lens = cache.lens.clone()
    t0 = time.perf_counter()
    n = cpu_step.settle(t, cache, 8, 0.05)
    assert time.perf_counter() - t0 >= 0.05 and n >= 1
    assert torch.equal(cache.lens, lens)
    assert cpu_step.settle(t, cache, 8, 0.0) == 0


def test_a_tiny_run_reports_every_shape_and_its_settling(target, tmp_path):
    out = tmp_path / "r.md"
    cpu_step.main(["--model", target, "--quantizations", "none", "--rounds", "1", "--context", "8", "--blocks", "1,2",
                   "--prefill", "", "--ppl-texts", "0", "--settle", "0.02", "--warm", "1", "--out", str(out)])
    text = out.read_text()
    assert "starts with 0.02 s of untimed plain steps" in text
    row = next(line for line in text.splitlines() if line.startswith("| none |"))
    assert len(row.strip("|").split("|")) == 13      # the columns of blocks 1, 2: one verify and its ratio
