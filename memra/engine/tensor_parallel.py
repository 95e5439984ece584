"""Running a tensor/expert-parallel engine (the sharding itself is memra/parallel): rank 0 holds the scheduler, the block manager and the
server; ranks 1..N-1 are workers that mirror every model call on their shard.

- :func:`start` (rank 0): spawns the workers on this node (torch.multiprocessing, spawn) unless
  the process group comes from torchrun (``WORLD_SIZE`` / ``RANK`` in the environment: one
  process per rank, possibly on several nodes), joins the group, checks that every rank loaded
  the same model and configuration, shards rank 0's model and returns it wrapped in
  :class:`TensorParallelModel`.
- :class:`TensorParallelModel`: the model the engine sees on rank 0. Each forward / logits call
  is first broadcast to the workers (the step's token ids, positions and the sequences' block
  tables; the hidden rows for the LM head), then run on rank 0's shard; the collectives inside
  the parallel layers meet the workers' identical calls.
- :func:`worker_main` (ranks > 0): load, shard, allocate the paged KV cache rank 0 announces
  (its own KV heads), then serve the broadcast calls until "stop".

Devices: on the CPU the model's collectives run over gloo; with a CUDA device every rank moves
its shard and KV cache to its own GPU (rank r on ``cuda:r`` on one node, ``cuda:$LOCAL_RANK``
under torchrun) and the collectives run over NCCL, the same code (a GPU run builds the NCCL group
at TP 1 too). The control messages stay on gloo. A GPU shard holds its weights dense in the
compute dtype (cuBLAS GEMMs, the paged-attention kernels), sharded from the CPU-loaded model.

Faults: every collective has the context's timeout; a failed collective (a dead rank) raises
:class:`ParallelFailure` on the ranks still alive, which the server turns into errors for the
requests in flight and a non-zero exit. Workers are daemon processes of rank 0 and exit when
their collectives fail, so no rank outlives the run.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.group import DEFAULT_PARTS, ParallelContext, ParallelFailure
from ..parallel.shard import shard_model

__all__ = ["ParallelFailure", "TensorParallelModel", "start", "worker_main", "default_parts", "rank_device"]


def default_parts(world: int) -> int:
    """Canonical parts for a TP size: 4 when it divides 4 (TP 1, 2, 4 give the same bits), else world."""
    return DEFAULT_PARTS if DEFAULT_PARTS % world == 0 else world


def _fingerprint(model, spec: dict) -> str:
    """A digest of the configuration and of every parameter/buffer of the unsharded model: its
    name, shape, dtype and a strided sample of 64 values (plus the sum of all values)."""
    h = hashlib.sha256(repr(sorted(spec.items())).encode())
    h.update(repr(model.config).encode())
    for name, t in list(model.named_buffers()) + list(model.named_parameters()):
        if t is None:
            continue
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        if flat.numel() and flat.is_floating_point():
            h.update(flat[:: max(1, flat.numel() // 64)][:64].float().numpy().tobytes())
            h.update(repr(float(flat.double().sum())).encode())
        elif flat.numel():
            h.update(flat[:: max(1, flat.numel() // 64)][:64].numpy().tobytes())
    return h.hexdigest()


def _check_same(ctx: ParallelContext, digest: str) -> None:
    """All ranks' start-up results compared: a digest each, or ``"ERROR ..."`` from a rank that
    failed to load (its error text is raised here on every rank). Raises RuntimeError."""
    if ctx.world == 1:
        return
    got = [None] * ctx.world
    dist.all_gather_object(got, digest, group=ctx.control)
    errors = [(r, d) for r, d in enumerate(got) if d.startswith("ERROR ")]
    if errors:
        raise RuntimeError("tensor parallel start-up failed: " + "; ".join(f"rank {r}: {d[6:]}" for r, d in errors))
    bad = [r for r, d in enumerate(got) if d != got[0]]
    if bad:
        raise RuntimeError(f"tensor parallel start-up: ranks {bad} loaded a different model or configuration "
                           f"than rank 0 (fingerprints {[d[:12] for d in got]})")


def _send(ctx: ParallelContext, msg) -> None:
    if ctx.world == 1:
        return
    try:
        dist.broadcast_object_list([msg], src=0, group=ctx.control)
    except Exception as ex:  # noqa: BLE001 - any collective failure ends the run
        raise ParallelFailure(f"tensor parallel: a worker rank is gone ({type(ex).__name__}: {ex})") from ex


def _recv(ctx: ParallelContext):
    box = [None]
    dist.broadcast_object_list(box, src=0, group=ctx.control)
    return box[0]


class TensorParallelModel(nn.Module):
    """Rank 0's shard, with every call mirrored on the workers (module docstring).
    Attribute access falls through to the shard (config, dtype, layers, norm, ...)."""

    def __init__(self, shard, ctx: ParallelContext, procs: list):
        super().__init__()
        self.shard, self.ctx, self.procs = shard, ctx, procs
        self.closed = False
        self.broken: str | None = None  # set when a call failed half-way: the ranks are out of step
        self.rendezvous_dir: str | None = None

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.shard, name)

    def _check(self) -> None:
        if self.broken is not None:
            raise ParallelFailure(f"tensor parallel: the ranks are out of step since a call failed ({self.broken}); "
                                  f"start a new engine")
        if self.closed:
            raise ParallelFailure("tensor parallel: the engine was closed")

    def _guard(self, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except BaseException as ex:  # a failed or interrupted call leaves the workers inside its collectives
            self.broken = f"{type(ex).__name__}: {ex}"
            if isinstance(ex, RuntimeError) and not isinstance(ex, ParallelFailure):
                raise ParallelFailure(f"tensor parallel: a call failed ({ex})") from ex
            raise

    def forward(self, input_ids, positions, kv, *, prenorm: bool = False, both: bool = False):
        self._check()
        chunks = [(c.start, c.num_new, c.block_tables) for c in kv.chunks]
        _send(self.ctx, ("forward", input_ids.cpu(), positions.cpu(), chunks, prenorm, both))  # host copies: each
        # worker moves them to its own device
        return self._guard(self.shard, input_ids, positions, kv, prenorm=prenorm, both=both)

    def logits(self, hidden):
        self._check()
        _send(self.ctx, ("logits", hidden.cpu()))
        return self._guard(self.shard.logits, hidden)

    def announce_cache(self, groups, num_blocks: list[int], block_size: int, dtype: torch.dtype) -> None:
        """Tells the workers to allocate their paged KV cache (their own KV heads, same blocks)."""
        _send(self.ctx, ("cache", groups, num_blocks, block_size, dtype))

    def close(self) -> None:
        """Stops the workers and leaves the process group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        import atexit

        atexit.unregister(self.close)
        try:
            _send(self.ctx, ("stop",))
        except ParallelFailure:
            pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        self.ctx.close()
        if self.rendezvous_dir:
            import shutil

            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)


