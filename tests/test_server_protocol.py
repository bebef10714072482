"""Request parsing (peagle/server/protocol.py): text that is not valid Unicode, in any field of either endpoint,
is a 400 naming that field (never a 5xx, never echoed), whether it comes as a JSON escape of a lone surrogate, as
the raw bytes of one, or as bytes that are not UTF-8; JSON that Python cannot hold (deep nesting, huge integers) is
a 400 too; odd but valid values are served. End to end on a real server for the cases of issue 18."""
import json

import pytest
from serving import client, get_json, model_dir, post, ref_complete, ref_llm, start, wait_idle  # noqa: F401 (fixtures)

from peagle.server.protocol import ApiError, ChatRequest, CompletionRequest, parse_body

BAD = "\ud800"          # stands for the unencodable text; each encoding below turns it into bytes its own way
ENCODINGS = {
    "escape": lambda body: json.dumps(body).encode(),                                         # "\ud800"
    "raw-surrogate": lambda body: json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass"),
    "not-utf8": lambda body: json.dumps(body, ensure_ascii=False).replace(BAD, "\udcff").encode(
        "utf-8", "surrogateescape"),                                                          # a lone 0xff byte
}
MSG = {"role": "user", "content": "hi"}
# (request class, body with BAD somewhere, the field named in the message, param)
FIELDS = [
    (CompletionRequest, {"prompt": "a" + BAD + "b"}, "'prompt'", "prompt"),
    (CompletionRequest, {"prompt": ["ok", BAD]}, "'prompt[1]'", "prompt"),
    (CompletionRequest, {"prompt": "hi", "model": BAD}, "'model'", "model"),
    (CompletionRequest, {"prompt": "hi", "stop": BAD}, "'stop'", "stop"),
    (CompletionRequest, {"prompt": "hi", "stop": ["x", BAD]}, "'stop[1]'", "stop"),
    (CompletionRequest, {"prompt": "hi", "user": BAD}, "'user'", "user"),
    (CompletionRequest, {"prompt": "hi", "suffix": BAD}, "'suffix'", "suffix"),
    (CompletionRequest, {"prompt": "hi", "logit_bias": {BAD: 1}}, "a field name in 'logit_bias'", "logit_bias"),
    (CompletionRequest, {"prompt": "hi", "stream_options": {"x": [BAD]}}, "'stream_options.x[0]'",
     "stream_options"),
    (CompletionRequest, {"prompt": "hi", BAD: 1}, "a field name", None),
    (CompletionRequest, {"prompt": "hi", "unknown": {"deep": [[BAD]]}}, "'unknown.deep[0][0]'", "unknown"),
    (ChatRequest, {"messages": [{"role": "user", "content": BAD}]}, "'messages[0].content'", "messages"),
    (ChatRequest, {"messages": [MSG, {"role": "user", "content": [{"type": "text", "text": BAD}]}]},
     "'messages[1].content[0].text'", "messages"),
    (ChatRequest, {"messages": [{"role": "user", "content": [{"type": BAD}]}]}, "'messages[0].content[0].type'",
     "messages"),
    (ChatRequest, {"messages": [{"role": BAD, "content": "hi"}]}, "'messages[0].role'", "messages"),
    (ChatRequest, {"messages": [{**MSG, "name": BAD}]}, "'messages[0].name'", "messages"),
    (ChatRequest, {"messages": [MSG], "model": BAD}, "'model'", "model"),
    (ChatRequest, {"messages": [MSG], "stop": [BAD]}, "'stop[0]'", "stop"),
    (ChatRequest, {"messages": [MSG], "response_format": {"type": BAD}}, "'response_format.type'",
     "response_format"),
    (ChatRequest, {"messages": [MSG], "tools": [{"function": {"name": BAD}}]}, "'tools[0].function.name'", "tools"),
    (ChatRequest, {"messages": [MSG], "tool_choice": BAD}, "'tool_choice'", "tool_choice"),
]


@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_invalid_unicode_in_any_field_is_400_naming_it(encoding):
    for cls, body, where, param in FIELDS:
        raw = ENCODINGS[encoding](body)
        with pytest.raises(ApiError) as e:
            parse_body(raw, cls)
        err = e.value
        assert (err.status, err.param, err.code) == (400, param, "invalid_unicode"), (body, err.message)
        assert err.message.startswith(where + " is not valid Unicode"), (where, err.message)
        json.dumps(err.body(), ensure_ascii=False).encode("utf-8")           # the error itself is encodable
        # the same body with the text made valid parses (or fails for another reason than Unicode)
        fixed = ENCODINGS[encoding](json.loads(json.dumps(body).replace("\\ud800", "ok")))
        try:
            parse_body(fixed, cls)
        except ApiError as e2:
            assert e2.code != "invalid_unicode"


