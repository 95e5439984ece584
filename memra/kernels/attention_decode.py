"""Paged decode attention (one new query token per sequence) over the paged KV cache.

Layouts (those of :class:`memra.engine.kv_cache.PagedKVCache`):
- ``q`` [B, H, D]: the step's queries, one per sequence (bf16 on the GPU; fp16/fp32 too).
- ``k_cache``, ``v_cache`` [num_blocks, block_size, KV, D]: one layer's paged storage, same
  dtype as ``q`` or bf16; H % KV == 0 and query head h reads kv head ``h // (H // KV)``.
- ``block_table`` int32 [B, max_blocks]: physical block of each sequence's page; entries of
  pages outside the visible range may be -1 (released) and are never read.
- ``seq_lens`` int32 [B]: tokens in the cache for each sequence, the current one included
  (already written). The query sits at position L-1 and sees keys
  ``max(0, L - window) <= j <= L - 1`` (``window=None``: all of them; the convention of
  :mod:`memra.layers.attention`). ``L == 0`` marks a padding row: its output is zeros and
  nothing of it is read.
- ``gate`` (optional) [B, H]: Step-3.5 head-gate logits; the output is ``o * sigmoid(gate)``.

Math: ``o[b, h] = softmax(scale * q K^T) V`` over the visible keys, fp32 scores and softmax
(running max subtracted), fp32 accumulation, output in q's dtype.

Kernel (flash-decoding, split-KV): each sequence's visible pages are divided evenly over
``num_splits`` partitions. Program (b, kv head, split) loads the G = H / KV query heads of
its kv head at once (padded to a power of two >= 16 rows, so that K and V are read once per
group and both products run on tensor cores via ``tl.dot``; any G, also 3 or 9), walks its
partition ``BLOCK_N`` keys at a time (gathering page ids from the block table), keeps an
online softmax and writes its partial (m, l, acc) to fp32 scratch; a second kernel merges
the partials (and applies the gate). With one split the first kernel normalises and stores
the output directly (one launch). bf16/fp16: the probabilities are rounded to the cache
dtype before the P V product (as FlashAttention does); fp32 or mixed dtypes: both operands
in fp32 with IEEE products.

The grid depends only on (B, KV, max_blocks, window) and never on ``seq_lens`` values, and the
wrapper never synchronises with the device, so a call can be captured in a CUDA graph and
replayed with new ``seq_lens`` / ``block_table`` contents copied into the captured buffers.

Default split count (:func:`default_num_splits`): about 4 programs per SM
(``B * KV * splits ~ 4 * SMs``), at most one split per ``BLOCK_N`` keys of the largest
visible range (``max_blocks`` pages, or the window's pages) and at most 128.

Measured on the H200 (bf16, CUDA-graph replay, KV bytes read / time; copy ceiling 4.27 TB/s):
Step-3.5 full layer (H 64, KV 8, D 128) B=1 ctx 32768: 42 us, 3.2 TB/s; B=1 ctx 4096: 10 us;
B=64 ctx 4096: 254 us, 4.2 TB/s; sliding layer (H 96, window 512) B=1: 6.9 us, B=64: 39 us.

Sources: Dao et al. 2023, "Flash-Decoding for long-context inference" (the split-KV idea);
vLLM's paged attention and Triton's fused-attention tutorial (ideas only).
"""

from __future__ import annotations

import torch

from .pdl import pdl_args

__all__ = ["paged_decode_attention", "paged_decode_attention_ref", "default_num_splits"]

_MAX_SPLITS = 128


