"""Decode steps on the GPU: the paged-KV view of a decode-only batch and CUDA graphs of the step.

A decode step (every scheduled sequence adds one token) has the same shapes from step to
step for a given batch size, so the whole model forward plus the LM head is captured once
per batch-size bucket in a CUDA graph and replayed: one launch per step instead of a few
hundred (at batch 1 the flagship's step is ~3.6 ms of HBM traffic; unfused launches would
cost more than that). The graph reads its inputs from static device buffers that each step
fills: token ids, positions, per KV-cache group a block table [B, max_blocks] (int32, -1 =
released) and slot mapping, and the context lengths. A batch is padded up to its bucket
with rows of context length 0 (the attention kernel writes zeros for them and reads
nothing) whose K/V go to a scratch block that the block manager never hands out.

Mixed steps (prefill chunks) run eagerly through :class:`~memra.engine.kv_cache.PagedBatch`.
Same idea as vLLM's / SGLang's CUDA-graph runners (ideas only).
"""

from __future__ import annotations

import functools
import time

import torch

from .kv_cache import PagedKVCache

__all__ = ["DecodeKV", "CudaGraphRunner", "default_buckets"]


class DecodeKV:
    """The ``kv`` a model receives for a decode-only step on the GPU (and for the MTP proposer's padded
    rows, which also run on the CPU: there through the kernels' torch twins).

    Args:
        cache: paged storage on the GPU (each group with one scratch block past those the
            block manager owns).
        tables: per group, block tables int32 [B, max_blocks] (-1 = released).
        seq_lens: int32 [B], tokens in the cache per row after this step's write (0 = padding row).
        slots: per group, int64 [B], where this step's K/V row goes.
    """

    fuses_gate = True  # attend() takes the head gate (applied in the attention kernel's epilogue)

    def __init__(self, cache: PagedKVCache, tables: list[torch.Tensor], seq_lens: torch.Tensor,
                 slots: list[torch.Tensor]):
        self.cache, self.tables, self.seq_lens, self.slots = cache, tables, seq_lens, slots
        self._cu = None  # batch-invariant mode: one query per row (attend)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
               scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
        """Write k, v [B, KV, D] to their slots, then attend q [B, H, D] -> [B, H, D] over the pages
        (memra/kernels/attention_decode.py; ``gate`` [B, H]: output times sigmoid(gate)). On the CPU
        the kernels' torch twins run instead (the MTP proposer's padded rows are tested there).

        In batch-invariant mode (memra/kernels/batch_invariant.py) the GPU runs the paged prefill
        kernel instead, each row a sequence of one query, with tiles aligned (``aligned``), as a
        mixed prefill + decode step runs its decode rows: so a token's attention is the same bits
        whether its step holds prefill chunks, other sequences, or its own drafts (a verify step)
        or not. Padding rows (context 0, anywhere: the MTP drafting graphs pad before the real
        rows) get zeros."""
        from ..kernels import attention_decode, fused
        from ..kernels.batch_invariant import batch_invariant

        cache = self.cache
        gi = cache.layer_group[layer]
        kc, vc = cache.k[layer], cache.v[layer]
        cpu = q.device.type == "cpu"
        (fused.kv_write_ref if cpu else fused.kv_write)(k, v, kc, vc, self.slots[gi])
        if not cpu and batch_invariant():
            from ..kernels.attention_prefill import paged_prefill_attention

            b = self.seq_lens.shape[0]
            if q.shape[0] != b:
                raise ValueError(f"DecodeKV.attend: q has {q.shape[0]} rows, the step {b} (seq_lens)")
            if self._cu is None:  # once per step (the layers share it)
                self._cu = torch.arange(b + 1, dtype=torch.int32, device=q.device)
            return paged_prefill_attention(q, kc, vc, self.tables[gi], self._cu, self.seq_lens, window, scale,
                                           gate=gate, max_q_len=1, aligned=True)
        attend = attention_decode.paged_decode_attention_ref if cpu else attention_decode.paged_decode_attention
        return attend(q, kc, vc, self.tables[gi], self.seq_lens, window, scale, gate=gate)


MAX_GRAPH_BATCH = 64  # the decode kernels' widest input (memra/layers/linear.py gpu_linear, moe_decode)


