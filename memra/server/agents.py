"""The chat output pipeline of one choice: reasoning split, then tool calls, as OpenAI fields.

Completion text goes through the reasoning parser (memra/server/reasoning.py) when the server
has one, its content part through the request's tool-call parser (memra/server/tool_parsers.py)
when the request offers tools; what comes out is OpenAI's ``reasoning_content``, ``content``
and ``tool_calls``, as stream deltas (:meth:`ChatOutput.feed`) or as one message
(:meth:`ChatOutput.message`). Streaming and non-streaming run the same code, so they give the
same calls.
"""

from __future__ import annotations

from typing import Any

from .reasoning import REASONING_PARSERS
from .tool_parsers import ToolCall, make_tool_parser

__all__ = ["ChatOutput"]


class ChatOutput:
    """Args:
        tool_parser: format name (``step3p5``, ``hermes``) or None (no tool-call parsing).
        tools: the request's tools (for parameter types).
        reasoning_parser: ``step3p5`` or None.
        seeded: the prompt ends inside an open ``<think>`` (the template seeded it).
    """

    def __init__(self, tool_parser: str | None, tools: list[dict] | None, reasoning_parser: str | None,
                 seeded: bool = False):
        self.tools = make_tool_parser(tool_parser, tools)
        self.reasoning = REASONING_PARSERS[reasoning_parser](seeded) if reasoning_parser else None
        self.content: list[str] = []
        self.reasoning_text: list[str] = []
        self.calls: list[ToolCall] = []

    def _route(self, reasoning: str, content: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if reasoning:
            self.reasoning_text.append(reasoning)
            deltas.append({"reasoning_content": reasoning})
        if content:
            self.content.append(content)
            deltas.append({"content": content})
        if calls:
            first = len(self.calls)
            self.calls += calls
            deltas.append({"tool_calls": [c.openai(first + i) for i, c in enumerate(calls)]})
        return deltas

    def _tools(self, content: str, final: bool) -> tuple[str, list[ToolCall]]:
        if self.tools is None:
            return content, []
        c, calls = self.tools.feed(content)
        if final:
            c2, more = self.tools.finish()
            c, calls = c + c2, calls + more
        return c, calls

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Completion text -> the OpenAI deltas that are certain now (possibly none)."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._route(reasoning, *self._tools(content, False))

    def finish(self) -> list[dict[str, Any]]:
        """End of the choice: flush what is held."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self._route(reasoning, *self._tools(content, True))

    def message(self) -> dict[str, Any]:
        """The whole choice as ``ChatResponseMessage`` fields (after :meth:`finish`)."""
        content = "".join(self.content)
        out: dict[str, Any] = {"content": content if content or not self.calls else None}
        if self.reasoning is not None:
            out["reasoning_content"] = "".join(self.reasoning_text) or None
        if self.calls:
            out["tool_calls"] = [c.openai() for c in self.calls]
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: ``tool_calls`` when the choice ended normally after making calls."""
        return "tool_calls" if self.calls and reason == "stop" else reason
