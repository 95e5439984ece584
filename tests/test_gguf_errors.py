"""read_gguf on small GGUF files written with gguf.GGUFWriter, then corrupted.

Every corruption must give a CheckpointError (or UnsupportedQTypeError) whose message
names the file, the tensor where there is one, and what was expected. Also QTensor's
own validation and permute_rows.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from memra.io.gguf import CheckpointError, read_gguf
from memra.quant.dequant import dequantize_blocks, quantize_q8_0
from memra.quant.tensor import QTensor
from memra.quant.types import QTYPE_INFO, QType, UnsupportedQTypeError

GT = gguf.GGMLQuantizationType


def make_tensors(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, GT | None]]:
    """a: F32 (4, 64); b: Q8_0 (4, 64) as raw blocks; c: F16 (2, 32); d: F16 (16, 64).

    File order a, b, c, d (d is last and largest, so a grown a, b or c overlaps its
    neighbour before it reaches the end of the file).
    """
    b = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), GT.Q8_0)
    return {
        "a": (rng.standard_normal((4, 64)).astype(np.float32), None),
        "b": (b, GT.Q8_0),
        "c": (rng.standard_normal((2, 32)).astype(np.float16), None),
        "d": (rng.standard_normal((16, 64)).astype(np.float16), None),
    }


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, GT | None]], **kw) -> Path:
    w = gguf.GGUFWriter(path, "llama", **kw)
    for name, (arr, raw_dtype) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def good(tmp_path: Path):
    tensors = make_tensors(np.random.default_rng(0))
    path = write_gguf(tmp_path / "model.gguf", tensors)
    return path, tensors


class Layout:
    """Byte positions of each tensor-info field in a good file (found with GGUFReader)."""

    def __init__(self, path: Path):
        r = gguf.GGUFReader(path)
        self.data_start = int(r.data_offset)
        self.size = path.stat().st_size
        self.fields: dict[str, dict[str, int]] = {}
        self.starts: dict[str, int] = {}
        self.ends: dict[str, int] = {}
        for t in r.tensors:
            pos, where = t.field.offset, {}
            for key, part in zip(["name_len", "name", "n_dims", "dims", "type", "offset"], t.field.parts):
                where[key] = pos
                pos += part.nbytes
            self.fields[t.name] = where
            self.starts[t.name] = int(t.data_offset)
            self.ends[t.name] = int(t.data_offset) + int(t.n_bytes)

    def patch(self, path: Path, name: str, key: str, value: int, dim: int = 0, fmt: str = "<u8") -> None:
        pos = self.fields[name][key] + (8 * dim if key == "dims" else 0)
        raw = bytearray(path.read_bytes())
        b = np.array([value], dtype=fmt).tobytes()
        raw[pos : pos + len(b)] = b
        path.write_bytes(bytes(raw))


def cut(path: Path, n: int) -> None:
    path.write_bytes(path.read_bytes()[:n])


def raises(exc, path: Path, *parts: str) -> str:
    """read_gguf raises ``exc`` (exactly that class or a subclass) naming path and parts."""
    with pytest.raises(exc) as e:
        read_gguf(path)
    msg = str(e.value)
    assert str(path) in msg, msg
    for p in parts:
        assert p in msg, f"{p!r} not in {msg!r}"
    return msg


# --------------------------------------------------------------------------------------


def test_good_file_reads_back(good):
    path, tensors = good
    ckpt = read_gguf(path)
    assert ckpt.architecture == "llama"
    assert list(ckpt.infos) == ["a", "b", "c", "d"]
    assert ckpt.infos["b"].qtype == QType.Q8_0 and ckpt.infos["b"].shape == (4, 64)
    assert torch.equal(ckpt.tensor("a").dequantize(), torch.from_numpy(tensors["a"][0]))
    assert torch.equal(ckpt.tensor("c").data, torch.from_numpy(tensors["c"][0]))
    b = ckpt.tensor("b", (4, 64))
    assert np.array_equal(b.data.numpy(), tensors["b"][0])
    ref = gguf.quants.dequantize(tensors["b"][0], GT.Q8_0)
    assert np.array_equal(b.dequantize().numpy().view(np.uint32), ref.view(np.uint32))


def test_missing_file(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        read_gguf(tmp_path / "nope.gguf")


def test_bad_magic(good, tmp_path: Path):
    path, _ = good
    raw = bytearray(path.read_bytes())
    raw[:4] = b"GGUX"
    path.write_bytes(bytes(raw))
    raises(CheckpointError, path, "not a GGUF file", "b'GGUX'", "expected b'GGUF'")
    text = tmp_path / "notes.txt"
    text.write_text("hello, I am not a model\n")
    raises(CheckpointError, text, "not a GGUF file", "expected b'GGUF'")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    raises(CheckpointError, empty, "not a GGUF file", "b''")


def test_truncated_header_every_cut(good):
    """A file cut anywhere before the first tensor's data is never accepted."""
    path, _ = good
    lay = Layout(path)
    full = path.read_bytes()
    for n in range(0, lay.data_start + 1):
        path.write_bytes(full[:n])
        with pytest.raises(CheckpointError) as e:
            read_gguf(path)
        msg = str(e.value)
        assert str(path) in msg, (n, msg)
        if n < 4:
            assert "not a GGUF file" in msg, (n, msg)
        else:
            assert "truncated" in msg, (n, msg)
    path.write_bytes(full[: lay.fields["b"]["type"] + 2])  # inside tensor b's info
    raises(CheckpointError, path, "truncated")