def default_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every 8 up to ``max_batch`` (as vLLM), at most
    :data:`MAX_GRAPH_BATCH`: wider decode steps run eagerly (wider inputs leave the decode
    kernels for the prefill path, which is not graph-safe)."""
    max_batch = min(max_batch, MAX_GRAPH_BATCH)
    out = [b for b in (1, 2, 4) if b < max_batch]
    b = 8
    while b < max_batch:
        out.append(b)
        b += 8
    out.append(max_batch)
    return sorted(set(out))


class CudaGraphRunner:
    """Captures ``logits(model(ids, positions, DecodeKV))`` per batch-size bucket and replays it.

    Args:
        model: a model moved to the GPU (:meth:`~memra.models.base.CausalLM.to_gpu`).
        cache: its :class:`PagedKVCache` on the same device; ``scratch_blocks[g]`` is the
            index of group g's scratch block.
        max_batch: largest decode batch (the engine's ``max_num_seqs``).
        max_blocks: block-table width (ceil(max_model_len / block_size)).
        scratch_blocks: per group, a block the block manager never allocates.
        buckets: batch sizes to capture (default :func:`default_buckets`).
    """

    def __init__(self, model, cache: PagedKVCache, max_batch: int, max_blocks: int, scratch_blocks: list[int],
                 buckets: list[int] | None = None):
        self.model, self.cache = model, cache
        dev = cache.k[cache.groups[0].layers[0]].device
        self.device, self.block_size = dev, cache.block_size
        self.buckets = sorted(buckets) if buckets else default_buckets(max_batch)
        if self.buckets[-1] > MAX_GRAPH_BATCH:
            raise ValueError(f"CUDA graph batch sizes {self.buckets} exceed {MAX_GRAPH_BATCH}")
        self.max_batch = self.buckets[-1]
        n = self.max_batch
        self.scratch = [b * cache.block_size for b in scratch_blocks]
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.tables = [torch.full((n, max_blocks), -1, dtype=torch.int32, device=dev) for _ in cache.groups]
        self.slots = [torch.full((n,), s, dtype=torch.int64, device=dev) for s in self.scratch]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.prenorm: dict[int, torch.Tensor] = {}  # the step's pre-final-norm hidden rows (MTP drafting)
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        self.precompile = None  # the memra.kernels.precompile report of capture()

    def _kv(self, b: int) -> DecodeKV:
        return DecodeKV(self.cache, [t[:b] for t in self.tables], self.seq_lens[:b], [s[:b] for s in self.slots])

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        y, x = self.model(self.ids[:b], self.pos[:b], self._kv(b), both=True)
        return self.model.logits(y), x

    @torch.inference_mode()
    def capture(self, manifest: str | None = None) -> None:
        """Warm up (compiles the Triton kernels) and capture every bucket, largest first, in
        one shared memory pool. Inputs are padding rows (context 0) while capturing. ``manifest``:
        the key of the kernel precompile's manifest (:func:`memra.kernels.precompile.precompile`;
        the buckets are added to it), None for none.

        The first bucket runs twice before its capture (lazy state of any kind settles: library
        handles and workspaces, kernel loads, allocator pools); each later one once (its own kernel
        specializations load): a warm start spends most of this phase in the forwards' Python."""
        t0 = time.perf_counter()
        from ..kernels.precompile import precompile

        # every bucket's kernels compiled in parallel first (the warm-up below then finds them)
        self.precompile = precompile([functools.partial(self._forward, b) for b in reversed(self.buckets)],
                                     self.device, manifest=manifest and f"{manifest}|buckets {self.buckets}")
        before = torch.cuda.memory_reserved(self.device)
        pool = None
        for b in reversed(self.buckets):
            for _ in range(2 if pool is None else 1):
                self._forward(b)
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out, pre = self._forward(b)
            pool = g.pool()
            self.graphs[b], self.outputs[b], self.prenorm[b] = g, out, pre
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - before

    def bucket(self, n: int) -> int:
        """Smallest captured batch size >= n. Raises ValueError if n exceeds the largest."""
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"decode batch of {n} rows exceeds the largest captured batch ({self.max_batch})")

    def prepare(self, ids: list[int], positions: list[int], block_tables: list[list[list[int]]]) -> int:
        """Fill the static inputs for one decode step (row r adds token ``ids[r]`` at
        ``positions[r]`` with per-group block tables ``block_tables[r][g]``), padded to the bucket;
        returns the bucket. One host tensor and one copy per input.

        Raises: ValueError for mismatched lengths, an empty or too large batch, a block table
        wider than the captured width, or a position without a KV block."""
        n = len(ids)
        if n == 0 or len(positions) != n or len(block_tables) != n:
            raise ValueError(f"CudaGraphRunner: {n} ids, {len(positions)} positions and {len(block_tables)} "
                             f"block tables; expected the same number >= 1")
        b = self.bucket(n)
        bs = self.block_size
        pad = b - n
        self.ids[:b].copy_(torch.tensor(ids + [0] * pad, dtype=torch.int64), non_blocking=True)
        self.pos[:b].copy_(torch.tensor(positions + [0] * pad, dtype=torch.int64), non_blocking=True)
        self.seq_lens[:b].copy_(torch.tensor([p + 1 for p in positions] + [0] * pad, dtype=torch.int32),
                                non_blocking=True)
        width = self.tables[0].shape[1]
        for g in range(len(self.tables)):
            rows, slots = [], []
            for r in range(n):
                t = block_tables[r][g]
                if len(t) > width:
                    raise ValueError(f"block table of {len(t)} blocks exceeds the captured width {width}")
                p = positions[r]
                blk = t[p // bs] if p // bs < len(t) else -1
                if blk < 0:
                    raise ValueError(f"row {r}: position {p} has no KV block in group {g} (block table {t})")
                rows.append(t + [-1] * (width - len(t)))
                slots.append(blk * bs + p % bs)
            rows += [[-1] * width] * pad
            self.tables[g][:b].copy_(torch.tensor(rows, dtype=torch.int32), non_blocking=True)
            self.slots[g][:b].copy_(torch.tensor(slots + [self.scratch[g]] * pad, dtype=torch.int64),
                                    non_blocking=True)
        return b

    def run(self, ids: list[int], positions: list[int], block_tables: list[list[list[int]]]) -> torch.Tensor:
        """One decode step (inputs as :meth:`prepare`). Returns the fp32 logits [len(ids), vocab]
        (a view of the graph's output buffer, valid until the next call); :meth:`hidden` then
        gives the step's pre-norm hidden rows.

        Several rows may belong to one sequence (a speculative verify step: its last token and
        its drafts at consecutive positions, each row with the sequence's block table): every
        row's K/V are written before any row attends, and row r sees positions <= positions[r],
        so each draft sees exactly the prefix and the drafts before it."""
        b = self.prepare(ids, positions, block_tables)
        self.graphs[b].replay()
        self._last = (b, len(ids))
        return self.outputs[b][:len(ids)]

    def hidden(self) -> torch.Tensor:
        """Pre-final-norm hidden rows [n, hidden] of the last :meth:`run` (valid until the next call)."""
        b, n = self._last
        return self.prenorm[b][:n]
