"""The OpenAI-compatible HTTP server: routes, auth, error handling, streaming.

Endpoints (semantics of the OpenAI API reference, with vLLM's extensions and its
``/tokenize`` / ``/detokenize`` / ``/metrics``):

* ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE stream);
* ``GET /v1/models``, ``GET /v1/models/{model}``;
* ``POST /tokenize``, ``POST /detokenize``;
* ``GET /health`` and ``GET /metrics`` (Prometheus), both open without an API key.

Errors always have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``:
400 for bad input (pydantic's validation errors included, instead of FastAPI's 422),
401 for a missing/wrong API key, 404 for an unknown model or route, 429 when the
engine's bounded queue is full, 500 only for failures of the server itself (an engine
exception in one request ends that request, never the server).

A client that goes away aborts its engine request, which frees its KV blocks: streaming
responses are cancelled by Starlette when the disconnect arrives; non-streaming ones
poll ``request.is_disconnected()`` while waiting for the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import math
import re
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_engine import QueueFullError
from ..engine.engine import PromptTooLongError
from ..engine.sampling import SamplingParams
from ..engine.structured import GrammarBackend, GrammarError
from .agents import ChatOutput
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ProtocolError,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    _param_of,
    random_id,
)
from .reasoning import REASONING_PARSERS, detect_reasoning_parser, prompt_opens_reasoning
from .tool_parsers import TOOL_PARSERS, detect_tool_parser, tool_call_grammar

__all__ = ["create_app", "APIError", "parse_size", "check_api_key", "run_server"]

log = logging.getLogger("memra.server")

#: Paths served without an API key (liveness probes, Prometheus scrapers, the schema).
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request (the parameter is named)"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    429: {"model": ErrorResponse, "description": "the engine's queue is full"},
}


# --------------------------------------------------------------------------- errors

class APIError(Exception):
    """An error answered with OpenAI's error body.

    Args:
        status: HTTP status code.
        message: human-readable; names the parameter and what was expected.
        type: OpenAI error type (``invalid_request_error``, ``authentication_error``,
            ``rate_limit_error``, ``server_error``).
        param: the offending request field, or None.
        code: a machine-readable code (``model_not_found``, ``context_length_exceeded``...).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return _AsciiJSONResponse(self.body(), status_code=self.status)


class _AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote input holding lone surrogates,
    which cannot be encoded as UTF-8 but can be written as ``\\udXXX`` escapes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _check_unicode(text: str, param: str) -> None:
    """Raises APIError 400 if ``text`` holds a lone surrogate (valid JSON, not valid Unicode text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} is not valid Unicode text: a lone surrogate at position {e.start}",
                       param=param) from None


async def _in_thread(fn, *args, **kwargs):
    """Run a CPU-bound call (tokenization, template rendering) off the event loop."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


def _to_api_error(exc: BaseException, prompt_param: str = "prompt") -> APIError:
    """Map an exception from validation or the engine to the :class:`APIError` to answer."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(429, f"the server is busy: {exc}" if str(exc) else "the server is busy: the request "
                        "queue is full; retry later", "rate_limit_error", None, "queue_full")
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, ProtocolError):
        return APIError(400, exc.message, param=exc.param)
    if isinstance(exc, ValueError):  # engine validation (token ids, stop_token_ids), tokenizer, template
        msg = str(exc)
        return APIError(400, msg, param=_guess_param(msg, prompt_param))
    log.exception("internal error while serving a request", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", "server_error", None,
                    "internal_error")


_KNOWN_PARAMS = ("stop_token_ids", "max_tokens", "logprobs", "prompt", "messages", "tokens", "temperature",
                 "top_p", "top_k", "min_p", "seed", "n", "stop")


def _guess_param(message: str, prompt_param: str) -> str | None:
    m = re.match(r"invalid sampling parameter (\w+)", message)
    if m:
        return m.group(1)
    for name in _KNOWN_PARAMS:
        if re.search(rf"\b{name}\b", message):
            return prompt_param if name in ("prompt", "messages") else name
    return None


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _split_loc(loc: Sequence[Any]) -> tuple[str, str | None]:
    """pydantic error location -> (dotted parameter path, union-member tag or None).

    ``('body', 'messages', 0, 'content', 'list[dict[str,any]]', 0)`` gives
    ``('messages[0].content', 'list[dict[str,any]]')``: below a union-member tag the path
    belongs to one alternative only, so the parameter is named up to the tag.
    """
    parts: list[str] = []
    for x in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(x, int):
            parts.append(f"[{x}]")
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(x)) and str(x).lower() not in _TYPE_TAGS:
            parts.append(("." if parts else "") + str(x))
        else:
            return "".join(parts), str(x)
    return "".join(parts), None


def _validation_error(exc: RequestValidationError) -> APIError:
    """pydantic's errors -> one 400 naming the first offending parameter (dotted path)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        err = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {err}".rstrip(": "))
    unknown = [".".join(str(x) for x in e.get("loc", ())[1:]) for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        names = ", ".join(repr(u) for u in unknown)
        return APIError(400, f"unrecognized request argument{'s' if len(unknown) > 1 else ''} supplied: {names}",
                        param=unknown[0])
    param, tag = _split_loc(list(first.get("loc", ())))
    if not param:
        msg = "a JSON object body is required" if first.get("type") == "missing" else first.get("msg", "invalid")
        return APIError(400, f"invalid request body: {msg}")
    got = _short(first.get("input"))
    tags: list[str] = []
    if tag is not None:
        for e in errors:
            p, t = _split_loc(list(e.get("loc", ())))
            if p == param and t is not None and t not in tags:
                tags.append(t)
    if len(tags) > 1:
        return APIError(400, f"invalid value for '{param}': expected one of {', '.join(tags)} (got {got})",
                        param=param)
    msg = f"invalid value for '{param}': {first.get('msg', 'invalid')}"
    if first.get("type") != "missing":
        msg += f" (got {got})"
    return APIError(400, msg, param=param)


def _short(x: Any, limit: int = 80) -> str:
    try:
        s = json.dumps(x, ensure_ascii=False)
    except (TypeError, ValueError):
        s = repr(x)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def check_api_key(key: str | None, source: str) -> str | None:
    """Validate an API key from the command line or ``MEMRA_API_KEY``.

    Returns:
        The key, or None when ``key`` is None (no auth).
    Raises:
        ValueError: empty, or containing whitespace / non-printable / non-ASCII characters
            (it could never be sent in an ``Authorization`` header as given).
    """
    if key is None:
        return None
    if key == "":
        raise ValueError(f"{source} is set but empty: give a non-empty API key or unset it")
    if not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError(f"{source} must be printable ASCII without spaces (got {len(key)} characters including "
                         f"whitespace, control or non-ASCII ones)")
    return key


class _AuthMiddleware:
    """ASGI middleware: ``Authorization: Bearer <key>`` required except on :data:`OPEN_PATHS`.

    Checked before the body is parsed, so unauthenticated clients learn nothing about
    validation. Keys are compared in constant time.
    """

    def __init__(self, app, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            auth = ""
            for k, v in scope.get("headers", ()):
                if k == b"authorization":
                    auth = v.decode("latin-1")
                    break
            scheme, _, token = auth.partition(" ")
            if not auth:
                err = APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                               "authentication_error", None, "invalid_api_key")
                return await err.response()(scope, receive, send)
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), self._key):
                err = APIError(401, "incorrect API key provided", "authentication_error", None, "invalid_api_key")
                return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)


