"""The demo target's evaluator (lab/demo_target/evaluate_target.py): HumanEval body truncation and the repetition rate."""

from lab.demo_target.evaluate_target import body_parses, repetition_rate, truncate_body

PROMPT = 'def add(a, b):\n    """Return a + b."""'


def test_a_dedent_ends_the_body():
    body, completed = truncate_body("\n    return a + b\n\ndef other():\n    pass")
    assert completed and body == "\n    return a + b\n"


def test_a_body_that_ended_with_a_stop_token_is_whole():
    comp = "\n    s = a + b\n    return s"
    assert truncate_body(comp, stopped=True) == (comp, True)
    r = body_parses(PROMPT, comp, stopped=True)
    assert r == {"parses": True, "completed": True, "nonempty": True}


def test_a_body_cut_by_the_token_limit_loses_its_last_line():
    # Negative control: the same text, not stopped, drops "    return s" (it may be partial).
    assert truncate_body("\n    s = a + b\n    return s") == ("\n    s = a + b", False)
    assert truncate_body("\n    return (a +", stopped=False) == ("", False)
    assert body_parses(PROMPT, "\n    return (a +", stopped=True)["parses"] is False


def test_repetition_rate_counts_repeated_8grams():
    assert repetition_rate(list(range(20))) == (0, 20)
    loop = [1, 2, 3] * 10  # 30 tokens; every 8-gram from position 10 on was seen 3 tokens earlier
    assert repetition_rate(loop) == (30 - 10, 30)
