"""The FastAPI app: OpenAI-compatible completions and chat completions (streaming and not), models, health,
Prometheus metrics and a debug view of the engine."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..detok import IncrementalDetokenizer
from .auth import ApiKeyAuth
from .limits import Limits, read_body
from .loop import EngineLoop, Failure, Gone, Handle, Tokens
from .prometheus import ServerMetrics
from .prompt import chat_prompt, completion_prompt
from .protocol import ApiError, ChatRequest, CompletionRequest, check_unsupported, error_body, parse_body, sampling_params

log = logging.getLogger("peagle.serve")
COMPLETIONS_MAX_TOKENS = 16     # OpenAI's default for completions that give no max_tokens
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/debug/engine")


class ServerState:
    """Everything the app needs: the engine (owned by the loop thread), a tokenizer for the HTTP side, names."""

    def __init__(self, engine, tokenizer, model_name: str, model_dir: str, spec=None, max_waiting: int = 512,
                 limits: Limits | None = None, api_keys=(), aliases=(), thread=None, root: str | None = None):
        """thread: the loop.EngineThread that built the engine, to run the engine loop on."""
        self.engine, self.tokenizer = engine, tokenizer
        self.model_name, self.model_dir, self.spec = model_name, model_dir, spec
        self.root = root or model_dir      # the model as given (vLLM's `root`): no path it was not given
        self.names = {model_name, self.root, *aliases}
        self.max_model_len = engine.max_model_len
        self.limits = limits or Limits()
        self.api_keys = tuple(api_keys)
        self.metrics = ServerMetrics(model_name)
        self.loop = EngineLoop(engine, max_waiting, self.metrics, thread=thread)
        self.metrics.loop = self.loop
        self.created = int(time.time())
        self.vocab_size = engine.target.cfg.vocab_size
        # prompts are rendered and tokenized on one thread of their own, off the event loop (a long one would
        # stall every stream); one: a tokenizer's settings are not safe to change from two threads (vLLM: one too)
        self.prompt_thread = ThreadPoolExecutor(1, thread_name_prefix="peagle-prompt")

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.prompt_thread, fn, *args)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        state.loop.start()
        yield
        state.loop.stop()
        state.prompt_thread.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="peagle", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.peagle = state
    m = state.metrics

    # ------------------------------------------------------------ errors
    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        typ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), typ, None, None), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "internal_error"), status_code=500)

    # ------------------------------------------------------------ simple routes
    @app.get("/health")
    async def health():
        if not state.loop.alive:
            return JSONResponse(error_body("engine loop is not running", "internal_error"), status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "peagle", "root": state.root,
                                            "parent": None, "max_model_len": state.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/engine")
    async def debug_engine():
        lp, s = state.loop, state.loop.snapshot
        return {"rows_in_use": s["rows_in_use"], "running": s["running"], "waiting": s["waiting"],
                "in_flight": lp.in_flight, "max_num_seqs": state.engine.max_num_seqs,
                "max_waiting": lp.max_waiting, "max_model_len": state.max_model_len, "steps": lp.steps,
                "step_errors": lp.step_errors, "last_error": lp.last_error, "loop_alive": lp.alive,
                "speculative": None if state.spec is None else {
                    "method": state.spec.name, "model": state.spec.model,
                    "num_speculative_tokens": state.spec.num_speculative_tokens, "k_max": state.engine.k},
                "spec_metrics": s["spec"]}

    # ------------------------------------------------------------ generation
    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.perf_counter()
        req = await _read_request(state, request, CompletionRequest)
        ids, text = await state.off_loop(completion_prompt, state, req.prompt, req.add_special_tokens)
        given = "max_tokens" in req.model_fields_set     # absent: OpenAI's 16 (or the server's default)
        return await _generate(state, request, req, ids, text, chat=False, max_tokens=req.max_tokens, t0=t0,
                               fallback=None if given else COMPLETIONS_MAX_TOKENS)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        t0 = time.perf_counter()
        req = await _read_request(state, request, ChatRequest)
        ids = await state.off_loop(chat_prompt, state, req)
        newer = req.max_completion_tokens is not None          # it wins over max_tokens, as in OpenAI's API
        return await _generate(state, request, req, ids, None, chat=True, t0=t0,
                               max_tokens=req.max_completion_tokens if newer else req.max_tokens,
                               param="max_completion_tokens" if newer else "max_tokens")

    return _StatusCounter(ApiKeyAuth(app, state.api_keys), m, app.state)


class _StatusCounter:
    """Pure ASGI middleware counting responses by route and status (no BaseHTTPMiddleware: it breaks streaming
    disconnect detection)."""

    def __init__(self, app, metrics, app_state):
        self.app, self.m, self.state = app, metrics, app_state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [0]

        async def _send(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)
        try:
            await self.app(scope, receive, _send)
        finally:
            path = scope.get("path", "")
            self.m.http.labels(path if path in ROUTES else "other", str(status[0] or 499)).inc()


# ---------------------------------------------------------------- request helpers
async def _read_request(state: ServerState, request: Request, model_cls):
    """The body as a request of model_cls, for this server's model, with no unsupported option."""
    req = parse_body(await read_body(request, state.limits.max_body_bytes), model_cls)
    if req.model is not None and req.model not in state.names:
        raise ApiError(404, f"The model `{req.model[:200]}` does not exist. This server serves "
                       f"`{state.model_name}`.", "not_found_error", "model", "model_not_found")
    check_unsupported(req)
    if state.loop.in_flight >= state.loop.capacity:      # full: a 429 before the prompt is tokenized
        _busy(state)
    return req