class _InternalErrorMiddleware:
    """ASGI middleware: an unexpected exception before the response started becomes an
    OpenAI-style 500 (logged), and the connection stays usable; the server keeps serving."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracked(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:  # noqa: BLE001 - the last line of defence for one request
            if started:
                raise
            await _to_api_error(exc).response()(scope, receive, send)


#: Default ``--max-request-body``: larger bodies get 413 before they are parsed.
DEFAULT_MAX_BODY_BYTES = 4 << 20


class _BodyGuardMiddleware:
    """ASGI middleware in front of every POST: a body that is not ``application/json`` gets 415,
    a body larger than ``max_bytes`` gets 413 (from ``Content-Length`` at once, or as soon as a
    chunked body passes the bound while it is read here), both in OpenAI's error shape and
    before anything is parsed or tokenized; the app then receives the whole body at once."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def _refuse(self, scope, receive, send, status: int, message: str):
        await APIError(status, message).response()(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            got = f"Content-Type {ctype!r}" if ctype else "no Content-Type header"
            return await self._refuse(scope, receive, send, 415,
                                      f"the request body must be JSON sent with 'Content-Type: application/json' "
                                      f"(got {got})")
        length = headers.get("content-length")
        limit_msg = f"than this server's limit of {self.max_bytes} bytes (--max-request-body)"
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send, 413,
                                      f"the request body of {int(length)} bytes is larger {limit_msg}")
        # read the whole body here (it is at most max_bytes), so a chunked body over the limit
        # is refused too, then hand it to the app in one message
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            if message["type"] != "http.request":
                continue
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                return await self._refuse(scope, receive, send, 413, f"the request body is larger {limit_msg}")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notifications

        await self.app(scope, replay, send)


# --------------------------------------------------------------------------- engine runs

class _ClientDisconnected(Exception):
    pass


