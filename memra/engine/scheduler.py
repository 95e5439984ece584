"""Continuous-batching scheduler with chunked prefill, prefix caching and preemption.

Each engine step the scheduler picks, under a token budget (``max_num_batched_tokens``)
and a sequence limit (``max_num_seqs``), what the model computes:

1. one token for every running request that is decoding (decodes go first, so a long
   prompt never stalls them), plus its draft tokens when it speculates (memra/engine/speculative.py);
2. the next prefill chunk of every running request still prefilling;
3. new (or preempted) requests from the waiting queue, first come first served, each
   starting at its longest cached prefix, prefilled in chunks of what budget is left.
   The extra sequences of a request with ``n > 1`` are admitted once the first one has
   prefilled the prompt, so the prompt is computed once and shared through the prefix cache.

When a group's block pool runs dry, the most recently admitted running request that is
not yet in this step is preempted: its blocks are released, it goes back to the front
of the waiting queue, and it will be recomputed (prompt + tokens generated so far) when
scheduled again (vLLM's recompute preemption). Sampling state stays with the request, so
its output continues exactly where it stopped. No waiting request is admitted in a step
that preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_manager import KVCacheManager
from .request import Request, RequestStatus

__all__ = ["Scheduler", "ScheduledBatch"]


@dataclass
class ScheduledBatch:
    """What one step computes: ``(request, new tokens)`` pairs, decodes first, and who was preempted."""

    items: list[tuple[Request, int]]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        """Tokens computed by the step."""
        return sum(n for _, n in self.items)


class Scheduler:
    """Holds the waiting queue and the running list, and decides each step.

    Args:
        kv: the block manager.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: most tokens computed per step (prefill chunk size bound).
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} and max_num_batched_tokens={max_num_batched_tokens} "
                             "must be >= 1")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        """Queue a new request at the back of the waiting queue."""
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take ``req`` out of the queues and release its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status

    def _preempt(self, scheduled: set[int]) -> Request | None:
        """Preempt the last running request not scheduled this step; None if there is none."""
        for j in range(len(self.running) - 1, -1, -1):
            victim = self.running[j]
            if id(victim) not in scheduled:
                del self.running[j]
                self.kv.free(victim)
                victim.status = RequestStatus.PREEMPTED
                victim.spec_tokens = []
                victim.num_preemptions += 1
                self.waiting.appendleft(victim)
                self.num_preemptions += 1
                return victim
        return None

    def schedule(self) -> ScheduledBatch:
        """Decide the next step (see the module docstring); allocates the blocks it needs."""
        budget = self.max_num_batched_tokens
        items: list[tuple[Request, int]] = []
        scheduled: set[int] = set()
        preempted: list[Request] = []
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decoding + prefilling:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.spec_tokens:  # a decode with drafts: its last token and the drafts the budget allows
                req.spec_tokens = req.spec_tokens[:budget - 1]
                n = 1 + len(req.spec_tokens)
            while not self.kv.allocate(req, n):
                victim = self._preempt(scheduled)
                if victim is None:
                    break
                preempted.append(victim)
                if victim is req:
                    break
            else:
                items.append((req, n))
                scheduled.add(id(req))
                budget -= n
        # admit waiting requests in order (none in a step that had to preempt); the n-1 siblings of a
        # request with n > 1 wait until the first has prefilled the prompt, then reuse its blocks
        for req in list(self.waiting):
            if preempted or budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            lead = req.leader
            if (lead is not None and req.num_preemptions == 0 and not lead.status.finished
                    and lead.num_computed_tokens < len(lead.prompt_ids)):
                continue
            first = req.num_computed_tokens == 0 and req.num_preemptions == 0
            prefix = self.kv.find_prefix(req)
            start = prefix[0]
            n = min(req.num_tokens - start, budget)
            if not self.kv.allocate(req, n, prefix):
                break
            if first:
                req.num_cached_tokens = start
                if lead is None:  # one lookup per user request
                    self.kv.record_lookup(len(req.prompt_ids), start)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            items.append((req, n))
            scheduled.add(id(req))
            budget -= n
        for req in list(self.running):  # drafts of a decode that got no room this step are dropped
            if req.spec_tokens and id(req) not in scheduled:
                req.spec_tokens = []
        # decodes first in the batch (the model runner relies on nothing else)
        items.sort(key=lambda it: it[1] != 1)
        return ScheduledBatch(items, preempted)
