"""The current llama.cpp (2026-10-01) as memra's peer and second oracle, built from source.

PyPI's source package ``llama-cpp-python==0.3.36`` vendors llama.cpp of 2026-10-01 (with the
``step35`` architecture, its converter ``convert_hf_to_gguf.py`` and ``gguf-py``) under
``vendor/llama.cpp``, next to the binding's pure-ctypes Python package ``llama_cpp``. This
module, all in ``<memra cache>/llamacpp/llama-cpp-python-0.3.36/`` (memra cache:
``$MEMRA_CACHE`` or ``~/.cache/memra``):

* downloads the sdist once with pip (``pip download --no-deps --no-binary :all:``) and
  unpacks it into ``src/`` (:func:`ensure_source`);
* builds the CPU library and the tools it is asked for with CMake into ``build/``
  (:func:`ensure_built`, :func:`binary`): ``libllama.so`` for the Python binding,
  ``llama-bench`` for ``memra bench cpu``, ``llama-server`` for ``memra bench
  serve-compare``. Each target is built on first use and then reused; a lock file keeps
  concurrent processes from building twice. The build is ``-DGGML_NATIVE=OFF`` with the
  instruction sets named (:data:`CMAKE_FLAGS`): a native build uses AMX / AVX-512, which
  these virtual machines advertise but do not allow (``Illegal instruction``);
* imports the binding from ``src/llama_cpp`` with ``LLAMA_CPP_LIB_PATH`` pointing at the
  build (:func:`ensure_llama_cpp`), for logits (``logits_all``) and tokenization;
* runs llama.cpp's own converter, unmodified, under the transformers version its
  requirements pin (:func:`convert_hf_to_gguf`).

Build cost, measured on the project's 2-core machine: see README "Benchmarks" (the
library alone for the tests; llama-server adds its multimodal library and web UI code).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import os
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path
from typing import Any

SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
#: llama.cpp's converter requirements (``requirements/requirements-convert_legacy_llama.txt``)
#: pin transformers 4.57.6; newer transformers map ``model_type: step3p5`` to a config class
#: that drops the keys the converter reads (``partial_rotary_factors``, ``num_attention_groups``).
CONVERTER_DEPS = ("transformers==4.57.6", "huggingface-hub==0.36.0", "tokenizers==0.22.1")

#: CPU build: no native tuning (AMX/AVX-512 are advertised but not allowed here), AVX2 + FMA +
#: F16C named; no network features (curl/openssl, the prebuilt web UI), no tests or examples.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
    "-DGGML_OPENMP=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
)

__all__ = [
    "LlamaCppUnavailable",
    "SDIST_VERSION",
    "install_dir",
    "ensure_source",
    "ensure_built",
    "binary",
    "ensure_llama_cpp",
    "load_llama",
    "logits",
    "tokenize",
    "detokenize",
    "convert_hf_to_gguf",
]


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp could not be downloaded, built or imported (the message says which step)."""


def install_dir() -> Path:
    """``<memra cache>/llamacpp/llama-cpp-python-0.3.36`` (``src/`` and ``build/`` inside).

    Raises:
        ValueError: ``$MEMRA_CACHE`` is set but not an absolute path.
    """
    from ..hub import cache_dir

    return cache_dir() / "llamacpp" / f"{SDIST}-{SDIST_VERSION}"


def _src() -> Path:
    return install_dir() / "src"


def _vendor() -> Path:
    return _src() / "vendor" / "llama.cpp"


def _build() -> Path:
    return install_dir() / "build"


@contextlib.contextmanager
def _lock():
    """An exclusive lock on ``install_dir()/.lock`` (one downloader/builder at a time)."""
    import fcntl

    d = install_dir()
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(cmd: list[str], what: str, log: Path, **kw: Any) -> None:
    with open(log, "w") as out:
        r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, **kw)
    if r.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise LlamaCppUnavailable(f"{what} failed (exit {r.returncode}; log {log}):\n{tail}")


