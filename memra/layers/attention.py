"""Scaled dot-product attention with causal + sliding-window masking and GQA.

Visibility (the one rule every attention path here follows): key at position j is
visible to a query at position i iff ``j <= i`` and, on sliding-window layers,
``i - window < j`` (the query's own token included; Gemma 3 / Step-3.5 convention,
transformers ``sliding_window_overlay``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["visibility_mask", "attention"]


def visibility_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean mask [Tq, Tk]: True where key ``k_pos[j]`` is visible to query ``q_pos[i]``."""
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = diff >= 0
    if window is not None:
        allowed &= diff < window
    return allowed


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              window: int | None, scale: float) -> torch.Tensor:
    """Attention of queries over keys/values of one sequence.

    Args:
        q: [Tq, H, D]; k, v: [Tk, KV, D] with H a multiple of KV (grouped-query attention).
        q_pos: int64 [Tq] absolute positions of the queries; k_pos: int64 [Tk] of the keys.
        window: sliding window in tokens, or None for full causal attention.
        scale: softmax scale (usually D ** -0.5).
    Returns:
        [Tq, H, D] in q's dtype.
    """
    mask = None
    if not (q.shape[0] == 1 and window is None and int(k_pos[-1]) <= int(q_pos[0])):
        mask = visibility_mask(q_pos, k_pos, window)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)
