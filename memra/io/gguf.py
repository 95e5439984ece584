"""GGUF checkpoints: metadata and tensors.

memra parses the GGUF header itself (fast; checked against the ``gguf`` package's
reader in tests), checks every tensor's geometry against the file before any byte is
used, and hands tensors out as
:class:`~memra.quant.tensor.QTensor` objects in their on-disk format.

Shapes: GGUF stores dimensions innermost first (ggml ``ne``); memra reverses them to
torch order, so a linear weight ``[in, out]`` in ggml terms is ``(out, in)`` here.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..quant.tensor import QTensor
from ..quant.types import QTYPE_INFO, QType, UnsupportedQTypeError, qtype_from_int
from .staging import StagingReaders

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
        self._staging = StagingReaders()

    def release_staging(self) -> None:
        """Close the staging readers of :meth:`tensor` ``(device=...)`` (their pinned buffers and
        file descriptors); later calls open new ones. Loaders call this when they finish."""
        self._staging.close()

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{self.path}: metadata key 'general.architecture' is missing")
        return arch

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def tensor(self, name: str, shape: tuple[int, ...] | None = None, *, why: str = "",
               device: torch.device | str | None = None) -> QTensor:
        """Load tensor ``name`` as a :class:`QTensor` (a private copy of its bytes).

        Args:
            name: GGUF tensor name, e.g. ``"blk.0.attn_q.weight"``.
            shape: the torch-order shape the model expects; checked if given.
            why: where the expected shape comes from, quoted in the error.
            device: where the bytes go (default: host memory). A CUDA device gets them through
                pinned staging buffers (:class:`memra.io.staging.DeviceReader`), never a host copy.

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
        if device is None:
            raw = torch.from_numpy(np.array(self._mm[info.offset : info.offset + info.nbytes]))
        else:
            raw = self._staging.read(device, self.path, info.offset, info.nbytes)
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
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
            12: "<f8"}


_U64 = struct.Struct("<Q")


class _Cursor:
    """Little-endian reader over the file's bytes; raises EOFError past the end."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise EOFError(f"needed {n} bytes at offset {self.pos}, the file has {len(self.buf)}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "little")

    def u64(self) -> int:
        return int.from_bytes(self.take(8), "little")

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, n: int) -> list[str]:
        """``n`` strings in a row (u64 length, then UTF-8 bytes; invalid bytes replaced), in one
        loop: a vocabulary's tokens and merges are ~258k strings in a 128k-vocab file."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = _U64.unpack_from
        out = []
        append = out.append
        for _ in range(n):
            if pos + 8 > end:
                raise EOFError(f"needed 8 bytes at offset {pos}, the file has {end}")
            (k,) = unpack(buf, pos)
            pos += 8
            if pos + k > end:
                raise EOFError(f"needed {k} bytes at offset {pos}, the file has {end}")
            append(str(buf[pos:pos + k], "utf-8", errors="replace"))
            pos += k
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == 8:
            return self.string()
        if vtype == 9:
            itype, n = self.u32(), self.u64()
            if itype == 8:
                return self.strings(n)
            if itype == 9:
                return [self.value(9) for _ in range(n)]
            if itype not in _SCALARS:
                raise ValueError(f"unknown metadata array item type {itype}")
            dt = np.dtype(_SCALARS[itype])
            arr = np.frombuffer(self.take(n * dt.itemsize), dtype=dt)
            return arr.astype(bool).tolist() if itype == 7 else arr.tolist()
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        dt = np.dtype(_SCALARS[vtype])
        v = np.frombuffer(self.take(dt.itemsize), dtype=dt)[0].item()
        return bool(v) if vtype == 7 else v


def _parse_header(buf: memoryview) -> tuple[dict[str, Any], list[tuple[str, list[int], int, int]], int, int]:
    """Parse a little-endian GGUF v2/v3 header (ggml ``docs/gguf.md``).

    Returns (metadata, tensor table as (name, ggml dims innermost first, type id,
    relative data offset), alignment, absolute start of the data section).

    memra parses the header itself because ``gguf.GGUFReader`` builds a numpy view per
    string and takes tens of seconds on a 262k-token vocabulary; tests check that the
    two agree on every real model file.

    Raises:
        EOFError: the header runs past the end of the file.
        ValueError: unsupported version or value type, or a big-endian file.
    """
    c = _Cursor(buf)
    c.take(4)
    version = c.u32()
    if version not in (2, 3):
        if version & 0x00FFFFFF == 0 and version >> 24 in (2, 3):
            raise ValueError("big-endian GGUF files are not supported (expected little-endian)")
        raise ValueError(f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = c.u64(), c.u64()
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        meta[key] = c.value(c.u32())
    table = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.u32()
        if not 1 <= n_dims <= _MAX_DIMS:
            raise _BadDims(name, n_dims)
        dims = [c.u64() for _ in range(n_dims)]
        table.append((name, dims, c.u32(), c.u64()))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment = {align!r} must be a positive power of two")
    start = (c.pos + align - 1) // align * align
    return meta, table, align, start


class _BadDims(Exception):
    def __init__(self, name: str, n_dims: int):
        self.name, self.n_dims = name, n_dims


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
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        metadata, table, alignment, data_start = _parse_header(memoryview(mm))
    except _BadDims as e:
        raise CheckpointError(f"{path}: tensor {e.name!r}: has {e.n_dims} dimensions, expected 1 to {_MAX_DIMS}") from None
    except EOFError as e:
        raise CheckpointError(f"{path}: truncated GGUF header ({e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        msg = str(e)
        if "big-endian" in msg:
            raise CheckpointError(f"{path}: {msg}") from None
        raise CheckpointError(f"{path}: corrupt GGUF header ({msg})") from None

    infos: dict[str, TensorInfo] = {}
    for i, (name, dims, type_id, rel) in enumerate(table):
        where = f"{path}: tensor {name!r}"
        if name in infos:
            raise CheckpointError(f"{where}: duplicate tensor name (tensor info #{i}); names must be unique")
        qtype = qtype_from_int(type_id, where=where)
        shape = tuple(reversed(dims))
        info = QTYPE_INFO[qtype]
        if shape[-1] % info.block_size:
            raise CheckpointError(
                f"{where}: innermost dimension {shape[-1]} is not a multiple of the {qtype.name} "
                f"block size {info.block_size}"
            )
        numel = math.prod(shape)  # Python ints: no overflow on corrupt dimensions
        nbytes = info.nbytes(numel)
        if rel % alignment:
            raise CheckpointError(
                f"{where}: data offset {rel} is not a multiple of the file's alignment {alignment}"
            )
        offset = data_start + rel
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
    return GGUFCheckpoint(path, metadata, infos, mm)


__all__ += ["UnsupportedQTypeError"]