def test_truncated_data_names_tensor(good):
    path, _ = good
    lay = Layout(path)
    full = path.read_bytes()
    assert lay.ends["d"] == len(full)  # d is the last thing in the file
    for n in range(lay.data_start + 1, len(full), 29):
        path.write_bytes(full[:n])
        first_short = next(name for name in ["a", "b", "c", "d"] if lay.ends[name] > n)
        raises(CheckpointError, path, f"tensor {first_short!r}", "runs past the end of the file", f"({n} bytes)")
    path.write_bytes(full[:-50])
    raises(CheckpointError, path, "tensor 'd'", f"({len(full) - 50} bytes)", "F16 (16, 64) needs 2048 bytes")


def test_type_patch_overlaps_next_tensor(good):
    path, _ = good
    Layout(path).patch(path, "b", "type", int(GT.F32), fmt="<u4")  # 256 weights * 4 bytes
    raises(CheckpointError, path, "tensor 'b'", "F32 (4, 64)", "1024 bytes", "overlaps tensor 'c'",
           "byte size does not match shape and type")


def test_type_patch_runs_past_end(good):
    path, _ = good
    Layout(path).patch(path, "d", "type", int(GT.F32), fmt="<u4")
    raises(CheckpointError, path, "tensor 'd'", "runs past the end", "F32 (16, 64) needs 4096 bytes")


def test_dim_patch_overlaps_next_tensor(good):
    path, _ = good
    lay = Layout(path)
    lay.patch(path, "a", "dims", 5, dim=1)  # a: (4, 64) -> (5, 64) F32
    raises(CheckpointError, path, "tensor 'a'", "F32 (5, 64)", "overlaps tensor 'b'")


def test_dim_patch_rows_of_blocks(good):
    path, _ = good
    Layout(path).patch(path, "b", "dims", 8, dim=1)  # b: 8 rows of Q8_0 -> 544 bytes
    raises(CheckpointError, path, "tensor 'b'", "Q8_0 (8, 64)", "544 bytes", "overlaps tensor 'c'")


def test_dim_patch_overflowing_product(good):
    """32 * 2^59 = 2^64 elements: wraps to 0 in int64 arithmetic; must still be caught."""
    path, _ = good
    Layout(path).patch(path, "c", "dims", 2**59, dim=1)
    raises(CheckpointError, path, "tensor 'c'", "runs past the end", f"({2**59}, 32)")


def test_innermost_not_whole_blocks(good):
    path, _ = good
    Layout(path).patch(path, "b", "dims", 48, dim=0)
    raises(CheckpointError, path, "tensor 'b'", "innermost dimension 48", "Q8_0 block size 32")


def test_offset_patches(good):
    path, _ = good
    lay = Layout(path)
    full = path.read_bytes()
    c_rel = lay.starts["c"] - lay.data_start
    lay.patch(path, "c", "offset", c_rel + 1)
    raises(CheckpointError, path, "tensor 'c'", f"data offset {c_rel + 1}", "alignment 32")
    path.write_bytes(full)
    assert lay.ends["b"] > lay.starts["c"] - 32
    lay.patch(path, "c", "offset", c_rel - 32)  # aligned, but inside b
    raises(CheckpointError, path, "tensor 'b'", "overlaps tensor 'c'")


def test_duplicate_tensor_name(good):
    path, _ = good
    Layout(path).patch(path, "c", "name", ord("b"), fmt="u1")
    raises(CheckpointError, path, "tensor 'b'", "duplicate tensor name")


@pytest.mark.parametrize("type_id, name", [(16, "IQ2_XXS"), (10, "Q2_K"), (99, "unknown")])
def test_unsupported_type_patched(good, type_id: int, name: str):
    path, _ = good
    Layout(path).patch(path, "b", "type", type_id, fmt="<u4")
    msg = raises(UnsupportedQTypeError, path, "tensor 'b'", f"tensor type {type_id} ({name}) is not supported",
                 "supported types:")
    for t in QType:
        assert t.name in msg