def check_paged_cache(name: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      window: int | None = None, gate: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> tuple[int, int]:
    """Checks shared by the paged attention kernels (decode and prefill): q [rows, H, D] in bf16 /
    fp16 / fp32, equal caches [num_blocks, block_size, KV, D] of q's dtype or bf16, H % KV == 0,
    ``window`` None or >= 1, ``gate`` [rows, H], ``out`` q's dtype and shape.
    Returns (block_size, KV). Raises: ValueError naming ``name`` and what is wrong."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{name}: k_cache/v_cache must be equal [num_blocks, block_size, KV, D], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    R, H, D = q.shape
    _, bs, KV, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"{name}: cache head dim {Dk} != q head dim {D}")
    if KV < 1 or H % KV:
        raise ValueError(f"{name}: H = {H} is not a multiple of KV = {KV}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: q dtype {q.dtype} not supported (bf16, fp16, fp32)")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, torch.bfloat16):
        raise ValueError(f"{name}: cache dtype {k_cache.dtype}/{v_cache.dtype} must be q's ({q.dtype}) or bf16")
    if window is not None and window < 1:
        raise ValueError(f"{name}: window must be None or >= 1, got {window}")
    if gate is not None and tuple(gate.shape) != (R, H):
        raise ValueError(f"{name}: gate must be [{R}, {H}], got {tuple(gate.shape)}")
    if out is not None and (tuple(out.shape) != (R, H, D) or out.dtype != q.dtype):
        raise ValueError(f"{name}: out must be {q.dtype} [{R}, {H}, {D}], got {out.dtype} {tuple(out.shape)}")
    return bs, KV


def _check(q, k_cache, v_cache, block_table, seq_lens, window, gate, out) -> tuple[int, int, int, int, int]:
    if q.dim() != 3:
        raise ValueError(f"paged_decode_attention: q must be [B, H, D], got shape {tuple(q.shape)}")
    B, H, D = q.shape
    bs, KV = check_paged_cache("paged_decode_attention", q, k_cache, v_cache, window, gate, out)
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype != torch.int32:
        raise ValueError(f"paged_decode_attention: block_table must be int32 [{B}, max_blocks], got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if seq_lens.shape != (B,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"paged_decode_attention: seq_lens must be int32 [{B}], got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table),
                    ("seq_lens", seq_lens)) + ((("gate", gate),) if gate is not None else ()):
        if t.device != q.device:
            raise ValueError(f"paged_decode_attention: {name} is on {t.device}, q on {q.device}")
    return B, H, D, bs, KV


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor, window: int | None, scale: float,
                               gate: torch.Tensor | None = None, out: torch.Tensor | None = None,
                               num_splits: int | None = None) -> torch.Tensor:
    """Plain torch twin of :func:`paged_decode_attention` (a loop over sequences; syncs).

    K/V are converted to q's dtype (as :class:`~memra.engine.kv_cache.PagedBatch` does), then
    scores, softmax and ``P V`` are computed in fp32; the gate is applied in fp32 and the result
    rounded once to q's dtype. ``num_splits`` is ignored."""
    B, H, D, bs, KV = _check(q, k_cache, v_cache, block_table, seq_lens, window, gate, out)
    res = torch.zeros(B, H, D, dtype=torch.float32, device=q.device)
    lens = seq_lens.tolist()
    for b in range(B):
        L = lens[b]
        if L <= 0:
            continue
        lo = 0 if window is None else max(0, L - window)
        pos = torch.arange(lo, L, device=q.device)
        blocks = block_table[b].long()[pos // bs]
        if bool((blocks < 0).any()):
            raise RuntimeError(f"paged_decode_attention_ref: sequence {b} reaches a released block")
        k = k_cache[blocks, pos % bs].to(q.dtype).float()  # [n, KV, D]
        v = v_cache[blocks, pos % bs].to(q.dtype).float()
        k = k.repeat_interleave(H // KV, dim=1)
        v = v.repeat_interleave(H // KV, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        p = torch.softmax(s, dim=-1)
        res[b] = torch.einsum("hn,nhd->hd", p, v)
    if gate is not None:
        res = res * torch.sigmoid(gate.float())[..., None]
    if out is not None:
        out.copy_(res)
        return out
    return res.to(q.dtype)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def default_num_splits(batch: int, num_kv: int, max_blocks: int, block_size: int, window: int | None,
                       block_n: int = 64, sm_count: int = 132) -> int:
    """Splits per sequence: ``round(4 * SMs / (B * KV))`` programs' worth (measured best on the H200
    at B = 1, 4, 16, 64 for the flagship and smollm2 shapes), at most one per ``block_n`` keys of the
    largest visible range (``max_blocks`` pages, or the window's) and at most 128."""
    pages = max_blocks
    if window is not None:
        pages = min(pages, -(-(window - 1) // block_size) + 1)
    cap = max(1, -(-pages * block_size // block_n))
    want = round(4 * sm_count / max(1, batch * num_kv))
    return max(1, min(want, cap, _MAX_SPLITS))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _default_launch(D: int, G: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps)."""
    gp = max(16, _next_pow2(G))
    if gp >= 64:
        return 32, 4
    return 64, 4


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, window: int | None, scale: float,
                           gate: torch.Tensor | None = None, out: torch.Tensor | None = None,
                           num_splits: int | None = None, block_n: int | None = None,
                           num_warps: int | None = None, num_stages: int = 2) -> torch.Tensor:
    """Decode attention of ``q`` [B, H, D] over the paged cache (module docstring), by Triton.

    Args:
        q, k_cache, v_cache, block_table, seq_lens, window, scale, gate: see the module docstring.
        out: optional preallocated [B, H, D] output of q's dtype (written in full).
        num_splits: key partitions per sequence (default :func:`default_num_splits`).
        block_n, num_warps, num_stages: launch tuning (``block_n``: keys per loop step, a power of
            two >= 16, independent of the block size; defaults by shape).
    Returns:
        [B, H, D] in q's dtype (``out`` when given).
    Raises:
        ValueError: shapes, dtypes or devices that do not match (naming the argument).
    """
    B, H, D, bs, KV = _check(q, k_cache, v_cache, block_table, seq_lens, window, gate, out)
    if D & (D - 1) or D < 16:
        raise ValueError(f"paged_decode_attention: head dim {D} must be a power of two >= 16")
    if bs & (bs - 1):
        raise ValueError(f"paged_decode_attention: block size {bs} must be a power of two")
    G = H // KV
    gp = max(16, _next_pow2(G))
    bn_def, nw_def = _default_launch(D, G)
    block_n = block_n or bn_def
    num_warps = num_warps or nw_def
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"paged_decode_attention: block_n {block_n} must be a power of two >= 16")
    max_blocks = block_table.shape[1]
    if num_splits is None:
        num_splits = default_num_splits(B, KV, max_blocks, bs, window, block_n, _sm_count(q.device))
    num_splits = max(1, int(num_splits))
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged_decode_attention: k_cache/v_cache need a unit stride along D")
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    if out is None:
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if out.stride(2) != 1:
        raise ValueError("paged_decode_attention: out needs a unit stride along D")
    if B == 0:
        return out
    direct = num_splits == 1
    if direct:
        m = l = acc = out  # unused
    else:
        m = torch.empty(B * H * num_splits, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty(B * H * num_splits, D, dtype=torch.float32, device=q.device)
    mixed = k_cache.dtype != q.dtype
    ieee = q.dtype == torch.float32 or mixed
    g = gate if gate is not None else q
    s_gb = gate.stride(0) if gate is not None else 0
    if gate is not None and gate.stride(1) != 1:
        gate = gate.contiguous()
        g, s_gb = gate, gate.stride(0)
    from ._attention_triton import _decode_combine_kernel, _decode_split_kernel

    _decode_split_kernel[(B * KV, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, g, out, m, l, acc,
        float(scale), int(window or 0), KV, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0), s_gb,
        out.stride(0), out.stride(1),
        G=G, GP=gp, D=D, BS=bs, BLOCK_N=block_n, HAS_WINDOW=window is not None, HAS_GATE=gate is not None,
        DIRECT=direct, IEEE=ieee, CAST_F32=mixed, num_warps=num_warps, num_stages=num_stages,
        **pdl_args(q.device),
    )
    if not direct:
        _decode_combine_kernel[(B * H,)](
            m, l, acc, g, out, H, num_splits, s_gb, out.stride(0), out.stride(1),
            D=D, SP=max(2, _next_pow2(num_splits)), HAS_GATE=gate is not None, num_warps=4,
            **pdl_args(q.device),
        )
    return out


def gathered_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, idx: torch.Tensor,
                  valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Baseline for benchmarks: gather the cache by slot ``idx`` [B, Lmax] and run torch SDPA
    with the boolean mask ``valid`` [B, 1, 1, Lmax] (what PagedBatch.attend does today)."""
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    kk = kc[idx].transpose(1, 2)
    vv = vc[idx].transpose(1, 2)
    o = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None, :], kk.to(q.dtype), vv.to(q.dtype), attn_mask=valid, scale=scale,
        enable_gqa=q.shape[1] != kk.shape[1])
    return o[:, :, 0, :]

