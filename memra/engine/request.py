"""A request inside the engine, its states, and what the engine reports back per step.

Lifecycle (vLLM v1 / nano-vllm style)::

    WAITING --schedule--> RUNNING --finish--> FINISHED_STOPPED | FINISHED_LENGTH
       ^                     |
       +-----preempt---------+          any state --abort--> FINISHED_ABORTED

A preempted request loses its KV blocks and goes back to the front of the waiting
queue; when it is scheduled again its prompt *and* the tokens generated so far are
prefilled again (preemption by recompute), and sampling resumes where it stopped.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .output import CompletionOutput, OutputProcessor
from .sampling import Sampler, SamplingParams

__all__ = ["RequestStatus", "Request", "CompletionDelta", "RequestEvent"]


class RequestStatus(enum.Enum):
    """Where a request is in its lifecycle (see the module docstring); the value is the finish reason."""
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        """Whether the request has ended (stopped, hit its length limit or was aborted)."""
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class CompletionDelta:
    """What one completion produced in one engine step.

    Attributes:
        index: which of the request's ``n`` completions (0-based).
        text: text newly released this step (stop strings held back / cut, see output.py).
        token_ids: tokens sampled this step (usually one).
        logprobs: per new token ``(token, logprob, [(id, logprob), ...top-n])`` when the
            request asked for logprobs, else None.
        finish_reason: None while running; ``"stop"``, ``"length"`` or ``"abort"`` at the end.
        stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestEvent:
    """One message from the engine to a request's consumer (one per step with news).

    Attributes:
        request_id: the id given to ``add_request``.
        prompt_token_ids: the prompt.
        prompt_logprobs: only on the first event of a request that asked for them: one
            entry per prompt token, None for the first, else ``(logprob, [(id, logprob)...])``.
        deltas: new output per completion this step.
        finished: True on the last event (every completion finished or aborted).
        num_cached_tokens: prompt tokens served from the prefix cache (for ``usage``).
    """

    request_id: str
    prompt_token_ids: list[int]
    deltas: list[CompletionDelta] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0


class Request:
    """One sequence being generated (a request with ``n > 1`` is run as ``n`` of these).

    Attributes:
        request_id: the engine-wide id (``"<user id>"`` or ``"<user id>#<j>"`` for fan-out).
        prompt_ids: the prompt's token ids.
        status: :class:`RequestStatus`.
        num_computed_tokens: tokens (prompt then output) whose K/V are in the cache.
        num_cached_tokens: prompt tokens found in the prefix cache at first schedule.
        block_tables: one list of block ids per KV-cache group (see kv_cache.py); -1 marks
            a block freed because it fell out of a sliding window.
        spec_tokens: drafts for the next step (memra/engine/speculative.py); never part of
            ``all_token_ids`` until verified.
    """

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sampler: Sampler,
                 processor: OutputProcessor, index: int = 0, prompt_logprobs: int | None = None,
                 arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.sampler = sampler
        self.processor = processor
        self.index = index
        self.prompt_logprobs = prompt_logprobs
        self.collected_prompt_logprobs: list | None = [None] if prompt_logprobs is not None else None
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_tables: list[list[int]] = []
        self.block_hashes: list[bytes] = []
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.num_preemptions = 0
        self.parent_id = request_id
        self.leader: Request | None = None  # for sequences 1..n-1 of a request: sequence 0
        self.spec_tokens: list[int] = []  # draft tokens to verify in the next step (speculative.py)

    @property
    def output_ids(self) -> list[int]:
        """Tokens generated so far."""
        return self.processor.out.token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then generated tokens: what the KV cache must eventually hold."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_ids) + len(self.processor.out.token_ids)

    @property
    def output(self) -> CompletionOutput:
        """The completion accumulated so far."""
        return self.processor.out

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={len(self.prompt_ids)}, "
                f"out={len(self.output_ids)}, computed={self.num_computed_tokens})")
