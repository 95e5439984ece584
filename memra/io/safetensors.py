"""Hugging Face checkpoint directories: ``config.json`` + safetensors weights.

A directory holds either one ``model.safetensors`` (any single ``*.safetensors`` file), or
shards listed by ``model.safetensors.index.json`` (``{"weight_map": {tensor: file}}``).
Files are opened with the ``safetensors`` library (memory-mapped); each tensor's dtype and
shape are read from the headers before any byte is used, and tensors are handed out in
their stored format:

* BF16 / F16 / F32 -> :class:`~memra.quant.tensor.QTensor` (``QType.BF16`` / ``F16`` / ``F32``);
* F8_E4M3 with a companion ``<name>_scale_inv`` (fp32 per 128x128 block) ->
  :class:`~memra.quant.fp8.FP8BlockTensor`, kept packed.

Source: safetensors format (huggingface/safetensors), transformers' sharded-checkpoint
index convention, shared/FORMATS.md for the FP8 block layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..quant.fp8 import FP8BlockTensor, fp8_scale_shape
from ..quant.tensor import QTensor
from ..quant.types import QType, UnsupportedQTypeError
from .gguf import CheckpointError
from .staging import StagingReaders

__all__ = ["SafetensorsCheckpoint", "STInfo", "read_hf_dir", "INDEX_NAME"]

INDEX_NAME = "model.safetensors.index.json"
_PLAIN = {"BF16": QType.BF16, "F16": QType.F16, "F32": QType.F32}
_FP8 = "F8_E4M3"
_TORCH_DTYPE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}
_ST_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


@dataclass(frozen=True)
class STInfo:
    """Where one tensor lives: its file, safetensors dtype string (``"BF16"``, ``"F8_E4M3"``...) and shape."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0  # absolute byte offset of the data in ``file`` (from the header)
    nbytes: int = 0


class SafetensorsCheckpoint:
    """An opened HF model directory.

    Attributes:
        path: the directory.
        config: the parsed ``config.json`` (dict).
        infos: tensor name -> :class:`STInfo`, over all shards.
        fp8_block: the FP8 tile size from ``quantization_config.weight_block_size`` (default 128x128).

    Use :func:`read_hf_dir` to open one.
    """

    def __init__(self, path: Path, config: dict[str, Any], infos: dict[str, STInfo], fp8_block: tuple[int, int]):
        self.path, self.config, self.infos, self.fp8_block = path, config, infos, fp8_block
        self._handles: dict[Path, Any] = {}
        self._staging = StagingReaders()

    def release_staging(self) -> None:
        """Close the staging readers of :meth:`tensor` ``(device=...)``; later calls open new ones."""
        self._staging.close()

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def names(self) -> list[str]:
        return sorted(self.infos)

    def _raw(self, name: str, device: torch.device | str | None = None) -> torch.Tensor:
        info = self.infos[name]
        if device is not None:
            raw = self._staging.read(device, info.file, info.offset, info.nbytes)
            return raw.view(_TORCH_DTYPE[info.dtype]).reshape(info.shape)
        from safetensors import safe_open

        f = self._handles.get(info.file)
        if f is None:
            f = self._handles[info.file] = safe_open(str(info.file), framework="pt")
        return f.get_tensor(name)

    def _check(self, name: str, shape: tuple[int, ...] | None, why: str) -> STInfo:
        info = self.infos.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}" + (f" (needed for {why})" if why else ""))
        if shape is not None and tuple(shape) != info.shape:
            raise CheckpointError(f"{info.file}: tensor {name!r} has shape {info.shape}, expected {tuple(shape)}"
                                  + (f" from the config ({why})" if why else ""))
        return info

    def tensor(self, name: str, shape: tuple[int, ...] | None = None, *, why: str = "",
               device: torch.device | str | None = None) -> QTensor | FP8BlockTensor:
        """Load tensor ``name`` in its stored format.

        Args:
            name: e.g. ``"model.layers.0.self_attn.q_proj.weight"``.
            shape: the torch-order shape the model expects; checked if given.
            why: where the expected shape comes from (config keys), quoted in errors.
            device: where the bytes go (default: the safetensors library's host copy). A CUDA
                device gets them through pinned staging buffers (:class:`memra.io.staging.DeviceReader`).
        Returns:
            a QTensor (BF16/F16/F32) or, for F8_E4M3, an FP8BlockTensor with its
            ``<name>_scale_inv``.
        Raises:
            CheckpointError: the tensor (or its scale) is missing, a shape differs from the
                expectation, or the scale grid has the wrong shape / dtype.
            UnsupportedQTypeError: a dtype memra does not compute with (e.g. I64, F8_E5M2).
        """
        info = self._check(name, shape, why)
        if info.dtype in _PLAIN:
            t = self._raw(name, device)
            return QTensor(name, _PLAIN[info.dtype], info.shape, t)
        if info.dtype == _FP8:
            sname = name + "_scale_inv"
            want = fp8_scale_shape(info.shape, self.fp8_block) if len(info.shape) >= 2 else None
            if want is None:
                raise CheckpointError(f"{info.file}: tensor {name!r} is FP8 but {len(info.shape)}-D; "
                                      "FP8 block weights must be at least 2-D")
            if sname not in self.infos:
                raise CheckpointError(f"{self.path}: FP8 tensor {name!r} has no scale tensor {sname!r} "
                                      f"(expected fp32 {want})")
            sinfo = self.infos[sname]
            if sinfo.shape != want:
                raise CheckpointError(
                    f"{sinfo.file}: scale tensor {sname!r} has shape {sinfo.shape}, expected {want} (one fp32 "
                    f"scale per {self.fp8_block[0]}x{self.fp8_block[1]} block of the {info.shape} weight {name!r})")
            if sinfo.dtype != "F32":
                raise CheckpointError(f"{sinfo.file}: scale tensor {sname!r} is {sinfo.dtype}, expected F32")
            return FP8BlockTensor(name, info.shape, self._raw(name, device), self._raw(sname, device), self.fp8_block)
        raise UnsupportedQTypeError(f"{info.file}: tensor {name!r} has dtype {info.dtype}; supported: "
                                    f"{', '.join(list(_PLAIN) + [_FP8])} (F8_E4M3 with block scales)")

    def total_bytes(self) -> int:
        """Bytes of every tensor (scales included), from the headers."""
        n = 0
        for i in self.infos.values():
            p = _ST_BYTES.get(i.dtype, 0)
            for d in i.shape:
                p *= d
            n += p
        return n

    def parameter_count(self) -> int:
        n = 0
        for name, i in self.infos.items():
            if not name.endswith("_scale_inv"):
                p = 1
                for d in i.shape:
                    p *= d
                n += p
        return n