@dataclass
class _Choice:
    """Accumulated output of one completion."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class _Run:
    """One engine request (one prompt, ``n`` completions).

    :meth:`start` submits the request, so validation and queue errors surface before any
    HTTP response is started. :meth:`events` yields its events; :meth:`close` aborts the request if it is unfinished
    (closing the engine's generator frees its KV blocks) and closes its metrics.
    """

    def __init__(self, server: _Server, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 prompt_logprobs: int | None, arrival: float):
        self.server = server
        self.prompt_ids = prompt_ids
        self.params = params
        self.request_id = request_id
        self.arrival = arrival
        self.prompt_logprobs = prompt_logprobs
        self.agen = None
        self.first = None
        self._next: asyncio.Future | None = None
        self.tracker = None
        self.finished = False
        self.cached_tokens = 0

    async def start(self) -> None:
        """Submit the request: returns once the engine has accepted it (it does not wait for
        the first token). Raises what ``AsyncLLMEngine.submit`` raises (ValueError,
        PromptTooLongError, QueueFullError)."""
        self.agen = self.server.engine.submit(self.prompt_ids, self.params, self.request_id,
                                              prompt_logprobs=self.prompt_logprobs)
        self._next = asyncio.ensure_future(self.agen.__anext__())
        self.tracker = self.server.metrics.tracker(self.params.n, self.arrival)

    def _seen(self, ev) -> None:
        self.tracker.on_event(ev)
        self.cached_tokens = max(self.cached_tokens, ev.num_cached_tokens or 0)
        if ev.finished:
            self.finished = True

    async def events(self) -> AsyncIterator[Any]:
        """The request's events, in order, until the finished one.

        Raises:
            RuntimeError: the engine failed this request, or its stream ended unfinished.
        """
        try:
            self.first = await self._next
        except StopAsyncIteration:
            raise RuntimeError(f"engine produced no events for request {self.request_id}") from None
        self._seen(self.first)
        yield self.first
        if self.first.finished:
            return
        async for ev in self.agen:
            self._seen(ev)
            yield ev
            if ev.finished:
                return
        if not self.finished:
            raise RuntimeError(f"engine stream of request {self.request_id} ended without a finished event")

    async def close(self, error: bool = False) -> None:
        """End the request: record its outcome, abort it if unfinished, close the engine stream."""
        if self.tracker is not None:
            self.tracker.close(error=error)
        if self._next is not None and not self._next.done():
            self._next.cancel()  # cancelling the pending step of the generator ends it (and aborts)
            await asyncio.gather(self._next, return_exceptions=True)
        try:
            if self.agen is not None:
                await self.agen.aclose()
        except Exception:  # the request ends either way
            log.exception("closing engine request %s", self.request_id)
        if not self.finished:
            try:
                self.server.engine.abort(self.request_id)
            except Exception:
                log.exception("aborting engine request %s", self.request_id)


async def _close_all(runs: Sequence[_Run], error: bool = False) -> None:
    """Close every run, shielded from cancellation: a streaming response is cancelled (by
    an anyio cancel scope, which re-cancels every later await) when its client leaves,
    and the clean-up in its ``finally`` must still run to the end."""
    with anyio.CancelScope(shield=True):
        await asyncio.gather(*(r.close(error=error) for r in runs), return_exceptions=True)


async def _merge(runs: Sequence[_Run]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave the event streams of several runs as ``(run index, event)``, in arrival order.

    Raises the first exception of any stream; cancels the others when closed early.
    """
    if len(runs) == 1:
        async for ev in runs[0].events():
            yield 0, ev
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, run: _Run) -> None:
        try:
            async for ev in run.events():
                queue.put_nowait((i, ev, None))
            queue.put_nowait((i, None, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(runs)]
    try:
        remaining = len(runs)
        while remaining:
            i, ev, exc = await queue.get()
            if exc is not None:
                raise exc
            if ev is None:
                remaining -= 1
                continue
            yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):  # see _close_all
            await asyncio.gather(*tasks, return_exceptions=True)


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable alphabet for bytes (Radford et al. 2019, ``bytes_to_unicode``), inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) \
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_GPT2_BYTE_DECODER = _gpt2_byte_decoder()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _lp(x: float | None) -> float | None:
    """A logprob safe for JSON (-inf -> -9999.0, as vLLM does)."""
    if x is None:
        return None
    return -9999.0 if math.isinf(x) and x < 0 or math.isnan(x) else float(x)


# --------------------------------------------------------------------------- the server

