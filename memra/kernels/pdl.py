"""Programmatic dependent launch (PDL) for memra's Triton kernels.

A decode step is a chain of ~850 short kernels (batch 1, flagship), each reading its predecessor's
output. Normally a kernel starts only once its predecessor has fully drained; with PDL (sm_90+,
CUDA Programming Guide, "Programmatic Dependent Launch and Synchronization") a kernel launched with
``launch_pdl=True`` may be scheduled as soon as every program of its predecessor has executed
``griddepcontrol.launch_dependents``, and it blocks in ``griddepcontrol.wait`` until the
predecessor has finished and its writes are visible. The scheduling and launch latency of one
kernel then overlaps the tail of the one before.

The contract, kept by every kernel that takes a ``PDL`` constexpr: its first statement is
``pdl_enter(PDL)`` (memra/kernels/_pdl_triton.py): wait, then trigger. No global memory is read or
written before the wait, so every kernel still sees everything its predecessors wrote (the wait
is transitive: the predecessor itself only finished after its own wait). A kernel launched
without PDL (cuBLAS, torch) after one with it simply waits for it to finish, as usual; a PDL
kernel after a kernel that never triggers starts when that kernel ends. Results are bit-identical
with and without PDL (tests/test_kernels_pdl.py); CUDA graphs capture the launches with their
programmatic edges.

Measured with ``benchmarks/pdl_probe.py`` (a chain of 40 decode-like kernels in a CUDA graph,
H100): 0.55 µs less per kernel with the wait alone, 0.68 µs with the early trigger
(benchmarks/results/issue14/pdl-probe-7436181-h100.json).

:func:`pdl_args` is what a launch site passes: ``kernel[grid](..., **pdl_args(device))``.
``MEMRA_PDL=0`` (or ``off``: :mod:`memra.kernels.envflags`) in the environment, or :func:`set_pdl`
(False), turns it off (A/B benchmarks:
``memra bench decode --pdl off``).
"""

from __future__ import annotations

import torch

from .envflags import env_flag, triton_interpreted

__all__ = ["pdl_args", "pdl_enabled", "set_pdl"]

_OVERRIDE: list[bool | None] = [None]
_CAPABLE: dict[int, bool] = {}


def set_pdl(enabled: bool | None) -> None:
    """Turn PDL on or off for launches from now on (None: back to the default, which is on
    where the device supports it unless ``MEMRA_PDL=0``). CUDA graphs keep what they captured."""
    _OVERRIDE[0] = enabled


def pdl_enabled(device: torch.device | str) -> bool:
    """True when kernels launched on ``device`` use PDL: a CUDA device of compute capability
    >= 9.0, not under Triton's CPU interpreter (``TRITON_INTERPRET=1``), and not turned off."""
    device = torch.device(device)
    if device.type != "cuda" or triton_interpreted():
        return False
    on = _OVERRIDE[0]
    if on is None:
        on = env_flag("MEMRA_PDL", True)
    if not on or not torch.cuda.is_available():
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABLE:
        _CAPABLE[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _CAPABLE[idx]


def pdl_args(device: torch.device | str) -> dict:
    """Launch keywords for a kernel that takes the ``PDL`` constexpr: ``{"PDL": True,
    "launch_pdl": True}`` where :func:`pdl_enabled`, else ``{"PDL": False}``."""
    if pdl_enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