def _busy(state: ServerState):
    state.metrics.rejected.inc()
    raise ApiError(429, f"server busy: {state.loop.capacity} requests in flight (max_num_seqs="
                        f"{state.engine.max_num_seqs} + max_waiting={state.loop.max_waiting}); retry later",
                   "rate_limit_error", None, "rate_limit_exceeded", headers={"Retry-After": "1"})


async def _generate(state: ServerState, request: Request, req, ids, text, chat: bool, max_tokens, t0=None,
                    fallback=None, param: str = "max_tokens"):
    params = sampling_params(req, state.limits.max_tokens_for(max_tokens, len(ids), state.max_model_len, fallback,
                                                              param))
    state.limits.check_stop(params.stop, params.stop_token_ids)
    if params.stop and (state.tokenizer is None or state.engine.tok is None):
        raise ApiError(400, "stop strings need a tokenizer; this model has none (use stop_token_ids)", param="stop")
    if any(not 0 <= t < state.vocab_size for t in params.stop_token_ids):
        raise ApiError(400, f"stop_token_ids must be in 0..{state.vocab_size - 1}", param="stop_token_ids")
    if not state.loop.alive:
        raise ApiError(503, "engine loop is not running", "internal_error")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    h = Handle(rid, ids, params, text, asyncio.get_running_loop())
    h.arrival = t0 or h.arrival          # TTFT and e2e latency count from HTTP arrival
    gen = _Gen(state, h, req, chat)
    if not state.loop.try_reserve():
        _busy(state)
    state.loop.submit(h)                 # from here on the engine loop releases the reservation
    if req.stream:
        return _Stream(gen.sse(), gen.close)
    return await gen.collect(request)


