"""Compile the Triton kernels a piece of GPU work will launch, in parallel, before it runs.

A cold engine start (empty Triton cache) used to compile every kernel specialization one after
another on first launch, in the KV-budget profile run and in the CUDA-graph warm-up: about 37 s
of a 46 s start on the H100 for the 12-layer step35 file (46 specializations of 14 kernels,
``memra bench file``, NOTES.md). :func:`precompile` does the same work in three passes:

1. record: the calls run, in the calling thread, with Triton's ``knobs.runtime.jit_cache_hook``
   set to a hook that records each launch's specialization (``specialization_data``, the JSON
   that ``JITFunction.preload`` reads back) and answers "skip": the launch is then neither
   compiled nor launched (Triton returns before both). Every Triton kernel compiled already (any
   ``JITFunction`` in the process) is taken out of its in-memory cache for the pass and put back
   after, so it is skipped too: no kernel runs on a skipped kernel's output. Those outputs are
   ``torch.empty`` garbage and the calls' results are dropped: use it only on work whose outputs
   nothing reads (warm-up and profile runs) and whose host code does not branch on what kernels
   would have written. Torch ops still run on the garbage; the one integer tensor a kernel writes
   and torch then indexes with, the router's top-k experts
   (:func:`memra.kernels.fused.router_topk`, read by the torch paths of ``moe_align`` and
   ``moe_group``), is zeroed while :func:`recording`. Launches from other threads are not
   touched (the hook and :func:`recording` answer for the recording thread only);
2. compile: the specializations not in Triton's disk cache yet (this process computes each one's
   cache key, as ``triton.compile`` does) are compiled for the GPU's target by worker processes
   (``python -m memra.kernels.precompile``, fresh interpreters that never touch the GPU: code
   generation, LLVM and ptxas run on the CPU), each writing the kernel and its launcher stub to
   the disk cache. Processes, not threads: Triton's code generation holds the GIL, so threads
   gained 1.45x on 2 cores where processes scale with the cores. The workers start only when
   something is missing (a warm start starts none), and stop at the end of the call unless
   ``keep_workers`` (the engine keeps them from its profile step to its CUDA-graph capture);
3. load: ``JITFunction.preload`` in this process finds each kernel in the disk cache and fills
   the kernel's in-memory cache, where the real run finds it.

A warm start (every kernel on disk) spends this function's time in the record pass, a Python run of
the work. With a ``manifest`` key (the engine passes one naming its model file, config and GPU) a
call that recorded writes what it saw to a manifest in Triton's cache directory, and the next call
with the same key loads the kernels it names without recording, while they are all on disk.

Nothing here changes results: a specialization the record pass did not see, one a worker failed
to compile (or took longer than :data:`TASK_TIMEOUT_S`) and one whose load failed all compile on
first launch, as before; a record pass that raises is abandoned (the report says why) and the
real run that follows meets the same error, if it is one. On the CPU, under the interpreter
(``TRITON_INTERPRET=1``) or with ``MEMRA_PRECOMPILE=0`` (on by default since the whole GPU
suite passed with it on, H200, 2026-12-07) it does nothing. ``MEMRA_PRECOMPILE_WORKERS`` sets the number of workers (default: the CPUs this process
may use, at most 16).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .envflags import env_flag, triton_interpreted

__all__ = ["PrecompileReport", "TASK_TIMEOUT_S", "compile_specialization", "default_workers", "describe", "precompile",
           "precompile_enabled", "recording", "settle_cache_keys", "start_workers", "stop_workers", "warm_triton_key"]

#: seconds a worker may spend on one specialization before it is killed (the kernel then compiles
#: in the engine's process, on first launch)
TASK_TIMEOUT_S = 300.0

_RECORDER: list[int | None] = [None]  # the thread id of the record pass in progress
_ABANDONED = "record pass raised "  # how a report's ``skipped`` starts when the record pass raised
_POOL: list = [None, 0]  # the workers and their number
_SETTLED: set[str] = set()  # the kernel modules settle_cache_keys has seen
_LOCK = threading.Lock()  # held by the precompile call in progress


def recording() -> bool:
    """True in the thread running :func:`precompile`'s record pass (kernel launches are skipped:
    see the module docstring)."""
    return _RECORDER[0] is not None and _RECORDER[0] == threading.get_ident()


@dataclass
class PrecompileReport:
    """What :func:`precompile` did. ``kernels``: distinct specializations recorded; ``on_disk`` of
    them were in Triton's disk cache already, the others went to ``workers`` processes, where
    ``failed`` of them failed (they compile here, on first launch); ``cache_hits``: loads here that
    found the kernel on disk; ``record_s`` / ``compile_s`` / ``load_s``: wall seconds of the three
    passes; ``slowest_s``: the longest compile of one specialization in a worker;
    ``workers_ready_s``: seconds from the workers' start to the last one's hello (its imports:
    part of ``compile_s`` when this call started them); ``functions``: specializations per kernel
    (``"module:qualname"``); ``errors``: the distinct errors (workers' and loads'). ``skipped``: why
    nothing was done (None when it ran). ``from_manifest``: the specializations came from the
    manifest of an earlier call with the same ``manifest`` key (no record pass ran; see
    :func:`precompile`)."""

    kernels: int = 0
    on_disk: int = 0
    failed: int = 0
    cache_hits: int = 0
    record_s: float = 0.0
    compile_s: float = 0.0
    load_s: float = 0.0
    workers: int = 0
    slowest_s: float = 0.0
    workers_ready_s: float = 0.0
    skipped: str | None = None
    functions: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    from_manifest: bool = False


def precompile_enabled(device) -> bool:
    """True for a CUDA device, outside the interpreter, unless ``MEMRA_PRECOMPILE=0`` (on by
    default: :mod:`memra.kernels.envflags` reads the value).

    Raises: ValueError: the variable holds a value that is neither on nor off."""
    import torch

    if torch.device(device).type != "cuda" or triton_interpreted():
        return False
    return env_flag("MEMRA_PRECOMPILE", True)


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


def describe(reports: Iterable[PrecompileReport | None]) -> str:
    """One clause for an engine's start-up report: what the passes that ran precompiled, and the
    first record pass abandoned (``""`` when none ran and none was abandoned)."""
    reports = [r for r in reports if r is not None]
    done = [r for r in reports if r.skipped is None]
    out = ""
    if done:
        out += (f"; Triton kernels precompiled at start: {sum(r.kernels for r in done)} "
                f"({sum(r.on_disk for r in done)} on disk already) in "
                f"{sum(r.compile_s + r.load_s for r in done):.1f} s on {max(r.workers for r in done)} processes"
                + (f" (their start {max(r.workers_ready_s for r in done):.1f} s, the slowest kernel "
                   f"{max(r.slowest_s for r in done):.1f} s)" if any(r.workers for r in done) else "")
                + (f", {sum(r.failed for r in done)} left to their first launch" if any(r.failed for r in done)
                   else "")
                + (f", record passes {sum(r.record_s for r in done):.1f} s" if any(r.record_s for r in done) else "")
                + (f", {sum(r.kernels for r in done if r.from_manifest)} of them named by an earlier "
                   f"start's manifest (no record pass)" if any(r.from_manifest for r in done) else ""))
    abandoned = [r.skipped for r in reports if r.skipped and r.skipped.startswith(_ABANDONED)]
    if abandoned:
        out += f"; Triton precompile abandoned: {abandoned[0]}"
    return out


# ---------------------------------------------------------------------------------------
# the worker processes


def _worker_init() -> None:
    # what the compiles will need, imported once per worker: Triton's compiler and CUDA launcher
    # builder, and memra's kernel sources (the ``_*_triton`` modules, which import Triton only).
    # Not torch: nothing a compile does needs it, and 16 workers importing a CUDA build of torch
    # at once took seconds of a cold start. A module that fails to import here is retried (and
    # its error reported) by the compile that needs it; a task naming another module imports it.
    import importlib
    import pkgutil

    import triton.compiler.compiler  # noqa: F401

    try:
        import triton.backends.nvidia.driver  # noqa: F401
    except Exception:  # noqa: BLE001, S110 - another backend: nothing to prepare
        pass
    for m in pkgutil.iter_modules([os.path.dirname(os.path.abspath(__file__))], "memra.kernels."):
        if not m.name.endswith("_triton"):
            continue
        try:
            importlib.import_module(m.name)
        except Exception:  # noqa: BLE001, S112
            continue
    try:
        settle_cache_keys()
    except Exception:  # noqa: BLE001 - its keys may then differ from the engine's: the engine compiles those
        pass


def _memra_root() -> str:
    # the memra package directory this module belongs to (memra/kernels/precompile.py)
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Workers:
    """``n`` compile processes, each ``python -P -m memra.kernels.precompile`` (``-P``: the
    working directory does not shadow this process's memra). A worker first writes a hello line
    (``{"memra": its package directory, "init_s": its imports' seconds, "torch": whether they
    pulled torch in}``, kept in :attr:`hellos`; a worker running another copy of memra is not used),
    then answers one JSON task per line on its stdin (``where``, ``spec``, ``target``:
    :func:`compile_specialization`'s arguments) with one JSON result per line on its stdout
    (``ok``, ``seconds`` or ``error``); its stderr goes to a temporary log, whose tail a failure
    quotes. Plain subprocesses, not multiprocessing: a spawned multiprocessing child re-imports the
    parent's main script, which in a user's script without a ``__main__`` guard would run the
    script (and load the model) again.

    Raises: OSError: a process could not be started (the ones started are stopped first)."""

    def __init__(self, n: int):
        import subprocess
        import sys
        import tempfile

        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # where our modules are
        self.root = _memra_root()
        self.procs, self.logs = [], []
        try:
            for _ in range(n):
                log = tempfile.NamedTemporaryFile(prefix="memra-precompile-", suffix=".log", delete=False)
                self.logs.append(log)
                self.procs.append(subprocess.Popen([sys.executable, "-P", "-m", "memra.kernels.precompile"],
                                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                                   text=True, env=env))
        except OSError:
            self.close()
            raise
        self.started = time.perf_counter()
        self.ready_s = 0.0  # from the start to the last hello seen
        self.greeted = [False] * n
        self.hellos: list[dict] = [{} for _ in range(n)]  # what each worker said first
        self.refused: list[str | None] = [None] * n  # why a worker was not used

    def _tail(self, i: int) -> str:
        try:
            with open(self.logs[i].name, errors="replace") as f:
                return f.read()[-1500:].strip()
        except OSError:
            return ""

    def _dead(self, i: int, what: str) -> str:
        p = self.procs[i]
        try:
            p.wait(timeout=2)
        except Exception:  # noqa: BLE001 - still running: killed below, status unknown
            pass
        tail = self._tail(i)
        return f"{what} (worker status {p.poll()})" + (f": {tail}" if tail else "")

    def map(self, tasks: list[dict], timeout: float = TASK_TIMEOUT_S) -> list[dict]:
        """Run ``tasks`` on the workers (each worker takes the next task when done); results in
        task order. A task whose worker died, took more than ``timeout`` seconds (it is killed) or
        answered garbage gets ``{"ok": False, "error": ...}``; that worker takes no more tasks."""
        import json
        import queue

        todo: queue.Queue = queue.Queue()
        for i, t in enumerate(tasks):
            todo.put((i, t))
        results: list[dict | None] = [None] * len(tasks)

        def drive(w: int) -> None:
            p = self.procs[w]
            if not self.greeted[w]:  # the hello line, once (its imports may take a while on a busy machine)
                timer = threading.Timer(max(timeout, TASK_TIMEOUT_S), p.kill)
                timer.start()
                try:
                    hello = p.stdout.readline()
                finally:
                    timer.cancel()
                try:
                    self.hellos[w] = json.loads(hello)
                    theirs = self.hellos[w].get("memra")
                except (ValueError, AttributeError):
                    theirs = None
                if theirs != self.root:
                    p.kill()
                    self.refused[w] = (f"worker runs memra from {theirs}, not {self.root}" if theirs else
                                       self._dead(w, "worker did not start"))
                    return
                self.greeted[w] = True
                self.ready_s = max(self.ready_s, time.perf_counter() - self.started)
            while True:
                try:
                    i, t = todo.get_nowait()
                except queue.Empty:
                    return
                timer = threading.Timer(timeout, p.kill)
                timer.start()
                try:
                    p.stdin.write(json.dumps(t) + "\n")
                    p.stdin.flush()
                    line = p.stdout.readline()
                except (OSError, ValueError) as e:  # a dead worker's pipe
                    line = ""
                    results[i] = {"ok": False, "error": self._dead(w, repr(e))}
                finally:
                    timer.cancel()
                if not line:
                    if results[i] is None:
                        results[i] = {"ok": False, "error": self._dead(w, "worker exited or timed out")}
                    return  # this worker is gone; the others take the rest
                try:
                    results[i] = json.loads(line)
                except ValueError:
                    results[i] = {"ok": False, "error": f"worker answered {line[:200]!r}"}
                    p.kill()
                    return

        threads = [threading.Thread(target=drive, args=(w,), daemon=True) for w in range(len(self.procs))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        why = "; ".join(sorted({r for r in self.refused if r})) or "no live worker"
        return [r if r is not None else {"ok": False, "error": why} for r in results]

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
        for log in self.logs:
            log.close()
            try:
                os.unlink(log.name)
            except OSError:
                pass


def _serve() -> None:
    """A worker's loop (``python -m memra.kernels.precompile``): a hello line, then tasks from
    stdin and results to stdout. Library output meant for stdout goes to stderr, so that stdout
    carries only the protocol."""
    import json
    import sys

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        os.nice(5)  # the engine's own work first
    except OSError:
        pass
    t0 = time.perf_counter()
    _worker_init()
    out.write(json.dumps({"memra": _memra_root(), "init_s": time.perf_counter() - t0,
                          "torch": "torch" in sys.modules}) + "\n")
    out.flush()
    for line in sys.stdin:
        t = json.loads(line)
        try:
            r = {"ok": True, "seconds": compile_specialization(t["where"], t["spec"], tuple(t["target"]))}
        except Exception as e:  # noqa: BLE001 - reported; the parent compiles it itself
            r = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        out.write(json.dumps(r) + "\n")
        out.flush()


def start_workers(workers: int | None = None) -> int:
    """Start (once) ``workers`` compile processes (default :func:`default_workers`); returns their
    number. Cheap to call again.

    Raises: OSError: the processes could not be started."""
    if _POOL[0] is None:
        n = workers or default_workers()
        _POOL[0], _POOL[1] = _Workers(n), n
    return _POOL[1]


def warm_triton_key() -> threading.Thread | None:
    """Compute Triton's own cache-key salt on a daemon thread and return it (None where there is
    nothing to warm: no such function in this Triton, or the interpreter).

    ``triton.runtime.cache.triton_key`` is a SHA-256 of Triton's compiler sources and of
    libtriton (~0.35 s, once per process, cached), paid at a process's first kernel lookup, warm
    Triton cache or not. An engine calls this before reading its weights: the file reads and the
    hashing release the GIL, so the load hides it (measured on a 2-core CPU with a 2.5 GB read:
    0.65 s one after the other, 0.47 s together)."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return None
    if triton_interpreted():
        return None

    def run() -> None:
        try:
            triton_key()
        except Exception:  # noqa: BLE001 - the first kernel lookup computes it again and raises there
            pass

    t = threading.Thread(target=run, name="memra-triton-key", daemon=True)
    t.start()
    return t


def stop_workers() -> None:
    """Stop the compile processes, if any (waits for them to exit)."""
    pool, _POOL[0], _POOL[1] = _POOL[0], None, 0
    if pool is not None:
        pool.close()


# ---------------------------------------------------------------------------------------
# the three passes


def precompile(calls: Iterable[Callable[[], object]], device, workers: int | None = None,
               keep_workers: bool = False, manifest: str | None = None) -> PrecompileReport:
    """Record the not-yet-compiled Triton launches of ``calls`` (run in order in this thread,
    results dropped, kernels skipped), compile those missing from the disk cache in worker
    processes, and load them all here.

    Args:
        calls: zero-argument callables doing GPU work whose results nothing reads.
        device: the CUDA device the calls run on (nothing is done for another device type).
        workers: compile processes (>= 1) if none are running (default :func:`default_workers`).
        keep_workers: leave the workers running for a next call (:func:`stop_workers` ends them);
            by default they stop before this returns.
        manifest: a key naming the work (the caller's: everything that decides which kernels
            ``calls`` launch, e.g. the model file and the engine's config). A call whose record pass
            went through with nothing left to first launch writes the specializations it saw to a
            manifest in Triton's cache directory (``memra-precompile/``, under a hash of the key,
            Triton's version, the contents of memra's source files, the GPU target and the
            ``MEMRA_*`` / ``TRITON_*`` environment): every launch it saw, kernels this process had
            compiled before included. A later call with the same key whose manifest names only
            kernels on disk skips the record pass, i.e. a Python run of ``calls`` (the warm start's
            cost of this function), and only loads them. A manifest that is stale, unreadable or names
            a kernel no longer on disk is ignored: the record pass runs. Never a question of
            results, only of time: a kernel the manifest missed compiles at its first launch.

    Returns: a :class:`PrecompileReport`; a record pass that raised gives ``skipped`` with the error
    (the calls' real run, after this, meets it again if it is one).

    Raises:
        ValueError: ``workers`` < 1, or ``MEMRA_PRECOMPILE`` holds neither an on nor an off value.
    """
    if workers is not None and workers < 1:
        raise ValueError(f"precompile: workers must be >= 1, got {workers}")
    if not precompile_enabled(device):
        return PrecompileReport(skipped="not a CUDA device, interpreter, or MEMRA_PRECOMPILE off")
    import triton
    from triton import knobs

    if not hasattr(knobs.runtime, "jit_cache_hook"):
        return PrecompileReport(skipped=f"Triton {triton.__version__} has no jit_cache_hook")
    if not _LOCK.acquire(blocking=False):  # one at a time in a process: a record pass empties every kernel cache
        return PrecompileReport(skipped="another precompile is running")
    try:
        return _precompile(calls, workers, keep_workers, manifest)
    finally:
        _LOCK.release()


def _precompile(calls, workers, keep_workers, manifest) -> PrecompileReport:
    # precompile's passes, under _LOCK
    from triton import knobs
    from triton.runtime.driver import driver

    target = driver.active.get_current_target()
    tgt = [target.backend, target.arch, target.warp_size]
    mpath = _manifest_path(manifest, tgt) if manifest is not None else None
    if mpath is not None:
        report = _load_manifest(mpath, tgt)
        if report is not None:
            if not keep_workers:
                stop_workers()
            return report
    seen: dict[tuple[int, str], tuple[object, str, str]] = {}
    launched: dict[tuple[int, str], tuple[str, str, str]] = {}  # every launch, compiled before or not (the manifest)
    held = _take_compiled()  # (jit function, its kernel cache, the kernels taken out)
    compiled = {(id(jf), key) for jf, _, kernels in held for key in kernels}
    me = threading.get_ident()
    previous = knobs.runtime.jit_cache_hook

    def record(*, key, fn, compile, **kw):  # noqa: A002 - Triton's keyword
        if threading.get_ident() != me:  # another thread's launch: as usual
            return previous(key=key, fn=fn, compile=compile, **kw) if previous is not None else None
        k = (id(fn.jit_function), str(key))
        launched.setdefault(k, (f"{fn.module}:{fn.name}", compile["specialization_data"], str(key)))
        if k not in compiled:
            seen.setdefault(k, (fn.jit_function, f"{fn.module}:{fn.name}", compile["specialization_data"]))
        return True  # skip: neither compile nor launch

    t0 = time.perf_counter()
    knobs.runtime.jit_cache_hook = record
    _RECORDER[0] = me
    failure = None
    try:
        for call in calls:
            call()
    except Exception as e:  # noqa: BLE001 - abandoned: the real run meets it again if it is the model's
        failure = f"{_ABANDONED}{type(e).__name__}: {e}"[:2000]
    finally:
        _RECORDER[0] = None
        knobs.runtime.jit_cache_hook = previous
        for _, cache, kernels in held:
            cache.update(kernels)
    t1 = time.perf_counter()
    functions = _functions(where for _, where, _ in seen.values())
    if failure is not None:
        if not keep_workers:
            stop_workers()
        return PrecompileReport(kernels=len(seen), record_s=t1 - t0, skipped=failure, functions=functions)
    try:
        settle_cache_keys()  # the workers' keys, whatever this process hashed first
    except Exception as e:  # noqa: BLE001 - then every kernel compiles here, on first launch, as without
        if not keep_workers:
            stop_workers()
        return PrecompileReport(kernels=len(seen), record_s=t1 - t0, functions=functions,
                                skipped=f"cache keys not settled: {type(e).__name__}: {e}"[:2000])
    missing = [(jf, where, spec) for jf, where, spec in seen.values() if not _on_disk(jf, spec, tgt)]
    errors: set[str] = set()
    n = failed = 0
    slowest = ready = 0.0
    if missing:
        try:
            n = start_workers(workers)
            results = _POOL[0].map([dict(where=where, spec=spec, target=tgt) for _, where, spec in missing])
        except OSError as e:  # no processes allowed: all compiled here, on first launch
            results = [{"ok": False, "error": f"workers not started: {e!r}"}] * len(missing)
        failed = sum(not r["ok"] for r in results)
        errors.update(r["error"] for r in results if not r["ok"])
        slowest = max((r.get("seconds", 0.0) for r in results if r["ok"]), default=0.0)
        ready = _POOL[0].ready_s if _POOL[0] is not None else 0.0
    if not keep_workers:
        stop_workers()
    t2 = time.perf_counter()
    hits = _preload(seen.values(), errors)
    if mpath is not None and not failed and not errors:
        _write_manifest(mpath, list(launched.values()))
    return PrecompileReport(kernels=len(seen), on_disk=len(seen) - len(missing), failed=failed,
                            cache_hits=sum(hits), record_s=t1 - t0, compile_s=t2 - t1,
                            load_s=time.perf_counter() - t2, workers=n, slowest_s=slowest,
                            workers_ready_s=ready, functions=functions,
                            errors=sorted(errors))


# ---------------------------------------------------------------------------------------
# the manifest: a warm start's record pass skipped

_MANIFEST_DIR = "memra-precompile"


def _manifest_path(key: str, target) -> str | None:
    """Where the manifest of ``key`` lives: Triton's cache directory, ``memra-precompile/<sha256>.json``,
    the hash over the key, the target, Triton's version, the contents of memra's ``.py`` and
    ``.json`` files (host code and tuned tables decide which kernels launch, with what) and the
    ``MEMRA_*`` and ``TRITON_*`` environment. None when that cannot be computed (no cache
    directory, a file that cannot be read)."""
    import hashlib

    import triton
    from triton import knobs

    try:
        base = knobs.cache.dir
        if not base:
            return None
        h = hashlib.sha256()
        for part in (key, repr(list(target)), triton.__version__, _sources_digest()):
            h.update(part.encode("utf-8", "surrogateescape") + b"\0")
        for k in sorted(os.environ):
            if k.startswith(("MEMRA_", "TRITON_")):
                h.update(f"{k}={os.environ[k]}\0".encode("utf-8", "surrogateescape"))
        return os.path.join(base, _MANIFEST_DIR, h.hexdigest() + ".json")
    except Exception:  # noqa: BLE001 - no manifest then: the record pass runs
        return None


_SOURCES: list[str] = []  # the digest of memra's sources, once per process


def _sources_digest() -> str:
    """SHA-256 of memra's ``.py`` and ``.json`` files (names and contents), computed once per
    process: what runs is what was imported.

    Raises: OSError: a file cannot be read."""
    if not _SOURCES:
        import hashlib

        h = hashlib.sha256()
        root = _memra_root()
        for dirpath, dirnames, filenames in os.walk(root):  # the memra package directory
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith((".py", ".json")) and not name.startswith("."):
                    f = os.path.join(dirpath, name)
                    with open(f, "rb") as fh:
                        data = fh.read()
                    h.update(os.path.relpath(f, root).encode("utf-8", "surrogateescape") + b"\0"
                             + len(data).to_bytes(8, "little") + data)
        _SOURCES.append(h.hexdigest())
    return _SOURCES[0]


def _write_manifest(path: str, entries: list[tuple[str, str, str]]) -> None:
    """Write ``[[where, spec, key], ...]`` (``key``: the launch's in-memory cache key) to ``path``
    through a temporary file and a rename, so that a reader never sees half of it (two engines
    starting at once: the last rename wins, both whole); a failure to write is ignored (the next
    start records again)."""
    import json
    import tempfile

    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": 2, "kernels": [list(e) for e in entries]}, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _load_manifest(path: str, target) -> PrecompileReport | None:
    """Load every specialization the manifest at ``path`` names and report it, or None (the caller
    runs the record pass) when the manifest is missing, unreadable, names a function that is
    gone, or a kernel not in the disk cache."""
    import json

    t0 = time.perf_counter()
    try:
        with open(path) as f:
            d = json.load(f)
        entries = [(str(w), str(sp), str(k)) for w, sp, k in d["kernels"]] if d.get("version") == 2 else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if entries is None:
        return None
    try:
        fns = [_jit_function(where) for where, _, _ in entries]
        settle_cache_keys()
    except Exception:  # noqa: BLE001 - a function gone or unhashable: record instead
        return None
    # the ones this process has in memory already (an earlier call loaded them) are not loaded again
    todo = [(fn, where, spec) for fn, (where, spec, key) in zip(fns, entries)
            if not any(key in caches[0] for caches in fn.device_caches.values())]
    if not all(_on_disk(fn, spec, target) for fn, _, spec in todo):
        return None
    t1 = time.perf_counter()
    errors: set[str] = set()
    hits = _preload(todo, errors)
    return PrecompileReport(kernels=len(todo), on_disk=len(todo), cache_hits=sum(hits), compile_s=t1 - t0,
                            load_s=time.perf_counter() - t1, functions=_functions(w for _, w, _ in todo),
                            errors=sorted(errors), from_manifest=True)


def _preload(items, errors: set[str]) -> list[bool]:
    """``JITFunction.preload`` of each (function, where, spec): a disk-cache hit, or this process
    compiles it; returns whether each load was a hit (Triton's compile listener) and adds a
    failed load's error to ``errors`` (that kernel is left to its first launch, which reports a
    real error)."""
    from triton import knobs

    hits: list[bool] = []
    listener = knobs.compilation.listener

    def count(**kw):
        hits.append(bool(kw.get("cache_hit")))
        if listener is not None:
            listener(**kw)

    knobs.compilation.listener = count
    try:
        for fn, where, spec in items:
            try:
                fn.preload(spec)
            except Exception as e:  # noqa: BLE001 - left to its first launch
                errors.add(f"load of {where}: {type(e).__name__}: {e}"[:2000])
    finally:
        knobs.compilation.listener = listener
    return hits


def _functions(wheres) -> dict[str, int]:
    """Specializations per kernel (``"module:qualname"``), for a report."""
    out: dict[str, int] = {}
    for where in wheres:
        out[where] = out.get(where, 0) + 1
    return out


def _jit_function(where: str):
    """The ``@triton.jit`` function at ``"module:qualname"`` (through autotuner / heuristics wrappers).

    Raises: LookupError: nothing there; ImportError: no such module."""
    import importlib

    from triton.runtime.jit import JITFunction

    module, _, qualname = where.partition(":")
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part, None)
    while fn is not None and not isinstance(fn, JITFunction):
        fn = getattr(fn, "fn", None)  # an autotuner / heuristics wrapper
    if fn is None:
        raise LookupError(f"precompile: no Triton JIT function at {where}")
    return fn


