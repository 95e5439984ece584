"""``memra inspect``: what a GGUF file holds, without building the model."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from ..config import ModelConfig
from ..hub import resolve_model
from .gguf import read_gguf

__all__ = ["inspect_gguf"]


def inspect_gguf(model: str) -> dict[str, Any]:
    """Summary of a GGUF file or model key.

    Returns a dict with ``path``, ``arch``, ``name``, ``parameters`` (weights),
    ``tensor_bytes``, ``bits_per_weight``, ``types`` ({type: [tensors, weights, bytes]}),
    ``config`` (normalised, when the architecture is supported; else an ``error``) and
    ``metadata`` (arrays summarised by length).

    Raises:
        FileNotFoundError, CheckpointError: see :func:`memra.io.gguf.read_gguf`.
    """
    ckpt = read_gguf(resolve_model(model))
    types: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for info in ckpt.infos.values():
        n = 1
        for d in info.shape:
            n *= d
        row = types[info.qtype.name]
        row[0] += 1
        row[1] += n
        row[2] += info.nbytes
    params, nbytes = ckpt.parameter_count(), ckpt.total_bytes()
    try:
        config: dict[str, Any] = ModelConfig.from_gguf(ckpt.metadata, set(ckpt.infos), str(ckpt.path)).summary()
    except ValueError as e:
        config = {"error": str(e)}
    meta = {k: (f"[{len(v)} items]" if isinstance(v, list) and len(v) > 16 else
                (v[:200] + "..." if isinstance(v, str) and len(v) > 200 else v))
            for k, v in ckpt.metadata.items()}
    return {"path": str(ckpt.path), "arch": ckpt.metadata.get("general.architecture"),
            "name": ckpt.metadata.get("general.name", ""), "parameters": params, "tensor_bytes": nbytes,
            "bits_per_weight": 8 * nbytes / max(params, 1), "types": dict(types), "config": config, "metadata": meta}
