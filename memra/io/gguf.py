"""GGUF checkpoints: metadata and tensors, read through the ``gguf`` package.

The ``gguf`` package (maintained by ggml) parses the header; memra checks every tensor's
geometry against the file before any byte is used, and hands tensors out as
:class:`~memra.quant.tensor.QTensor` objects in their on-disk format.

Shapes: GGUF stores dimensions innermost first (ggml ``ne``); memra reverses them to
torch order, so a linear weight ``[in, out]`` in ggml terms is ``(out, in)`` here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..quant.tensor import QTensor
from ..quant.types import QTYPE_INFO, QType, UnsupportedQTypeError, qtype_from_int

__all__ = ["CheckpointError", "TensorInfo", "GGUFCheckpoint", "read_gguf", "read_metadata"]


class CheckpointError(ValueError):
    """A checkpoint is unusable: corrupt, truncated, incomplete or self-contradicting.

    The message names the file, the tensor or key, and what was expected.
    """


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in the file. ``shape`` is in torch order."""

    name: str
    qtype: QType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def _field_value(field: Any) -> Any:
    """Python value of a ``gguf.ReaderField`` (str, int, float, bool or list of them)."""
    return field.contents()


def read_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values.

    Arrays become lists (``tokenizer.ggml.tokens`` -> ``list[str]`` and so on).

    Raises:
        CheckpointError: the file is not a readable GGUF file.
    """
    return read_gguf(path).metadata


class GGUFCheckpoint:
    """An opened GGUF file: ``metadata`` (dict) and ``infos`` (name -> :class:`TensorInfo`).

    Tensor bytes are read on demand from a read-only memory map by :meth:`tensor`.
    """

    def __init__(self, path: Path, metadata: dict[str, Any], infos: dict[str, TensorInfo], mm: np.memmap):
        self.path = path
        self.metadata = metadata
        self.infos = infos
        self._mm = mm

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{self.path}: metadata key 'general.architecture' is missing")
        return arch

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def tensor(self, name: str, shape: tuple[int, ...] | None = None, *, why: str = "") -> QTensor:
        """Load tensor ``name`` as a :class:`QTensor` (a private copy of its bytes).

        Args:
            name: GGUF tensor name, e.g. ``"blk.0.attn_q.weight"``.
            shape: the torch-order shape the model expects; checked if given.
            why: where the expected shape comes from, quoted in the error.

        Raises:
            CheckpointError: the tensor is missing or its shape differs from ``shape``.
        """
        info = self.infos.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}" + (f" (needed for {why})" if why else ""))
        if shape is not None and tuple(shape) != info.shape:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has shape {info.shape}, expected {tuple(shape)}"
                + (f" from the config ({why})" if why else "")
            )
        raw = torch.from_numpy(np.array(self._mm[info.offset : info.offset + info.nbytes]))
        if info.qtype == QType.F32:
            data = raw.view(torch.float32).reshape(info.shape)
        elif info.qtype == QType.F16:
            data = raw.view(torch.float16).reshape(info.shape)
        elif info.qtype == QType.BF16:
            data = raw.view(torch.bfloat16).reshape(info.shape)
        else:
            rows = int(np.prod(info.shape[:-1]))
            data = raw.reshape(rows, -1)
        return QTensor(name, info.qtype, info.shape, data)

    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.infos.values())

    def parameter_count(self) -> int:
        return sum(int(np.prod(i.shape)) for i in self.infos.values())


_MAX_DIMS = 4  # GGML_MAX_DIMS


@functools.cache
def _table_reader_class() -> type:
    """A ``gguf.GGUFReader`` that parses the header and keeps the raw tensor-info fields.

    ``tensor_fields`` holds one ``ReaderField`` per tensor with parts ``[name_len,
    name_data, n_dims, dims, type, offset]`` (gguf 0.19 ``_get_tensor_info_field``);
    :func:`read_gguf` validates them itself so every error names the tensor.
    """
    import gguf

    class _TableReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:
            self.tensor_fields = fields
            self.tensors = []

    return _TableReader


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open a GGUF file and validate its tensor table against the file.

    Checks, before any tensor is used: the file is little-endian GGUF, tensor names are
    unique, every tensor type is supported, every tensor has 1 to 4 dimensions and an
    innermost dimension that is a whole number of blocks, every data offset is aligned,
    and every tensor's bytes lie inside the file and do not run into the next tensor.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: not a GGUF file, truncated or corrupt header, big-endian file,
            duplicate tensor names, tensor data past the end of the file, overlapping
            tensors, a misaligned data offset, or a shape that is not whole blocks; the
            message names the file, the tensor and what was expected.
        UnsupportedQTypeError: a tensor type memra does not support (a ``ValueError``).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
    try:
        reader = _table_reader_class()(path, "r")
    except Exception as e:  # the package raises ValueError/IndexError/struct errors on bad headers
        raise CheckpointError(f"{path}: corrupt or truncated GGUF header ({type(e).__name__}: {e})") from None
    if reader.byte_order != "I":
        raise CheckpointError(f"{path}: big-endian GGUF files are not supported (expected little-endian)")

    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = _field_value(field)
        except Exception as e:
            raise CheckpointError(f"{path}: metadata key {key!r} is unreadable ({e})") from None

    # The tensor table is validated here rather than by GGUFReader._build_tensors, whose
    # errors (bad type id, partial blocks, data past the end) do not name the tensor.
    alignment = int(reader.alignment)
    infos: dict[str, TensorInfo] = {}
    for i, field in enumerate(reader.tensor_fields):
        name_len, name_data, n_dims, dims, raw_dtype, offset_tensor = field.parts
        if (
            len(n_dims) != 1 or len(raw_dtype) != 1 or len(offset_tensor) != 1
            or len(dims) != int(n_dims[0]) or len(name_data) != int(name_len[0])
        ):
            raise CheckpointError(
                f"{path}: truncated GGUF header: tensor info #{i} ({field.name!r}) ends past the end "
                f"of the file ({size} bytes)"
            )
        name = field.name
        where = f"{path}: tensor {name!r}"
        if name in infos:
            raise CheckpointError(f"{where}: duplicate tensor name (tensor info #{i}); names must be unique")
        qtype = qtype_from_int(int(raw_dtype[0]), where=where)
        if not 1 <= len(dims) <= _MAX_DIMS:
            raise CheckpointError(f"{where}: has {len(dims)} dimensions, expected 1 to {_MAX_DIMS}")
        shape = tuple(int(d) for d in reversed([int(x) for x in dims]))
        info = QTYPE_INFO[qtype]
        if shape[-1] % info.block_size:
            raise CheckpointError(
                f"{where}: innermost dimension {shape[-1]} is not a multiple of the {qtype.name} "
                f"block size {info.block_size}"
            )
        numel = math.prod(shape)  # Python ints: no overflow on corrupt dimensions
        nbytes = info.nbytes(numel)
        rel = int(offset_tensor[0])
        if rel % alignment:
            raise CheckpointError(
                f"{where}: data offset {rel} is not a multiple of the file's alignment {alignment}"
            )
        offset = int(reader.data_offset) + rel
        if offset + nbytes > size:
            raise CheckpointError(
                f"{where}: data at bytes [{offset}, {offset + nbytes}) runs past the end of the file "
                f"({size} bytes): truncated or corrupt ({qtype.name} {shape} needs {nbytes} bytes)"
            )
        infos[name] = TensorInfo(name, qtype, shape, offset, nbytes)

    ordered = sorted(infos.values(), key=lambda i: i.offset)
    for a, b in zip(ordered, ordered[1:]):
        if a.offset + a.nbytes > b.offset:
            raise CheckpointError(
                f"{path}: tensor {a.name!r} ({a.qtype.name} {a.shape}, {a.nbytes} bytes at {a.offset}) "
                f"overlaps tensor {b.name!r} at {b.offset}: byte size does not match shape and type"
            )
    return GGUFCheckpoint(path, metadata, infos, reader.data)


__all__ += ["UnsupportedQTypeError"]
