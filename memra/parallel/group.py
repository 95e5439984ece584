"""The process group of a parallel run and the collectives the parallel layers use."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["ParallelContext", "ParallelFailure", "DEFAULT_PARTS", "DEFAULT_TIMEOUT_S"]

DEFAULT_PARTS = 4  # canonical parts per sharded dimension: TP 1, 2 and 4 compute the same bits
DEFAULT_TIMEOUT_S = 120.0


class ParallelFailure(RuntimeError):
    """A collective failed (a rank died or timed out): the parallel run cannot continue."""


@dataclass
class ParallelContext:
    """Rank ``rank`` of ``world`` tensor-parallel ranks (expert parallel too with ``expert_parallel``).

    Attributes:
        rank, world: this process's rank and the TP size.
        parts: canonical parts per sharded dimension (a multiple of ``world``; module docstring of
            :mod:`memra.parallel`).
        expert_parallel: routed experts split by expert (EP) instead of along their intermediate
            dimension.
        group: the torch.distributed process group of the model's collectives (None when
            ``world == 1``: no collectives); its timeout is ``timeout_s``.
        control: a second gloo group for rank 0's messages to the workers (start-up checks, each
            step's inputs): no short timeout, so that an idle server or a slow load on another rank
            is not mistaken for a dead rank (a dead peer still fails at once: its socket closes).
        timeout_s: collective timeout (a rank that dies makes the others fail after this many
            seconds instead of hanging).

    Raises: ValueError if ``parts`` is not a positive multiple of ``world`` or rank is out of range.
    """

    rank: int = 0
    world: int = 1
    parts: int = DEFAULT_PARTS
    expert_parallel: bool = False
    group: object = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    control: object = None
    _owned: range = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"ParallelContext: rank {self.rank} of world {self.world} is out of range")
        if self.parts < 1 or self.parts % self.world:
            raise ValueError(f"ParallelContext: {self.parts} canonical parts cannot be shared evenly by "
                             f"{self.world} ranks (parts must be a multiple of the tensor-parallel size)")
        per = self.parts // self.world
        self._owned = range(self.rank * per, (self.rank + 1) * per)

    @classmethod
    def init(cls, rank: int, world: int, init_method: str, backend: str = "gloo", parts: int = DEFAULT_PARTS,
             expert_parallel: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelContext:
        """Joins (or, for world 1, skips) the default process group and returns the context.
        ``init_method``: a torch.distributed URL (``tcp://host:port``, ``file:///path``, ``env://``
        under torchrun). Raises: ValueError as the constructor; RuntimeError from torch.distributed
        if the rendezvous fails within the timeout."""
        ctx = cls(rank, world, parts, expert_parallel, None, timeout_s)
        if world > 1:
            # the rendezvous and the control messages: no short timeout (workers start, import torch and
            # load on a busy machine); the model's collectives: their own group with ``timeout_s``
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(days=365))
            ctx.control = dist.group.WORLD
            ctx.group = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        return ctx

    @property
    def owned_parts(self) -> range:
        """The canonical parts this rank owns (consecutive)."""
        return self._owned

    def all_reduce_exact(self, stacked: torch.Tensor) -> torch.Tensor:
        """Sum over ranks of ``stacked`` [P, ...] in which every slot p holds a non-zero value on one
        rank at most (the owner of part p) and zeros elsewhere: exact whatever the reduction order.
        In place; returned."""
        if self.world > 1:
            dist.all_reduce(stacked, group=self.group)
        return stacked

    def close(self) -> None:
        """Leaves the process group (no-op for world 1)."""
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
