"""Paged prefill attention (many new query tokens per sequence, varlen) over the paged KV cache.

Layouts (those of :class:`memra.engine.kv_cache.PagedKVCache`):
- ``q`` [T, H, D]: the step's new query rows of S sequences concatenated; sequence s owns rows
  ``cu_seqlens_q[s] .. cu_seqlens_q[s+1]`` (bf16 on the GPU; fp16/fp32 too).
- ``k_cache``, ``v_cache`` [num_blocks, block_size, KV, D]: one layer's paged storage, same
  dtype as ``q`` or bf16; H % KV == 0 and query head h reads kv head ``h // (H // KV)``. The new
  tokens' K/V are already written to the cache by the caller.
- ``block_table`` int32 [S, max_blocks]: physical block of each sequence's page; entries of
  pages outside the visible range may be -1 (released) and are never read.
- ``cu_seqlens_q`` int32 [S+1]: row offsets into ``q`` (``cu[0] = 0``, non-decreasing). Rows of
  ``q`` outside ``cu[0] .. cu[S]`` are not written by the kernel (the reference zeroes them).
- ``seq_lens`` int32 [S]: tokens in the cache for sequence s, this chunk's included. So sequence
  s has ``n_s = cu[s+1] - cu[s]`` new queries (0 allowed: nothing to do) after a cached prefix of
  ``P_s = seq_lens[s] - n_s`` tokens, and its query i sits at position ``p = P_s + i``.
- Visibility (causal + sliding window, the rule of :mod:`memra.layers.attention` and
  :mod:`memra.kernels.attention_decode`): the query at position p sees the keys
  ``max(0, p - window + 1) <= j <= p`` (``window=None``: ``0 <= j <= p``).
- ``gate`` (optional) [T, H]: Step-3.5 head-gate logits; the output is ``o * sigmoid(gate)``.

Math: ``o = softmax(scale * q K^T) V`` over the visible keys, fp32 scores and online softmax
(exp2 domain), fp32 accumulation; bf16/fp16: the probabilities are rounded to the cache dtype
before the ``P V`` product (as FlashAttention does); fp32 or mixed dtypes: both products in fp32
with IEEE (non-TF32) dots. The gate is applied in fp32; the output is rounded once to q's dtype.

Kernel (``_prefill_kernel``, FlashAttention-2 style tiling, no O(T^2) memory):
- Grid ``(ceil(max_q_len * G / BLOCK_M), KV, S)``, G = H / KV: only host ints, so no host sync
  when ``max_q_len`` is given. Program (m, kv head, s) owns BLOCK_M *flattened* rows
  ``f = i * G + g`` (query i of sequence s, head g of the kv head's group): all the group's
  query heads share every K/V tile (any G, also 3 or 12; no padding of the group). A block
  spans about ``BLOCK_M / G + 1`` query positions. Blocks past a sequence's ``n_s * G`` rows
  exit at once; the last (heaviest, causally) blocks are launched first.
- Keys are gathered position by position through the block table (page ``j // block_size``,
  slot ``j % block_size``; any block size), BLOCK_N at a time. A block whose queries sit at
  ``p_first .. p_last`` walks only keys ``[lo, p_last]``, ``lo = max(0, p_first - window + 1)``,
  in three ranges: the window's lower edge ``[lo, b)``, ``b = max(lo, p_last - window + 1)``
  (masked; at most p_last - p_first keys), whole tiles ``[b, c)`` that every row sees in full
  (no mask, no bounds checks: the bulk of the work) and the causal diagonal ``[c, p_last]``
  (masked). So a sliding layer touches ~``window + BLOCK_M / G`` keys per block, whatever the
  prefix length. ``aligned`` (batch-invariant mode) walks ``[lo rounded down to a multiple of
  BLOCK_N, p_last]`` instead, every tile through the masked path: the tiles a query meets, and
  the instructions that meet them, then do not depend on the block's other queries, so its
  bits are those of the same query at any q_len (a decode row, a verify row, any chunk split).
- Launch config (:func:`default_prefill_launch`, measured on the H200): D = 128 bf16/fp16:
  BLOCK_M 128, BLOCK_N 64 (32 with a sliding window), 4 warps, 3 stages. fp32 operands (IEEE
  dots, no tensor cores) 32 x 16 (larger tiles spill); under the Triton interpreter 16 x 16.

Measured on the H200 (bf16, random inputs, ``memra.bench.prefill.benchmark_prefill_attention``; the GPU tests at
these shapes pass with max relative error ~3e-3 vs the fp32 reference): full layer (H 64, KV 8,
D 128), T = 4096 at prefix 0: 728 us, 377 TFLOP/s of causal FLOPs (torch SDPA's flash kernel,
contiguous K/V, no pages, no gate: 476 us); sliding layer (H 96, window 512) T = 4096: 401 us.
Slower than SDPA's kernel by ~1.5x at full attention: the next step is a tuned per-shape table
and fewer masked tiles per block (a block spans only BLOCK_M / G query positions).

Sources: Dao 2023, "FlashAttention-2" (tiling, online softmax, causal block skipping); Triton's
fused-attention tutorial (the split of the key loop into masked and unmasked ranges; ideas
only); vLLM / FlashInfer paged prefill (block-table gather; ideas only).
"""

