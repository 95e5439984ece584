"""Model registry: architecture name -> model class, and the loaders.

:func:`load_model` dispatches on what the path is: a ``.gguf`` file goes to
:func:`load_gguf_model`, a Hugging Face directory (``config.json`` + safetensors) to
:func:`load_hf_model`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ConfigError, ModelConfig
from ..io.gguf import GGUFCheckpoint, read_gguf
from ..io.safetensors import SafetensorsCheckpoint, read_hf_dir
from . import gemma3, llama, step3p5  # noqa: F401  (registration)
from .base import MODEL_REGISTRY, CausalLM

__all__ = ["MODEL_REGISTRY", "CausalLM", "load_gguf_model", "load_hf_model", "load_model"]


def _build(from_ckpt, ckpt, config: ModelConfig, dtype: torch.dtype, progress: bool, device):
    """``from_ckpt(ckpt, ...)`` (a model class's ``from_gguf`` / ``from_hf``), then the CPU kernel forms
    (CPU loads only); the checkpoint's staging readers are closed whatever happens."""
    try:
        with torch.no_grad():
            model = from_ckpt(ckpt, config, dtype, progress=progress, device=device)
            if device is None:
                model.build_cpu(progress)
    finally:
        ckpt.release_staging()
    return model.eval(), ckpt


def load_gguf_model(path: str | Path, dtype: torch.dtype = torch.float32,
                    ckpt: GGUFCheckpoint | None = None, progress: bool = False,
                    device: torch.device | str | None = None) -> tuple[CausalLM, GGUFCheckpoint]:
    """Read a GGUF file and build its model on the CPU, or with ``device`` (CUDA) on that GPU,
    layer by layer (see :meth:`CausalLM.to_gpu`).

    Returns:
        (model, checkpoint); ``model.config`` is the normalised config.
    Raises:
        FileNotFoundError, CheckpointError, ConfigError, UnsupportedQTypeError: see
        :func:`memra.io.gguf.read_gguf` and :meth:`ModelConfig.from_gguf`.
    """
    ckpt = ckpt or read_gguf(path)
    config = ModelConfig.from_gguf(ckpt.metadata, set(ckpt.infos), where=str(ckpt.path))
    cls = MODEL_REGISTRY[config.arch]
    return _build(cls.from_gguf, ckpt, config, dtype, progress, device)


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32,
                  progress: bool = False, device: torch.device | str | None = None
                  ) -> tuple[CausalLM, SafetensorsCheckpoint]:
    """Read a Hugging Face model directory (``config.json`` + safetensors) and build its model on the
    CPU, or with ``device`` (CUDA) on that GPU, layer by layer.

    Returns:
        (model, checkpoint); ``model.config`` is the normalised config.
    Raises:
        FileNotFoundError: not a directory.
        CheckpointError: see :func:`memra.io.safetensors.read_hf_dir` and the model's ``from_hf``.
        ConfigError: see :meth:`ModelConfig.from_hf_config`; also an architecture without a HF loader.
        UnsupportedQTypeError: a tensor dtype memra cannot compute with.
    """
    ckpt = read_hf_dir(path)
    config = ModelConfig.from_hf_config(ckpt.config, where=str(ckpt.path / "config.json"))
    cls = MODEL_REGISTRY[config.arch]
    if not hasattr(cls, "from_hf"):
        raise ConfigError(f"{ckpt.path}: architecture {config.arch!r} has no safetensors loader yet")
    return _build(cls.from_hf, ckpt, config, dtype, progress, device)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               progress: bool = False, device: torch.device | str | None = None
               ) -> tuple[CausalLM, GGUFCheckpoint | SafetensorsCheckpoint]:
    """Load a model from a ``.gguf`` file or a HF directory with ``config.json``; ``device``:
    a CUDA device to build it on, one layer at a time (None: the CPU).

    Raises:
        FileNotFoundError: ``path`` does not exist, or is a directory without ``config.json``.
        Otherwise as :func:`load_gguf_model` / :func:`load_hf_model`.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p}: a model directory needs a config.json (Hugging Face layout)")
        return load_hf_model(p, dtype, progress=progress, device=device)
    if p.is_file():
        return load_gguf_model(p, dtype, progress=progress, device=device)
    raise FileNotFoundError(f"{p}: no such file or directory (expected a .gguf file or a HF model directory)")
