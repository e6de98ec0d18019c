"""Read a safetensors file onto the device in large reads, a thread ahead of the copies.

Why: safetensors' own path maps the file, faults each page in and copies pageable memory to
the GPU, one tensor at a time (~5 GB/s for the 4B checkpoint on the H200's host). Here a few
threads read the file's data in chunks with `preadv` (no page faults, the GIL let go) into
reused host buffers, pinned on CUDA, while the main thread copies finished chunks to the
device without waiting. A tensor is handed out once all its bytes are on the device.

The format (github.com/huggingface/safetensors, README): 8 bytes of little-endian header
length, a JSON header mapping each name to dtype, shape and [begin, end) offsets into the
data that follows, and an optional `__metadata__` entry.
"""

from __future__ import annotations

import json
import math
import os
import queue
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

CHUNK_BYTES = 32 << 20
BUFFERS = 8
# The 4B checkpoint from the page cache to an H200 (16-core host): 1 reader 5.0 GB/s, 4
# readers 14-15, 8 readers 18-21; safetensors' mmap path 7.1-7.3.
READERS = min(8, os.cpu_count() or 1)

DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # offsets into the file, header included
    end: int


def read_header(path: Path) -> list[TensorEntry]:
    """The file's tensors in file order; an error names the file and what is wrong."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path.name}: too short for a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise SafetensorsError(
                f"{path.name}: header length {length} runs past the end of the file"
            )
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise SafetensorsError(f"{path.name}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path.name}: header is not a JSON object")
    header.pop("__metadata__", None)
    base = 8 + length
    entries = []
    for name, info in header.items():
        try:
            dtype = DTYPES.get(info["dtype"])
            shape = tuple(int(dim) for dim in info["shape"])
            begin, end = (int(offset) for offset in info["data_offsets"])
            if any(dim < 0 for dim in shape):
                raise ValueError("a negative dimension")
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(
                f"{path.name}: tensor {name!r} has a malformed header entry {info!r}"
            ) from None
        if dtype is None:
            raise SafetensorsError(
                f"{path.name}: tensor {name!r} has unsupported dtype {info['dtype']!r}"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0 or base + end > size:
            raise SafetensorsError(
                f"{path.name}: tensor {name!r} of shape {shape} ({nbytes} bytes) has data offsets "
                f"[{begin}, {end}) that do not fit it or the file"
            )
        entries.append(TensorEntry(name, dtype, shape, base + begin, base + end))
    entries.sort(key=lambda e: (e.begin, e.end))
    for before, after in zip(entries, entries[1:], strict=False):
        if after.begin < before.end:
            raise SafetensorsError(
                f"{path.name}: tensors {before.name!r} and {after.name!r} overlap"
            )
    return entries


@dataclass(slots=True)
class Chunk:
    """A piece of the file to read into one host buffer; `copied` is the event of the device
    copies still reading that buffer from its last chunk (None on the CPU or the first use)."""

    index: int  # its place in file order
    begin: int  # file offset of its first byte
    length: int
    buffer: int
    copied: torch.cuda.Event | None = None


def chunks(entries: list[TensorEntry], chunk_bytes: int) -> list[Chunk]:
    """The wanted bytes in file order, cut into chunks: adjacent tensors are read together,
    gaps (unwanted tensors) are skipped. Buffers are assigned later."""
    spans: list[list[int]] = []
    for entry in entries:
        if spans and entry.begin == spans[-1][1]:
            spans[-1][1] = entry.end
        elif entry.end > entry.begin:
            spans.append([entry.begin, entry.end])
    pieces = [
        (at, min(end, at + chunk_bytes))
        for begin, end in spans
        for at in range(begin, end, chunk_bytes)
    ]
    return [Chunk(index, begin, end - begin, -1) for index, (begin, end) in enumerate(pieces)]


def read_chunks(
    fd: int,
    name: str,
    buffers: list[torch.Tensor],
    work: queue.SimpleQueue,
    filled: queue.SimpleQueue,
) -> None:
    """A reader thread: reads each chunk handed to it into its buffer, once the device copies
    from that buffer's previous chunk are done, and hands it back (or the exception). A None
    ends the thread."""
    while (chunk := work.get()) is not None:
        try:
            if chunk.copied is not None:
                chunk.copied.synchronize()
            view = memoryview(buffers[chunk.buffer].numpy())[: chunk.length]
            got = 0
            while got < chunk.length:
                n = os.preadv(fd, [view[got:]], chunk.begin + got)
                if not n:
                    raise SafetensorsError(f"{name}: file ended at byte {chunk.begin + got}")
                got += n
            filled.put(chunk)
        except BaseException as e:  # noqa: BLE001 (handed to the main thread, which raises it)
            filled.put(e)


class CheckpointReader:
    """Host buffers (pinned on CUDA) kept across the files of one checkpoint, and the
    threads that fill them: several, since one thread copies from the page cache at only
    ~5 GB/s."""

    def __init__(
        self,
        device: torch.device,
        chunk_bytes: int = CHUNK_BYTES,
        buffers: int = BUFFERS,
        readers: int = READERS,
    ) -> None:
        self.device = device
        self.readers = readers
        pinned = device.type == "cuda"
        self.buffers = [
            torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(buffers)
        ]

    def tensors(
        self, path: Path, wanted: Callable[[str], bool]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor on the device) for each wanted tensor of a safetensors file, in file
        order. Each is a fresh tensor for the caller to copy where it belongs and drop;
        unwanted tensors are not read."""
        entries = [entry for entry in read_header(path) if wanted(entry.name)]
        work: queue.SimpleQueue = queue.SimpleQueue()
        filled: queue.SimpleQueue = queue.SimpleQueue()
        fd = os.open(path, os.O_RDONLY)
        threads = [
            threading.Thread(
                target=read_chunks,
                args=(fd, path.name, self.buffers, work, filled),
                name=f"checkpoint-reader-{i}",
                daemon=True,
            )
            for i in range(self.readers)
        ]
        for thread in threads:
            thread.start()
        try:
            yield from self.assemble(
                entries, chunks(entries, self.buffers[0].numel()), work, filled
            )
        finally:
            for _ in threads:
                work.put(None)
            for thread in threads:
                thread.join()
            os.close(fd)

    def assemble(
        self,
        entries: list[TensorEntry],
        pieces: list[Chunk],
        work: queue.SimpleQueue,
        filled: queue.SimpleQueue,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Hands out chunks to the readers, a buffer each, the next in file order whenever a
        buffer is free (so the chunk awaited always has one); copies each chunk, in file
        order, into the device tensors it holds bytes of, and hands out a tensor once its
        last byte is copied. Tensors may share a chunk and a tensor may span many."""
        device = self.device
        for buffer, chunk in enumerate(pieces[: len(self.buffers)]):
            chunk.buffer = buffer
            work.put(chunk)
        done: dict[int, Chunk] = {}
        staged: torch.Tensor | None = None  # the current tensor's bytes, while partly copied
        at = 0
        for index in range(len(pieces)):
            while index not in done:
                got = filled.get()
                if isinstance(got, BaseException):
                    raise got
                done[got.index] = got
            chunk = done.pop(index)
            host = self.buffers[chunk.buffer]
            chunk_end = chunk.begin + chunk.length
            while at < len(entries) and entries[at].begin < chunk_end:
                entry = entries[at]
                if staged is None:
                    staged = torch.empty(entry.end - entry.begin, dtype=torch.uint8, device=device)
                lo, hi = max(entry.begin, chunk.begin), min(entry.end, chunk_end)
                if hi > lo:
                    staged[lo - entry.begin : hi - entry.begin].copy_(
                        host[lo - chunk.begin : hi - chunk.begin], non_blocking=True
                    )
                if entry.end > chunk_end:
                    break  # the rest of this tensor is in later chunks
                yield entry.name, staged.view(entry.dtype).view(entry.shape)
                staged = None
                at += 1
            following = index + len(self.buffers)
            if following < len(pieces):
                pieces[following].buffer = chunk.buffer
                if device.type == "cuda":
                    pieces[following].copied = torch.cuda.Event()
                    pieces[following].copied.record()
                work.put(pieces[following])
        for entry in entries[at:]:  # only empty tensors are left, at the data's end
            yield entry.name, torch.empty(entry.shape, dtype=entry.dtype, device=device)
