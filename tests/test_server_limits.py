"""Per-request limits (peagle/server/limits.py) on a real server with small limits: each one gets a 4xx naming
its parameter just past the limit and passes at it; requests without max_tokens get the server's default; the
server stays exact afterwards; bad limit flags are one-line errors."""
import json

import pytest
from serving import client, model_dir, post, ref_complete, ref_llm, start, wait_idle  # noqa: F401 (fixtures)

from peagle import cli
from peagle.errors import PeagleError
from peagle.server.limits import Limits

LIMITS = Limits(max_body_bytes=4096, max_prompt_tokens=40, max_tokens_limit=20, default_max_tokens=5, max_stop=2,
                max_stop_chars=8)
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def limited(model_dir):
    srv = start(model_dir, max_num_seqs=4, limits=LIMITS)
    yield srv
    srv.stop()


def _post(srv, path, body):
    return post(srv, path, json.dumps(body).encode())


# (path, body over a limit, param, the same body at the limit)
CASES = [
    ("/v1/completions", {"prompt": [5] * 41, "max_tokens": 1}, "prompt", {"prompt": [5] * 40, "max_tokens": 1}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 21}, "max_tokens", {"prompt": "hi", "max_tokens": 20}),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 21}, "max_completion_tokens",
     {"messages": MSG, "max_completion_tokens": 20}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 21}, "max_tokens", {"messages": MSG, "max_tokens": 20}),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c"]}, "stop", {"prompt": "hi", "stop": ["a", "b"]}),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 9}, "stop", {"prompt": "hi", "stop": "x" * 8}),
    ("/v1/chat/completions", {"messages": MSG, "stop_token_ids": [7, 8, 9]}, "stop_token_ids",
     {"messages": MSG, "stop_token_ids": [7, 8]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "fox " * 40}]}, "messages",
     {"messages": [{"role": "user", "content": "fox " * 4}]}),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n", {"prompt": "hi", "n": 1}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1}}, "logit_bias", {"prompt": "hi", "logit_bias": {}}),
    # vLLM's extensions that change the output: served only at the value that changes nothing
    ("/v1/completions", {"prompt": "hi", "min_p": 0.5}, "min_p", {"prompt": "hi", "min_p": 0}),
    ("/v1/chat/completions", {"messages": MSG, "repetition_penalty": 1.5}, "repetition_penalty",
     {"messages": MSG, "repetition_penalty": 1.0}),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 3}, "min_tokens", {"prompt": "hi", "min_tokens": None}),
    ("/v1/chat/completions", {"messages": MSG, "skip_special_tokens": False}, "skip_special_tokens",
     {"messages": MSG, "skip_special_tokens": True}),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": 1}, "use_beam_search",
     {"prompt": "hi", "use_beam_search": False, "some_unknown_field": 7, "guided_json": {"type": "object"}}),
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {"enable_thinking": True}},
     "chat_template_kwargs", {"messages": MSG, "add_generation_prompt": True, "echo": False}),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}}, "response_format",
     {"prompt": "hi", "response_format": {"type": "text"}}),
]


def test_limits_get_4xx_naming_the_parameter(limited, ref_llm):
    for path, over, param, at in CASES:
        code, js = _post(limited, path, over)
        assert code == 400 and js["error"]["param"] == param, (over, js)
        code, js = _post(limited, path, at)
        assert code == 200, (at, js)
    code, js = _post(limited, "/v1/completions", {"prompt": "x" * 5000})
    assert code == 413 and js["error"]["code"] == "request_too_large"
    code, js = _post(limited, "/v1/completions", {"prompt": "x" * 4000, "max_tokens": 1})     # under 4096 bytes
    assert code == 400 and js["error"]["param"] == "prompt"                                  # but over 40 tokens
    # no max_tokens: the server's default (5) for chat and completions; an explicit null is the same
    c = client(limited)
    for extra in ({}, {"max_tokens": None}):
        code, js = _post(limited, "/v1/completions", {"prompt": "Hello there", "ignore_eos": True, **extra})
        assert code == 200 and js["usage"]["completion_tokens"] == 5, js
    r = c.chat.completions.create(model="tiny", messages=MSG, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    # still exact
    wait_idle(limited)
    ref = ref_complete(ref_llm, ["Hello there"], 20)[0]
    assert c.completions.create(model="tiny", prompt="Hello there", max_tokens=20,
                                temperature=0).choices[0].text == ref.text


def test_default_max_tokens_fits_the_context():
    """Without a server default, completions get OpenAI's 16 and chat the rest of the context, both cut to the
    context and to --max-tokens-limit."""
    lim = Limits(max_tokens_limit=12)
    assert lim.max_tokens_for(None, 10, 1024, fallback=16) == 12
    assert lim.max_tokens_for(None, 1020, 1024, fallback=16) == 4
    assert Limits().max_tokens_for(None, 10, 1024, fallback=16) == 16
    assert Limits().max_tokens_for(None, 10, 1024) is None                  # the engine stops at the context
    assert Limits(default_max_tokens=3).max_tokens_for(None, 10, 1024, fallback=16) == 3
    assert Limits().prompt_tokens(1024) == 1023 and Limits(max_prompt_tokens=5000).prompt_tokens(1024) == 1023


def test_bad_limit_flags_are_one_line_errors(model_dir, capsys):
    with pytest.raises(PeagleError):
        Limits(default_max_tokens=9, max_tokens_limit=4)
    with pytest.raises(PeagleError):
        Limits(max_body_bytes=0)
    assert cli.main(["serve", model_dir, "--default-max-tokens", "9", "--max-tokens-limit", "4"]) == 1
    assert "--default-max-tokens (9) must not exceed --max-tokens-limit (4)" in capsys.readouterr().err
    assert cli.main(["serve", model_dir, "--max-stop", "-1"]) == 1
    assert "--max-stop must be >= 0" in capsys.readouterr().err