def _decode(fn, spec: str, target) -> tuple[object, object, object]:
    """(ASTSource, parsed options, GPUTarget) of a recorded specialization, read as
    ``JITFunction.preload`` reads it (Triton 3.6's jit-hook JSON)."""
    import json

    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    d = json.loads(spec)
    constexprs = {tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else
                  tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
                  for k, v in zip(d["constant_keys"], d["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(d["attrs_keys"], d["attrs_vals"])}
    signature = {k: _tuples(v) for k, v in d["signature"].items()}
    gpu = GPUTarget(*target)
    options = make_backend(gpu).parse_options({k: tuple(v) if isinstance(v, list) else v
                                               for k, v in d["options"].items()})
    return ASTSource(fn, signature, constexprs, attrs), options, gpu


def _on_disk(fn, spec: str, target) -> bool:
    """Whether ``triton.compile`` would find this specialization in the disk cache (the same key
    and lookup as its own; False when that cannot be told)."""
    try:
        import hashlib

        from triton import knobs
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.compiler.compiler import make_backend
        from triton.runtime.cache import get_cache_key, get_cache_manager

        src, options, gpu = _decode(fn, spec, target)
        backend = make_backend(gpu)
        options = backend.parse_options(dict(options.__dict__, **src.parse_options()))
        key = get_cache_key(src, backend, options, env_vars=get_cache_invalidating_env_vars())
        name = f"{src.name[:150]}.json"
        group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name) or {}
        return not knobs.compilation.always_compile and group.get(name) is not None
    except Exception:  # noqa: BLE001 - unknown: let a worker compile it
        return False


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
    import triton

    t0 = time.perf_counter()
    fn = _jit_function(where)
    module = where.partition(":")[0]
    if module.startswith(__package__ + ".") and module not in _SETTLED:  # imported now (_worker_init failed it)
        settle_cache_keys()
    src, options, gpu = _decode(fn, spec, target)
    kernel = triton.compile(src, target=gpu, options=options.__dict__)
    if gpu.backend == "cuda":  # the launcher stub (a C module, cached by its source): built at first launch otherwise
        from triton.backends.nvidia.driver import CudaLauncher

        try:
            CudaLauncher(kernel.src, kernel.metadata)
        except Exception:  # noqa: BLE001 - no libcuda here (a machine without a GPU): left to the first launch
            pass
    return time.perf_counter() - t0


def settle_cache_keys(modules: Iterable[str] | None = None) -> int:
    """Make the Triton cache key of every JIT function in memra's imported kernel modules (or in
    the imported ``modules``, by name) independent of the order in which this process first
    computed them; returns how many passes that took.

    Triton 3.6's ``JITCallable.cache_key`` merges a called helper's ``used_global_vals`` into the
    caller's before it computes the helper's own key (``DependenciesFinder._update_hash``), so a
    kernel whose helper was not hashed yet misses the helper's global constexprs (``_F8_TOP`` of
    the GEMV helpers, say) and gets another key than in a process where the helper came first.
    The engine and the precompile workers hash kernels in different orders: their keys differed
    and the engine missed the workers' disk-cache entries (the MoE decode kernels, found on the
    H100). Fixed upstream (triton-lang/triton#10494, later than 3.6). Here every key is
    recomputed, helpers' merged globals included, until no key changes: the result depends only
    on each kernel's call graph (each pass settles one more level of calls). The engine calls
    this before the compile pass, each worker after importing the kernel modules. Only module-level
    functions (and autotuner / heuristics wrappers') are reset: memra defines no other.

    Raises: RuntimeError: no fixed point after 16 passes (a call chain that deep); whatever
    Triton's hashing raises for a function (the engine's caller catches both).
    """
    import sys

    from triton.runtime.jit import JITCallable

    names = set(modules) if modules is not None else None
    fns: dict[int, JITCallable] = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name in names if names is not None else name.startswith(__package__ + ".")):
            continue
        for obj in list(vars(mod).values()):
            for _ in range(4):  # an autotuner / heuristics wrapper holds the function as .fn
                if isinstance(obj, JITCallable) or not hasattr(obj, "fn"):
                    break
                obj = obj.fn
            if isinstance(obj, JITCallable):
                fns[id(obj)] = obj
        _SETTLED.add(name)
    before = None
    for n in range(1, 17):
        for f in fns.values():
            with f._hash_lock:
                f.hash = None
        keys = {i: f.cache_key for i, f in fns.items()}
        if keys == before:
            return n
        before = keys
    raise RuntimeError("settle_cache_keys: Triton cache keys did not settle in 16 passes")


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _take_compiled() -> list[tuple[object, dict, dict]]:
    """Empty the in-memory kernel caches of every Triton JITFunction in the process (memra's and
    any other library's: an already compiled kernel would launch on the record pass's garbage);
    returns (function, cache, what it held) to put back."""
    import gc

    from triton.runtime.jit import JITFunction

    out = []
    for obj in gc.get_objects():
        if isinstance(obj, JITFunction):
            for caches in obj.device_caches.values():
                cache = caches[0]
                if cache:
                    out.append((obj, cache, dict(cache)))
                    cache.clear()
    return out


if __name__ == "__main__":
    _serve()
