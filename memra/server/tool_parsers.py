"""Tool calls in model output: parsers for the models' own call formats, streaming-first.

Two formats (``--tool-call-parser``):

- ``step3p5`` (Step-3.5/3.7, the Qwen3-Coder family's XML form)::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

  A bare ``<function=...>...</function>`` without the ``<tool_call>`` wrapper is a call too.
  Parameter values are text; one newline after ``<parameter=...>`` and one before
  ``</parameter>`` belong to the markup. A value is converted by the tool's JSON-schema type
  of that parameter: ``string`` kept verbatim (multi-line included); ``integer``, ``number``,
  ``boolean``, ``null``, ``object``, ``array`` parsed as JSON (a value that does not parse is
  kept as the string); a parameter the schema does not name is kept as a string.
- ``hermes`` (Qwen2.5, NousResearch Hermes)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

The parser is fed the completion text as it streams, in deltas of any size, and returns
what is certain so far: content (text outside calls) and complete calls. A call is emitted
once, whole, when its closing tag arrives (so several complete calls in one delta all come
out, none twice). Text that may be the start of a tag is held back until it is decided.
Markup that does not parse (a call of an unknown shape, JSON that does not load) and markup
cut off at the end of the completion (``finish``) go to content unchanged: nothing is lost and
nothing raises. Non-streaming parsing is ``feed(all) + finish()``, so both give the same calls.

Reference for the formats: the models' chat templates (Qwen2.5 and Qwen3-Coder ``tools``
sections); behaviour as vLLM's ``hermes`` / ``qwen3_coder`` parsers are expected to behave.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

__all__ = ["TOOL_PARSERS", "HermesToolParser", "Step35ToolParser", "ToolCall", "ToolParser", "detect_tool_parser",
           "make_tool_parser", "parse_tool_calls"]


@dataclass
class ToolCall:
    """One parsed call: ``arguments`` is a JSON object as a string (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self):
        if not self.id:
            self.id = "call_" + secrets.token_hex(12)

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """The call as an OpenAI ``tool_calls`` entry (``index`` for streamed deltas)."""
        d: dict[str, Any] = {"id": self.id, "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def _tool_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """name -> the ``parameters`` JSON schema of each function tool."""
    out = {}
    for t in tools or []:
        f = t.get("function") if isinstance(t, dict) else None
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            out[f["name"]] = f.get("parameters") if isinstance(f.get("parameters"), dict) else {}
    return out


def _held_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class ToolParser:
    """Incremental parser (module docstring). Subclasses set ``starts`` (opening tag -> its
    closing tag) and implement :meth:`parse_block`.

    Args:
        tools: the request's ``tools`` (OpenAI shape), for the parameter types.
    """

    name = ""
    starts: dict[str, str] = {}

    def __init__(self, tools: list[dict] | None = None):
        self.schemas = _tool_schemas(tools)
        self.buf = ""
        self.end: str | None = None  # the closing tag awaited, inside a call block
        self.scanned = 0  # inside a block: buf[:scanned] holds no closing tag (linear streaming)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Add completion text; returns (content that is certain, calls completed)."""
        self.buf += text
        content, calls = [], []
        while True:
            if self.end is None:
                hits = [(self.buf.find(s), s) for s in self.starts if s in self.buf]
                if not hits:
                    keep = _held_suffix(self.buf, tuple(self.starts))
                    content.append(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                i, s = min(hits)
                content.append(self.buf[:i])
                self.buf, self.end, self.scanned = self.buf[i:], self.starts[s], 0
            j = self.buf.find(self.end, self.scanned)
            if j < 0:
                self.scanned = max(0, len(self.buf) - len(self.end) + 1)
                break
            block, self.buf = self.buf[:j + len(self.end)], self.buf[j + len(self.end):]
            self.end = None
            try:
                parsed = self.parse_block(block)
            except Exception:  # noqa: BLE001 - e.g. RecursionError on absurdly nested JSON: text, never a 500
                parsed = None
            if parsed is None:
                content.append(block)  # malformed: kept as text
            else:
                calls.extend(parsed)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of the completion: whatever is held (a partial tag, an unterminated call) is content."""
        rest, self.buf, self.end = self.buf, "", None
        return rest, []

    def parse_block(self, block: str) -> list[ToolCall] | None:
        """The calls of one complete block (opening to closing tag), or None if it does not parse."""
        raise NotImplementedError


def _convert(value: str, schema: dict | None) -> Any:
    """A step3p5 parameter value by its JSON-schema type (module docstring)."""
    types = _schema_types(schema)
    if not types or types == {"string"}:
        return value
    try:
        v = json.loads(value)
    except ValueError:
        return value
    if isinstance(v, float) and not math.isfinite(v):
        return value  # NaN / Infinity are not JSON
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}[type(v)]
    if kind in types or (kind == "integer" and "number" in types):
        return v
    return value


def _schema_types(schema: dict | None) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    out: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            out |= _schema_types(sub)
    if "enum" in schema and not out:
        out = {{bool: "boolean", int: "integer", float: "number", str: "string"}.get(type(e), "null")
               for e in schema["enum"]}
    return out


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


class Step35ToolParser(ToolParser):
    """The XML call format of Step-3.5 / Qwen3-Coder (module docstring)."""

    name = "step3p5"
    starts = {"<tool_call>": "</tool_call>", "<function=": "</function>"}

    def parse_block(self, block: str) -> list[ToolCall] | None:
        body = block
        if block.startswith("<tool_call>"):
            body = block[len("<tool_call>"):-len("</tool_call>")]
        calls, rest = [], _FUNCTION.sub("", body)
        if rest.strip():
            return None  # text in the block outside any function: not a call we understand
        for m in _FUNCTION.finditer(body):
            name = m.group(1).strip()
            if not name:
                return None
            props = (self.schemas.get(name) or {}).get("properties") or {}
            inner = m.group(2)
            if _PARAMETER.sub("", inner).strip():
                return None
            args = {}
            for p in _PARAMETER.finditer(inner):
                arg, value = p.group(1).strip(), p.group(2)
                if value.startswith("\n"):
                    value = value[1:]
                if value.endswith("\n"):
                    value = value[:-1]
                args[arg] = _convert(value, props.get(arg) if isinstance(props, dict) else None)
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False, allow_nan=False)))
        return calls or None


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (module docstring)."""

    name = "hermes"
    starts = {"<tool_call>": "</tool_call>"}

    def parse_block(self, block: str) -> list[ToolCall] | None:
        try:
            obj = json.loads(block[len("<tool_call>"):-len("</tool_call>")])
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        if not obj["name"]:
            return None
        return [ToolCall(obj["name"], json.dumps(args, ensure_ascii=False, allow_nan=False))]


TOOL_PARSERS: dict[str, type[ToolParser]] = {"step3p5": Step35ToolParser, "hermes": HermesToolParser}


def detect_tool_parser(chat_template: str | None) -> str | None:
    """``auto``: the parser whose format the chat template speaks (step3p5 for ``<function=``
    with ``<parameter=``, hermes for ``<tool_call>``), or None."""
    t = chat_template or ""
    if "<function=" in t and "<parameter=" in t:
        return "step3p5"
    if "<tool_call>" in t:
        return "hermes"
    return None


def make_tool_parser(name: str | None, tools: list[dict] | None) -> ToolParser | None:
    """A fresh parser of format ``name`` (None: no parsing). Raises ValueError for an unknown name."""
    if name is None:
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r} (known: {', '.join(TOOL_PARSERS)})")
    return TOOL_PARSERS[name](tools)


def parse_tool_calls(name: str, text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
    """Non-streaming: (content outside calls, calls) of a whole completion ``text``."""
    p = make_tool_parser(name, tools)
    a, calls = p.feed(text)
    b, more = p.finish()
    return a + b, calls + more


# --------------------------------------------------------------------------- forced calls
def _lark_rule_name(prefix: str, i: int, j: int | None = None) -> str:
    return f"{prefix}_{i}" if j is None else f"{prefix}_{i}_{j}"


def tool_call_grammar(fmt: str, tools: list[dict], name: str | None, literal) -> str:
    """A Lark grammar (llguidance's dialect) of exactly one call in format ``fmt`` to the tool
    ``name`` (None: any of ``tools``), its arguments valid under the tool's parameter schema:
    what ``tool_choice: "required"`` or a named function enforces.

    ``literal(text)`` returns the Lark expression of a markup tag (memra/engine/structured.py
    ``GrammarBackend.literal``: the quoted text, or the vocabulary's token for it too).
    step3p5 string parameters are one line without ``<`` (the grammar's approximation of "any
    text up to ``</parameter>``"), of ``minLength`` to ``maxLength`` characters; every other type is JSON of the parameter's schema; required
    parameters come first, in schema order, then the optional ones, each optional.

    Raises: ValueError for an unknown format or a tool name that is not in ``tools``.
    """
    from ..engine.structured import bounded_integers

    schemas = _tool_schemas(tools)
    names = [name] if name is not None else list(schemas)
    if not names or any(n not in schemas for n in names):
        raise ValueError(f"tool_call_grammar: {name!r} is not among the tools {list(schemas)}")
    try:
        return _tool_call_grammar(fmt, names, {n: bounded_integers(schemas[n]) for n in names}, literal)
    except (TypeError, AttributeError, IndexError, KeyError) as e:
        raise ValueError(f"tools: a parameters schema is not a JSON-schema object of properties ({e})") from None


def _tool_call_grammar(fmt: str, names: list[str], schemas: dict[str, dict], literal) -> str:
    if fmt == "hermes":
        alts = [{"type": "object", "properties": {"name": {"const": n}, "arguments": schemas[n] or {"type": "object"}},
                 "required": ["name", "arguments"], "additionalProperties": False} for n in names]
        schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
        return (f'start: {literal("<tool_call>")} "\\n" call "\\n" {literal("</tool_call>")}\n'
                f"call: %json {json.dumps(schema)}\n")
    if fmt != "step3p5":
        raise ValueError(f"tool_call_grammar: unknown format {fmt!r} (known: {', '.join(TOOL_PARSERS)})")
    rules = [f'start: {literal("<tool_call>")} "\\n" ({" | ".join(f"fn_{i}" for i in range(len(names)))}) '
             f'{literal("</tool_call>")}']
    for i, n in enumerate(names):
        sch = schemas[n] or {}
        props = sch.get("properties") or {}
        if not isinstance(props, dict):
            raise ValueError(f"tools: {n}.parameters.properties must be an object")
        bad = [a for a in props if not a or any(c in a for c in "<>\n")]
        if bad:
            raise ValueError(f"tools: parameter name {bad[0]!r} of {n!r} cannot be written in the step3p5 format")
        required = [a for a in sch.get("required") or [] if isinstance(a, str) and a in props]
        order = required + [a for a in props if a not in required]
        parts = []
        for j, arg in enumerate(order):
            ps = props[arg] if isinstance(props[arg], dict) else {}
            if "enum" in ps and (not isinstance(ps["enum"], list) or not ps["enum"]):
                raise ValueError(f"tools: the enum of {n}.{arg} must be a non-empty list")
            if _schema_types(ps) == {"string"} and "enum" in ps:
                value = " | ".join(json.dumps(str(e)) for e in ps["enum"])
            elif _schema_types(ps) == {"string"} or not _schema_types(ps):
                lo, hi = int(ps.get("minLength", 0)), ps.get("maxLength")
                reps = "*" if hi is None and lo == 0 else f"{{{lo},{'' if hi is None else int(hi)}}}"
                rules.append(f"{_lark_rule_name('V', i, j)}: /[^<\\n]{reps}/")
                value = _lark_rule_name("V", i, j)
            else:
                rules.append(f"{_lark_rule_name('v', i, j)}: %json {json.dumps(ps)}")
                value = _lark_rule_name("v", i, j)
            rules.append(f'{_lark_rule_name("p", i, j)}: {json.dumps(f"<parameter={arg}>" + chr(10))} ({value}) '
                         f'"\\n</parameter>\\n"')
            parts.append(_lark_rule_name("p", i, j) + ("" if arg in required else "?"))
        rules.append(f'fn_{i}: {json.dumps(f"<function={n}>" + chr(10))} {" ".join(parts)} "</function>\\n"')
    return "\n".join(rules) + "\n"
