"""peagle/drafters/base.py: a drafter's rows follow the engine's -- when a request leaves and the last row moves
into its place, the drafter's cache and context move with it -- so each request drafts what it drafts alone."""
import pytest

from peagle import LLM, SamplingParams
from peagle.llm import DEMO_EAGLE3_HEAD, DEMO_PEAGLE_HEAD, DEMO_TARGET


@pytest.mark.parametrize("head,parallel", [(DEMO_PEAGLE_HEAD, True), (DEMO_EAGLE3_HEAD, False)],
                         ids=["peagle", "eagle3"])
def test_each_request_accepts_what_it_accepts_alone_as_rows_leave(head, parallel):
    """Requests of different lengths in one batch (rows leave and the last row moves into the gap): each one's
    accepted drafts equal a run of it alone. Without the drafter's cache moving with its row, the target's
    output stayed exact (verification) while the drafts of a moved row read another request's keys: only its
    acceptance showed it (a mutation review found no test that did)."""
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "parallel_drafting": parallel}
    llm = LLM(DEMO_TARGET, speculative_config=spec, max_num_seqs=4)
    prompts = ["Once upon a time", "def add(a, b):", "The weather today is", "import os\n", "Hello",
               "A list of fruits:"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 40, 16, 30, 5, 24)]
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    llm.reset_metrics()
    together = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    got = [(o.metrics["num_drafts"], o.metrics["num_accepted_tokens"]) for o in together]
    assert got == [(o.metrics["num_drafts"], o.metrics["num_accepted_tokens"]) for o in alone]
    assert sum(a for _, a in got) > 0
    m = llm.get_metrics()                                   # per request adds up to the engine's counters
    assert sum(a for _, a in got) == m["num_accepted_tokens"] and sum(n for n, _ in got) == m["num_drafts"]
