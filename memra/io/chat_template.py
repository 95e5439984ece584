"""Chat templates: Jinja2 programs shipped with a model that turn messages into a prompt.

A GGUF carries its template as ``tokenizer.chat_template`` (Hugging Face's
``tokenizer_config.json`` field of the same name). Templates are untrusted code from a
model file, so they run in ``jinja2.sandbox.ImmutableSandboxedEnvironment``: no
attribute starting with ``_`` (so no ``__class__``/``__globals__`` walk into Python
internals), no mutation of the messages, bounded ``range``; memra also bounds string and
list repetition and integer powers. The environment matches what templates are written
against (Hugging Face ``transformers`` chat template rendering):

* ``trim_blocks`` and ``lstrip_blocks`` on, the ``loopcontrols`` extension
  (``{% break %}``, ``{% continue %}``), and ``{% generation %}...{% endgeneration %}``
  accepted (rendered as its body);
* ``tojson`` filter as ``json.dumps`` (non-ASCII kept, ``indent``, ``separators``,
  ``sort_keys`` optional; key order kept), replacing Jinja's HTML-escaping one;
* globals ``raise_exception(message)`` and ``strftime_now(format)``;
* variables ``messages``, ``add_generation_prompt``, ``tools``, ``bos_token``,
  ``eos_token`` and any extra keyword (e.g. ``enable_thinking``).

Errors are :class:`ChatTemplateError` (a ``ValueError``) or a subclass, with a message
saying what went wrong and, for runtime failures, at which template line.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ChatTemplateError",
    "ChatTemplateSecurityError",
    "ChatTemplateRejected",
    "NoChatTemplateError",
    "ChatTemplateLimitError",
    "compile_chat_template",
    "render_chat_template",
    "render_chat_template_bounded",
    "RenderLimits",
    "MAX_REPEAT_LENGTH",
    "MAX_POWER_EXPONENT",
]

#: Longest string/list a template may build with ``*`` (elements or characters).
MAX_REPEAT_LENGTH = 1_000_000
#: Largest exponent a template may use in ``**`` on integers.
MAX_POWER_EXPONENT = 4096


class ChatTemplateError(ValueError):
    """A chat template could not be compiled or rendered; the message says why and where."""


class ChatTemplateSecurityError(ChatTemplateError):
    """A chat template tried to reach Python internals, mutate its inputs, or exceed a sandbox limit."""


class ChatTemplateLimitError(ChatTemplateSecurityError):
    """Rendering exceeded a bound of :class:`RenderLimits` (time, output size or memory); the
    message names the bound and its value."""


class ChatTemplateRejected(ChatTemplateError):
    """The template itself refused the conversation by calling ``raise_exception(message)``
    (e.g. "Conversation roles must alternate user/assistant"). The message is the template's."""


class NoChatTemplateError(ChatTemplateError):
    """The model has no chat template (typically a base model) and none was given."""


def _raise_exception(message: Any) -> None:
    """Template global ``raise_exception``: stop rendering with the template's own message."""
    raise ChatTemplateRejected(f"the chat template rejected the request: {message}")


def _strftime_now(fmt: Any) -> str:
    """Template global ``strftime_now(format)``: local time now, formatted."""
    if not isinstance(fmt, str):
        raise ChatTemplateError(f"strftime_now() takes a format string, got {type(fmt).__name__}")
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """Template filter ``tojson``: ``json.dumps`` with key order and non-ASCII kept, no HTML escaping."""
    if isinstance(separators, list):
        separators = tuple(separators)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text (for training masks
    in transformers); memra renders the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        """Parse the block into a plain scope around its body."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox that fails loudly on unsafe attributes and bounds ``*``/``**``.

    jinja2's sandbox answers an unsafe attribute (``''.__class__``) with an undefined
    value that only raises when used further, so ``{{ lipsum.__globals__ }}`` would
    quietly print nothing; here any unsafe access raises at once.
    """

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        """Raise ``SecurityError`` for an unsafe attribute instead of returning an undefined."""
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        """``*`` and ``**`` with size limits (:data:`MAX_REPEAT_LENGTH`, :data:`MAX_POWER_EXPONENT`)."""
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if (isinstance(seq, (str, list, tuple)) and isinstance(n, int)
                        and len(seq) * n > MAX_REPEAT_LENGTH):
                    raise ChatTemplateSecurityError(
                        f"chat template tried to build a sequence of {len(seq) * n} items with '*' "
                        f"(sandbox limit {MAX_REPEAT_LENGTH})"
                    )
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(right) > MAX_POWER_EXPONENT \
                    and abs(left) > 1:
                raise ChatTemplateSecurityError(
                    f"chat template tried '**' with exponent {right} (sandbox limit {MAX_POWER_EXPONENT})"
                )
        return super().call_binop(context, operator, left, right)


