"""From sampled tokens to completion text: incremental detokenization and stop conditions.

Stop conditions, in the order checked after each token: a stop token id or (unless
``ignore_eos``) an end-of-generation id -> ``"stop"`` (the token is kept in
``token_ids`` but adds no text); a stop string appearing in the text -> ``"stop"``, the
text cut before it; ``max_tokens`` reached -> ``"length"``. Text that could still turn
out to be the start of a stop string is held back, so streamed text never contains
(part of) a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .detokenizer import IncrementalDetokenizer
from .sampling import SampleResult, SamplingParams

__all__ = ["CompletionOutput", "OutputProcessor"]


@dataclass
class CompletionOutput:
    """One completion: text, token ids, why it ended, and logprobs if asked for.

    ``logprobs``: one entry per generated token, ``(token, logprob, [(id, logprob), ...])``.
    ``stop_reason``: the stop string or token id that ended it, if any.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None


class OutputProcessor:
    """Accumulates one completion. ``add`` returns the text newly safe to show."""

    def __init__(self, index: int, tokenizer, params: SamplingParams, eos_ids: list[int], prompt_ids: list[int]):
        self.params = params
        self.out = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.buffer = ""
        self.guard = 0  # stop strings must end past buffer[:guard] (text from before min_tokens)

    @property
    def finished(self) -> bool:
        return self.out.finish_reason is not None

    def add(self, r: SampleResult) -> str:
        """Record sampled token ``r``; return newly released text ('' if none)."""
        assert not self.finished, "completion already finished"
        out = self.out
        out.token_ids.append(r.token)
        if out.logprobs is not None:
            out.logprobs.append((r.token, r.logprob, r.top or []))
        if r.token in self.stop_ids:
            return self._finish("stop", r.token)
        self.buffer += self.detok.add(r.token)
        if self.params.stop and len(out.token_ids) < self.params.min_tokens:
            # vLLM: only a stop string completed after min_tokens counts; buffer[:guard] is older
            self.guard = len(self.buffer)
        elif self.params.stop:
            # the earliest match ending past the guard; at equal positions the stop string listed first
            hit = min(((i, k) for k, s in enumerate(self.params.stop)
                       if (i := self.buffer.find(s, max(0, self.guard - len(s) + 1))) >= 0),
                      default=None)
            if hit is not None:
                released = self.buffer[: hit[0]]
                self.buffer = ""
                out.text += released
                out.finish_reason, out.stop_reason = "stop", self.params.stop[hit[1]]
                return released
        if len(out.token_ids) >= self.params.max_tokens:
            return self._finish("length", None)
        cut = len(self.buffer) - self.hold
        if cut <= 0:
            return ""
        released, self.buffer = self.buffer[:cut], self.buffer[cut:]
        self.guard = max(0, self.guard - cut)
        out.text += released
        return released

    def _finish(self, reason: str, stop_reason) -> str:
        released = self.buffer + self.detok.flush()
        self.buffer = ""
        self.out.text += released
        self.out.finish_reason, self.out.stop_reason = reason, stop_reason
        return released
