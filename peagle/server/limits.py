"""Per-request limits of a public endpoint: body size, prompt tokens, stop strings and ids, max_tokens.

Invariants: every limit is checked before the request reaches the engine and a request over one gets a 4xx
OpenAI-style error naming the parameter (413 for the body, 400 for the rest); a request that gives no max_tokens
gets the server's default cap (or the rest of the context), never more than --max-tokens-limit. n (only 1) and
logit_bias (only empty) are not limits but unsupported features: protocol.check_unsupported rejects them."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import PeagleError
from .protocol import ApiError


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 << 20           # request body (bytes)
    max_prompt_tokens: int | None = None     # None: the context (max_model_len - 1)
    max_tokens_limit: int | None = None      # the most a request may ask for; None: the rest of the context
    default_max_tokens: int | None = None    # for requests that give none; None: max_tokens_limit, else the context
    max_stop: int = 16                       # stop strings per request, and stop_token_ids per request
    max_stop_chars: int = 512                # characters per stop string

    def __post_init__(self):
        for name, v in vars(self).items():
            lo = 0 if name == "max_stop" else 1
            if v is not None and v < lo:
                raise PeagleError(f"--{name.replace('_', '-')} must be >= {lo}, got {v}")
        cap, default = self.max_tokens_limit, self.default_max_tokens
        if cap is not None and default is not None and default > cap:
            raise PeagleError(f"--default-max-tokens ({default}) must not exceed --max-tokens-limit ({cap})")

    def prompt_tokens(self, max_model_len: int) -> int:
        """The longest prompt accepted: the context minus one generated token, or less."""
        ctx = max_model_len - 1
        return ctx if self.max_prompt_tokens is None else min(ctx, self.max_prompt_tokens)

    def check_stop(self, stop: list[str], stop_token_ids: list[int] | None):
        if len(stop) > self.max_stop:
            raise ApiError(400, f"{len(stop)} stop strings; the limit is {self.max_stop}", param="stop")
        if any(len(s) > self.max_stop_chars for s in stop):
            raise ApiError(400, f"a stop string is longer than the limit of {self.max_stop_chars} characters",
                           param="stop")
        if stop_token_ids and len(stop_token_ids) > self.max_stop:
            raise ApiError(400, f"{len(stop_token_ids)} stop_token_ids; the limit is {self.max_stop}",
                           param="stop_token_ids")

    def max_tokens_for(self, requested: int | None, prompt_len: int, max_model_len: int, fallback=None,
                       param: str = "max_tokens"):
        """The request's max_tokens after the limits: a 400 (naming `param`, the field the client sent) if it
        asks for too many. A request that gives none gets the server's default (else `fallback`, e.g. OpenAI's
        16 for completions), never more than --max-tokens-limit, cut to the context (the client did not ask for
        a number); None: up to the context."""
        if requested is None:
            default = self.default_max_tokens if self.default_max_tokens is not None else fallback
            caps = [c for c in (default, self.max_tokens_limit) if c is not None]
            return min(*caps, max_model_len - prompt_len) if caps else None
        if requested < 1:
            raise ApiError(400, f"{param} must be at least 1, got {requested}", param=param)
        if self.max_tokens_limit is not None and requested > self.max_tokens_limit:
            raise ApiError(400, f"{param} is {_num(requested)}; this server allows at most {self.max_tokens_limit}",
                           param=param, code="max_tokens_exceeded")
        if prompt_len + requested > max_model_len:
            raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                                f"requested {_num(prompt_len + requested)} tokens ({prompt_len} in the prompt, "
                                f"{_num(requested)} in the completion). Please reduce the length of the prompt or "
                                f"completion.", param=param, code="context_length_exceeded")
        return requested


def _num(n: int) -> str:
    """n for a message: Python refuses to write integers of over 4,300 digits (JSON reads them)."""
    return str(n) if n.bit_length() <= 64 else f"more than {2 ** 64}"


async def read_body(request, limit: int) -> bytes:
    """The body, or 413. A body over the limit is still read (and dropped) up to 8x the limit, so that an
    ordinary client gets to read the 413 instead of a broken pipe; beyond that the connection is cut."""
    n = request.headers.get("content-length")
    drain_cap = 8 * limit
    if n is not None and n.isdigit() and (len(n) > 18 or int(n) > drain_cap):
        raise ApiError(413, f"request body is {n} bytes; the limit is {limit}", code="request_too_large")
    from starlette.requests import ClientDisconnect
    chunks, size = [], 0
    try:
        async for c in request.stream():
            size += len(c)
            if size > drain_cap:
                break
            if size <= limit:
                chunks.append(c)
    except ClientDisconnect:      # the client left before sending its body: nobody to answer, nothing failed here
        raise ApiError(499, "client closed the request before sending its body", code="client_closed") from None
    if size > limit:
        raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
    return b"".join(chunks)
