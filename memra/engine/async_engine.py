"""An asyncio front end for :class:`~memra.engine.engine.LLMEngine`.

The engine loop runs in one background thread (torch releases the GIL inside its
kernels, so the HTTP event loop stays responsive); asyncio code talks to it through a
command inbox (add / abort) and receives :class:`~memra.engine.request.RequestEvent`
objects on a per-request ``asyncio.Queue``. A consumer that stops listening (client
disconnect, cancelled task) aborts its request, which releases its KV blocks at the
start of the next engine step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from .engine import EngineStats, LLMEngine
from .request import RequestEvent
from .sampling import SamplingParams

__all__ = ["AsyncLLMEngine", "QueueFullError", "RequestStream"]

log = logging.getLogger("memra.engine")


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full (the server answers 429)."""


class AsyncLLMEngine:
    """Runs ``engine`` in a background thread and serves requests to asyncio callers.

    Args:
        engine: the engine (used only from the background thread once started).
        max_queue: most requests waiting to be admitted (not yet running); None = unbounded.
            Requests beyond it are refused with :class:`QueueFullError`.
    """

    def __init__(self, engine: LLMEngine, max_queue: int | None = None):
        if max_queue is not None and (not isinstance(max_queue, int) or max_queue < 1):
            raise ValueError(f"max_queue={max_queue!r} must be an integer >= 1 or None")
        self.engine = engine
        self.max_queue = max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending = 0  # requests in the inbox, not yet handed to the engine
        self._live: dict[str, str] = {}  # user request id -> engine request id
        self._serial = 0
        self._thread: threading.Thread | None = None
        self._stop = False
        self._stats = engine.stats()
        self.fatal: Exception | None = None  # set when the engine cannot go on (a parallel rank died)
        self.on_fatal = None  # called with that error (the server uses it to shut down)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="memra-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; unfinished requests are aborted."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._lock:  # consumers still waiting (also those whose request never reached the engine)
            waiting = list(self._streams)
        for eid in waiting:
            self._deliver(eid, RuntimeError("the engine was shut down"))
        self.engine.close()

    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive and not shutting down (what /health reports)."""
        return self._thread is not None and self._thread.is_alive() and not self._stop

    # ------------------------------------------------------------------ API
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise what :meth:`LLMEngine.validate` raises for a bad request (safe from any thread)."""
        self.engine.validate(prompt_ids, params)

    def stats(self) -> EngineStats:
        """The engine's counters as of its last step."""
        return self._stats

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
               prompt_logprobs: int | None = None) -> RequestStream:
        """Queue a request now (call from a running event loop) and return its event stream.

        Everything that can refuse the request is raised here, synchronously, before any
        event: the server answers such errors before it starts a response.

        Raises:
            ValueError, PromptTooLongError, KVCapacityError: bad request (see :meth:`validate`);
                ValueError also for a request id already in use.
            QueueFullError: ``max_queue`` requests are already waiting.
            RuntimeError: the engine is shut down.
        """
        self.validate(prompt_ids, params)
        if self._stop:
            raise RuntimeError("the engine is shut down")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already in use")
            if self.max_queue is not None and self._waiting() >= self.max_queue:
                raise QueueFullError(f"the request queue is full ({self.max_queue} requests waiting)")
            # the engine sees a unique id, so a reused user id never receives a stale request's events
            self._serial += 1
            eid = f"{request_id}@{self._serial}"
            self._live[request_id] = eid
            self._streams[eid] = (loop, q)
            self._pending += 1
        self._inbox.put(("add", eid, list(prompt_ids), params, prompt_logprobs))
        self._wake.set()
        return RequestStream(self, request_id, eid, q)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       prompt_logprobs: int | None = None) -> AsyncIterator[RequestEvent]:
        """:meth:`submit` then yield the request's events until it finishes (raising as submit
        does on the first iteration). Leaving early (``aclose``, cancellation) aborts the request.

        Raises:
            RuntimeError: (from the iteration) the engine failed while computing this request.
        """
        stream = self.submit(prompt_ids, params, request_id, prompt_logprobs)
        try:
            async for ev in stream:
                yield ev
        finally:
            await stream.aclose()

    def _release(self, request_id: str, eid: str, abort: bool) -> None:
        """Forget a consumer's stream; abort its engine request unless it finished."""
        with self._lock:
            self._streams.pop(eid, None)
            if self._live.get(request_id) == eid:
                del self._live[request_id]
        if abort:
            self._inbox.put(("abort", eid))
            self._wake.set()

    def abort(self, request_id: str) -> None:
        """Abort a request by the id given to :meth:`generate` (no-op if unknown or finished); its
        consumer gets no more events and its blocks are freed at the next step."""
        with self._lock:
            eid = self._live.pop(request_id, None)
            if eid is not None:
                self._streams.pop(eid, None)
        if eid is not None:
            self._inbox.put(("abort", eid))
            self._wake.set()

    # ------------------------------------------------------------ internals
    def _waiting(self) -> int:
        """Requests submitted but not yet admitted to the running batch (approximate across threads)."""
        return self._pending + self._stats.num_waiting

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed
                pass

    def _drain_inbox(self) -> int:
        """Hand queued adds and aborts to the engine; returns the number of adds taken."""
        handed = 0
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return handed
            if cmd[0] == "add":
                _, rid, ids, params, plp = cmd
                handed += 1
                with self._lock:
                    alive = rid in self._streams
                if not alive:  # the consumer left before the request reached the engine
                    continue
                try:
                    self.engine.add_request(rid, ids, params, prompt_logprobs=plp)
                except Exception as e:  # validated already; anything here is reported to that request only
                    self._deliver(rid, e)
            else:
                self.engine.abort_request(cmd[1])

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop:
            try:
                handed = self._drain_inbox()
                self._stats = eng.stats()
                with self._lock:  # only now: the stats count them as waiting
                    self._pending -= handed
                if not eng.has_unfinished():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                events = eng.step()
                # refresh before delivering: a consumer that reacts to this step's tokens (e.g. by
                # submitting) must not see the requests this step admitted still counted as waiting
                # (a stale count refused requests with QueueFullError under CPU load)
                self._stats = eng.stats()
            except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving the others
                log.exception("engine step failed; aborting the requests in flight")
                for rid in eng.request_ids():
                    eng.abort_request(rid)
                    self._deliver(rid, RuntimeError(f"internal engine error: {e!r}"))
                from ..parallel.group import ParallelFailure

                if isinstance(e, ParallelFailure):  # a rank is gone: nothing more can be served
                    log.critical("%s; the server stops", e)
                    self.fatal = e
                    self._stop = True
                    if self.on_fatal is not None:
                        self.on_fatal(e)
                continue
            for ev in events:
                self._deliver(ev.request_id, ev)
            for rid, e in eng.pop_failures():
                log.error("request %s failed in the engine: %r", rid, e)
                self._deliver(rid, RuntimeError(f"internal engine error in this request: {e!r}"))
        for rid in eng.request_ids():
            eng.abort_request(rid)
        self._stats = eng.stats()


class RequestStream:
    """The events of one submitted request (an async iterator of RequestEvent).

    Ends after the finished event. :meth:`aclose`, or a cancellation while waiting, ends it
    early and aborts the request (its KV blocks are freed at the next engine step).
    """

    def __init__(self, owner: AsyncLLMEngine, request_id: str, eid: str, q: asyncio.Queue):
        self._owner, self._request_id, self._eid, self._q = owner, request_id, eid, q
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestEvent:
        if self._closed:
            raise StopAsyncIteration
        try:
            item = await self._q.get()
        except BaseException:  # cancelled while waiting: the consumer is gone
            await self.aclose()
            raise
        if isinstance(item, BaseException):  # the engine already ended this request
            self._close(abort=False)
            raise item
        item.request_id = self._request_id
        if item.finished:
            self._close(abort=False)
        return item

    async def aclose(self) -> None:
        """Stop listening; aborts the request if it has not finished."""
        self._close(abort=True)

    def _close(self, abort: bool) -> None:
        if not self._closed:
            self._closed = True
            self._owner._release(self._request_id, self._eid, abort)
