"""Reasoning content: ``<think>...</think>`` split from the answer, streaming-first.

``--reasoning-parser step3p5`` (Step-3.5/3.7 and the other ``<think>`` models): the text of a
reasoning block goes to ``reasoning_content``, the rest to ``content``.

- The block starts with ``<think>`` at the start of the completion (leading whitespace allowed),
  or is already open when the chat template seeded ``<think>`` at the end of the prompt
  (``seeded=True``: the model's output starts inside the block and holds no ``<think>``).
- It ends at ``</think>``; one newline right after it belongs to the markup.
- A tool call (``<tool_call>`` or ``<function=``) before ``</think>`` ends the block too: the
  call and what follows are content, so the tool-call parser sees them (models that call a
  tool without closing their reasoning would otherwise lose the call).
- Only the completion is parsed: ``</think>`` of earlier turns inside the prompt is never seen.
- A block still open at the end is all reasoning.

Deltas of any size: text that may be the start of a tag is held back until it is decided.
"""

from __future__ import annotations

from .tool_parsers import _held_suffix

__all__ = ["REASONING_PARSERS", "ReasoningParser", "detect_reasoning_parser", "prompt_opens_reasoning"]

_CALL_STARTS = ("<tool_call>", "<function=")


class ReasoningParser:
    """Splits completion text into (reasoning, content) as it streams (module docstring)."""

    name = "step3p5"
    start, end = "<think>", "</think>"

    def __init__(self, seeded: bool = False):
        self.state = "reasoning" if seeded else "start"  # start -> reasoning -> content
        self.buf = ""
        self.ws = ""  # leading whitespace held while the start is undecided
        self.eat_newline = False

    def feed(self, text: str) -> tuple[str, str]:
        """Add completion text; returns (reasoning, content) that are certain."""
        self.buf += text
        reasoning, content = [], []
        while self.buf:
            if self.state == "start":
                lead = self.buf.lstrip()
                self.ws += self.buf[:len(self.buf) - len(lead)]  # each character looked at once
                self.buf = lead
                if not lead:
                    break  # only whitespace so far: undecided
                if lead.startswith(self.start):
                    self.buf, self.state, self.ws = lead[len(self.start):], "reasoning", ""
                    continue
                if self.start.startswith(lead):
                    break  # a partial "<think>"
                self.buf, self.state, self.ws = self.ws + lead, "content", ""
                continue
            if self.state == "reasoning":
                stops = [(self.buf.find(t), t) for t in (self.end, *_CALL_STARTS) if t in self.buf]
                if not stops:
                    keep = _held_suffix(self.buf, (self.end, *_CALL_STARTS))
                    reasoning.append(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                i, tag = min(stops)
                reasoning.append(self.buf[:i])
                self.state = "content"
                if tag == self.end:
                    self.buf, self.eat_newline = self.buf[i + len(tag):], True
                else:
                    self.buf = self.buf[i:]
                continue
            if self.eat_newline:
                self.eat_newline = False
                if self.buf.startswith("\n"):
                    self.buf = self.buf[1:]
                    continue
            content.append(self.buf)
            self.buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """End of the completion: held text goes where its state says."""
        rest, self.buf = self.ws + self.buf, ""
        self.ws = ""
        if self.state == "reasoning":
            return rest, ""
        if self.state == "start":
            return "", rest
        return "", rest


REASONING_PARSERS = {"step3p5": ReasoningParser}


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """``auto``: step3p5 when the chat template speaks ``<think>`` and ``</think>``, else None."""
    t = chat_template or ""
    return "step3p5" if "<think>" in t and "</think>" in t else None


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt ends inside an open ``<think>`` (a template-seeded block)."""
    i = prompt.rfind("<think>")
    return i >= 0 and "</think>" not in prompt[i:]