def test_unsupported_type_written(tmp_path: Path):
    """A well-formed Q2_K tensor (gguf supports writing it; memra does not compute with it)."""
    rng = np.random.default_rng(1)
    tensors = make_tensors(rng)
    tensors["k"] = (rng.integers(0, 256, size=(2, 84), dtype=np.uint8), GT.Q2_K)  # 2 x 256 weights
    path = write_gguf(tmp_path / "q2k.gguf", tensors)
    raises(UnsupportedQTypeError, path, "tensor 'k'", "tensor type 10 (Q2_K) is not supported")


def test_big_endian_rejected(tmp_path: Path):
    path = write_gguf(tmp_path / "be.gguf", make_tensors(np.random.default_rng(2)), endianess=gguf.GGUFEndian.BIG)
    raises(CheckpointError, path, "big-endian", "expected little-endian")


def test_checkpoint_tensor_errors(good):
    path, _ = good
    ckpt = read_gguf(path)
    with pytest.raises(CheckpointError) as e:
        ckpt.tensor("blk.0.attn_q.weight", why="layer 0 attention")
    assert str(path) in str(e.value) and "'blk.0.attn_q.weight'" in str(e.value) and "layer 0 attention" in str(e.value)
    with pytest.raises(CheckpointError) as e:
        ckpt.tensor("b", (64, 4), why="hidden_size=64")
    assert "(4, 64)" in str(e.value) and "expected (64, 4)" in str(e.value) and "'b'" in str(e.value)


# --------------------------------------------------------------------------------------
# QTensor


