"""KV cache for one sequence, stored contiguously per layer.

The model never touches cache layout: each attention layer calls
:meth:`ContiguousKVCache.attend`, which writes the step's keys/values and attends over
everything cached. ``advance`` is called once per model step after all layers ran.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..layers.attention import attention

__all__ = ["ContiguousKVCache", "ContextOverflowError"]


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

    def __init__(self, config: ModelConfig, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.max_len = max_len
        self.k = [torch.empty(max_len, lc.num_kv_heads, lc.head_dim, dtype=dtype, device=device) for lc in config.layers]
        self.v = [torch.empty_like(k) for k in self.k]
        self.positions = torch.arange(max_len, device=device)
        self.length = 0

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
        self.k[layer][start:end] = k
        self.v[layer][start:end] = v
        lo = 0 if window is None else max(0, start - window + 1)
        return attention(q, self.k[layer][lo:end], self.v[layer][lo:end], self.positions[start:end],
                         self.positions[lo:end], window, scale)

    def advance(self, t: int) -> None:
        """Commit the ``t`` tokens written by the last model step."""
        self.length += t

    def truncate(self, length: int) -> None:
        """Forget every token at position >= ``length`` (rejected draft tokens, retries)."""
        self.length = min(self.length, length)
