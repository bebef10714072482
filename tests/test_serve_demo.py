"""Slow: the acceptance load test against the embedded demo target with its P-EAGLE head (`peagle serve` with
no model): 128 concurrent streaming clients, zero errors, every greedy output identical to plain decoding, no
rows leaked. Skipped until models/demo-target and models/demo-target-peagle exist."""
import os
import sys

import pytest

from peagle.llm import DEMO_PEAGLE_HEAD, DEMO_TARGET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.skipif(not (os.path.isdir(DEMO_TARGET) and os.path.isdir(DEMO_PEAGLE_HEAD)),
                    reason="needs the demo target and its P-EAGLE head")
def test_demo_128_streaming_chat_clients():
    sys.path.insert(0, os.path.join(REPO, "lab", "measure"))
    import load_test
    assert load_test.main(["--launch", "demo", "--chat", "--clients", "128", "--max-tokens", "64"]) == 0