def test_qtensor_validation():
    with pytest.raises(ValueError, match=r"expected uint8 \(4, 68\) for Q8_0 \(4, 64\)"):
        QTensor("w", QType.Q8_0, (4, 64), torch.zeros(4, 67, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"expected uint8 \(4, 68\)"):
        QTensor("w", QType.Q8_0, (4, 64), torch.zeros(4, 68, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"expected uint8 \(6, 288\)"):  # rows are prod(shape[:-1])
        QTensor("w", QType.Q4_K, (2, 3, 512), torch.zeros(2, 3, 288, dtype=torch.uint8))
    with pytest.raises(ValueError, match="last dimension 48 is not a multiple of the Q8_0 block size 32"):
        QTensor("w", QType.Q8_0, (4, 48), torch.zeros(4, 51, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"expected torch.float16 \(4, 8\)"):
        QTensor("w", QType.F16, (4, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"expected torch.float32 \(4, 8\)"):
        QTensor("w", QType.F32, (4, 8), torch.zeros(8, 4))
    t = QTensor("w", QType.Q8_0, (2, 3, 64), torch.zeros(6, 68, dtype=torch.uint8))
    assert t.numel == 384 and t.nbytes == 6 * 68


@pytest.mark.parametrize("qt", list(QType), ids=lambda t: t.name)
def test_permute_rows(qt: QType):
    """Permuting packed rows equals permuting the dequantized rows (bit for bit)."""
    g = torch.Generator().manual_seed(int(qt))
    info = QTYPE_INFO[qt]
    rows, cols = 7, 2 * info.block_size if info.block_size > 1 else 16
    if qt == QType.Q8_0:
        data = quantize_q8_0(torch.randn(rows, cols, generator=g))
    elif info.block_size > 1:
        data = torch.randint(0, 256, (rows, info.nbytes(cols)), dtype=torch.uint8, generator=g)
        flat = data.view(-1, info.type_size)  # keep fp16 fields finite: clear sign and exponent MSB
        offs = {QType.Q6_K: (208,)}.get(qt, () if qt == QType.NVFP4 else (0, 2))
        for o in offs:
            flat[:, o + 1] &= 0x3F
    else:
        dt = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}[qt]
        data = torch.randn(rows, cols, generator=g).to(dt)
    t = QTensor("w", qt, (rows, cols), data)
    perm = torch.randperm(rows, generator=g)
    p = t.permute_rows(perm)
    dense = t.dequantize()
    assert torch.isfinite(dense).all()
    assert p.shape == t.shape and p.qtype == qt
    assert torch.equal(p.dequantize().view(torch.int32), dense[perm].view(torch.int32))
    assert torch.equal(p.data, t.data[perm])
    if t.is_quantized:
        row0 = dequantize_blocks(t.data[perm[0]].contiguous(), qt)
        assert torch.equal(p.dequantize()[0].view(torch.int32), row0.view(torch.int32))
    with pytest.raises(ValueError, match="needs 2-D"):
        QTensor("w3", qt, (1, rows, cols), data.reshape(1, rows, -1) if not t.is_quantized else data).permute_rows(perm)


def _random_file(tmp_path, n: int):
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    tmp_path.mkdir(parents=True, exist_ok=True)
    p = tmp_path / "bytes.bin"
    p.write_bytes(data.numpy().tobytes())
    return p, data


def test_device_reader_reads_ranges_and_names_a_short_file(tmp_path):
    """memra.io.staging.DeviceReader: exact byte ranges (empty, unaligned, whole file) on the CPU;
    a range past the end raises EOFError naming the file; negative ranges ValueError."""
    from memra.io.staging import DeviceReader

    p, data = _random_file(tmp_path, 100_003)
    with DeviceReader("cpu") as r:
        for off, n in ((0, 0), (0, 100_003), (17, 4096), (99_999, 4)):
            assert torch.equal(r.read(p, off, n), data[off:off + n])
        assert r.bytes_read == 100_003 + 4096 + 4
        with pytest.raises(EOFError, match="bytes.bin"):
            r.read(p, 100_000, 10)
        with pytest.raises(ValueError, match=">= 0"):
            r.read(p, -1, 4)
        with pytest.raises(FileNotFoundError):
            r.read(tmp_path / "missing.bin", 0, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [1, 3])
def test_device_reader_streams_through_pinned_buffers(tmp_path, monkeypatch, threads):
    """The CUDA path: chunks far smaller than the ranges (so both staging buffers are reused many
    times, copies in flight while the next chunk is read, each chunk read by ``threads``
    concurrent slices) give the file's bytes exactly."""
    from memra.io import staging
    from memra.io.staging import DeviceReader

    monkeypatch.setattr(staging, "READ_THREADS", threads)
    monkeypatch.setattr(staging, "READ_SPLIT_MIN", 1000)

    p, data = _random_file(tmp_path, 1_000_003)
    q, data2 = _random_file(tmp_path / "b", 5000)
    with DeviceReader("cuda", chunk=4099) as r:
        outs = [(off, n, r.read(p, off, n)) for off, n in ((0, 1_000_003), (5, 77_777), (999_000, 1003), (3, 0))]
        assert torch.equal(r.read(q, 1, 4999).cpu(), data2[1:])  # a second file through the same buffers
        for off, n, t in outs:
            assert t.device.type == "cuda" and torch.equal(t.cpu(), data[off:off + n])
        # work queued on the caller's stream right after a read (no host sync between) sees its
        # bytes: the copies run on the reader's stream, the caller's stream waits for them
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            sums = [r.read(p, off, n).to(torch.int64).sum() for off, n in ((0, 1_000_003), (11, 500_000))]
        side.synchronize()
        assert [int(s) for s in sums] == [int(data[:1_000_003].to(torch.int64).sum()),
                                          int(data[11:500_011].to(torch.int64).sum())]


@pytest.mark.parametrize("arch", ["llama", "step35"])
def test_load_progress_counts_every_byte(tmp_path, arch, monkeypatch):
    """The loading bar (bytes, shows GB/s) ends at the file's tensor bytes: every tensor read,
    rope_freqs (read by adjust_config) included."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import tiny_gguf

    from memra.io.synthetic import write_synthetic
    from memra.models import base, load_model

    path = (write_synthetic("tiny", "gguf-q8_0", 0, tmp_path / "s.gguf") if arch == "step35"
            else tiny_gguf(tmp_path / "m.gguf", arch, layers=2))
    seen = []
    close = base.LoadProgress.close
    monkeypatch.setattr(base.LoadProgress, "close", lambda self: (close(self), seen.append((self.bar.n, self.bar.total))))
    load_model(path, torch.float32, progress=True)
    total = read_gguf(path).total_bytes()
    assert seen == [(total, total)]


def test_device_reader_splits_large_reads_across_threads(tmp_path, monkeypatch):
    """Reads past READ_SPLIT_MIN go out as READ_THREADS concurrent slices: same bytes, and a slice
    that runs past the end of the file still raises EOFError."""
    from memra.io import staging

    monkeypatch.setattr(staging, "READ_THREADS", 3)
    monkeypatch.setattr(staging, "READ_SPLIT_MIN", 1000)
    p, data = _random_file(tmp_path, 100_003)
    with staging.DeviceReader("cpu") as r:
        for off, n in ((0, 100_003), (1, 99_001), (50_000, 1001), (7, 999)):
            assert torch.equal(r.read(p, off, n), data[off:off + n])
        with pytest.raises(EOFError, match="bytes.bin"):
            r.read(p, 90_000, 20_000)
