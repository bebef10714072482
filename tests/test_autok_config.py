"""Auto K's knobs in one typed config (peagle/autok/config.py): read from the speculative config's "auto_k" key,
checked with one-line errors, kept out of what is written for vLLM, and overridden by the environment for A/B
runs only."""
import pytest

from peagle.autok.acceptance import Acceptance
from peagle.autok.auto import AutoK
from peagle.autok.config import KEEP, MARGIN, PROBE_TOL, SETTLE, AutoKConfig, GuardConfig
from peagle.autok.costmodel import CostModel
from peagle.autok.factory import make_policy
from peagle.errors import PeagleError
from peagle.spec_config import parse_spec_config

AUTO = {"method": "eagle3", "model": "h", "num_speculative_tokens": "auto"}


def cost(k_max=3):
    return CostModel([1, 4], [[0.01 + 0.002 * k for k in range(k_max + 1)], [0.02 + 0.004 * k for k in range(k_max + 1)]])


def test_defaults():
    c = AutoKConfig()
    assert (c.margin, c.settle, c.keep, c.probe_tol, c.horizon, c.default_max_tokens) == (MARGIN, SETTLE, KEEP, None,
                                                                                            64, 256)
    assert c.refine and c.guard == GuardConfig() and c.guard.enabled and c.trace is None
    assert AutoKConfig.from_dict(None) == AutoKConfig.from_dict({}) == c and c.as_dict() == {}


def test_from_dict_and_back():
    d = {"margin": 0.05, "settle": 1, "probe_tol": 0.1, "guard": {"window": 8, "backoff": 16}, "trace": "t.jsonl"}
    c = AutoKConfig.from_dict(d)
    assert (c.margin, c.settle, c.probe_tol, c.guard.window, c.guard.backoff, c.trace) == (0.05, 1, 0.1, 8, 16,
                                                                                             "t.jsonl")
    assert c.as_dict() == d and AutoKConfig.from_dict(c.as_dict()) == c
    off = AutoKConfig.from_dict({"guard": False})
    assert not off.guard.enabled and off.as_dict() == {"guard": False}
    assert off.probing is None and AutoKConfig(probe_tol=PROBE_TOL).probing == PROBE_TOL   # probing needs the guard


@pytest.mark.parametrize("bad, match", [
    ({"margins": 0.1}, "unknown auto_k key"), ({"margin": "0.1"}, "auto_k.margin"), ({"settle": True}, "auto_k.settle"),
    ({"margin": -0.1}, "margin"), ({"settle": 0}, "settle"), ({"probe_tol": 1.5}, "probe_tol"),
    ({"guard": {"windows": 3}}, "unknown guard key"), ({"guard": {"window": 0}}, "window"), ([], "JSON object"),
    # the guard's own fields: a string is not a bool ("false" kept the guard on), NaN / out-of-range numbers
    ({"guard": {"enabled": "false"}}, "guard.enabled"), ({"guard": {"window": 2.7}}, "guard.window"),
    ({"guard": {"budget": float("nan")}}, "guard.budget"), ({"guard": {"rate": 3.0}}, "rate"),
    ({"guard": {"z": -1.0}}, "z >= 0"), ({"guard": {"min_speedup": 0}}, "min_speedup"),
    ({"guard": {"plain_max": 4}}, "plain_max > plain_samples"), ({"guard": {"plain_spacing": 8}}, "unknown guard key"),
    ({"keep": -5}, "keep"), ({"keep": float("nan")}, "keep"),
])
def test_bad_settings_are_one_line_errors(bad, match):
    with pytest.raises(PeagleError, match=match):
        AutoKConfig.from_dict(bad)


def test_the_speculative_config_carries_it():
    """The speculative config carries "auto_k" as given (the spec config sits below auto K in the layers); the
    policy's factory types and checks it before it measures anything."""
    s = parse_spec_config({**AUTO, "auto_k": {"margin": 0.05, "guard": False}})
    assert AutoKConfig.from_dict(s.auto_k) == AutoKConfig(margin=0.05, guard=GuardConfig(enabled=False))
    assert parse_spec_config(s.as_dict()) == s
    assert parse_spec_config(AUTO).auto_k is None and "auto_k" not in parse_spec_config(AUTO).as_dict()
    for bad in ({**AUTO, "num_speculative_tokens": 3, "auto_k": {}}, {**AUTO, "auto_k": [0.1]}):
        with pytest.raises(PeagleError, match="auto_k"):
            parse_spec_config(bad)
    with pytest.raises(PeagleError, match="auto_k.margin"):
        make_policy(parse_spec_config({**AUTO, "auto_k": {"margin": "high"}}), None, None, None, 3, 1, "m", None)


def test_the_environment_overrides_for_ab_runs():
    c = AutoKConfig(margin=0.3, probe_tol=0.05, guard=GuardConfig(enabled=False, window=8))
    assert c.with_env({}) == c
    e = c.with_env({"PEAGLE_AUTOK_GUARD": "1", "PEAGLE_AUTOK_MARGIN": "0.05", "PEAGLE_AUTOK_PROBE": "off",
                    "PEAGLE_AUTOK_TRACE": "x.jsonl"})
    assert e == AutoKConfig(margin=0.05, probe_tol=None, trace="x.jsonl", guard=GuardConfig(enabled=True, window=8))
    assert AutoKConfig().with_env({"PEAGLE_AUTOK_PROBE": "on"}).probe_tol == PROBE_TOL
    with pytest.raises(PeagleError, match="PEAGLE_AUTOK_MARGIN"):
        c.with_env({"PEAGLE_AUTOK_MARGIN": "lots"})


def test_the_policy_reads_its_config():
    pol = AutoK(3, cost(), Acceptance(3), AutoKConfig(margin=0.3, settle=2, horizon=8, default_max_tokens=32,
                                                      refine=False, probe_tol=0.05, keep=0.1,
                                                      guard=GuardConfig(window=4, budget=2.0)))
    assert (pol.margin, pol.settle, pol.horizon, pol.default_max_tokens, pol.refine, pol.probe_tol, pol.keep) == \
        (0.3, 2, 8, 32, False, 0.05, 0.1)
    assert (pol.guard.window, pol.guard.budget, pol.guard.enabled) == (4, 2.0, True)
    assert AutoK(3, cost(), Acceptance(3)).config == AutoKConfig()


def test_peagle_bench_takes_it_on_the_command_line(capsys):
    from peagle.bench.command import apply_defaults, canonical_command
    from peagle.cli import build_parser
    a = build_parser("bench").parse_args(["bench", "--ks", "1,auto", "--auto-k", '{"margin": 0.05, "guard": false}'])
    assert a.auto_k == AutoKConfig(margin=0.05, guard=GuardConfig(enabled=False))
    apply_defaults(a)
    assert """--auto-k '{"margin":0.05,"guard":false}'""" in canonical_command(a)     # the report's command
    with pytest.raises(SystemExit):
        build_parser("bench").parse_args(["bench", "--auto-k", '{"margins": 1}'])
    assert "unknown auto_k key" in capsys.readouterr().err
