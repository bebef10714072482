"""The engine loop: one thread owns the engine (it is not thread-safe) and runs continuous batching.

That thread should be the one that built the engine (build_state builds it on the EngineThread the loop then
runs on): OpenMP keeps a thread team per thread that enters parallel regions (torch's ops and the C++ kernels'),
and with a second team on a 2-core machine libgomp throttles its spin-waits, so every one of a step's ~200
regions waits for a futex wake-up. Measured on a 2-core Intel Xeon, q4a8 SmolLM2, greedy: a plain step 2.5 ms
on the thread that loaded the model, 13.1 ms on a second thread after the first had run the load's regions,
2.5 ms when the second thread loaded the model itself; through `peagle serve`, plain decoding at c=1 ran 3.9x
as fast once the loop ran on the building thread (docs/serving.md).

HTTP handlers (asyncio) talk to it only through a command deque (add / abort) and receive results through
their Handle's asyncio.Queue (one call_soon_threadsafe per engine step for all outputs of that step).

Admission: `try_reserve()` counts requests from acceptance until the engine is done with them (finished,
aborted or failed); beyond max_num_seqs running + max_waiting waiting the server answers 429.

Fault isolation, from the engine's typed errors (peagle/errors.py): a bad request raises PeagleError in
`engine.add_request` (-> 400 for that request only). A PrefillError names the newly admitted requests it
dropped; the running rows are untouched (prefill writes only the new rows), so those requests are retried one
per step and the one that fails alone is failed (500). A DecodeError (or anything else out of a step) leaves
the batch state unknown, so the running requests it names are failed (500) and their rows freed; waiting
requests and the server carry on."""
from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass

from ..errors import DecodeError, PeagleError, PrefillError

log = logging.getLogger("peagle.serve")


class Handle:
    """One request as both sides see it. Engine-side fields are written only by the engine thread."""

    def __init__(self, rid: str, prompt_ids: list, params, prompt_text: str | None, loop: asyncio.AbstractEventLoop):
        self.rid, self.prompt_ids, self.params, self.prompt_text = rid, prompt_ids, params, prompt_text
        self.aloop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.done = False                 # set on the asyncio side once a final item was consumed or it aborted
        self.retried = False              # engine side: already retried alone after a prefill failure
        self.prefilled = False            # engine side: its prompt was prefilled (its first token came)


# ---- what a Handle's queue carries (put by the engine thread, or Gone by the HTTP side)
@dataclass(frozen=True)
class Tokens:
    """New tokens of one request from one engine step; finished: the request is done (reason, stats set)."""
    ids: list
    finished: bool
    finish_reason: str | None = None
    stop_text_at: int | None = None
    stop_reason: int | str | None = None
    stats: dict | None = None


@dataclass(frozen=True)
class Failure:
    """The request failed: answer with this HTTP status and message."""
    status: int
    message: str


@dataclass(frozen=True)
class Gone:
    """The client disconnected (non-streaming requests' watcher)."""


# ---- what the command deque carries (HTTP side -> engine thread)
@dataclass(frozen=True)
class _Add:
    handle: Handle


@dataclass(frozen=True)
class _Abort:
    rid: str


class EngineThread:
    """One daemon thread running the calls submitted to it, in order: it builds an engine, then runs its
    EngineLoop. A daemon (concurrent.futures' workers are not): Ctrl-C during a long build, e.g. auto K's first
    measurement, ends the process at once instead of after the build."""

    def __init__(self):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._work, name="peagle-engine-loop", daemon=True).start()

    def _work(self):
        while (call := self._calls.get()) is not None:
            fn, fut = call
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - the submitter gets it from its Future
                    fut.set_exception(e)

    def submit(self, fn, *args, **kwargs) -> Future:
        fut = Future()
        self._calls.put((lambda: fn(*args, **kwargs), fut))
        return fut

    def shutdown(self):
        """The thread ends after the calls already submitted."""
        self._calls.put(None)