def rank_device(rank: int, world: int, device: torch.device | str) -> torch.device:
    """The device of ``rank``: the CPU for a CPU run; for CUDA, ``cuda:$LOCAL_RANK`` under torchrun,
    else ``cuda:rank``. Raises ValueError when this node has fewer GPUs than it needs."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.device("cpu")
    if device.index not in (None, 0):
        raise ValueError(f"tensor parallel on {device}: rank r runs on cuda:r; give device 'cuda'")
    local = int(os.environ.get("LOCAL_RANK", rank)) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else rank
    have = torch.cuda.device_count()
    if local >= have:
        need = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        raise ValueError(f"tensor parallel: rank {rank} needs cuda:{local} but this node has {have} GPU(s) "
                         f"({need} ranks on it need {need})")
    return torch.device("cuda", local)


def _load_cpu(model: str, dtype: torch.dtype):
    """The model of a key, GGUF path or HF directory on the CPU (a worker needs no tokenizer)."""
    from pathlib import Path

    from ..hub import resolve_model
    from ..models import load_model

    local = Path(model).expanduser()
    return load_model(local if local.is_dir() else resolve_model(str(model), progress=False), dtype)[0]


def worker_main(rank: int, world: int, init: str, model: str, dtype: torch.dtype, ep: bool, parts: int,
                timeout_s: float, threads: int | None = None, device: str = "cpu") -> None:
    """A worker rank: load + shard (then move to its GPU for a CUDA ``device``), check the
    fingerprint, then mirror rank 0's calls until "stop". Exits (non-zero through the raised
    error) when a collective fails."""
    from .block_manager import kv_groups
    from .kv_cache import PagedBatch, PagedKVCache, SeqChunk

    if threads:
        torch.set_num_threads(threads)
    dev = rank_device(rank, world, device)
    ctx = ParallelContext.init(rank, world, init, parts=parts, expert_parallel=ep, timeout_s=timeout_s, device=dev)
    try:
        spec = dict(dtype=str(dtype), ep=ep, parts=parts, world=world, device=dev.type)
        try:
            m = _load_cpu(model, dtype)
            digest = _fingerprint(m, spec)
            shard = shard_model(m, ctx).to(dev)
        except Exception as ex:  # told to every rank through the start-up check, then raised here too
            _check_same(ctx, f"ERROR {type(ex).__name__}: {ex}")
            raise
        _check_same(ctx, digest)
        cache = None
        with torch.inference_mode():
            while True:
                msg = _recv(ctx)
                if msg[0] == "stop":
                    break
                if msg[0] == "cache":  # rank 0's groups and blocks; this rank's own KV heads
                    _, groups0, nb, bs, dt = msg
                    groups = kv_groups(shard.config)
                    if [g.layers for g in groups] != [g.layers for g in groups0]:
                        raise RuntimeError(f"rank {rank}: KV-cache groups {[g.layers for g in groups]} differ from "
                                           f"rank 0's {[g.layers for g in groups0]}")
                    cache = PagedKVCache(groups, nb, bs, dt, device=dev)
                elif msg[0] == "forward":
                    _, ids, pos, chunks, prenorm, both = msg
                    kv = PagedBatch(cache, [SeqChunk(s, n, bt) for s, n, bt in chunks],
                                    use_kernels=dev.type == "cuda")  # as rank 0's ModelRunner
                    shard(ids.to(dev), pos.to(dev), kv, prenorm=prenorm, both=both)
                elif msg[0] == "logits":
                    shard.logits(msg[1].to(dev))
    finally:
        ctx.close()




def start(model, model_name: str, dtype: torch.dtype, world: int, ep: bool, timeout_s: float,
          threads: int | None = None, device: torch.device | str = "cpu") -> TensorParallelModel:
    """Rank 0 of a TP run over ``world`` ranks: spawn the workers (or join torchrun's group), shard
    ``model`` (loaded on the CPU from ``model_name``; moved to ``cuda:0`` after sharding for a
    CUDA ``device``, each worker to its own GPU), check every rank's fingerprint.

    Raises: ValueError for a model already on its GPU kernel path (shard the CPU-loaded model),
    too few GPUs, or a split that cuts a head / block (names the tensor); RuntimeError if the
    ranks disagree or the rendezvous fails within the timeout."""
    import torch.multiprocessing as mp

    parts = default_parts(world)
    dev = rank_device(0, world, device)
    for r in range(1, world if int(os.environ.get("WORLD_SIZE", "1")) == 1 else 1):
        rank_device(r, world, device)  # enough GPUs on this node before any worker starts
    procs = []
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: every rank is its own process already
        if int(os.environ["WORLD_SIZE"]) != world or int(os.environ.get("RANK", "0")) != 0:
            raise ValueError(f"torchrun: WORLD_SIZE={os.environ['WORLD_SIZE']} RANK={os.environ.get('RANK')} but "
                             f"--tensor-parallel-size {world}: rank 0 runs the engine; every rank runs the same memra command")
        init = "env://"
    else:
        init = f"file://{tempfile.mkdtemp(prefix='memra-tp-')}/rendezvous"
        ctx_mp = mp.get_context("spawn")
        for r in range(1, world):
            p = ctx_mp.Process(target=worker_main, args=(r, world, init, model_name, dtype, ep, parts, timeout_s,
                                                         threads, str(device)), daemon=True, name=f"memra-tp-rank{r}")
            p.start()
            procs.append(p)
    ctx = None
    try:
        ctx = ParallelContext.init(0, world, init, parts=parts, expert_parallel=ep, timeout_s=timeout_s, device=dev)
        spec = dict(dtype=str(dtype), ep=ep, parts=parts, world=world, device=dev.type)
        try:
            digest = _fingerprint(model, spec)  # the unsharded model: every weight sampled
            shard = shard_model(model, ctx).to(dev)
        except Exception as ex:
            _check_same(ctx, f"ERROR {type(ex).__name__}: {ex}")
            raise
        _check_same(ctx, digest)
    except BaseException:
        for p in procs:
            p.kill()
        if ctx is not None:
            ctx.close()
        if init.startswith("file://"):
            import shutil

            shutil.rmtree(os.path.dirname(init[len("file://"):]), ignore_errors=True)
        raise
    import atexit

    tp = TensorParallelModel(shard, ctx, procs)
    if init.startswith("file://"):
        tp.rendezvous_dir = os.path.dirname(init[len("file://"):])
    atexit.register(tp.close)  # an engine never closed still stops its workers at exit; close() unregisters
    return tp
