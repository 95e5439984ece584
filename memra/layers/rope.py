"""Rotary position embedding (RoPE), NeoX / rotate-half layout, optionally partial.

Su et al. 2021, "RoFormer". The first ``rotary_dim`` dims of each head are split in two
halves (x1, x2) rotated as (x1 cos - x2 sin, x2 cos + x1 sin) with frequencies
``theta ** (-2i / rotary_dim)``; the remaining dims pass through. Checkpoints whose
q/k rows are stored in the interleaved (GPT-J) order are permuted at load time, so
every model here uses this one layout. The rotation itself (``apply_rope``) is
memra/kernels/norm_rope.py ``rope_torch``, whose fused GPU form (with the q/k norms)
memra/layers/attention.py calls.

Scalings: ``linear`` divides frequencies by the factor; ``llama3`` applies Meta's
wavelength-dependent rule (Llama 3.1 report, section on long context; same numbers as
transformers' ``rope_type="llama3"``); per-frequency divisors from a checkpoint
(llama.cpp ``rope_freqs``) are applied as given.
"""

from __future__ import annotations

import functools
import math

import torch

from ..config import LayerConfig, RopeScaling
from ..kernels.norm_rope import rope_torch as apply_rope  # x [T, H, D] rotated by cos, sin [T, rot]

__all__ = ["inv_frequencies", "rope_cos_sin", "apply_rope"]


@functools.lru_cache(maxsize=64)  # once per distinct RoPE setting, not once per decode step
def inv_frequencies(theta: float, rotary_dim: int, scaling: RopeScaling | None = None,
                    freq_factors: tuple[float, ...] | None = None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2], fp32 (cached: callers must not modify the result).

    Raises:
        ValueError: unknown scaling kind, or ``freq_factors`` of the wrong length.
    """
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if freq_factors is not None:
        f = torch.tensor(freq_factors, dtype=torch.float32)
        if f.numel() != inv.numel():
            raise ValueError(f"rope frequency factors have {f.numel()} entries, expected {inv.numel()}")
        return inv / f
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "llama3":
        low_wavelen = scaling.original_max_position / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unknown RoPE scaling kind {scaling.kind!r} (supported: linear, llama3)")


def rope_key(lc: LayerConfig) -> tuple:
    """Layers with equal keys share one cos/sin table."""
    return (lc.rope_theta, lc.rotary_dim, lc.rope_scaling, lc.rope_freq_factors)


_INV_ON_DEVICE: dict[tuple, torch.Tensor] = {}


def _inv_on(key: tuple, device: torch.device) -> torch.Tensor:
    """inv_frequencies of ``key`` (:func:`rope_key`) held on ``device``: copied there once, so that
    a forward pass makes no host-to-device copy (a CUDA graph capture forbids one)."""
    if device.type == "cpu":
        return inv_frequencies(*key)
    k = (key, str(device))
    if k not in _INV_ON_DEVICE:
        _INV_ON_DEVICE[k] = inv_frequencies(*key).to(device)
    return _INV_ON_DEVICE[k]


def rope_cos_sin(lc: LayerConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [T, rotary_dim] for int64 ``positions`` [T] (computed in fp32)."""
    inv = _inv_on(rope_key(lc), positions.device)
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