class EngineLoop:
    def __init__(self, engine, max_waiting: int, metrics=None, idle_wait_s: float = 0.5,
                 thread: EngineThread | None = None, release_after_s: float = 30.0):
        """thread: the EngineThread that built the engine (else a new one: see the module doc). release_after_s:
        idle this long, the engine gives its caches' memory back."""
        self.engine = engine
        self.release_after_s = release_after_s
        self._idle_since: float | None = None
        self._released = True
        self.max_waiting = max_waiting
        self.capacity = engine.max_num_seqs + max_waiting
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self._lock = threading.Lock()
        self._in_flight = 0
        self._cmds: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._handles: dict[str, Handle] = {}
        self._isolate: set[str] = set()
        self._budget = engine.prefill_token_budget
        self._stop = False
        self._drain_until: float | None = None     # shutting down: running requests may finish until then
        self.steps = 0
        self.step_errors = 0
        self.last_error: str | None = None
        self._thread = thread or EngineThread()
        self._running = None                  # the Future of _run on that thread, once started
        self._spec = None
        self._spec_on = getattr(engine, "k", 0) > 0

    # ------------------------------------------------------------------ any thread
    def start(self):
        if self._running is None:
            self._running = self._thread.submit(self._run)

    def stop(self, timeout: float = 10.0):
        self._stop = True
        self._wake.set()
        if self._running is not None:
            try:
                self._running.result(timeout)
            except Exception:  # noqa: BLE001 - _run logs its own errors; a timeout leaves the thread to exit
                pass
        self._thread.shutdown()

    def drain(self, seconds: float):
        """Shutting down (any thread): requests not yet running are answered 503 at once, running ones may finish
        for `seconds`, then the loop stops and answers the rest 503 -- while their handlers can still send it
        (uvicorn cancels them after its graceful timeout, before the app's lifespan shutdown calls stop())."""
        if self._drain_until is None:            # a second signal keeps the first deadline
            self._drain_until = time.monotonic() + seconds
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._running is not None and not self._running.done() and not self._stop

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def try_reserve(self) -> bool:
        with self._lock:
            if self._in_flight >= self.capacity:
                return False
            self._in_flight += 1
            return True

    def unreserve(self):
        with self._lock:
            self._in_flight -= 1

    def submit(self, h: Handle):
        """Hand a reserved request to the engine thread."""
        self._cmds.append(_Add(h))
        self._wake.set()

    def abort(self, rid: str):
        self._cmds.append(_Abort(rid))
        self._wake.set()

    # ------------------------------------------------------------------ engine thread
    def _run(self):
        while not self._stop:
            try:
                if self._pass():
                    break
            except Exception:
                log.exception("engine loop error")
                time.sleep(0.01)
        # shutting down: fail whatever is left so no handler waits forever
        for h in list(self._handles.values()):
            self._fail(h, 503, "server is shutting down")
        while self._cmds:
            cmd = self._cmds.popleft()
            if isinstance(cmd, _Add):
                self.unreserve()
                self._post([(cmd.handle, Failure(503, "server is shutting down"))])

    def _pass(self) -> bool:
        """One pass of the engine loop: wait while idle, take the commands, one step, the idle release. True:
        shutting down and drained (the loop ends)."""
        if not self._cmds and not self.engine.has_unfinished():
            self._wake.wait(self.idle_wait_s)
        self._wake.clear()
        self._drain()
        if self._drain_until is not None:
            for r in list(self.engine.waiting):
                if r.request_id in self._handles:
                    self._fail(self._handles[r.request_id], 503, "server is shutting down")
            if not self.engine.running or time.monotonic() > self._drain_until:
                return True
        busy = self.engine.has_unfinished()
        if busy:
            self._step()
        self._snap()
        self._release_when_idle(busy)       # busy even if this one step finished every request
        return False

    def _release_when_idle(self, stepped: bool):
        """Once the engine has been idle for release_after_s: its caches' memory back (Engine.release_memory),
        once per idle spell. stepped: this pass ran a step."""
        now = time.monotonic()
        if stepped or self.engine.has_unfinished() or self._cmds:
            self._idle_since, self._released = None, False
        elif self._idle_since is None:
            self._idle_since = now
        elif not self._released and now - self._idle_since >= self.release_after_s:
            self._released = self.engine.release_memory()

    def _snap(self):
        self._spec = self.engine.metrics.as_dict() if self._spec_on else None

    @property
    def snapshot(self) -> dict:
        """Live counts (len() of the engine's lists is safe to read from any thread) + spec metrics as of the
        last step."""
        e = self.engine
        return {"running": len(e.running), "waiting": len(e.waiting) + sum(isinstance(c, _Add) for c in list(self._cmds)),
                "rows_in_use": e.num_rows_in_use, "in_flight": self._in_flight, "spec": self._spec}

    def _release(self, h: Handle):
        self._handles.pop(h.rid, None)
        self.unreserve()

    def _post(self, items):
        """Deliver [(handle, item)] to the asyncio side with one wake-up per event loop."""
        by_loop: dict = {}
        for h, item in items:
            by_loop.setdefault(h.aloop, []).append((h, item))
        for aloop, its in by_loop.items():
            try:
                aloop.call_soon_threadsafe(_deliver, its)
            except RuntimeError:      # event loop closed (shutdown)
                pass

    def _fail(self, h: Handle, status: int, message: str):
        if h.rid in self._handles:
            self.engine.abort(h.rid)
            self._release(h)
        if self.metrics is not None and status >= 500:
            self.metrics.failed.inc()
        self._post([(h, Failure(status, message))])

    def _drain(self):
        while self._cmds:
            cmd = self._cmds.popleft()
            if isinstance(cmd, _Add):
                h = cmd.handle
                if h.done:                       # client already gone
                    self.unreserve()
                    continue
                try:
                    self.engine.add_request(h.rid, h.prompt_ids, h.params, h.prompt_text)
                except PeagleError as e:
                    self.unreserve()
                    self._post([(h, Failure(400, str(e)))])
                    continue
                except Exception as e:
                    log.exception("add_request failed for %s", h.rid)
                    self.unreserve()
                    self._post([(h, Failure(500, f"internal error: {type(e).__name__}: {e}"))])
                    continue
                self._handles[h.rid] = h
            else:
                h = self._handles.get(cmd.rid)
                if h is not None:
                    self.engine.abort(cmd.rid)
                    self._release(h)
                    self._unisolate({cmd.rid})
                    if self.metrics is not None:
                        self.metrics.aborted.inc()

    def _step(self):
        e = self.engine
        try:
            outs = e.step()
        except Exception as ex:  # noqa: BLE001 - a failed step fails its requests; the loop must go on
            self.step_errors += 1
            self.last_error = f"{type(ex).__name__}: {ex}"
            log.error("engine step failed: %s\n%s", self.last_error, "".join(traceback.format_exc(limit=8)))
            self._recover(ex)
            return
        self.steps += 1
        items, ntok, ptok = [], 0, 0
        for o in outs:
            r = o.request
            h = self._handles.get(r.request_id)
            if h is None:
                continue
            ntok += len(o.new_token_ids)
            if not h.prefilled:           # prompt tokens count once processed, as vLLM's counter does
                h.prefilled = True
                ptok += len(h.prompt_ids)
            stats = None
            if o.finished:
                self._release(h)
                stats = {"num_drafts": r.num_drafts, "num_accepted": r.num_accepted}
                if self.metrics is not None:      # where the engine finishes it, as vLLM counts (its client
                    self.metrics.success(r.finish_reason)   # may be gone by the time the item is read)
            items.append((h, Tokens(list(o.new_token_ids), o.finished, r.finish_reason, r.stop_text_at, r.stop_reason,
                                          stats)))
        if self.metrics is not None and ntok:
            self.metrics.generation_tokens.inc(ntok)
            self.metrics.prompt_tokens.inc(ptok)
        self._snap()                      # spec counters current before clients see this step's tokens
        self._post(items)
        if self._isolate:
            self._unisolate(self._isolate - {r.request_id for r in e.waiting})

    def _unisolate(self, rids: set):
        """Requests admitted alone after a failed prefill that are admitted or gone now: once none is left, the
        prefill budget comes back (an abort of the last one left it at one request per step for good)."""
        if self._isolate and rids & self._isolate:
            self._isolate -= rids
            if not self._isolate:
                self.engine.prefill_token_budget = self._budget

    def _recover(self, ex: Exception):
        e = self.engine
        cause = ex.__cause__ or ex
        msg = f"internal error: {type(cause).__name__}: {cause}"
        if isinstance(ex, PrefillError):
            # the engine dropped these requests; the running ones are untouched
            new = [rid for rid in ex.request_ids if rid in self._handles]
            retry = [self._handles[rid] for rid in new if len(new) > 1 and not self._handles[rid].retried]
            for rid in new:
                h = self._handles[rid]
                if h in retry:
                    h.retried = True
                else:
                    self._fail(h, 500, msg)
            # retried requests go back to the head of the queue and are admitted one per step
            for h in reversed(retry):
                try:
                    r = e.add_request(h.rid, h.prompt_ids, h.params, h.prompt_text)
                except Exception as e2:  # noqa: BLE001 - any failure to admit is answered with a 500
                    self._fail(h, 500, f"internal error: {e2}")
                    continue
                e.waiting.remove(r)
                e.waiting.insert(0, r)
                self._isolate.add(h.rid)
            if self._isolate:
                e.prefill_token_budget = 0
        else:
            # a decode step (or anything else) failed: the named (else all running) requests' state is unknown
            rids = ex.request_ids if isinstance(ex, DecodeError) else [r.request_id for r in e.running]
            for rid in rids:
                h = self._handles.get(rid)
                if h is not None:
                    self._fail(h, 500, msg)
                else:
                    e.abort(rid)


def _deliver(items):
    for h, item in items:
        h.queue.put_nowait(item)
