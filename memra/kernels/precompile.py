"""Compile the Triton kernels a piece of GPU work will launch, in parallel, before it runs.

A cold engine start (empty Triton cache) used to compile every kernel specialization one after
another on first launch, in the KV-budget profile run and in the CUDA-graph warm-up: about
30 s of a 36 s start on the H200 (``memra bench file``, NOTES.md). :func:`precompile` does the
same work in two passes:

1. record: the calls run with Triton's ``knobs.runtime.jit_cache_hook`` set to a hook that
   records each launch's specialization (``specialization_data``, the JSON that
   ``JITFunction.preload`` reads back) and answers "skip": the launch is then neither compiled
   nor launched (Triton returns before both). memra's kernels that are compiled already are
   taken out of their in-memory caches for the pass (and put back after), so they are skipped
   too: no kernel runs on a skipped kernel's output. Those outputs are ``torch.empty`` garbage
   and the calls' results are dropped: use it only on work whose outputs nothing reads (warm-up
   and profile runs) and whose host code does not branch on what kernels would have written.
   Torch ops still run on the garbage; the one integer tensor a kernel writes and torch then
   indexes with, the router's top-k experts (:func:`memra.kernels.fused.router_topk`, read by
   the torch paths of ``moe_align`` and ``moe_group``), is zeroed while :func:`recording`;
2. compile: every distinct specialization is handed to ``JITFunction.preload`` under
   ``triton.AsyncCompileMode`` with a thread pool. Triton's code generation holds the GIL, its
   MLIR/LLVM passes and ptxas do not, so several kernels compile at once; each result lands in
   the kernel's in-memory cache (and Triton's disk cache), where the real run finds it.

A specialization the record pass did not see, or one that failed to compile here, compiles on
its first launch as before, so the mechanism changes start-up time, never results. On the CPU,
under the interpreter (``TRITON_INTERPRET=1``) or with ``MEMRA_PRECOMPILE=0`` it does nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

__all__ = ["PrecompileReport", "precompile", "precompile_enabled", "recording"]

_RECORDING = [False]


def recording() -> bool:
    """True inside :func:`precompile`'s record pass (kernel launches are skipped: see the module
    docstring)."""
    return _RECORDING[0]


@dataclass
class PrecompileReport:
    """What :func:`precompile` did: ``kernels`` distinct specializations compiled (``failed`` of
    them raised, left to their first launch), ``record_s`` / ``compile_s`` wall seconds of the two
    passes, ``workers`` threads. ``skipped``: why nothing was done (None when it ran)."""

    kernels: int = 0
    failed: int = 0
    record_s: float = 0.0
    compile_s: float = 0.0
    workers: int = 0
    skipped: str | None = None


def precompile_enabled(device) -> bool:
    """True for a CUDA device, outside the interpreter, unless ``MEMRA_PRECOMPILE=0``."""
    import torch

    if torch.device(device).type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return os.environ.get("MEMRA_PRECOMPILE", "1") != "0"


def precompile(calls: Iterable[Callable[[], object]], device, workers: int | None = None) -> PrecompileReport:
    """Record the not-yet-compiled Triton launches of ``calls`` (run in order, results dropped,
    kernels skipped) and compile them on ``workers`` threads (default: the CPU count, at most 32).

    Args:
        calls: zero-argument callables doing GPU work whose results nothing reads.
        device: the CUDA device the calls run on (nothing is done for another device type).
        workers: compile threads (>= 1).

    Returns: a :class:`PrecompileReport`.

    Raises:
        ValueError: ``workers`` < 1.
        Any exception a call raises in the record pass (the hook is removed first).
    """
    if workers is not None and workers < 1:
        raise ValueError(f"precompile: workers must be >= 1, got {workers}")
    if not precompile_enabled(device):
        return PrecompileReport(skipped="not a CUDA device, interpreter, or MEMRA_PRECOMPILE=0")
    import triton
    from triton import knobs

    if not hasattr(triton, "AsyncCompileMode") or not hasattr(knobs.runtime, "jit_cache_hook"):
        return PrecompileReport(skipped=f"Triton {triton.__version__} has no AsyncCompileMode / jit_cache_hook")
    seen: dict[tuple[int, str], tuple[object, str]] = {}
    held = _take_compiled()  # (jit function, its kernel cache, the kernels taken out)

    compiled = {(id(jf), key) for jf, _, kernels in held for key in kernels}

    def record(*, key, fn, compile, **_):  # noqa: A002 - Triton's keyword
        k = (id(fn.jit_function), str(key))
        if k not in compiled:
            seen.setdefault(k, (fn.jit_function, compile["specialization_data"]))
        return True  # skip: neither compile nor launch

    t0 = time.perf_counter()
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = record
    _RECORDING[0] = True
    try:
        for call in calls:
            call()
    finally:
        _RECORDING[0] = False
        knobs.runtime.jit_cache_hook = previous
        for _, cache, kernels in held:
            cache.update(kernels)
    t1 = time.perf_counter()
    n = workers or min(32, os.cpu_count() or 1)
    failed = 0
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="memra-precompile") as pool:
        mode = triton.AsyncCompileMode(pool, ignore_errors=True)
        with mode:
            for jit_function, spec in seen.values():
                jit_function.preload(spec)
        failed = sum(1 for f in mode.raw_futures if f.exception() is not None)
    return PrecompileReport(kernels=len(seen), failed=failed, record_s=t1 - t0, compile_s=time.perf_counter() - t1,
                            workers=n)


def _take_compiled() -> list[tuple[object, dict, dict]]:
    """Empty the in-memory kernel caches of every Triton JITFunction in memra's kernel modules
    imported so far; returns (function, cache, what it held) to put back."""
    import sys

    from triton.runtime.jit import JITFunction

    out = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("memra."):
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, JITFunction):
                for caches in obj.device_caches.values():
                    cache = caches[0]
                    if cache:
                        out.append((obj, cache, dict(cache)))
                        cache.clear()
    return out
