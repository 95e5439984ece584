"""KV-cache storage and the attention step over it.

The model never touches cache layout: each attention layer calls
``kv.attend(layer, q, k, v, window, scale)`` (the attention-backend interface,
memra/layers/attention.py ``AttentionBackend``), which writes the step's keys/values and
attends over everything the queries may see. Two implementations here (the CUDA-graph decode
view is memra/engine/cuda_graph.py ``DecodeKV``):

- :class:`ContiguousKVCache`: one sequence, contiguous per layer (tests, single-prompt tools);
- :class:`PagedKVCache` + :class:`PagedBatch`: the serving engine's paged cache. A
  ``PagedBatch`` describes one engine step (several sequences' prefill chunks and
  decode tokens concatenated) and is what the model receives as ``kv``. Block tables
  and slot mapping come from block_manager.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..kernels import cpu_native
from ..layers.attention import attention, decode_attention, visibility_mask
from .block_manager import NULL_BLOCK, KVGroupSpec

__all__ = ["ContiguousKVCache", "ContextOverflowError", "PagedKVCache", "PagedBatch", "SeqChunk", "kv_storage_dtype"]


def kv_storage_dtype(compute_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The KV cache's storage dtype for a model computing in ``compute_dtype`` on ``device``: float32
    on the CPU whatever the compute dtype (the CPU decode attention,
    memra/layers/attention.py ``decode_attention``, computes in fp32: a bf16 cache would be cast
    back every step, which costs more than the attention itself), the compute dtype elsewhere."""
    return torch.float32 if torch.device(device).type == "cpu" else compute_dtype


class ContextOverflowError(ValueError):
    """More tokens than the cache was sized for."""


class ContiguousKVCache:
    """Per-layer K and V buffers [max_len, num_kv_heads, head_dim] for one sequence.

    Args:
        config: model config (per-layer KV geometry).
        max_len: capacity in tokens.
        dtype, device: storage of the cache.
    Attributes:
        length: number of tokens whose K/V are committed.
    """

    fuses_gate = False  # the attention layer applies a head gate itself

    def __init__(self, config: ModelConfig, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.max_len = max_len
        self.k = [torch.empty(max_len, lc.num_kv_heads, lc.head_dim, dtype=dtype, device=device) for lc in config.layers]
        self.v = [torch.empty_like(k) for k in self.k]
        self.positions = torch.arange(max_len, device=device)
        self.length = 0
        self._pointers: cpu_native.KVPointers | None = None  # native_decode's, built once

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
               scale: float) -> torch.Tensor:
        """Store this step's k, v [T, KV, D] after the committed tokens; attend q [T, H, D].

        Raises:
            ContextOverflowError: the step would exceed ``max_len``.
        """
        start, t = self.length, q.shape[0]
        end = start + t
        if end > self.max_len:
            raise ContextOverflowError(f"sequence of {end} tokens exceeds the KV cache capacity of {self.max_len}")
        lo = 0 if window is None else max(0, start - window + 1)
        if t == 1 and q.device.type == "cpu" and self.k[layer].dtype == torch.float32 and cpu_native.enabled():
            # the write and the attention over lo..end (every key visible to the one query) in one call
            return cpu_native.decode_attention(q, self.k[layer], self.v[layer], scale, start=lo, length=end - lo,
                                               k_new=k, v_new=v, write_pos=start)
        self.k[layer][start:end] = k
        self.v[layer][start:end] = v
        if t == 1 and q.device.type == "cpu":  # every key in lo..end is visible to the one query
            return decode_attention(q, self.k[layer][None, lo:end], self.v[layer][None, lo:end], None, scale)
        return attention(q, self.k[layer][lo:end], self.v[layer][lo:end], self.positions[start:end],
                         self.positions[lo:end], window, scale)

    def native_decode(self, t: int) -> cpu_native.NativeKV | None:
        """The addressing of a one-token step of full-attention layers for the fused native decode
        step (memra/kernels/cpu_native.py ``DecoderLayers``), the next token written after the
        committed ones; None where that path does not apply (t != 1, storage not fp32 on the host).

        Raises:
            ContextOverflowError: the step would exceed ``max_len``.
        """
        if t != 1 or self.k[0].dtype != torch.float32 or not self.k[0].is_cpu:
            return None
        if self.length + 1 > self.max_len:
            raise ContextOverflowError(f"sequence of {self.length + 1} tokens exceeds the KV cache capacity of "
                                       f"{self.max_len}")
        if self._pointers is None:
            self._pointers = cpu_native.KVPointers(self.k, self.v)
        return cpu_native.NativeKV(self._pointers, L=self.length + 1, write_pos=self.length)

    def advance(self, t: int) -> None:
        """Commit the ``t`` tokens written by the last model step."""
        self.length += t

    def truncate(self, length: int) -> None:
        """Forget every token at position >= ``length`` (rejected draft tokens, retries)."""
        self.length = min(self.length, length)