class _Server:
    """State behind the routes: engine, tokenizer, names, metrics."""

    def __init__(self, engine, served_model_name: str | None, disconnect_poll_s: float, template_timeout_s: float,
                 tool_call_parser: str = "auto", reasoning_parser: str = "auto"):
        from ..io.chat_template import RenderLimits

        self.engine = engine
        llm = engine.engine
        self.tokenizer = llm.tokenizer
        self.vocab_size = llm.config.vocab_size
        self.max_model_len = llm.max_model_len
        self.model_name = served_model_name or llm.model_name
        self.root = llm.model_name
        self.created = int(time.time())
        self.poll_s = disconnect_poll_s
        self.metrics = ServerMetrics(engine.stats, self.model_name)
        # the longest token text (>= the characters it decodes to): bounds a text's token count from below
        tok = self.tokenizer
        self.max_token_chars = (max(len(tok.id_to_token(i)) for i in range(tok.vocab_size))
                                if getattr(tok, "has_vocab", True) and hasattr(tok, "id_to_token") else 0)
        # a rendered prompt longer than this could never fit the context (check_text_length); the
        # render is stopped there
        self.template_limits = RenderLimits(
            timeout_s=template_timeout_s,
            max_output_chars=max(1 << 16, max(64, self.max_token_chars) * self.max_model_len + 1))
        self._token_text: dict[int, str] = {}
        template = getattr(self.tokenizer, "chat_template", None)
        self.tool_call_parser = resolve_parser("--tool-call-parser", tool_call_parser, TOOL_PARSERS,
                                               detect_tool_parser(template))
        self.reasoning_parser = resolve_parser("--reasoning-parser", reasoning_parser, REASONING_PARSERS,
                                               detect_reasoning_parser(template))
        self.grammars = GrammarBackend(self.tokenizer, self.vocab_size, llm.eos_ids)

    async def constrain(self, params: SamplingParams, body) -> SamplingParams:
        """``params`` with the grammar the request asks for (``response_format``,
        ``structured_outputs``, or a forced ``tool_choice`` in the model's call format), compiled
        in a worker thread: the engine's step loop never waits for a compile.

        Raises: APIError 400 naming the field for a schema or grammar that cannot be compiled
        (an unsupported JSON-schema feature included) or a combination that cannot be honoured."""
        asked = body.structured_request()
        if isinstance(body, ChatCompletionRequest):
            mode, name = body.tool_mode()
            if mode in ("required", "named"):
                if asked is not None:
                    raise ProtocolError(f"tool_choice {body.tool_choice!r} cannot be combined with "
                                        f"{asked[2].split('.')[0]}", "tool_choice")
                if self.tool_call_parser is None:
                    raise ProtocolError(f"tool_choice {body.tool_choice!r} needs a tool-call format: this model's "
                                        f"chat template speaks none; start the server with --tool-call-parser "
                                        f"step3p5 or hermes", "tool_choice")
                asked = ("tool", name, "tool_choice")
        if asked is None:
            return params
        kind, spec, param = asked
        g = self.grammars

        def build():
            if kind == "json":
                return g.json_schema(spec, param)
            if kind == "regex":
                return g.regex(spec, param)
            if kind == "choice":
                return g.choice(spec, param)
            if kind == "grammar":
                return g.lark(spec, param)
            return g.lark(tool_call_grammar(self.tool_call_parser, body.tools, spec, g.literal), param)

        try:
            grammar = await _in_thread(build)
        except (GrammarError, ValueError, RecursionError) as e:  # RecursionError: absurdly deep schemas
            raise APIError(400, str(e)[:2000], param="tools" if str(e).startswith("tools:") else param) from None
        try:
            return dataclasses.replace(params, structured=grammar)
        except ValueError as e:  # a sampling parameter the grammar excludes: name it
            raise APIError(400, str(e), param=_param_of(str(e)) or param) from None

    # ------------------------------------------------------------ helpers
    def chat_output(self, body: ChatCompletionRequest, prompt_text: str) -> ChatOutput:
        """A fresh output pipeline for one choice of ``body`` (memra/server/agents.py): tool calls
        are parsed when the request offers tools and does not say ``tool_choice: none``."""
        mode, _ = body.tool_mode()
        parser = self.tool_call_parser if mode != "none" else None
        return ChatOutput(parser, body.tools, self.reasoning_parser,
                          seeded=self.reasoning_parser is not None and prompt_opens_reasoning(prompt_text))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           "invalid_request_error", "model", "model_not_found")

    def token_text(self, token_id: int) -> str:
        """Text of one token as shown in logprobs (special tokens included)."""
        s = self._token_text.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 500_000:
                self._token_text[token_id] = s
        return s

    def token_bytes(self, token_id: int) -> list[int]:
        """The UTF-8 bytes a token contributes to the text (chat logprobs' ``bytes``): exact
        for byte-level BPE (GPT-2 byte alphabet) and SentencePiece (``<0xNN>``, ``▁``)
        vocabularies even where a token holds part of a character; the decoded text's
        bytes otherwise (HF tokenizers, control tokens)."""
        tok = self.tokenizer
        model = getattr(tok, "model", None)
        try:
            kind = tok.token_type(token_id)
            spelling = tok.id_to_token(token_id)
        except (AttributeError, ValueError):
            return list(self.token_text(token_id).encode("utf-8"))
        if kind == 1 and model == "gpt2" and all(c in _GPT2_BYTE_DECODER for c in spelling):
            return [_GPT2_BYTE_DECODER[c] for c in spelling]
        if kind == 6 and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", spelling):
            return [int(spelling[3:5], 16)]
        if kind == 1 and model == "llama":
            return list(spelling.replace("▁", " ").encode("utf-8"))
        return list(self.token_text(token_id).encode("utf-8"))

    def check_text_length(self, text: str, param: str) -> None:
        """Refuse, before tokenizing it, a text that cannot fit the context: no token spells more
        than :attr:`max_token_chars` characters, so such a text has more than max_model_len tokens.

        Raises: APIError 400 ``context_length_exceeded``."""
        if self.max_token_chars and len(text) > self.max_token_chars * self.max_model_len:
            raise APIError(400, f"the {param} has {len(text)} characters: with at most {self.max_token_chars} "
                           f"characters per token of this vocabulary that is more than the context length of "
                           f"{self.max_model_len} tokens", param=param, code="context_length_exceeded")

    async def encode_prompt(self, prompt: str | list[int], index: int) -> list[int]:
        if isinstance(prompt, str):
            _check_unicode(prompt, "prompt")
            self.check_text_length(prompt, "prompt")
            ids = await _in_thread(self.tokenizer.encode, prompt)
            if not ids:
                raise APIError(400, f"prompt {index} is empty: it must contain at least one token", param="prompt")
            return ids
        return list(prompt)

    async def start(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
                    prompt_logprobs: int | None, request: Request, prompt_param: str) -> list[_Run]:
        """Validate every prompt, submit them all, and wait for each one's first event.

        Raises:
            APIError: 400 (invalid), 429 (queue full), 500 (engine failure). Nothing is
                left running when it raises.
        """
        arrival = time.monotonic()
        bound = self.engine.max_queue
        if bound is not None and len(prompts) > bound:  # it could never be admitted: not a retryable 429
            raise APIError(400, f"a batch of {len(prompts)} prompts is more than the server's queue holds "
                           f"(--max-queue {bound}); send at most {bound} prompts per request", param=prompt_param)
        try:
            for ids in prompts:
                self.engine.validate(ids, params)
        except Exception as e:
            raise _to_api_error(e, prompt_param) from None
        ids_suffix = len(prompts) > 1
        runs = [_Run(self, ids, params, f"{request_id}-{i}" if ids_suffix else request_id, prompt_logprobs, arrival)
                for i, ids in enumerate(prompts)]
        try:
            results = await self.until_disconnected(
                request, asyncio.gather(*(r.start() for r in runs), return_exceptions=True))
        except BaseException:
            await _close_all(runs)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await _close_all(runs)
            raise _to_api_error(errors[0], prompt_param) from None
        return runs

    async def until_disconnected(self, request: Request, aw) -> Any:
        """Await ``aw``, cancelling it if the client disconnects meanwhile.

        Raises:
            _ClientDisconnected: the client went away (``aw`` was cancelled).
        """
        task = asyncio.ensure_future(aw)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.poll_s)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise _ClientDisconnected()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def collect(self, runs: list[_Run], request: Request) -> list[tuple[list[_Choice], Any]]:
        """Run every request to the end: per run, its ``n`` choices and its first event
        (prompt ids, prompt logprobs). Closes the runs (aborting any unfinished one).

        Raises:
            _ClientDisconnected: the client left; the runs were aborted.
            APIError: 500 if the engine failed.
        """
        async def one(run: _Run) -> tuple[list[_Choice], Any]:
            choices = [_Choice(logprobs=[] if run.params.logprobs is not None else None)
                       for _ in range(run.params.n)]
            async for ev in run.events():
                for d in ev.deltas:
                    c = choices[d.index]
                    c.text.append(d.text)
                    c.token_ids.extend(d.token_ids)
                    if c.logprobs is not None and d.logprobs:
                        c.logprobs.extend(d.logprobs)
                    if d.finish_reason is not None:
                        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
            return choices, run.first

        error = False
        try:
            return await self.until_disconnected(request, asyncio.gather(*(one(r) for r in runs)))
        except _ClientDisconnected:
            raise
        except Exception as e:
            error = True
            raise _to_api_error(e) from None
        finally:
            await _close_all(runs, error)

    def usage(self, runs: list[_Run], completion_tokens: int) -> UsageInfo:
        prompt_tokens = sum(len(r.prompt_ids) for r in runs)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(r.cached_tokens for r in runs)))

    # ------------------------------------------------------------ logprob formats
    def completion_logprobs(self, entries: list, offset: int, prompt_entries: list | None = None
                            ) -> tuple[CompletionLogprobs, int]:
        """Legacy ``logprobs`` object for generated ``entries`` (``(id, logprob, top)``),
        preceded by ``prompt_entries`` (``(id, logprob|None, top|None)``) when echoing.
        Returns it and the text offset after the last token."""
        out = CompletionLogprobs()
        for tok, lp, top in (prompt_entries or []) + list(entries):
            text = self.token_text(tok)
            out.tokens.append(text)
            out.token_logprobs.append(_lp(lp))
            if top is None:
                out.top_logprobs.append(None)
            else:
                d = {self.token_text(i): _lp(v) for i, v in top}
                d.setdefault(text, _lp(lp))
                out.top_logprobs.append(d)
            out.text_offset.append(offset)
            offset += len(text)
        return out, offset

    def chat_logprobs(self, entries: list) -> ChatLogprobs:
        """Chat ``logprobs.content``: per token its text, logprob, UTF-8 bytes and top alternatives."""
        content = []
        for tok, lp, top in entries:
            text = self.token_text(tok)
            content.append(ChatTokenLogprob(
                token=text, logprob=_lp(lp), bytes=self.token_bytes(tok),
                top_logprobs=[ChatTopLogprob(token=self.token_text(i), logprob=_lp(v), bytes=self.token_bytes(i))
                              for i, v in (top or [])]))
        return ChatLogprobs(content=content)

    def prompt_entries(self, first_event) -> list | None:
        """Echoed prompt tokens as ``(id, logprob|None, top|None)`` from the first event."""
        ids = first_event.prompt_token_ids
        plp = first_event.prompt_logprobs
        if plp is None:
            return None
        out = []
        for k, tok in enumerate(ids):
            e = plp[k] if k < len(plp) else None
            out.append((tok, None, None) if e is None else (tok, e[0], list(e[1])))
        return out