from __future__ import annotations

import torch

from .attention_decode import check_paged_cache
from .gemv import interpret_mode

__all__ = [
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "default_prefill_launch",
]

_NAME = "paged_prefill_attention"


def _check(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, window, gate, out, max_q_len
           ) -> tuple[int, int, int, int, int, int]:
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"{_NAME}: q must be [T, H, D], got shape {tuple(getattr(q, 'shape', ()))}")
    T, H, D = q.shape
    bs, KV = check_paged_cache(_NAME, q, k_cache, v_cache, window, gate, out)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1 or cu_seqlens_q.dtype != torch.int32:
        raise ValueError(f"{_NAME}: cu_seqlens_q must be int32 [S+1], got {cu_seqlens_q.dtype} "
                         f"{tuple(cu_seqlens_q.shape)}")
    S = cu_seqlens_q.shape[0] - 1
    if seq_lens.shape != (S,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"{_NAME}: seq_lens must be int32 [{S}] (S from cu_seqlens_q [S+1]), got "
                         f"{seq_lens.dtype} {tuple(seq_lens.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != S or block_table.dtype != torch.int32:
        raise ValueError(f"{_NAME}: block_table must be int32 [{S}, max_blocks], got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if max_q_len is not None and (not isinstance(max_q_len, int) or isinstance(max_q_len, bool) or max_q_len < 0):
        raise ValueError(f"{_NAME}: max_q_len must be None or a host int >= 0, got {max_q_len!r}")
    for name, t in ((("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table),
                     ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens))
                    + ((("gate", gate),) if gate is not None else ())
                    + ((("out", out),) if out is not None else ())):
        if t.device != q.device:
            raise ValueError(f"{_NAME}: {name} is on {t.device}, q on {q.device}")
    return T, H, D, bs, KV, S


def _resolve_aligned(aligned: bool | None) -> bool:
    """``aligned`` as given, or (None) whether batch-invariant mode is on."""
    if aligned is None:
        from .batch_invariant import batch_invariant

        return batch_invariant()
    return bool(aligned)


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                                window: int | None, scale: float, gate: torch.Tensor | None = None,
                                out: torch.Tensor | None = None, max_q_len: int | None = None,
                                aligned: bool | None = None, **_launch) -> torch.Tensor:
    """Plain torch twin of :func:`paged_prefill_attention` (a loop over sequences; syncs).

    K/V are converted to q's dtype (as :class:`~memra.engine.kv_cache.PagedBatch` does), then
    scores, softmax and ``P V`` are computed in fp32 (queries in chunks of 1024 rows, so the
    score matrix stays bounded); the gate is applied in fp32 and the result rounded once to q's
    dtype. Rows of q outside ``cu[0] .. cu[S]`` are zeros. ``max_q_len`` and launch keywords
    are ignored; ``aligned`` (as the kernel's; None: batch-invariant mode) only admits padding
    rows (``n_s = 1``, ``seq_lens[s] = 0``: zeros).

    Raises:
        ValueError: as :func:`paged_prefill_attention`, plus inconsistent ``cu_seqlens_q`` /
            ``seq_lens`` values (checked here on the host: cu non-decreasing within [0, T],
            ``n_s <= seq_lens[s]``).
        RuntimeError: a visible key's page is -1 in the block table.
    """
    T, H, D, bs, KV, S = _check(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, window, gate, out,
                                max_q_len)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    if cu[0] < 0 or cu[-1] > T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{_NAME}: cu_seqlens_q must be non-decreasing within [0, {T}], got {cu}")
    G = H // KV
    aligned = _resolve_aligned(aligned)
    res = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    for s in range(S):
        n, L = cu[s + 1] - cu[s], lens[s]
        if n == 0 or (n == 1 and L == 0 and aligned):
            continue
        if n > L:
            raise ValueError(f"{_NAME}: sequence {s} has {n} new queries but seq_lens {L} < {n}")
        P = L - n
        lo = 0 if window is None else max(0, P - window + 1)
        kpos = torch.arange(lo, L, device=q.device)
        blocks = block_table[s].long()[kpos // bs]
        if bool((blocks < 0).any()):
            raise RuntimeError(f"{_NAME}_ref: sequence {s} reaches a released block")
        k = k_cache[blocks, kpos % bs].to(q.dtype).float().repeat_interleave(G, dim=1)  # [Lk, H, D]
        v = v_cache[blocks, kpos % bs].to(q.dtype).float().repeat_interleave(G, dim=1)
        for c0 in range(0, n, 1024):
            c1 = min(n, c0 + 1024)
            qpos = P + torch.arange(c0, c1, device=q.device)
            diff = qpos[:, None] - kpos[None, :]
            vis = diff >= 0
            if window is not None:
                vis &= diff < window
            sc = torch.einsum("ihd,jhd->hij", q[cu[s] + c0:cu[s] + c1].float(), k) * scale
            sc = sc.masked_fill(~vis[None], float("-inf"))
            p = torch.softmax(sc, dim=-1)
            res[cu[s] + c0:cu[s] + c1] = torch.einsum("hij,jhd->ihd", p, v)
    if gate is not None:
        res = res * torch.sigmoid(gate.float())[..., None]
    if out is not None:
        out.copy_(res)
        return out
    return res.to(q.dtype)


def default_prefill_launch(d: int, dtype: torch.dtype = torch.bfloat16, mixed: bool = False,
                           window: int | None = None) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) for head dim ``d``. bf16/fp16, measured on the
    H200 (``memra.bench.prefill.benchmark_prefill_attention``, T = 4096, D = 128, 9 configurations each; see
    benchmarks/results/attention-prefill-h200.json): full attention (H 64, KV 8) 128 x 64 tiles,
    4 warps, 3 stages: 728 us (377 TFLOP/s; the first guess, 8 warps, took 901 us); sliding
    window 512 (H 96, KV 8) 128 x 32, 4 warps, 3 stages: 401 us (241 TFLOP/s; 461 us before).
    d <= 64: 128 x 64, 4 warps, 3 stages. fp32 operands 32 x 16, 4 warps, 2 stages (IEEE fp32
    dots run on CUDA cores; larger tiles spill registers at d = 128); mixed dtypes (fp32/fp16
    q, bf16 cache) the same with 1 stage (2 stages spill); under the Triton interpreter 16 x 16
    (the CPU tests)."""
    if interpret_mode():
        return 16, 16, 4, 1
    if mixed:
        return 32, 16, 4, 1
    if dtype == torch.float32:
        return 32, 16, 4, 2
    if window is not None and d > 64:
        return 128, 32, 4, 3
    return 128, 64, 4, 3


def _pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                            window: int | None, scale: float, gate: torch.Tensor | None = None,
                            out: torch.Tensor | None = None, max_q_len: int | None = None, *,
                            block_m: int | None = None, block_n: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            aligned: bool | None = None) -> torch.Tensor:
    """Prefill attention of ``q`` [T, H, D] over the paged cache (module docstring), by Triton.

    Args:
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, window, scale, gate: see the
            module docstring.
        out: optional preallocated [T, H, D] output of q's dtype (rows of the S sequences written).
        max_q_len: host int >= max_s n_s (sizes the grid without a device sync; a smaller value
            leaves the excess rows unwritten). None: computed from ``cu_seqlens_q`` (one sync).
        block_m, block_n, num_warps, num_stages: launch tuning (powers of two >= 16 for the
            blocks; defaults :func:`default_prefill_launch`).
        aligned: walk every block's keys in tiles at multiples of ``block_n``, all through one
            masked code path, so that a query's output does not depend on which other queries of
            its sequence share the launch (its own q_len, a chunk's split): the same bits as a
            decode row, a verify row or a prefill row. A sequence may then also have ``n_s = 1``
            with ``seq_lens[s] = 0`` (a padding row): its output is zeros. None (default): on in
            batch-invariant mode (:mod:`memra.kernels.batch_invariant`).
    Returns:
        [T, H, D] in q's dtype (``out`` when given).
    Raises:
        ValueError: shapes, dtypes or devices that do not match (naming the argument), a head dim
            or block size that is not a power of two, bad launch parameters.
    Values of ``cu_seqlens_q`` / ``seq_lens`` are not checked (that would need a sync): a prefix
    ``seq_lens[s] - n_s < 0`` or -1 pages inside the visible range are undefined behaviour.
    """
    T, H, D, bs, KV, S = _check(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, window, gate, out,
                                max_q_len)
    if D < 16 or not _pow2(D):
        raise ValueError(f"{_NAME}: head dim {D} must be a power of two >= 16")
    if not _pow2(bs):
        raise ValueError(f"{_NAME}: block size {bs} must be a power of two")
    G = H // KV
    mixed = k_cache.dtype != q.dtype
    bm_d, bn_d, nw_d, ns_d = default_prefill_launch(D, q.dtype, mixed, window)
    block_m, block_n = block_m or bm_d, block_n or bn_d
    num_warps, num_stages = num_warps or nw_d, num_stages or ns_d
    for name, v in (("block_m", block_m), ("block_n", block_n)):
        if v < 16 or not _pow2(v):
            raise ValueError(f"{_NAME}: {name} {v} must be a power of two >= 16")
    if not _pow2(num_warps) or num_stages < 1:
        raise ValueError(f"{_NAME}: num_warps {num_warps} must be a power of two, num_stages {num_stages} >= 1")
    aligned = _resolve_aligned(aligned)
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError(f"{_NAME}: k_cache/v_cache need a unit stride along D")
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    cu_seqlens_q = cu_seqlens_q.contiguous()
    seq_lens = seq_lens.contiguous()
    if out is None:
        out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if out.stride(2) != 1:
        raise ValueError(f"{_NAME}: out needs a unit stride along D")
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if S > 0 else 0
    if T == 0 or S == 0 or max_q_len == 0:
        return out
    if gate is not None and gate.stride(1) != 1:
        gate = gate.contiguous()
    g = gate if gate is not None else q
    s_gt = gate.stride(0) if gate is not None else 0
    num_m = -(-max_q_len * G // block_m)
    from ._attention_prefill_triton import _prefill_kernel

    _prefill_kernel[(num_m, KV, S)](
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, g, out,
        float(scale), int(window or 0), num_m,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0), s_gt,
        out.stride(0), out.stride(1),
        G=G, D=D, BS=bs, BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=window is not None,
        HAS_GATE=gate is not None, IEEE=q.dtype == torch.float32 or mixed, CAST_F32=mixed, ALIGNED=bool(aligned),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
