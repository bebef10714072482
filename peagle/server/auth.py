"""API keys (vLLM's --api-key): with keys set, a request needs `Authorization: Bearer KEY` for one of them.

Invariants: with no key nothing is checked. With keys, every path except OPEN (/health and /metrics, as in vLLM)
is refused with 401 and an OpenAI-style error unless its bearer token is one of the keys; the comparison is
constant-time: the token's and every key's SHA-256 digests (equal length, so no length leaks) are compared
with hmac.compare_digest, against every key whatever the outcome (so neither which key nor a matching prefix
leaks). Keys are never logged or echoed."""
from __future__ import annotations

import hashlib
import hmac
import ipaddress

from fastapi.responses import JSONResponse

from ..client import ENV_KEYS
from ..errors import PeagleError
from .protocol import error_body

OPEN = ("/health", "/metrics")


def resolve_api_keys(flags, env) -> tuple[str, ...]:
    """--api-key values (repeatable, each comma-separated) win; else $PEAGLE_API_KEY, else $VLLM_API_KEY.
    PeagleError for an --api-key that holds no key (`--api-key "$KEY"` with KEY unset would serve unguarded)."""
    if flags and not any(k.strip() for v in flags for k in v.split(",")):
        raise PeagleError("--api-key is empty: give a key, or leave the flag out to serve without keys")
    for raw in (flags or [], *([env.get(k)] for k in ENV_KEYS)):
        keys = tuple(k.strip() for v in raw if v for k in v.split(",") if k.strip())
        if keys:
            return keys
    return ()


def exposed_without_key(host: str, keys) -> bool:
    """True when the server binds a non-loopback address (reachable from elsewhere) and has no key."""
    if keys:
        return False
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return True          # a host name: may resolve to anything


def _digest(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


class ApiKeyAuth:
    """Pure ASGI middleware (so streaming responses pass through untouched)."""

    def __init__(self, app, keys):
        self.app = app
        self.digests = [_digest(k.encode()) for k in keys]

    def allowed(self, token: bytes) -> bool:
        d = _digest(token)
        ok = False
        for k in self.digests:             # no early exit: every key is compared
            ok |= hmac.compare_digest(d, k)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.digests or scope.get("path") in OPEN:
            return await self.app(scope, receive, send)
        auth = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        scheme, _, token = (auth or b"").strip().partition(b" ")
        if auth is None or scheme.lower() != b"bearer":
            msg, code = ("You didn't provide an API key. Send it in an Authorization header using Bearer auth "
                         "(Authorization: Bearer YOUR_KEY)."), None
        elif self.allowed(token.strip()):
            return await self.app(scope, receive, send)
        else:
            msg, code = "Incorrect API key provided.", "invalid_api_key"
        resp = JSONResponse(error_body(msg, "invalid_request_error", None, code), status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})
        await resp(scope, receive, send)
