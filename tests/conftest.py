"""Shared pytest fixtures.

Real-model tokenizer fixtures (session scope): GGUF paths, memra tokenizers and the
transformers tokenizers that serve as their oracle. transformers' GGUF tokenizer
conversion is slow (~35 s for gemma3's 262k tokens), so its result is cached on disk
under ``<memra cache>/test-cache/``, keyed by the GGUF file's name, size and mtime and
the transformers/tokenizers versions. Delete that folder to rebuild it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

TOKENIZER_MODEL_KEYS = ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m")


def _test_cache_file(gguf: Path, kind: str) -> Path:
    from memra.hub import cache_dir

    st = gguf.stat()
    d = cache_dir() / "test-cache"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{gguf.name}-{st.st_size}-{st.st_mtime_ns}.{kind}"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


class _PerKey:
    """Lazily computes and memoizes ``build(key)``; call the fixture value with a key."""

    def __init__(self, build: Callable[[str], Any]):
        self._build = build
        self._done: dict[str, Any] = {}

    def __call__(self, key: str) -> Any:
        if key not in self._done:
            self._done[key] = self._build(key)
        return self._done[key]


@pytest.fixture(scope="session")
def gguf_path() -> _PerKey:
    """``gguf_path(key) -> Path`` of a real model's GGUF (``memra.hub.resolve_model``)."""
    from memra.hub import resolve_model

    return _PerKey(lambda key: Path(resolve_model(key)))


@pytest.fixture(scope="session")
def gguf_tokenizer_metadata(gguf_path) -> _PerKey:
    """``gguf_tokenizer_metadata(key) -> dict``: the ``tokenizer.*`` and ``general.*``
    GGUF keys of a real model."""

    def build(key: str) -> dict[str, Any]:
        from memra.io.gguf import read_metadata

        return {k: v for k, v in read_metadata(gguf_path(key)).items() if k.startswith(("tokenizer.", "general."))}

    return _PerKey(build)


@pytest.fixture(scope="session")
def memra_tokenizer(gguf_tokenizer_metadata) -> _PerKey:
    """``memra_tokenizer(key) -> memra.io.tokenizer.Tokenizer`` for a real model."""
    from memra.io.tokenizer import Tokenizer

    return _PerKey(lambda key: Tokenizer.from_gguf_metadata(gguf_tokenizer_metadata(key)))


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path) -> _PerKey:
    """``hf_tokenizer(key) -> tokenizers.Tokenizer``: the backend of transformers'
    ``AutoTokenizer.from_pretrained(dir, gguf_file=name)`` for a real model.

    transformers' fast tokenizer encodes and decodes with exactly this object
    (``encode(text).ids`` with special tokens, ``decode(ids, skip_special_tokens)``;
    no space clean-up for BPE), so its JSON serialization is cached on disk, keyed by
    the transformers and tokenizers versions too.
    """
    import tokenizers
    import transformers

    def build(key: str) -> tokenizers.Tokenizer:
        path = gguf_path(key)
        cached = _test_cache_file(
            path, f"hf-{transformers.__version__}-tok-{tokenizers.__version__}.tokenizer.json"
        )
        if cached.is_file():
            return tokenizers.Tokenizer.from_str(cached.read_text(encoding="utf-8"))
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        finally:
            hf_logging.set_verbosity(verbosity)
        backend = tok.backend_tokenizer
        _atomic_write(cached, backend.to_str().encode("utf-8"))
        return backend

    return _PerKey(build)


@pytest.fixture
def torch_cpu_paths(monkeypatch):
    """Pin the CPU layers to their torch paths (memra/kernels/cpu_native.py off) for this test."""
    from memra.kernels import cpu_native

    monkeypatch.setattr(cpu_native, "ENABLED", False)
