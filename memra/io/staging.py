"""Reading checkpoint bytes straight into GPU memory.

:class:`DeviceReader` copies byte ranges of files (a GGUF file, safetensors shards) to a CUDA device through two pinned
host buffers: the ``pread`` of chunk i + 1 (from the page cache, or the disk) runs on the
host while the DMA engine copies chunk i, so a load streams at the speed of the slower of
the two (page-cache reads are ~5 GB/s per core, so a chunk is read by READ_THREADS threads;
pinned host-to-device copies on an H200 ~55 GB/s), instead of a pageable copy of a private host copy of every tensor.
Weights are then repacked into the kernels' layouts on the GPU
(memra/layers/linear.py, memra/layers/moe.py: they pack tensors where they find them).

The copies run on a stream of their own, so the upload of tensor i + 1 overlaps the packing
kernels of tensor i on the caller's stream.

On the CPU (and under the Triton interpreter, where tests run the GPU path on the CPU) the
bytes are read into ordinary host memory with the same call.

Design source: llama.cpp's CUDA model loading (reads into pinned buffers, asynchronous
uploads); ideas only.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = ["DeviceReader", "StagingReaders", "STAGING_CHUNK", "READ_THREADS"]

#: Bytes per pinned staging buffer (two are used): large enough that a chunk's syscall and
#: copy launch are amortised, small enough that pinning them at start-up is quick.
STAGING_CHUNK = 64 << 20
#: Threads that read one chunk's slices concurrently (one core copies ~5 GB/s out of the page cache:
#: measured on the H200 machine's host, 2026-12-03), and the smallest read that is split.
READ_THREADS = min(4, os.cpu_count() or 1)
READ_SPLIT_MIN = 8 << 20


def _resolve(device: torch.device | str) -> torch.device:
    """``device`` with a bare "cuda" made the current GPU (readers are kept per concrete device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class DeviceReader:
    """Reads byte ranges of files into uint8 tensors on ``device``.

    Args:
        device: a CUDA device (pinned double-buffered upload) or the CPU (a plain read).
        chunk: bytes per staging buffer (CUDA only).

    Files are opened on first use and kept open until :meth:`close`; the two staging buffers
    are shared by all of them. Use as a context manager, or call :meth:`close`.
    :attr:`bytes_read` counts the bytes handed out (for a load's GB/s).

    Raises (from :meth:`read`): FileNotFoundError; EOFError if the range runs past the end of
    the file; ValueError for a negative offset or size.
    """

    def __init__(self, device: torch.device | str, chunk: int = STAGING_CHUNK):
        self.device = _resolve(device)
        if chunk < 1:
            raise ValueError(f"DeviceReader: chunk = {chunk} bytes, must be >= 1")
        self.chunk = chunk
        self.bytes_read = 0
        self._fds: dict[Path, int] = {}
        self._bufs: list[torch.Tensor] = []
        self._done: list[torch.cuda.Event | None] = []
        self._next = 0  # the staging buffer the next chunk goes through (alternates across reads)
        self._pool: ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None  # the copies' stream (CUDA; made with the buffers)

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def _pread_part(self, fd: int, path: Path, view: memoryview, offset: int) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                raise EOFError(f"{path}: wanted {len(view)} bytes at offset {offset}, the file ends after {got}")
            got += n

    def _pread_into(self, path: Path, view: memoryview, offset: int) -> None:
        """Fill ``view`` from ``offset``: in READ_THREADS slices read concurrently when it is large
        (a page-cache read is a memcpy, bound per core; ``preadv`` releases the GIL)."""
        fd = self._fd(path)
        n = len(view)
        if n < READ_SPLIT_MIN or READ_THREADS < 2:
            self._pread_part(fd, path, view, offset)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="memra-read")
        step = -(-n // READ_THREADS)
        futures = [self._pool.submit(self._pread_part, fd, path, view[a:a + step], offset + a)
                   for a in range(0, n, step)]
        for f in futures:
            f.result()  # re-raises a slice's error (EOFError, OSError)

    def read(self, path: str | Path, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` of ``path`` as a new uint8 tensor [nbytes] on the device.

        On CUDA the copies run on the reader's own copy stream, so they overlap whatever the
        caller has queued (the packing of the previous tensor); the caller's current stream waits
        for the last copy (work queued on it afterwards sees the bytes) and the tensor's memory is
        recorded on it (not reused before that work is done). A staging buffer is refilled only
        once its previous copy has left the host."""
        path = Path(path)
        if offset < 0 or nbytes < 0:
            raise ValueError(f"{path}: read of {nbytes} bytes at offset {offset}: both must be >= 0")
        if self.device.type != "cuda":
            out = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                self._pread_into(path, memoryview(out.numpy()), offset)
            self.bytes_read += nbytes
            return out.to(self.device)
        with torch.cuda.device(self.device):  # events and copies on this device, whatever is current
            if not self._bufs:
                self._bufs = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
                self._done = [None, None]
                self._stream = torch.cuda.Stream(self.device)
            consumer = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self._stream):
                out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)  # the copy stream's memory
                pos, ev = 0, None
                while pos < nbytes:
                    n = min(self.chunk, nbytes - pos)
                    i = self._next
                    if self._done[i] is not None:
                        self._done[i].synchronize()  # this buffer's previous copy has left the host
                    b = self._bufs[i]
                    self._pread_into(path, memoryview(b.numpy())[:n], offset + pos)
                    out[pos:pos + n].copy_(b[:n], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(self._stream)
                    self._done[i] = ev
                    self._next = 1 - i
                    pos += n
            if ev is not None:
                consumer.wait_event(ev)
            out.record_stream(consumer)
        self.bytes_read += nbytes
        return out

    def close(self) -> None:
        """Wait for queued copies, release the staging buffers and the files."""
        try:
            for ev in self._done:
                if ev is not None:
                    ev.synchronize()
        finally:
            self._bufs, self._done, self._stream = [], [], None
            for fd in self._fds.values():
                os.close(fd)
            self._fds = {}
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None

    def __enter__(self) -> DeviceReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StagingReaders:
    """One :class:`DeviceReader` per device, opened on first use (what a checkpoint holds while a
    model loads); :meth:`close` closes them all (later reads open new ones)."""

    def __init__(self):
        self._readers: dict[torch.device, DeviceReader] = {}

    def read(self, device: torch.device | str, path: str | Path, offset: int, nbytes: int) -> torch.Tensor:
        """:meth:`DeviceReader.read` through ``device``'s reader ("cuda" means the current GPU)."""
        device = _resolve(device)
        reader = self._readers.get(device)
        if reader is None:
            reader = self._readers[device] = DeviceReader(device)
        return reader.read(path, offset, nbytes)

    def close(self) -> None:
        """Close every reader (waits for their queued copies); the next read opens a new one."""
        readers, self._readers = list(self._readers.values()), {}
        for r in readers:
            r.close()
