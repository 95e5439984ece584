"""Model registry: architecture name -> model class, and the loader."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..io.gguf import GGUFCheckpoint, read_gguf
from . import gemma3, llama  # noqa: F401  (registration)
from .base import MODEL_REGISTRY, CausalLM

__all__ = ["MODEL_REGISTRY", "CausalLM", "load_gguf_model"]


def load_gguf_model(path: str | Path, dtype: torch.dtype = torch.float32,
                    ckpt: GGUFCheckpoint | None = None, progress: bool = False) -> tuple[CausalLM, GGUFCheckpoint]:
    """Read a GGUF file and build its model on the CPU.

    Returns:
        (model, checkpoint); ``model.config`` is the normalised config.
    Raises:
        FileNotFoundError, CheckpointError, ConfigError, UnsupportedQTypeError: see
        :func:`memra.io.gguf.read_gguf` and :meth:`ModelConfig.from_gguf`.
    """
    ckpt = ckpt or read_gguf(path)
    config = ModelConfig.from_gguf(ckpt.metadata, set(ckpt.infos), where=str(ckpt.path))
    cls = MODEL_REGISTRY[config.arch]
    with torch.no_grad():
        model = cls.from_gguf(ckpt, config, dtype, progress=progress)
    return model.eval(), ckpt