def test_json_python_cannot_hold_is_400():
    for raw in (b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
                b'{"prompt": "hi"', b"\xff\xfe", b'["prompt"]', b""):
        with pytest.raises(ApiError) as e:
            parse_body(raw, CompletionRequest)
        assert e.value.status == 400 and e.value.code == "invalid_json", raw[:40]
    # valid: a surrogate pair escape is one character, a UTF-8 byte order mark is skipped
    assert parse_body(b'{"prompt": "\\ud83d\\ude00"}', CompletionRequest).prompt == "\U0001F600"
    assert parse_body(b'\xef\xbb\xbf{"prompt": "hi"}', CompletionRequest).prompt == "hi"


@pytest.fixture(scope="module")
def srv(model_dir):
    s = start(model_dir, max_num_seqs=4)
    yield s
    s.stop()


def test_issue_18_surrogates_get_400_and_the_server_stays_exact(srv, ref_llm):
    cases = [("/v1/completions", b'{"prompt": "\xed\xa0\x80"}', "prompt"),         # the issue's raw bytes
             ("/v1/completions", b'{"prompt": "\\ud800"}', "prompt"),              # and its JSON escape
             ("/v1/completions", b'{"prompt": "\\ud800", "stream": true}', "prompt"),
             ("/v1/completions", b'{"prompt": "hi", "model": "\\udfff"}', "model"),
             ("/v1/completions", b'{"prompt": "a\xffb"}', "prompt"),
             ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', "messages"),
             ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", '
                                      b'"text": "\\udc00"}]}], "stream": true}', "messages")]
    for path, raw, param in cases:
        code, js = post(srv, path, raw)
        assert code == 400 and js["error"]["param"] == param and js["error"]["code"] == "invalid_unicode", (raw, js)
    # odd but valid values are served (top_p below float32's smallest number used to be a 500)
    for extra in ({"top_p": 1e-320}, {"temperature": 1e-320}, {"temperature": 1e308, "top_k": 10 ** 30},
                  {"seed": -5}, {"seed": 2 ** 63 - 1}, {"seed": -2 ** 63}, {"stop": ["\u0000"]}):
        code, js = post(srv, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 4, **extra}).encode())
        assert code == 200, (extra, js)
    wait_idle(srv)
    ref = ref_complete(ref_llm, ["Hello there"], 12)[0]
    assert client(srv).completions.create(model="tiny", prompt="Hello there", max_tokens=12,
                                          temperature=0).choices[0].text == ref.text


def test_numbers_past_the_limits_are_400_not_500(srv):
    """A max_tokens of 4,300 digits (JSON reads it) was a 500: the context error summed it with the prompt's length
    into an integer Python refuses to write. Seeds beyond int64 wrapped onto others (2^64 + 5 drew seed 5's
    numbers); vLLM refuses them with a 400."""
    big = b"9" * 4300
    chat = b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": ' + big + b"}"
    for path, raw, param in (("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + big + b"}", "max_tokens"),
                             ("/v1/chat/completions", chat, "max_completion_tokens"),
                             ("/v1/completions", json.dumps({"prompt": "hi", "seed": 2 ** 63}).encode(), "seed"),
                             ("/v1/completions", json.dumps({"prompt": "hi", "seed": 2 ** 64 + 5}).encode(), "seed"),
                             ("/v1/completions", json.dumps({"prompt": "hi", "seed": -2 ** 63 - 1}).encode(), "seed")):
        code, js = post(srv, path, raw)
        assert code == 400 and js["error"]["param"] == param, (raw[:60], js)


def test_models_names_the_model_as_given_and_no_other_path(model_dir, monkeypatch):
    """/v1/models' root was the model's absolute path (a model given as a relative path showed the server's
    directories) and requests naming that absolute path were served; vLLM's root is the model as given."""
    import os
    monkeypatch.chdir(os.path.dirname(model_dir))
    rel = os.path.basename(model_dir)
    s = start(rel, max_num_seqs=1)
    try:
        assert get_json(s, "/v1/models")["data"][0]["root"] == rel
        for name, want in (("tiny", 200), (rel, 200), (os.path.abspath(rel), 404)):
            code, js = post(s, "/v1/completions", json.dumps({"model": name, "prompt": "hi", "max_tokens": 1}).encode())
            assert code == want, (name, js)
    finally:
        s.stop()