def _data_offsets(f: Path) -> dict[str, tuple[int, int]]:
    """Tensor name -> (absolute byte offset, byte count) from a safetensors header (an 8-byte
    little-endian header size, the JSON header, then the data; ``data_offsets`` are relative to
    the data). Called after the safetensors library has validated the file."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    return {k: (8 + n + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
            for k, v in header.items() if k != "__metadata__"}


def read_hf_dir(path: str | Path) -> SafetensorsCheckpoint:
    """Open a HF model directory: parse ``config.json`` and every safetensors header.

    Raises:
        FileNotFoundError: ``path`` is not a directory.
        CheckpointError: no/invalid ``config.json``; no safetensors file; an index that is
            not valid JSON, names a missing shard, or maps a tensor to a shard that lacks it;
            a tensor present in two shards; an unreadable safetensors header. Each message
            names the file (and tensor).
    """
    from safetensors import safe_open

    d = Path(path).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: not a directory (expected a HF model directory with config.json)")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{d}: no config.json (a HF model directory needs one)")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object")

    index_path = d / INDEX_NAME
    weight_map: dict[str, str] | None = None
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
            assert isinstance(weight_map, dict)
        except (json.JSONDecodeError, KeyError, AssertionError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a safetensors index (needs a 'weight_map' object): {e}") from None
        files = sorted({d / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                names = [k for k, v in weight_map.items() if d / v == f]
                raise CheckpointError(f"{index_path}: shard {f.name!r} (holding {names[0]!r} and "
                                      f"{len(names) - 1} more) does not exist")
    else:
        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{d}: no *.safetensors file and no {INDEX_NAME}")

    infos: dict[str, STInfo] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                where = _data_offsets(f)
                for name in h.keys():
                    sl = h.get_slice(name)
                    if name in infos:
                        raise CheckpointError(f"{d}: tensor {name!r} is in both {infos[name].file.name} and {f.name}")
                    off, n = where[name]
                    infos[name] = STInfo(f, sl.get_dtype(), tuple(int(x) for x in sl.get_shape()), off, n)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises SafetensorError / OSError on bad headers
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
    if weight_map is not None:
        for name, fname in weight_map.items():
            info = infos.get(name)
            if info is None or info.file != d / fname:
                raise CheckpointError(f"{index_path}: tensor {name!r} is mapped to {fname!r}, which does not "
                                      f"contain it" + (f" (found in {info.file.name})" if info else ""))

    block = (128, 128)
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if isinstance(q, dict) and q.get("weight_block_size") is not None:
        b = q["weight_block_size"]
        if not (isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) and x > 0 for x in b)):
            raise CheckpointError(f"{cfg_path}: quantization_config.weight_block_size = {b!r}, expected [rows, cols]")
        block = (b[0], b[1])
    if isinstance(q, dict) and q.get("quant_method") not in (None, "fp8"):
        raise CheckpointError(f"{cfg_path}: quantization_config.quant_method = {q.get('quant_method')!r} is not "
                              "supported (supported: fp8 block-scaled)")
    return SafetensorsCheckpoint(d, config, infos, block)