class PagedKVCache:
    """Paged K/V storage: per layer K and V of shape [num_blocks(group), block_size, KV, D].

    Args:
        groups: KV-cache groups (block_manager.kv_groups); layer i lives in the group listing it.
        num_blocks: physical blocks per group.
        block_size: tokens per block.
        dtype, device: storage.
    """

    def __init__(self, groups: list[KVGroupSpec], num_blocks: list[int], block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.groups, self.block_size, self.dtype = groups, block_size, dtype
        n_layers = max(max(g.layers) for g in groups) + 1
        self.layer_group = [0] * n_layers
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        for gi, (g, n) in enumerate(zip(groups, num_blocks)):
            for layer in g.layers:
                self.layer_group[layer] = gi
                # uninitialised: every slot is written before any query reads it (pages are
                # only touched, and resident, once used)
                self.k[layer] = torch.empty(n, block_size, g.num_kv_heads, g.head_dim, dtype=dtype, device=device)
                self.v[layer] = torch.empty_like(self.k[layer])

    def native_pointers(self) -> cpu_native.KVPointers:
        """Every layer's K and V as fp32 [slots, KV, D] for the fused native decode step (built once).

        Raises: ValueError if the storage is not fp32 on the host."""
        if getattr(self, "_pointers", None) is None:
            flat = lambda ts: [None if t is None else t.view(-1, *t.shape[2:]) for t in ts]  # noqa: E731
            self._pointers = cpu_native.KVPointers(flat(self.k), flat(self.v))
        return self._pointers

    @property
    def nbytes(self) -> int:
        """Bytes of K and V storage over all layers."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


class SeqChunk:
    """One sequence's part of an engine step.

    Attributes:
        start: position of its first new token (= tokens already in the cache).
        num_new: new tokens this step (1 for a decode).
        block_tables: per group, the sequence's block table (-1 = released).
    """

    __slots__ = ("start", "num_new", "block_tables")

    def __init__(self, start: int, num_new: int, block_tables: list[list[int]]):
        self.start, self.num_new, self.block_tables = start, num_new, block_tables


class PagedBatch:
    """The ``kv`` a model receives for one engine step over a :class:`PagedKVCache`.

    The step's tokens are the sequences' new tokens concatenated in ``chunks`` order
    (rows ``[sum(num_new[:i]), sum(num_new[:i+1]))`` belong to sequence i). Decode
    sequences (one new token) are attended together in one padded batched call; each
    prefill chunk attends over its cached prefix plus itself. Slot mappings, gather
    indices and masks are built once per group here and reused by every layer.

    With ``use_kernels`` (default: when the cache is on a CUDA device) every sequence of the step,
    decode rows included, is attended by one varlen launch of the Triton flash kernel
    :func:`memra.kernels.attention_prefill.paged_prefill_attention`, which reads K/V straight
    from the pages (no gather, no mask tensors, no O(T^2) memory) and applies the Step-3.5 head
    gate in its epilogue (``fuses_gate``); the step's K/V are written by the fused
    :func:`memra.kernels.fused.kv_write`. Otherwise (CPU) torch SDPA over gathered pages with
    explicit visibility masks.

    Args:
        cache: the storage.
        chunks: the step's sequences.
        use_kernels: force the kernel path on or off (the CPU interpreter tests force it on).
    """

    def __init__(self, cache: PagedKVCache, chunks: list[SeqChunk], use_kernels: bool | None = None):
        self.cache, self.chunks = cache, chunks
        bs = cache.block_size
        dev = cache.k[cache.groups[0].layers[0]].device
        self.use_kernels = dev.type == "cuda" if use_kernels is None else bool(use_kernels)
        if not chunks:
            raise ValueError("PagedBatch: a step needs at least one sequence (chunks is empty)")
        self.num_tokens = sum(c.num_new for c in chunks)
        self.per_group = []
        offsets, o = [], 0
        for c in chunks:
            offsets.append(o)
            o += c.num_new
        if self.use_kernels:
            cu = torch.tensor(offsets + [o], dtype=torch.int32).to(dev)
            lens = torch.tensor([c.start + c.num_new for c in chunks], dtype=torch.int32).to(dev)
            self.varlen = (cu, lens, max((c.num_new for c in chunks), default=0))

        for gi, g in enumerate(cache.groups):
            tables = [torch.tensor(c.block_tables[gi], dtype=torch.long) for c in chunks]
            slots = torch.cat([_slots(t, c.start, c.start + c.num_new, bs) for t, c in zip(tables, chunks)])
            if self.use_kernels:
                for t, c in zip(tables, chunks):  # the kernel reads every visible page: none released
                    lo = _window_start(c.start, g.window) // bs
                    if bool((t[lo:-(-(c.start + c.num_new) // bs)] == NULL_BLOCK).any()):
                        raise RuntimeError(f"positions {lo * bs}..{c.start + c.num_new - 1} reach a released KV "
                                           f"block (block table {t.tolist()})")
                width = max(len(t) for t in tables)
                bt = torch.full((len(chunks), max(width, 1)), NULL_BLOCK, dtype=torch.int32)
                for r, t in enumerate(tables):
                    bt[r, :len(t)] = t.to(torch.int32)
                self.per_group.append((slots.to(dev), bt.to(dev)))
                continue
            keys = [_slots(t, _window_start(c.start, g.window), c.start + c.num_new, bs)
                    for t, c in zip(tables, chunks)]
            dec = [i for i, c in enumerate(chunks) if c.num_new == 1]
            decode = None
            if dec:
                lmax = max(len(keys[i]) for i in dec)
                idx = torch.empty(len(dec), lmax, dtype=torch.long)
                valid = torch.zeros(len(dec), lmax, dtype=torch.bool)
                for r, i in enumerate(dec):
                    # padding repeats a written slot of the same sequence (masked out; storage is
                    # uninitialised, and 0 * NaN would poison the output)
                    idx[r] = keys[i][0]
                    idx[r, :len(keys[i])] = keys[i]
                    valid[r, :len(keys[i])] = True
                rows = torch.tensor([offsets[i] for i in dec], dtype=torch.long)
                lens = torch.tensor([len(keys[i]) for i in dec], dtype=torch.long)
                decode = (rows.to(dev), idx.to(dev), None if bool(valid.all()) else valid.to(dev), lens)
            prefill = []
            for i, c in enumerate(chunks):
                if c.num_new == 1:
                    continue
                lo = _window_start(c.start, g.window)
                mask = visibility_mask(torch.arange(c.start, c.start + c.num_new),
                                       torch.arange(lo, c.start + c.num_new), g.window)
                prefill.append((offsets[i], c.num_new, keys[i].to(dev), mask.to(dev)))
            self.per_group.append((slots.to(dev), decode, prefill))

    def native_decode(self, t: int) -> cpu_native.NativeKV | None:
        """The addressing of this step for the fused native decode step (memra/kernels/cpu_native.py
        ``DecoderLayers``) when every one of its ``t`` rows is a sequence's decode token, the cache is
        fp32 on the host and has one group (one block table per sequence for every layer); else None."""
        cache = self.cache
        if (self.use_kernels or len(cache.groups) != 1 or cache.dtype != torch.float32 or len(self.chunks) != t
                or self.num_tokens != t):
            return None
        slots, decode, prefill = self.per_group[0]
        if prefill or decode is None or slots.device.type != "cpu":
            return None
        _, idx, _, lens = decode
        return cpu_native.NativeKV(cache.native_pointers(), L=idx.shape[1], idx=idx, lens=lens, write_slots=slots)

    @property
    def fuses_gate(self) -> bool:
        """attend() takes the head gate (the kernel path applies it in its epilogue)."""
        return self.use_kernels

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
               scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
        """Write this step's k, v [T, KV, D] to their slots, then attend q [T, H, D] -> [T, H, D].
        ``gate`` [T, H] (kernel path only, ``fuses_gate``): the output times sigmoid(gate).

        Raises: ValueError for a gate without ``use_kernels`` (the caller applies it there)."""
        cache = self.cache
        gi = cache.layer_group[layer]
        if self.use_kernels:
            from ..kernels.attention_prefill import paged_prefill_attention
            from ..kernels.fused import kv_write

            slots, table = self.per_group[gi]
            kc, vc = cache.k[layer], cache.v[layer]
            kv_write(k, v, kc, vc, slots)
            cu, lens, max_q = self.varlen
            return paged_prefill_attention(q, kc, vc, table, cu, lens, window, scale, gate=gate, max_q_len=max_q)
        if gate is not None:
            raise ValueError("PagedBatch.attend: without use_kernels the head gate is not fused (fuses_gate is "
                             "False)")
        slots, decode, prefill = self.per_group[gi]
        kc = cache.k[layer].view(-1, *cache.k[layer].shape[2:])
        vc = cache.v[layer].view(-1, *cache.v[layer].shape[2:])
        kc[slots] = k.to(kc.dtype)
        vc[slots] = v.to(vc.dtype)
        out = torch.empty_like(q)
        if decode is not None:
            rows, idx, valid, lens = decode
            if cpu_native.enabled() and kc.dtype == torch.float32 and kc.device.type == "cpu":
                out[rows] = cpu_native.decode_attention(q[rows], kc, vc, scale, slots=idx, lens=lens)  # no gather
            else:
                out[rows] = decode_attention(q[rows], kc[idx], vc[idx], valid, scale)  # valid None: no padding
        for off, n, ks, mask in prefill:
            o = F.scaled_dot_product_attention(
                q[off:off + n].transpose(0, 1)[None], kc[ks].transpose(0, 1)[None].to(q.dtype),
                vc[ks].transpose(0, 1)[None].to(q.dtype), attn_mask=mask, scale=scale,
                enable_gqa=q.shape[1] != kc.shape[1])
            out[off:off + n] = o[0].transpose(0, 1)
        return out


def _window_start(start: int, window: int | None) -> int:
    """First key position a query at ``start`` or later can see."""
    return 0 if window is None else max(0, start - window + 1)


def _slots(table: torch.Tensor, lo: int, hi: int, bs: int) -> torch.Tensor:
    """Slots (block * bs + offset) of positions lo .. hi-1 through block table ``table`` (int64)."""
    pos = torch.arange(lo, hi)
    blocks = table[pos // bs]
    if bool((blocks == NULL_BLOCK).any()):
        raise RuntimeError(f"positions {lo}..{hi - 1} reach a released KV block (block table {table.tolist()})")
    return blocks * bs + pos % bs