def ensure_source() -> Path:
    """Download and unpack the sdist once; return ``src/`` (holding ``vendor/llama.cpp``).

    Raises:
        LlamaCppUnavailable: pip could not fetch it, or it lacks ``vendor/llama.cpp``.
    """
    src = _src()
    if (src / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        return src
    with _lock():
        if (src / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
            return src
        with tempfile.TemporaryDirectory(dir=install_dir()) as tmp:
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                  "--disable-pip-version-check", "-d", tmp, f"{SDIST}=={SDIST_VERSION}"],
                 f"pip download {SDIST}=={SDIST_VERSION}", Path(tmp) / "pip.log")
            archives = list(Path(tmp).glob("*.tar.gz"))
            if len(archives) != 1:
                raise LlamaCppUnavailable(f"pip download gave {[p.name for p in Path(tmp).iterdir()]}, "
                                          "expected one .tar.gz")
            with tarfile.open(archives[0]) as tf:
                tf.extractall(tmp, filter="data")
            top = Path(tmp) / f"{SDIST.replace('-', '_')}-{SDIST_VERSION}"
            if not (top / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
                raise LlamaCppUnavailable(f"{archives[0].name} has no vendor/llama.cpp/CMakeLists.txt")
            top.rename(src)
    return src


def _stamp(target: str) -> Path:
    return _build() / f".built-{target}"


def _built(target: str) -> Path | None:
    """The target's file if a build of it finished (a stamp written after a successful build:
    a file that merely exists may be half-linked by a concurrent or killed build)."""
    p = _build() / "bin" / ("libllama.so" if target == "llama" else target)
    return p if p.is_file() and _stamp(target).is_file() else None


def ensure_built(targets: tuple[str, ...] = ("llama",)) -> Path:
    """Build the CMake ``targets`` that are not built yet (``llama``: ``libllama.so``;
    ``llama-bench``, ``llama-server``, ...) with :data:`CMAKE_FLAGS`, one job per core; return
    ``build/bin``. The configure and build logs are kept in ``build/``.

    Raises:
        LlamaCppUnavailable: download, configure or build failed (with the log's tail).
    """
    missing = [t for t in targets if _built(t) is None]
    if not missing:
        return _build() / "bin"
    ensure_source()
    with _lock():
        missing = [t for t in targets if _built(t) is None]
        if missing:
            b = _build()
            b.mkdir(parents=True, exist_ok=True)
            if not (b / "CMakeCache.txt").is_file():
                _run(["cmake", "-S", str(_vendor()), "-B", str(b), *CMAKE_FLAGS], "cmake configure of llama.cpp",
                     b / "configure.log")
            jobs = str(max(1, os.cpu_count() or 1))
            _run(["cmake", "--build", str(b), "-j", jobs, "--target", *missing],
                 f"building llama.cpp target(s) {', '.join(missing)}", b / f"build-{'-'.join(missing)}.log")
            for t in missing:
                _stamp(t).write_text("ok\n")
    still = [t for t in targets if _built(t) is None]
    if still:
        raise LlamaCppUnavailable(f"the build finished but {still} are not in {_build() / 'bin'}")
    return _build() / "bin"


def binary(name: str) -> Path:
    """Path of a llama.cpp tool (``llama-bench``, ``llama-server``), built on first use.

    Raises:
        LlamaCppUnavailable: as :func:`ensure_built`.
    """
    return ensure_built((name,)) / name


@functools.cache
def ensure_llama_cpp() -> types.ModuleType:
    """Build ``libllama.so`` if needed and import the binding (``llama_cpp`` 0.3.36) over it.

    Raises:
        LlamaCppUnavailable: download/build failed, another ``llama_cpp`` is already imported,
            or the import / library load failed.
    """
    lib = ensure_built(("llama",))
    src = _src()
    existing = sys.modules.get("llama_cpp")
    if existing is not None and not str(getattr(existing, "__file__", "")).startswith(str(src)):
        raise LlamaCppUnavailable(f"another llama_cpp is already imported from {existing.__file__}; "
                                  f"this harness needs the one in {src}")
    if "diskcache" not in sys.modules:  # imported by llama_cpp.llama_cache only
        try:
            importlib.import_module("diskcache")
        except ImportError:
            stub = types.ModuleType("diskcache")

            class Cache:
                def __init__(self, *args: Any, **kwargs: Any):
                    raise LlamaCppUnavailable("diskcache is not installed; LlamaDiskCache is unavailable")

            stub.Cache = Cache
            sys.modules["diskcache"] = stub
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib)
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    try:
        module = importlib.import_module("llama_cpp")
    except Exception as e:  # OSError from ctypes, ImportError, ...
        raise LlamaCppUnavailable(f"importing llama_cpp from {src} failed: {type(e).__name__}: {e}") from e
    if getattr(module, "__version__", None) != SDIST_VERSION:
        raise LlamaCppUnavailable(f"imported llama_cpp {module.__version__}, expected {SDIST_VERSION}")
    module.llama_log_set(_quiet_log, None)  # llama.cpp's load log is chatty on stderr
    return module


def _quiet_log_impl(level, text, user_data):  # noqa: ARG001 - ctypes callback signature
    return None


def _make_quiet_log():
    import ctypes

    return ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(_quiet_log_impl)


_quiet_log = _make_quiet_log()


