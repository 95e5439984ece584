"""Writing GGUF files (tests, synthetic checkpoints), through the ``gguf`` package's writer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..quant.tensor import QTensor

__all__ = ["write_gguf"]


def write_gguf(path: str | Path, arch: str, metadata: dict[str, Any], tensors: dict[str, torch.Tensor | QTensor]) -> Path:
    """Write a GGUF file.

    Args:
        path: output file.
        arch: ``general.architecture``.
        metadata: key -> value (str, bool, int, float or a list of one of them); ints are
            written as uint32 (int32 if negative), floats as float32, as llama.cpp does.
        tensors: name -> fp32/fp16/bf16 torch tensor (written in that type) or a
            :class:`QTensor` (packed blocks, any number of dims: a 3-D expert bank
            [E, out, in] is written as such); shapes in torch order.
    Returns:
        ``Path(path)``.
    """
    import gguf

    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in metadata.items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            (w.add_uint32 if v >= 0 else w.add_int32)(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, (list, tuple)):
            w.add_array(k, list(v))
        else:
            raise TypeError(f"metadata {k!r}: unsupported value type {type(v).__name__}")
    for name, t in tensors.items():
        if isinstance(t, QTensor):
            if t.is_quantized:
                raw = t.data.reshape(*t.shape[:-1], t.data.shape[-1])  # byte shape: [.., row_bytes]
                w.add_tensor(name, raw.contiguous().numpy(), raw_shape=raw.shape,
                             raw_dtype=gguf.GGMLQuantizationType(int(t.qtype)))
                continue
            t = t.data
        if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16:
            raw = t.detach().contiguous().view(torch.uint8)  # [.., 2 * n] little-endian bf16
            w.add_tensor(name, raw.numpy(), raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
            continue
        if t.dtype not in (torch.float32, torch.float16):
            raise TypeError(f"tensor {name!r}: write fp32/fp16 tensors or packed QTensors, got {t.dtype}")
        w.add_tensor(name, t.detach().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

