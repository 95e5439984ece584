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
        control: the gloo group of rank 0's messages to the workers (start-up checks, each step's
            inputs, as pickled objects on the host): no short timeout, so that an idle server or a
            slow load on another rank is not mistaken for a dead rank (a dead peer still fails at
            once: its socket closes).
        device: where this rank's shard and KV cache live: the CPU (``group`` is gloo) or its CUDA
            device (``group`` is NCCL; on one node rank r uses ``cuda:r``, under torchrun
            ``cuda:$LOCAL_RANK``).
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
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
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
    def init(cls, rank: int, world: int, init_method: str, parts: int = DEFAULT_PARTS,
             expert_parallel: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
             device: torch.device | str = "cpu") -> ParallelContext:
        """Joins the default process group (the control messages, gloo) and creates the group of the
        model's collectives (gloo on the CPU, NCCL for a CUDA ``device``), and returns the context.
        On the CPU a world of 1 joins nothing (no collective runs); on a GPU it still builds a
        one-rank NCCL group, so that TP 1 runs the same code as TP N.

        ``init_method``: a torch.distributed URL (``tcp://host:port``, ``file:///path``, ``env://``
        under torchrun). Raises: ValueError as the constructor; RuntimeError from torch.distributed
        if the rendezvous fails within the timeout or NCCL is not available."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda": this process's current GPU
            device = torch.device("cuda", torch.cuda.current_device())
        ctx = cls(rank, world, parts, expert_parallel, None, timeout_s, None, device)
        if world > 1 or device.type == "cuda":
            if device.type == "cuda":
                if not dist.is_nccl_available():
                    raise RuntimeError("tensor parallel on CUDA needs NCCL, which this torch build lacks")
                torch.cuda.set_device(device)
            # the rendezvous and the control messages: no short timeout (workers start, import torch and
            # load on a busy machine); the model's collectives: their own group with ``timeout_s``
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(days=365))
            ctx.control = dist.group.WORLD
            ctx.group = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo",
                                       timeout=datetime.timedelta(seconds=timeout_s))
        return ctx

    @property
    def backend(self) -> str:
        """The backend of the model's collectives: ``"nccl"``, ``"gloo"`` or ``"none"`` (one CPU rank)."""
        return "none" if self.group is None else dist.get_backend(self.group)

    @property
    def owned_parts(self) -> range:
        """The canonical parts this rank owns (consecutive)."""
        return self._owned

    def all_reduce_exact(self, stacked: torch.Tensor) -> torch.Tensor:
        """Sum over ranks of ``stacked`` [P, ...] in which every slot p holds a non-zero value on one
        rank at most (the owner of part p) and zeros elsewhere: exact whatever the reduction order.
        In place; returned."""
        if self.group is not None:
            dist.all_reduce(stacked, group=self.group)
        return stacked

    def close(self) -> None:
        """Leaves the process group (no-op when none was joined)."""
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group()