class _Stream(StreamingResponse):
    """SSE response that aborts its request however the response ends (even if the body never started)."""

    def __init__(self, body, on_close):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Gen:
    """Turns a Handle's engine items into an OpenAI response (one JSON, or SSE chunks)."""

    def __init__(self, state: ServerState, h: Handle, req, chat: bool):
        self.state, self.h, self.req, self.chat = state, h, req, chat
        self.detok = IncrementalDetokenizer(state.tokenizer, h.params.stop)
        self.finished = False
        self.finish_reason = None
        self.stop_text_at = self.stop_reason = None
        self.n_out = 0
        self.t_last = None
        self.created = int(time.time())
        self.obj = "chat.completion" if chat else "text_completion"

    def close(self):
        """Client gone or response over: abort in the engine unless the request already finished."""
        if not self.finished and not self.h.done:
            self.h.done = True
            self.state.loop.abort(self.h.rid)
        self.h.done = True

    def _observe(self, new_ids):
        now = time.perf_counter()
        m = self.state.metrics
        if self.t_last is None:
            m.ttft.observe(now - self.h.arrival)
        else:
            m.itl.observe(now - self.t_last)
        self.t_last = now
        self.n_out += len(new_ids)

    def _final(self, item: Tokens):
        self.finished, self.finish_reason, self.stop_text_at = True, item.finish_reason, item.stop_text_at
        self.stop_reason = item.stop_reason
        self.h.done = True
        self.state.metrics.e2e.observe(time.perf_counter() - self.h.arrival)

    def _usage(self):
        p = len(self.h.prompt_ids)
        return {"prompt_tokens": p, "completion_tokens": self.n_out, "total_tokens": p + self.n_out}

    async def _next_items(self):
        """Wait for the next item, then take everything else already queued (coalesce a slow client's backlog)."""
        items = [await self.h.queue.get()]
        while not self.h.queue.empty():
            items.append(self.h.queue.get_nowait())
        return items

    # -------------------------------------------------------- non-streaming
    async def collect(self, request: Request):
        watcher = asyncio.ensure_future(_watch_disconnect(request, self.h))
        try:
            while not self.finished:
                for item in await self._next_items():
                    if isinstance(item, Gone):
                        raise _ClientGone()
                    if isinstance(item, Failure):
                        self.finished = self.h.done = True
                        raise ApiError(item.status, item.message, "invalid_request_error" if item.status < 500
                                       else "internal_error")
                    self.detok.ids.extend(item.ids)
                    self._observe(item.ids)
                    if item.finished:
                        self._final(item)
        except _ClientGone:
            return Response(status_code=499)
        finally:
            watcher.cancel()
            self.close()
        text = self.detok.final_text(self.stop_text_at)
        choice = {"index": 0, "logprobs": None, "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if self.req.return_token_ids:
            choice["token_ids"] = list(self.detok.ids)
        body = {"id": self.h.rid, "object": self.obj, "created": self.created, "model": self.state.model_name,
                "choices": [choice], "usage": self._usage()}
        if self.req.return_token_ids:
            body["prompt_token_ids"] = list(self.h.prompt_ids)
        return JSONResponse(body)

    # -------------------------------------------------------- streaming
    def _chunk(self, text=None, finish_reason=None, token_ids=None, role=False, usage=None, choices=True):
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.h.rid, "object": obj, "created": self.created, "model": self.state.model_name}
        if choices:
            c = {"index": 0, "logprobs": None, "finish_reason": finish_reason,
                 "stop_reason": self.stop_reason if finish_reason else None}
            if self.chat:
                d = {}
                if role:
                    d["role"] = "assistant"
                if text is not None:
                    d["content"] = text
                c["delta"] = d
            else:
                c["text"] = text or ""
            if token_ids is not None:
                c["token_ids"] = token_ids
            body["choices"] = [c]
        else:
            body["choices"] = []
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def sse(self):
        so = self.req.stream_options
        include_usage = bool(so and so.include_usage)
        continuous = bool(so and so.include_usage and so.continuous_usage_stats)
        want_ids = self.req.return_token_ids
        try:
            if self.chat:
                yield self._chunk("", role=True)
            while not self.finished:
                items = await self._next_items()
                new, final = [], None
                for item in items:
                    if isinstance(item, Failure):
                        self.finished = self.h.done = True
                        typ = "invalid_request_error" if item.status < 500 else "internal_error"
                        yield f"data: {json.dumps({'error': error_body(item.message, typ)['error']})}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    if isinstance(item, Gone):
                        continue
                    new += item.ids
                    if item.finished:
                        final = item
                self._observe(new)
                if final is not None:
                    self._final(final)
                    delta = self.detok.finish(self.stop_text_at, new)
                else:
                    delta = self.detok.add(new)
                if delta or want_ids or final is not None:
                    yield self._chunk(delta, self.finish_reason if final is not None else None,
                                      new if want_ids else None,
                                      usage=self._usage() if continuous else None)
            if include_usage:
                yield self._chunk(choices=False, usage=self._usage())
            yield "data: [DONE]\n\n"
        except Exception as e:
            log.exception("stream %s failed", self.h.rid)
            self.state.metrics.failed.inc()
            msg = f"internal error: {type(e).__name__}: {e}"
            yield f"data: {json.dumps({'error': error_body(msg, 'internal_error')['error']})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.close()


class _ClientGone(Exception):
    pass


async def _watch_disconnect(request: Request, h: Handle):
    """Non-streaming requests: wake the waiting handler when the client disconnects."""
    try:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                h.queue.put_nowait(Gone())
                return
    except asyncio.CancelledError:
        pass
    except Exception:  # noqa: BLE001 - a client gone mid-stream: nothing left to tell it
        pass
