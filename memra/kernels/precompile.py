"""Compile the Triton kernels a piece of GPU work will launch, in parallel, before it runs.

A cold engine start (empty Triton cache) used to compile every kernel specialization one after
another on first launch, in the KV-budget profile run and in the CUDA-graph warm-up: about 37 s
of a 46 s start on the H100 for the 12-layer step35 file (46 specializations of 14 kernels,
``memra bench file``, NOTES.md). :func:`precompile` does the same work in three passes:

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
2. compile: every distinct specialization is compiled for the GPU's target by worker processes
   (``python -m memra.kernels.precompile``, fresh interpreters that never touch the GPU: code
   generation, LLVM and ptxas run on the CPU). Each writes the kernel and its launcher stub to
   Triton's disk cache. Processes, not threads: Triton's code generation holds the GIL, so
   threads gained 1.45x on 2 cores where processes scale with the cores;
3. load: ``JITFunction.preload`` in this process finds each kernel in the disk cache (the cache
   key is the same: same source, options and cache-invalidating environment) and fills the
   kernel's in-memory cache, where the real run finds it.

:func:`start_workers` starts the pool early (the engine calls it before it loads the weights),
so the workers' imports overlap the load. A specialization the record pass did not see, or one a
worker failed to compile, compiles in this process in the load pass (as on first launch before),
so the mechanism changes start-up time, never results. On the CPU, under the interpreter
(``TRITON_INTERPRET=1``) or without ``MEMRA_PRECOMPILE=1`` (off by default for now) it does nothing.
``MEMRA_PRECOMPILE_WORKERS`` sets the pool size (default: the CPUs this process may use, at most 16).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

__all__ = ["PrecompileReport", "precompile", "precompile_enabled", "recording", "start_workers", "stop_workers"]

_RECORDING = [False]
_POOL: list = [None, 0]  # the worker pool and its size


def recording() -> bool:
    """True inside :func:`precompile`'s record pass (kernel launches are skipped: see the module
    docstring)."""
    return _RECORDING[0]


@dataclass
class PrecompileReport:
    """What :func:`precompile` did: ``kernels`` distinct specializations compiled (``failed`` of
    them failed in a worker and compiled in this process instead), ``record_s`` / ``compile_s`` /
    ``load_s`` wall seconds of the three passes, ``workers`` processes, ``functions`` how many
    specializations of each kernel (``"module:qualname"``). ``skipped``: why nothing was done
    (None when it ran)."""

    kernels: int = 0
    failed: int = 0
    record_s: float = 0.0
    compile_s: float = 0.0
    load_s: float = 0.0
    workers: int = 0
    skipped: str | None = None
    functions: dict[str, int] = field(default_factory=dict)  # "module:qualname" -> specializations compiled
    errors: list[str] = field(default_factory=list)  # the workers' distinct errors (``failed``)
    cache_hits: int = 0  # of the ``kernels`` loads here, how many found the workers' result on disk


def precompile_enabled(device) -> bool:
    """True for a CUDA device, outside the interpreter, with ``MEMRA_PRECOMPILE=1`` (off by
    default until the whole GPU suite has run with it on: :mod:`memra.envflags` reads the value).

    Raises: ValueError: the variable holds a value that is neither on nor off."""
    import torch

    if torch.device(device).type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    from ..envflags import env_flag

    return env_flag("MEMRA_PRECOMPILE", False)


def default_workers() -> int:
    """``MEMRA_PRECOMPILE_WORKERS``, else the CPUs this process may run on, at most 16.

    Raises: ValueError: the variable is not an integer >= 1."""
    env = os.environ.get("MEMRA_PRECOMPILE_WORKERS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"MEMRA_PRECOMPILE_WORKERS must be an integer >= 1, got {env!r}")
        return int(env)
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(16, n))


def _worker_init() -> None:
    # what the compiles will need (Triton, torch, memra's kernel modules), imported once per
    # worker while the parent does other work; a module that fails to import here is retried
    # (and its error reported) by the compile that needs it
    import importlib
    import pkgutil

    import torch  # noqa: F401
    import triton.compiler.compiler  # noqa: F401

    from memra import kernels

    for m in pkgutil.iter_modules(kernels.__path__, "memra.kernels."):
        try:
            importlib.import_module(m.name)
        except Exception:  # noqa: BLE001, S112
            continue


class _Workers:
    """``n`` compile processes, each ``python -m memra.kernels.precompile``: one JSON task per line
    on its stdin (``where``, ``spec``, ``target``: :func:`compile_specialization`'s arguments), one
    JSON result per line on its stdout (``ok``, ``seconds`` or ``error``). Plain subprocesses, not
    multiprocessing: a spawned multiprocessing child re-imports the parent's main script, which in a
    user's script without a ``__main__`` guard would run the script (and load the model) again."""

    def __init__(self, n: int):
        import subprocess
        import sys

        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # where our modules are
        self.procs = [subprocess.Popen([sys.executable, "-m", "memra.kernels.precompile"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
                      for _ in range(n)]

    def map(self, tasks: list[dict]) -> list[dict]:
        """Run ``tasks`` on the workers (each worker takes the next task when done); results in
        task order. A task whose worker died gets ``{"ok": False, "error": ...}``."""
        import json
        import queue
        import threading

        todo: queue.Queue = queue.Queue()
        for i, t in enumerate(tasks):
            todo.put((i, t))
        results: list[dict | None] = [None] * len(tasks)

        def drive(p) -> None:
            while True:
                try:
                    i, t = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    p.stdin.write(json.dumps(t) + "\n")
                    p.stdin.flush()
                    line = p.stdout.readline()
                except (OSError, ValueError) as e:  # a dead worker's pipe
                    line, err = "", repr(e)
                else:
                    err = f"worker exited with status {p.poll()}"
                if not line:
                    results[i] = {"ok": False, "error": err}
                    return  # this worker is gone; the others take the rest
                results[i] = json.loads(line)

        threads = [threading.Thread(target=drive, args=(p,), daemon=True) for p in self.procs]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return [r if r is not None else {"ok": False, "error": "no live worker"} for r in results]

    def close(self) -> None:
        import subprocess

        for p in self.procs:
            try:
                p.stdin.close()  # end of tasks: the worker exits
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _serve() -> None:
    """A worker's loop (``python -m memra.kernels.precompile``): tasks from stdin, results to stdout.
    Library output meant for stdout goes to stderr, so that stdout carries only results."""
    import json
    import sys

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        os.nice(5)  # the parent's work (loading the weights) first
    except OSError:
        pass
    _worker_init()
    for line in sys.stdin:
        t = json.loads(line)
        try:
            r = {"ok": True, "seconds": compile_specialization(t["where"], t["spec"], tuple(t["target"]))}
        except Exception as e:  # noqa: BLE001 - reported; the parent compiles it itself
            r = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        out.write(json.dumps(r) + "\n")
        out.flush()


def start_workers(workers: int | None = None) -> int:
    """Start (once) ``workers`` compile processes (default :func:`default_workers`), which import
    Triton, torch and memra's kernels in the background. Returns their number. Cheap to call again."""
    if _POOL[0] is None:
        n = workers or default_workers()
        _POOL[0], _POOL[1] = _Workers(n), n
    return _POOL[1]


def stop_workers() -> None:
    """Stop the compile processes (the engine calls it once its start-up is done)."""
    pool, _POOL[0], _POOL[1] = _POOL[0], None, 0
    if pool is not None:
        pool.close()


def precompile(calls: Iterable[Callable[[], object]], device, workers: int | None = None) -> PrecompileReport:
    """Record the not-yet-compiled Triton launches of ``calls`` (run in order, results dropped,
    kernels skipped), compile them in worker processes and load them here.

    Args:
        calls: zero-argument callables doing GPU work whose results nothing reads.
        device: the CUDA device the calls run on (nothing is done for another device type).
        workers: compile processes (>= 1) if no pool is running (default :func:`default_workers`).

    Returns: a :class:`PrecompileReport`.

    Raises:
        ValueError: ``workers`` < 1.
        Any exception a call raises in the record pass (the hook is removed first).
    """
    if workers is not None and workers < 1:
        raise ValueError(f"precompile: workers must be >= 1, got {workers}")
    if not precompile_enabled(device):
        return PrecompileReport(skipped="not a CUDA device, interpreter, or MEMRA_PRECOMPILE off")
    import triton
    from triton import knobs

    if not hasattr(knobs.runtime, "jit_cache_hook"):
        return PrecompileReport(skipped=f"Triton {triton.__version__} has no jit_cache_hook")
    seen: dict[tuple[int, str], tuple[object, str, str]] = {}
    held = _take_compiled()  # (jit function, its kernel cache, the kernels taken out)
    compiled = {(id(jf), key) for jf, _, kernels in held for key in kernels}

    def record(*, key, fn, compile, **_):  # noqa: A002 - Triton's keyword
        k = (id(fn.jit_function), str(key))
        if k not in compiled:
            seen.setdefault(k, (fn.jit_function, f"{fn.module}:{fn.name}", compile["specialization_data"]))
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
    if not seen:
        return PrecompileReport(record_s=t1 - t0, workers=_POOL[1])
    from triton.runtime.driver import driver

    target = driver.active.get_current_target()
    try:
        n = start_workers(workers)
        results = _POOL[0].map([dict(where=where, spec=spec, target=[target.backend, target.arch, target.warp_size])
                                for _, where, spec in seen.values()])
    except OSError as e:  # no processes allowed: all compiled below, here
        n, results = 0, [{"ok": False, "error": repr(e)}] * len(seen)
    failed = sum(not r["ok"] for r in results)
    errors = sorted({r["error"] for r in results if not r["ok"]})
    t2 = time.perf_counter()
    hits = []
    listener = knobs.compilation.listener

    def count(**kw):  # Triton's compile listener: was each preload a disk-cache hit?
        hits.append(bool(kw.get("cache_hit")))
        if listener is not None:
            listener(**kw)

    knobs.compilation.listener = count
    try:
        for jit_function, _, spec in seen.values():
            jit_function.preload(spec)  # a disk-cache hit, or this process compiles it
    finally:
        knobs.compilation.listener = listener
    functions: dict[str, int] = {}
    for _, where, _ in seen.values():
        functions[where] = functions.get(where, 0) + 1
    return PrecompileReport(kernels=len(seen), failed=failed, record_s=t1 - t0, compile_s=t2 - t1,
                            load_s=time.perf_counter() - t2, workers=n, functions=functions, errors=errors,
                            cache_hits=sum(hits))


def compile_specialization(where: str, spec: str, target: tuple) -> float:
    """Compile one recorded specialization into Triton's disk cache, without a GPU (a worker's job).

    Args:
        where: ``"module:qualname"`` of the ``@triton.jit`` function.
        spec: its ``specialization_data`` JSON (Triton's jit-hook format, read as
            ``JITFunction.preload`` reads it).
        target: ``(backend, arch, warp_size)`` of the GPU, e.g. ``("cuda", 90, 32)``.

    Returns: the seconds it took.

    Raises:
        LookupError: ``where`` names no JIT function.
        Whatever Triton's compiler raises.
    """
    import importlib
    import json

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction

    t0 = time.perf_counter()
    module, _, qualname = where.partition(":")
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part, None)
    while fn is not None and not isinstance(fn, JITFunction):
        fn = getattr(fn, "fn", None)  # an autotuner / heuristics wrapper
    if fn is None:
        raise LookupError(f"precompile: no Triton JIT function at {where}")
    d = json.loads(spec)
    constexprs = {tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else
                  tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
                  for k, v in zip(d["constant_keys"], d["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(d["attrs_keys"], d["attrs_vals"])}
    signature = {k: _tuples(v) for k, v in d["signature"].items()}
    gpu = GPUTarget(*target)
    backend = make_backend(gpu)
    options = backend.parse_options({k: tuple(v) if isinstance(v, list) else v for k, v in d["options"].items()})
    src = ASTSource(fn, signature, constexprs, attrs)
    kernel = triton.compile(src, target=gpu, options=options.__dict__)
    if gpu.backend == "cuda":  # the launcher stub (a C module, cached by its source): built at first launch otherwise
        from triton.backends.nvidia.driver import CudaLauncher

        try:
            CudaLauncher(kernel.src, kernel.metadata)
        except Exception:  # noqa: BLE001 - no libcuda here (a machine without a GPU): left to the first launch
            pass
    return time.perf_counter() - t0


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


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


if __name__ == "__main__":
    _serve()
