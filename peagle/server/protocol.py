"""OpenAI request bodies (strictly typed), OpenAI-style errors, and the mapping to SamplingParams."""
from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import PeagleError
from ..sampling import SamplingParams


class ApiError(Exception):
    """Becomes a JSON error response: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _Strict(BaseModel):
    # strict: "5" is not an int, true is not a number; unknown fields are ignored (as OpenAI and vLLM do)
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")   # model_extra: vLLM's extensions (VLLM_SERVED_AS)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)   # vLLM's int64 range (sampling keeps 64 bits)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None       # vLLM extension
    ignore_eos: bool = False                       # vLLM extension
    return_token_ids: bool = False                 # vLLM extension: token ids in the response
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    add_special_tokens: bool = True                # vLLM extension: the tokenizer's BOS etc. on a text prompt
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict | None = None


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes, cls):
    """bytes -> request model, or ApiError(400) naming the offending parameter. Text that is not valid Unicode
    (bytes that are not UTF-8, JSON escapes of lone surrogates) is a 400 naming the field that holds it."""
    try:
        text = raw.decode("utf-8")
        clean = not _SURROGATE_ESCAPE.search(text)
    except UnicodeDecodeError:   # invalid bytes become lone surrogates, so that check_text names their field
        text, clean = raw.decode("utf-8", "surrogateescape"), False
    try:
        data = json.loads(text.removeprefix("\ufeff"))
    except (ValueError, RecursionError) as e:     # ValueError: JSONDecodeError, ints over Python's digit limit
        msg = str(e).encode("ascii", "backslashreplace").decode()[:200]
        raise ApiError(400, f"request body is not valid JSON: {msg}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    if not clean:
        check_text(data)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ())]
        param = loc[0] if loc else None
        where = ".".join(loc) if loc else "body"
        raise ApiError(400, f"invalid value for '{where}': {err.get('msg')}", param=param,
                       code="invalid_type") from None


def check_text(data: dict):
    """400 for the first string (value or field name) that is not valid Unicode; the error names the field
    (e.g. messages[0].content) and never echoes the text."""
    todo = [(data, "", None)]
    while todo:
        v, where, param = todo.pop()
        if isinstance(v, str):
            _check_str(v, f"'{where}'", param)
        elif isinstance(v, dict):
            for k, x in v.items():
                _check_str(k, f"a field name in '{where}'" if where else "a field name", param)
                name = k.encode("ascii", "backslashreplace").decode()[:64]
                todo.append((x, f"{where}.{name}" if where else name, param or name))
        elif isinstance(v, list):
            todo.extend((x, f"{where}[{i}]", param) for i, x in enumerate(v))


def _check_str(s: str, what: str, param):
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{what} is not valid Unicode text (a lone surrogate or invalid UTF-8 at character "
                            f"{e.start})", param=param, code="invalid_unicode") from None


def _finite(name, v):
    if v is not None and not math.isfinite(v):
        raise ApiError(400, f"{name} must be a finite number", param=name)


# vLLM's request extensions that change the output, each with the one value peagle serves (what vLLM does when
# the field is absent); any other value is a 400 naming it (served as if absent, a request with min_p or
# repetition_penalty got output it did not ask for). null is the same as absent. Each name is an extension of
# one endpoint or both: chat's echo / add_special_tokens / template fields are declared fields of completions (or
# not vLLM's there), completions' response_format is chat's declared field, so model_extra never mixes them.
VLLM_SERVED_AS = {
    # sampling (both endpoints)
    "use_beam_search": False, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0,
    "include_stop_str_in_output": False, "skip_special_tokens": True, "bad_words": [], "allowed_token_ids": None,
    "prompt_logprobs": None, "logprob_token_ids": None, "truncate_prompt_tokens": None, "structured_outputs": None,
    "watermarking": None, "vllm_xargs": None, "repetition_detection": None, "thinking_token_budget": None,
    # the chat template (chat)
    "echo": False, "add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False,
    "chat_template": None, "chat_template_kwargs": None, "documents": None, "reasoning_effort": None,
    # completions
    "response_format": {"type": "text"},
}


def _served_as(v, default) -> bool:
    """v means the default: equal to it and of its kind (true is not 1, 0 is 0.0)."""
    return v is None or (v == default and isinstance(v, bool) == isinstance(default, bool))


def check_unsupported(req: _Common):
    for name, v in (req.model_extra or {}).items():
        if name in VLLM_SERVED_AS and not _served_as(v, VLLM_SERVED_AS[name]):
            raise ApiError(400, f"{name} is not supported (only {json.dumps(VLLM_SERVED_AS[name])})", param=name)
    if req.n is not None and req.n != 1:
        raise ApiError(400, f"only n=1 is supported, got n={req.n}", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v:
            raise ApiError(400, f"{name} is not supported (must be 0)", param=name)
    if req.logit_bias:
        raise ApiError(400, "logit_bias is not supported", param="logit_bias")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, 1):
            raise ApiError(400, "only best_of=1 is supported", param="best_of")
        if req.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if req.logprobs is not None:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        if req.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
    if isinstance(req, ChatRequest):
        if req.logprobs or req.top_logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        if req.tools:
            raise ApiError(400, "tools are not supported", param="tools")
        rf = req.response_format
        if rf is not None and rf.get("type", "text") != "text":
            raise ApiError(400, "only response_format type 'text' is supported", param="response_format")


def sampling_params(req: _Common, max_tokens: int | None) -> SamplingParams:
    """The request's sampling parameters (max_tokens already checked against the limits and the context)."""
    for name in ("temperature", "top_p"):
        _finite(name, getattr(req, name))
    if req.top_k is not None and req.top_k < -1:
        raise ApiError(400, f"top_k must be -1 (off), 0 (off) or positive, got {req.top_k}", param="top_k")
    try:
        return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p,
                              top_k=req.top_k or 0, max_tokens=max_tokens, stop=req.stop,
                              stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, seed=req.seed)
    except PeagleError as e:
        msg = str(e)
        param = next((p for p in ("temperature", "top_p", "top_k", "max_tokens", "seed") if msg.startswith(p)), None)
        raise ApiError(400, msg, param=param) from None