def load_llama(path: str | os.PathLike, n_ctx: int = 512, n_threads: int = 2, vocab_only: bool = False,
               logits_all: bool = False, seed: int = 0, **kwargs: Any) -> Any:
    """Load a GGUF file into llama.cpp (``llama_cpp.Llama``), quietly.

    Args:
        path: GGUF file of any architecture this llama.cpp knows (llama, qwen2, gemma3, step35, ...).
        n_ctx: context length in tokens.
        n_threads: CPU threads (for single-token and batch evaluation alike).
        vocab_only: load only the vocabulary (no weights).
        logits_all: keep the logits of every evaluated position (``Llama.scores``), at
            ``n_ctx * vocab * 4`` bytes.
        **kwargs: passed on to ``llama_cpp.Llama`` (e.g. ``n_batch``).

    Raises:
        FileNotFoundError: no such file. LlamaCppUnavailable: as :func:`ensure_llama_cpp`.
        ValueError: llama.cpp refused the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {path}")
    llama_cpp = ensure_llama_cpp()
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                           vocab_only=vocab_only, logits_all=logits_all, seed=seed, verbose=False, **kwargs)


def logits(path: str | os.PathLike, token_ids: list[int], n_batch: int = 512, n_threads: int = 2,
           **kwargs: Any):
    """llama.cpp's fp32 logits at every position of ``token_ids``: a float32 numpy array
    [len(token_ids), vocab]. The prompt is evaluated in ``n_batch``-token chunks (prefill),
    so ``n_batch=1`` gives the decode path one token at a time. The KV cache is f32
    (llama.cpp's default is f16, which alone puts its logits ~3e-4 off an fp32 reference);
    pass ``type_k`` / ``type_v`` (ggml type ids) to override.

    Raises:
        as :func:`load_llama`; ValueError for an empty prompt.
    """
    import numpy as np

    if not token_ids:
        raise ValueError("token_ids is empty")
    kwargs = {"type_k": 0, "type_v": 0} | kwargs  # GGML_TYPE_F32
    llm = load_llama(path, n_ctx=max(len(token_ids), 8), n_threads=n_threads, logits_all=True,
                     n_batch=n_batch, n_ubatch=n_batch, **kwargs)
    try:
        llm.eval([int(t) for t in token_ids])
        return np.array(llm.scores[: len(token_ids)], dtype=np.float32)
    finally:
        llm.close()


@functools.lru_cache(maxsize=8)
def _vocab(path: str) -> Any:
    return load_llama(path, vocab_only=True)


# free the cached vocabularies while the binding's modules still exist (else their __del__ runs
# during interpreter teardown and prints "Exception ignored")
atexit.register(_vocab.cache_clear)


def tokenize(path: str | os.PathLike, text: str, add_bos: bool, special: bool = True) -> list[int]:
    """llama.cpp's token ids for ``text`` with the vocabulary of the GGUF at ``path``
    (``llama_tokenize``; ``add_bos`` is honoured as the file's ``add_bos_token`` says).

    Raises:
        as :func:`load_llama`.
    """
    return list(_vocab(str(Path(path).resolve())).tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))


def detokenize(path: str | os.PathLike, ids: list[int], special: bool = False) -> bytes:
    """llama.cpp's bytes for token ids: ``llama_token_to_piece`` of each id, concatenated
    (control tokens give no bytes unless ``special``). Called per token with a buffer that
    grows as needed (the binding's ``detokenize`` has a fixed 32-byte buffer).

    Raises:
        as :func:`load_llama`; ValueError for an id outside the vocabulary.
    """
    import ctypes

    llama_cpp = ensure_llama_cpp()
    vocab = llama_cpp.llama_model_get_vocab(_vocab(str(Path(path).resolve())).model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    buf = ctypes.create_string_buffer(64)
    out = bytearray()
    for t in ids:
        if not 0 <= int(t) < n_vocab:
            raise ValueError(f"token id {t} is outside llama.cpp's vocabulary [0, {n_vocab})")
        n = llama_cpp.llama_token_to_piece(vocab, int(t), buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(vocab, int(t), buf, len(buf), 0, special)
        out += buf.raw[:n]
    return bytes(out)


def _converter_env() -> dict[str, str]:
    """Environment for llama.cpp's converter: its pinned transformers (:data:`CONVERTER_DEPS`,
    installed once with ``pip install --target`` into ``install_dir()/convert-deps``) first on
    ``PYTHONPATH``; numpy, torch, safetensors, ... from this interpreter."""
    target = install_dir() / "convert-deps"
    if not (target / "transformers").is_dir():
        with _lock():
            if not (target / "transformers").is_dir():
                with tempfile.TemporaryDirectory(dir=install_dir()) as tmp:
                    staging = Path(tmp) / "deps"
                    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
                          "--target", str(staging), *CONVERTER_DEPS], "pip install of the converter's requirements",
                         install_dir() / "convert-deps.log")
                    staging.rename(target)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(target), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("NO_LOCAL_GGUF", None)  # the converter imports the gguf-py beside it
    return env


def convert_hf_to_gguf(hf_dir: str | os.PathLike, outfile: str | os.PathLike, outtype: str = "f32",
                       extra: tuple[str, ...] = ()) -> Path:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` (unmodified) on a HF directory.

    Args:
        outtype: the converter's ``--outtype`` (f32, f16, bf16, q8_0, ...).
        extra: more converter arguments (e.g. ``("--no-mtp",)``).

    Raises:
        LlamaCppUnavailable: the converter failed (its output's tail in the message).
    """
    ensure_source()
    outfile = Path(outfile)
    outfile.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(_vendor() / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(outfile),
           "--outtype", outtype, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_converter_env())
    if r.returncode != 0 or not outfile.is_file():
        raise LlamaCppUnavailable(f"convert_hf_to_gguf.py {hf_dir} failed (exit {r.returncode}):\n"
                                  f"{(r.stdout + r.stderr)[-3000:]}")
    return outfile