@functools.lru_cache(maxsize=1)
def _environment() -> _Sandbox:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=64)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in memra's sandbox (cached by source text).

    Args:
        source: the Jinja2 template text.

    Raises:
        TypeError: ``source`` is not a str.
        ChatTemplateError: the template has a syntax error (message has the line).
    """
    if not isinstance(source, str):
        raise TypeError(f"a chat template is a str, got {type(source).__name__}")
    try:
        return _environment().from_string(source)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from None


def _template_line(exc: BaseException) -> int | None:
    """Template line of the innermost template frame in ``exc``'s traceback (Jinja
    rewrites tracebacks so that template frames carry template line numbers)."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _plain(value: Any, where: str) -> Any:
    """A copy of ``value`` made only of JSON types (dict, list, str, int, float, bool, None).

    The template then sees no object whose methods the sandbox does not know; pydantic
    models (``model_dump``) are converted; tuples become lists.

    Raises:
        ChatTemplateError: ``value`` holds something else (names where).
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # str subclasses (enums...) lose their extra methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ChatTemplateError(f"{where} has a non-string key {k!r}")
            out[str.__str__(k)] = _plain(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump(), where)
    raise ChatTemplateError(
        f"{where} is a {type(value).__name__}; chat template inputs must be JSON-like "
        f"(dict, list, str, int, float, bool, None)"
    )


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as plain dicts, keys whose value is None dropped (an OpenAI client sends
    ``content: null`` next to ``tool_calls``; templates expect the key to be absent, as
    transformers' ``apply_chat_template`` arranges)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of message objects, got {type(messages).__name__}")
    out = []
    for k, m in enumerate(messages):
        m = _plain(m, f"messages[{k}]")
        if not isinstance(m, dict):
            raise ChatTemplateError(f"messages[{k}] must be an object with 'role', got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{k}] has no string 'role' (got {m.get('role')!r})")
        out.append({key: v for key, v in m.items() if v is not None})
    return out


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    bos_token: str = "",
    eos_token: str = "",
    max_output_chars: int | None = None,
    **kwargs: Any,
) -> str:
    """Render a chat template over a conversation, in this process (no time or memory
    bound: for untrusted templates use :func:`render_chat_template_bounded`).

    Args:
        template: Jinja2 template text (e.g. a GGUF's ``tokenizer.chat_template``).
        messages: OpenAI-style messages, each a mapping with a string ``role``
            (``content``, ``tool_calls``, ...); copied as plain JSON data, and keys
            whose value is None dropped, as transformers does.
        add_generation_prompt: ask the template to open the assistant's turn.
        tools: tool descriptions (JSON-schema function specs) or None.
        bos_token, eos_token: token texts the template may write.
        max_output_chars: stop with :class:`ChatTemplateLimitError` once the output is longer.
        **kwargs: extra template variables (``enable_thinking``, ``documents``, ...);
            may not shadow the globals (``raise_exception``, ``strftime_now``, ``range``...).

    Returns:
        The rendered prompt text.

    Raises:
        ChatTemplateError: malformed or non-JSON ``messages``/``tools``/extra
            variables, a syntax error, or a
            failure while rendering (undefined operation, bad types, ...; the message
            names the template line).
        ChatTemplateRejected: the template called ``raise_exception``.
        ChatTemplateSecurityError: the template touched an unsafe attribute (anything
            starting with ``_``, e.g. ``__class__``, ``__globals__``), tried to mutate its
            inputs, or exceeded a sandbox limit (``range`` > 100000 items, huge ``*``/``**``).

    Source: Hugging Face transformers chat templating (environment and variables),
    jinja2's ``ImmutableSandboxedEnvironment``.
    """
    compiled = compile_chat_template(template)
    messages = _check_messages(messages)
    if tools is not None and (isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence)):
        raise ChatTemplateError(f"tools must be a list of tool objects or None, got {type(tools).__name__}")
    env_globals = _environment().globals
    shadowing = sorted(k for k in kwargs if k in env_globals)
    if shadowing:
        raise ChatTemplateError(f"template variables {shadowing} would shadow chat template globals")
    context = {k: _plain(v, k) for k, v in kwargs.items()}
    context.update(
        messages=messages,
        add_generation_prompt=bool(add_generation_prompt),
        tools=None if tools is None else _plain(list(tools), "tools"),
        bos_token=bos_token,
        eos_token=eos_token,
    )
    try:
        if max_output_chars is None:
            return compiled.render(**context)
        parts, n = [], 0
        for piece in compiled.generate(**context):
            n += len(piece)
            if n > max_output_chars:
                raise ChatTemplateLimitError(f"chat template output exceeded the limit of {max_output_chars} "
                                             "characters")
            parts.append(piece)
        return "".join(parts)
    except ChatTemplateError:
        raise
    except SecurityError as e:
        raise ChatTemplateSecurityError(
            f"chat template tried an unsafe operation{_at(e)}: {e} (blocked by the sandbox)"
        ) from None
    except OverflowError as e:  # jinja2's sandboxed range() beyond MAX_RANGE
        raise ChatTemplateSecurityError(f"chat template exceeded a sandbox limit{_at(e)}: {e}") from None
    except (TemplateError, ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as e:
        raise ChatTemplateError(f"chat template failed{_at(e)}: {type(e).__name__}: {e}") from None


def _at(exc: BaseException) -> str:
    line = _template_line(exc)
    return "" if line is None else f" at line {line}"


# ------------------------------------------------------------------ bounded rendering


@dataclasses.dataclass(frozen=True)
class RenderLimits:
    """Bounds on one chat-template render (:func:`render_chat_template_bounded`).

    Attributes:
        timeout_s: wall-clock seconds (the worker process is killed past it).
        max_output_chars: longest rendered prompt, in characters.
        memory_bytes: address-space cap of the worker process (``RLIMIT_AS``).
    """

    timeout_s: float = 1.0
    max_output_chars: int = 4_000_000
    memory_bytes: int = 1 << 30

    def __post_init__(self):
        if not (self.timeout_s > 0 and self.max_output_chars > 0 and self.memory_bytes >= 64 << 20):
            raise ValueError(f"invalid chat template limits {self}: timeout_s and max_output_chars must be "
                             "positive, memory_bytes at least 64 MiB")


class _Worker:
    """One render process (``memra.io._template_worker``); replaced after a timeout."""

    #: seconds a new worker may take to start (not counted against a render's timeout)
    START_TIMEOUT_S = 30.0

    def __init__(self, memory_bytes: int):
        import subprocess
        import sys

        self.memory_bytes = memory_bytes
        # -P: no current directory on sys.path; PYTHONPATH: exactly this process's import path,
        # so the worker runs the same memra and jinja2 as its parent
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "memra.io._template_worker", str(memory_bytes)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env)
        try:
            status, _ = self._read(self.START_TIMEOUT_S)
        except (TimeoutError, EOFError, OSError):
            self.kill()
            raise ChatTemplateError("the chat template worker process did not start") from None
        if status != "ready":
            self.kill()
            raise ChatTemplateError(f"the chat template worker process sent {status!r} instead of 'ready'")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()

    def call(self, request: tuple, timeout_s: float) -> tuple:
        """Send one request; the reply within ``timeout_s`` (TimeoutError, EOFError otherwise)."""
        import pickle
        import struct

        data = pickle.dumps(request)
        self.proc.stdin.write(struct.pack("<I", len(data)) + data)
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def _read(self, timeout_s: float) -> tuple:
        import pickle
        import select
        import struct
        import time

        fd = self.proc.stdout.fileno()
        poller = select.poll()  # poll, not select: file descriptors above 1024 are fine
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout_s

        def exactly(n: int) -> bytes:
            buf = bytearray()
            while len(buf) < n:
                left = deadline - time.monotonic()
                if left <= 0 or not poller.poll(left * 1000):
                    raise TimeoutError
                chunk = os.read(fd, min(n - len(buf), 1 << 20))
                if not chunk:
                    raise EOFError
                buf += chunk
            return bytes(buf)

        (length,) = struct.unpack("<I", exactly(4))
        return pickle.loads(exactly(length))


class _WorkerPool:
    """Up to ``size`` render processes shared by every thread of this process."""

    def __init__(self, size: int = 2):
        self.size = size
        self.idle: list[_Worker] = []
        self.count = 0
        self.cond = threading.Condition()

    def take(self, memory_bytes: int) -> _Worker:
        with self.cond:
            while True:
                for i, w in enumerate(self.idle):
                    if w.memory_bytes == memory_bytes and w.alive():
                        return self.idle.pop(i)
                if self.count < self.size:
                    self.count += 1
                    break
                if self.idle:  # an idle worker with other limits (or dead): replace it
                    self.idle.pop(0).kill()
                    self.count -= 1
                    continue
                self.cond.wait()
        try:
            return _Worker(memory_bytes)
        except BaseException:
            with self.cond:
                self.count -= 1
                self.cond.notify()
            raise

    def give(self, w: _Worker, ok: bool) -> None:
        with self.cond:
            if ok and w.alive():
                self.idle.append(w)
            else:
                w.kill()
                self.count -= 1
            self.cond.notify()


_POOL = _WorkerPool()


def render_chat_template_bounded(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    limits: RenderLimits | None = None,
    **kwargs: Any,
) -> str:
    """:func:`render_chat_template` in a separate worker process with hard bounds on time,
    output size and memory, so an untrusted template (a GGUF's ``tokenizer.chat_template``)
    cannot stall or exhaust the caller: a runaway render is killed and the next call starts a
    fresh worker. Safe to call from many threads at once (up to 2 renders run in parallel).

    Args:
        limits: :class:`RenderLimits` (default: 1 s, 4,000,000 characters, 1 GiB).
        template, messages, **kwargs: as :func:`render_chat_template`.

    Raises:
        ChatTemplateLimitError: a bound was exceeded (the message names it and its value).
        everything :func:`render_chat_template` raises.
    """
    limits = limits or RenderLimits()
    compile_chat_template(template)  # syntax errors are found here, without a round trip
    messages = _check_messages(messages)
    kwargs = {k: _plain(v, k) for k, v in kwargs.items()}
    w = _POOL.take(limits.memory_bytes)
    ok = False
    try:
        status, value = w.call((template, messages, kwargs, limits.max_output_chars), limits.timeout_s)
        ok = status != "fatal"  # a worker that hit its memory cap exits: replace it
    except TimeoutError:
        raise ChatTemplateLimitError(f"chat template rendering exceeded the time limit of {limits.timeout_s:g} s "
                                     "and was stopped") from None
    except (EOFError, OSError) as e:  # the worker died (e.g. killed by the memory cap)
        raise ChatTemplateLimitError(f"chat template rendering stopped its worker process ({type(e).__name__}); "
                                     f"memory limit {limits.memory_bytes >> 20} MiB") from None
    finally:
        _POOL.give(w, ok)
    if status == "ok":
        return value
    if status in ("err", "fatal") and isinstance(value, BaseException):
        raise value
    raise ChatTemplateError(f"the chat template worker process sent an unexpected reply {status!r}")