# --------------------------------------------------------------------------- app

def create_app(engine, served_model_name: str | None = None, api_key: str | None = None,
               disconnect_poll_s: float = 0.2, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               chat_template_timeout_s: float = 1.0, tool_call_parser: str = "auto",
               reasoning_parser: str = "auto") -> FastAPI:
    """Build the FastAPI app serving ``engine``.

    Args:
        engine: a started :class:`memra.engine.async_engine.AsyncLLMEngine` (the caller
            starts and shuts it down).
        served_model_name: the name clients must send as ``model`` (default: the engine's
            ``model_name``).
        api_key: if set, every route but :data:`OPEN_PATHS` needs ``Authorization: Bearer <key>``.
        disconnect_poll_s: how often a non-streaming request checks for a gone client (s).
        max_body_bytes: larger POST bodies get 413 before parsing; non-JSON ones get 415.
        chat_template_timeout_s: wall-time bound of one chat-template render (its output is
            bounded at the longest token's characters (at least 64) per token of context, its
            memory at 1 GiB).
        tool_call_parser: ``auto`` (the format the chat template speaks), ``step3p5``, ``hermes``
            or ``none`` (memra/server/tool_parsers.py).
        reasoning_parser: ``auto`` (step3p5 when the template speaks ``<think>``), ``step3p5`` or
            ``none`` (memra/server/reasoning.py).

    Raises:
        ValueError: ``api_key`` is empty or not printable ASCII; ``max_body_bytes`` < 1; an
            unknown parser name.
    """
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes} must be >= 1")
    api_key = check_api_key(api_key, "api_key")
    srv = _Server(engine, served_model_name, disconnect_poll_s, chat_template_timeout_s, tool_call_parser,
                  reasoning_parser)
    app = FastAPI(title="memra OpenAI-compatible server", version="0.1.0",
                  description="OpenAI-compatible completions and chat completions served by memra.")
    app.state.server = srv
    app.add_middleware(_InternalErrorMiddleware)
    app.add_middleware(_BodyGuardMiddleware, max_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(_AuthMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(ProtocolError)
    async def _protocol_error(_: Request, exc: ProtocolError):
        return _to_api_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        else:
            msg = str(exc.detail)
        typ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(APIError(exc.status_code, msg, typ).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    # ------------------------------------------------------------------ meta routes
    @app.get("/health", summary="liveness: 200 while the engine loop runs, 503 if it stopped",
             responses={503: {"model": ErrorResponse, "description": "the engine loop is not running"}})
    async def health():
        """200 ``{"status": "ok"}`` while the engine thread runs; 503 (OpenAI error body) otherwise."""
        if not srv.engine.is_running:
            return APIError(503, "the engine loop is not running", "server_error", None, "engine_stopped").response()
        return {"status": "ok"}

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE)

    def card() -> ModelCard:
        return ModelCard(id=srv.model_name, created=srv.created, root=srv.root, max_model_len=srv.max_model_len)

    @app.get("/v1/models", response_model=ModelList, responses=_ERROR_RESPONSES)
    async def list_models() -> ModelList:
        """OpenAI ``GET /v1/models``: the one served model, with vLLM's ``max_model_len``."""
        return ModelList(data=[card()])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERROR_RESPONSES)
    async def retrieve_model(model: str) -> ModelCard:
        srv.check_model(model)
        return card()

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """vLLM's ``POST /tokenize``: ids of a text prompt, or of a conversation rendered with
        the chat template (exactly what /v1/chat/completions would prefill)."""
        srv.check_model(body.model)
        try:
            body.check()
            if body.prompt is not None:
                _check_unicode(body.prompt, "prompt")
                ids = await _in_thread(srv.tokenizer.encode, body.prompt,
                                       add_special_tokens=body.add_special_tokens is not False)
            else:
                msgs = [m.template_dict(i) for i, m in enumerate(body.messages)]
                text = await _in_thread(srv.tokenizer.apply_chat_template, msgs, limits=srv.template_limits,
                                        add_generation_prompt=body.add_generation_prompt is not False)
                _check_unicode(text, "messages")
                ids = await _in_thread(srv.tokenizer.encode, text, add_special_tokens=bool(body.add_special_tokens))
        except (ValueError, TypeError) as e:
            raise _to_api_error(e if isinstance(e, ValueError) else ValueError(str(e)),
                                "prompt" if body.prompt is not None else "messages") from None
        strs = [srv.tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=srv.max_model_len, token_strs=strs)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's ``POST /detokenize``: the text of token ids (special tokens kept); 400 for an
        id outside the vocabulary."""
        srv.check_model(body.model)
        try:
            text = srv.tokenizer.decode(body.tokens)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"tokens: {e}", param="tokens") from None
        return DetokenizeResponse(prompt=text)

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions", response_model=CompletionResponse, responses={
        **_ERROR_RESPONSES, 200: {"description": "a text_completion (JSON), or SSE chunks of it when stream=true",
                                  "content": {"text/event-stream": {}}}})
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI ``POST /v1/completions``. Choices are indexed prompt-major: prompt i's
        j-th completion has ``index = i * n + j``."""
        srv.check_model(body.model)
        params = await srv.constrain(body.to_sampling_params(), body)
        raw = body.prompts()
        prompts = [await srv.encode_prompt(p, i) for i, p in enumerate(raw)]
        echo = bool(body.echo)
        want_plp = body.logprobs if echo and body.logprobs is not None else None
        request_id = random_id("cmpl")
        runs = await _start_or_abort(srv, prompts, params, request_id, want_plp, request, "prompt")
        prompt_texts = [p if isinstance(p, str) else srv.tokenizer.decode(p) for p in raw] if echo else None
        if body.stream:
            return _event_stream(_completion_stream(srv, runs, body, request_id, prompt_texts))
        try:
            results = await srv.collect(runs, request)
        except _ClientDisconnected:
            return Response(status_code=499)
        choices, completion_tokens = [], 0
        for i, (cs, first) in enumerate(results):
            prompt_text = prompt_texts[i] if echo else ""
            for j, c in enumerate(cs):
                completion_tokens += len(c.token_ids)
                lp = None
                if c.logprobs is not None:  # text_offset counts from the start of the choice's text
                    pe = srv.prompt_entries(first) if echo else None
                    lp, _ = srv.completion_logprobs(c.logprobs, 0 if pe is not None else len(prompt_text), pe)
                choices.append(CompletionChoice(index=i * params.n + j, text=prompt_text + "".join(c.text),
                                                logprobs=lp, finish_reason=c.finish_reason,
                                                stop_reason=c.stop_reason))
        return CompletionResponse(id=request_id, model=srv.model_name, choices=choices,
                                  usage=srv.usage(runs, completion_tokens))

    # ------------------------------------------------------------------ chat
    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={
        **_ERROR_RESPONSES, 200: {"description": "a chat.completion (JSON), or SSE chunks when stream=true",
                                  "content": {"text/event-stream": {}}}})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """OpenAI ``POST /v1/chat/completions``: messages rendered with the model's chat template."""
        srv.check_model(body.model)
        try:
            messages = body.template_messages()
            kwargs = body.template_kwargs()
            text = await _in_thread(srv.tokenizer.apply_chat_template, messages, limits=srv.template_limits,
                                    add_generation_prompt=body.add_generation_prompt is not False, **kwargs)
        except TypeError as e:  # e.g. chat_template_kwargs colliding with a template argument
            raise APIError(400, f"chat_template_kwargs: {e}", param="chat_template_kwargs") from None
        except ValueError as e:  # ChatTemplateError (incl. no template, raise_exception), ProtocolError
            raise _to_api_error(e, "messages") from None
        _check_unicode(text, "messages")
        srv.check_text_length(text, "messages")
        ids = await _in_thread(srv.tokenizer.encode, text, add_special_tokens=False)
        if not ids:
            raise APIError(400, "the rendered conversation is empty", param="messages")
        params = await srv.constrain(body.to_sampling_params(len(ids), srv.max_model_len), body)
        request_id = random_id("chatcmpl")
        runs = await _start_or_abort(srv, [ids], params, request_id, None, request, "messages")
        if body.stream:
            return _event_stream(_chat_stream(srv, runs[0], body, request_id, text))
        try:
            results = await srv.collect(runs, request)
        except _ClientDisconnected:
            return Response(status_code=499)
        cs, _ = results[0]
        choices = []
        for j, c in enumerate(cs):
            out = srv.chat_output(body, text)
            out.feed("".join(c.text))
            out.finish()
            choices.append(ChatChoice(index=j, message=ChatResponseMessage(**out.message()),
                                      logprobs=srv.chat_logprobs(c.logprobs) if c.logprobs is not None else None,
                                      finish_reason=out.finish_reason(c.finish_reason), stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=request_id, model=srv.model_name, choices=choices,
                                      usage=srv.usage(runs, sum(len(c.token_ids) for c in cs)))

    return app


def resolve_parser(flag: str, value: str, known: dict, detected: str | None) -> str | None:
    """``auto`` -> what the chat template speaks (``detected``), ``none`` -> None, else a known name.

    Raises: ValueError naming the flag and the known values."""
    if value == "auto":
        return detected
    if value == "none":
        return None
    if value not in known:
        raise ValueError(f"{flag} {value!r}: expected auto, none or one of {', '.join(known)}")
    return value


async def _start_or_abort(srv: _Server, prompts, params, request_id, prompt_logprobs, request, prompt_param):
    try:
        return await srv.start(prompts, params, request_id, prompt_logprobs, request, prompt_param)
    except _ClientDisconnected:
        raise APIError(499, "client disconnected", code="client_closed_request") from None


def _event_stream(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _completion_stream(srv: _Server, runs: list[_Run], body: CompletionRequest, request_id: str,
                             prompt_texts: list[str] | None) -> AsyncIterator[str]:
    """SSE chunks of a ``text_completion`` (one choice per chunk), then usage, then ``[DONE]``."""
    n = runs[0].params.n
    created = int(time.time())
    offsets: dict[int, int] = {}
    completion_tokens = 0
    error = False

    def chunk(index: int, text: str, logprobs=None, finish_reason=None, stop_reason=None) -> str:
        obj = {"id": request_id, "object": "text_completion", "created": created, "model": srv.model_name,
               "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                            "stop_reason": stop_reason}]}
        if body.include_usage:
            obj["usage"] = None
        return _sse(obj)

    try:
        async for i, ev in _merge(runs):
            if prompt_texts is not None and ev is runs[i].first:  # echo the prompt first
                pe = srv.prompt_entries(ev)
                for j in range(n):
                    lp = None
                    if body.logprobs is not None and pe is not None:
                        lpo, offsets[i * n + j] = srv.completion_logprobs([], 0, pe)
                        lp = lpo.model_dump()
                    else:
                        offsets[i * n + j] = len(prompt_texts[i])
                    yield chunk(i * n + j, prompt_texts[i], lp)
            for d in ev.deltas:
                index = i * n + d.index
                completion_tokens += len(d.token_ids)
                lp = None
                if body.logprobs is not None and d.logprobs:
                    lpo, offsets[index] = srv.completion_logprobs(d.logprobs, offsets.get(index, 0))
                    lp = lpo.model_dump()
                if d.text or lp is not None or d.finish_reason is not None:
                    yield chunk(index, d.text, lp, d.finish_reason, d.stop_reason)
        if body.include_usage:
            usage = srv.usage(runs, completion_tokens).model_dump()
            yield _sse({"id": request_id, "object": "text_completion", "created": created, "model": srv.model_name,
                        "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"
    except Exception as e:
        error = True
        yield _sse(_to_api_error(e).body())
        yield "data: [DONE]\n\n"
    finally:
        await _close_all(runs, error)


async def _chat_stream(srv: _Server, run: _Run, body: ChatCompletionRequest, request_id: str,
                       prompt_text: str) -> AsyncIterator[str]:
    """SSE ``chat.completion.chunk``s: a role chunk per choice, then its ``reasoning_content``,
    ``content`` and ``tool_calls`` deltas (memra/server/agents.py: each call once, whole), a final
    chunk with ``finish_reason`` per choice, the usage chunk if asked, then ``[DONE]``."""
    created = int(time.time())
    completion_tokens = 0
    error = False

    def chunk(index: int, delta: dict, logprobs=None, finish_reason=None, stop_reason=None) -> str:
        obj = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": srv.model_name,
               "system_fingerprint": None,
               "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                            "stop_reason": stop_reason}]}
        if body.include_usage:
            obj["usage"] = None
        return _sse(obj)

    outs = [srv.chat_output(body, prompt_text) for _ in range(run.params.n)]
    try:
        for j in range(run.params.n):
            yield chunk(j, {"role": "assistant", "content": ""})
        async for _, ev in _merge([run]):
            for d in ev.deltas:
                completion_tokens += len(d.token_ids)
                lp = None
                if run.params.logprobs is not None and d.logprobs:
                    lp = srv.chat_logprobs(d.logprobs).model_dump()
                out = outs[d.index]
                parts = out.feed(d.text) if d.text else []
                if d.finish_reason is not None:
                    parts += out.finish()
                if lp is not None and not parts:
                    parts = [{"content": ""}]
                for k, part in enumerate(parts):  # logprobs ride on the first delta of the step
                    yield chunk(d.index, part, lp if k == 0 else None)
                if d.finish_reason is not None:
                    yield chunk(d.index, {}, None, out.finish_reason(d.finish_reason), d.stop_reason)
        if body.include_usage:
            yield _sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                        "model": srv.model_name, "system_fingerprint": None, "choices": [],
                        "usage": srv.usage([run], completion_tokens).model_dump()})
        yield "data: [DONE]\n\n"
    except Exception as e:
        error = True
        yield _sse(_to_api_error(e).body())
        yield "data: [DONE]\n\n"
    finally:
        await _close_all([run], error)


# --------------------------------------------------------------------------- CLI support

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes in a size such as ``2GiB``, ``512MiB``, ``1.5GB`` or ``1000000``.

    Units (case-insensitive): B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers
    of 1024); none means bytes. The result must be a whole number of bytes >= 1.

    Raises:
        ValueError: not a positive finite number with a known unit, or not whole bytes.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r}: expected a number with an optional unit "
                         f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 2GiB or 512MiB")
    from fractions import Fraction

    value = Fraction(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if value.denominator != 1 or value < 1:
        raise ValueError(f"invalid size {text!r}: must be a whole number of bytes >= 1")
    return int(value)


def run_server(engine_config, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_name: str | None = None, max_queue: int | None = None,
               log_level: str = "info", max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               chat_template_timeout_s: float = 1.0, tool_call_parser: str = "auto",
               reasoning_parser: str = "auto") -> int:
    """Load the model, start the engine and serve until interrupted (``memra serve``).

    Args:
        engine_config: an :class:`memra.engine.engine.EngineConfig`.
        host, port: where to listen (127.0.0.1 unless told otherwise).
        api_key: bearer key required on every route but /health and /metrics (None: none).
        served_model_name: the name clients send as ``model`` (default: the model key).
        max_queue: most unfinished requests in the engine; more get 429 (None: unbounded).
        max_body_bytes, chat_template_timeout_s, tool_call_parser, reasoning_parser: as :func:`create_app`.

    Returns:
        0 after a clean shutdown.
    Raises:
        ValueError: invalid configuration (reported by the CLI as ``error: ...``).
    """
    import uvicorn

    from ..engine.async_engine import AsyncLLMEngine
    from ..engine.engine import LLMEngine

    api_key = check_api_key(api_key, "--api-key / MEMRA_API_KEY")
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port} is not a TCP port (0..65535)")
    if max_queue is not None and max_queue < 1:
        raise ValueError(f"--max-queue {max_queue} must be >= 1")
    # take the port before the model loads: a busy port fails in a second, not after the load
    sock = _bind(host, port)
    if not chat_template_timeout_s > 0:
        raise ValueError(f"--chat-template-timeout {chat_template_timeout_s} must be > 0 seconds")
    engine = AsyncLLMEngine(LLMEngine(engine_config, progress=True), max_queue=max_queue)
    app = create_app(engine, served_model_name=served_model_name, api_key=api_key, max_body_bytes=max_body_bytes,
                     chat_template_timeout_s=chat_template_timeout_s, tool_call_parser=tool_call_parser,
                     reasoning_parser=reasoning_parser)
    check_chat_template(app.state.server)
    name = app.state.server.model_name
    engine.start()
    try:
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        auth = " -H 'Authorization: Bearer YOUR_KEY'" if api_key else ""
        print(f"memra: serving {name!r} (max_model_len {app.state.server.max_model_len}) at {url}/v1", flush=True)
        print(f"memra: {engine.engine.kv_cache_summary()}", flush=True)
        print(f"try:   curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d "
              f"'{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
              f"\"max_tokens\": 32}}'", flush=True)
        server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))

        def stop(e: Exception) -> None:  # a parallel rank died: finish the error responses, then exit
            server.should_exit = True

        engine.on_fatal = stop
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
    if engine.fatal is not None:
        print(f"memra: stopped: {engine.fatal}", file=sys.stderr, flush=True)
        return 1
    return 0


def check_chat_template(srv) -> None:
    """Render a plain two-message conversation with the model's chat template (if it has one)
    under the server's limits, so a template that cannot (a runaway, a broken one) refuses the
    start-up instead of failing every chat request.

    Raises:
        ValueError: the render failed; the message names the template problem.
    """
    from ..io.chat_template import ChatTemplateError

    if getattr(srv.tokenizer, "chat_template", None) is None:
        return
    msgs = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi! How can I help?"}]
    try:
        srv.tokenizer.apply_chat_template(msgs, add_generation_prompt=False, limits=srv.template_limits)
    except ChatTemplateError as e:
        raise ValueError(f"the model's chat template cannot render a plain user/assistant conversation, so "
                         f"chat requests could never succeed: {e}") from None


def _bind(host: str, port: int):
    """A listening TCP socket on ``host:port``.

    Raises:
        ValueError: the address cannot be bound (port in use, unknown host), naming it.
    """
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} cannot be resolved: {e}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}; is another server running there? "
                         "choose another port with --port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
