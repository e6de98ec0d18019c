"""Read a safetensors file onto the device in large reads, a thread ahead of the copies.

Why: safetensors' own path maps the file, faults each page in and copies pageable memory to
the GPU, one tensor at a time (~4 GB/s for the 4B checkpoint on the H200's host). Here a
thread reads the file's data in chunks with plain `readinto` (no page faults, the GIL let go)
into a few reused host buffers, pinned on CUDA, while the main thread copies the last chunk
to the device without waiting. A tensor is handed out once all its bytes are on the device.

The format (github.com/huggingface/safetensors, README): 8 bytes of little-endian header
length, a JSON header mapping each name to dtype, shape and [begin, end) offsets into the
data that follows, and an optional `__metadata__` entry.
"""

from __future__ import annotations

import json
import math
import queue
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

CHUNK_BYTES = 64 << 20
BUFFERS = 3

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
            raise SafetensorsError(f"{path.name}: header length {length} runs past the end of the file")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise SafetensorsError(f"{path.name}: header is not JSON ({e})") from None
    header.pop("__metadata__", None)
    base = 8 + length
    entries = []
    for name, info in header.items():
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise SafetensorsError(f"{path.name}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
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
            raise SafetensorsError(f"{path.name}: tensors {before.name!r} and {after.name!r} overlap")
    return entries


@dataclass(slots=True)
class Chunk:
    buffer: int  # index of the host buffer holding it
    begin: int  # file offset of its first byte
    length: int


def spans(entries: list[TensorEntry]) -> list[tuple[int, int]]:
    """The byte ranges to read: adjacent tensors joined, gaps (skipped tensors) left out."""
    joined: list[tuple[int, int]] = []
    for entry in entries:
        if joined and entry.begin == joined[-1][1]:
            joined[-1] = (joined[-1][0], entry.end)
        elif entry.end > entry.begin:
            joined.append((entry.begin, entry.end))
    return joined


def read_chunks(path: Path, ranges: list[tuple[int, int]], buffers: list[torch.Tensor], filled: queue.Queue,
                free: queue.Queue) -> None:
    """The reader thread: each range of the file, chunk by chunk, into whichever buffer is
    free. A free buffer comes with the event of the copies still reading it (None on the
    CPU); the end (None) or an exception goes to the main thread through `filled`."""
    try:
        with open(path, "rb", buffering=0) as f:
            for begin, end in ranges:
                f.seek(begin)
                offset = begin
                while offset < end:
                    index, copied = free.get()
                    if index is None:  # the main thread stopped early
                        return
                    if copied is not None:
                        copied.synchronize()
                    length = min(end - offset, buffers[index].numel())
                    view = memoryview(buffers[index].numpy())[:length]
                    got = 0
                    while got < length:
                        n = f.readinto(view[got:])
                        if not n:
                            raise SafetensorsError(f"{path.name}: file ended at byte {offset + got}, expected {end}")
                        got += n
                    filled.put(Chunk(index, offset, length))
                    offset += length
        filled.put(None)  # all read
    except BaseException as e:  # noqa: BLE001 (handed to the main thread, which raises it)
        filled.put(e)


class CheckpointReader:
    """Host buffers (pinned on CUDA) kept across the files of one checkpoint."""

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES, buffers: int = BUFFERS) -> None:
        self.device = device
        pinned = device.type == "cuda"
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(buffers)]

    def tensors(self, path: Path, wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor on the device) for each wanted tensor of a safetensors file, in file
        order. Each is a fresh tensor for the caller to copy where it belongs and drop;
        unwanted tensors are not read."""
        entries = [entry for entry in read_header(path) if wanted(entry.name)]
        filled: queue.Queue = queue.Queue()
        free: queue.Queue = queue.Queue()
        for index in range(len(self.buffers)):
            free.put((index, None))
        reader = threading.Thread(target=read_chunks, args=(path, spans(entries), self.buffers, filled, free),
                                  name="checkpoint-reader", daemon=True)  # fmt: skip
        reader.start()
        try:
            yield from self.assemble(entries, filled, free)
        finally:
            free.put((None, None))  # stops a reader still waiting for a buffer
            reader.join()

    def assemble(self, entries: list[TensorEntry], filled: queue.Queue,
                 free: queue.Queue) -> Iterator[tuple[str, torch.Tensor]]:
        """Copy each chunk's bytes into the device tensors they belong to; hand out a tensor
        once its last byte is copied. Tensors may share a chunk and a tensor may span many."""
        device = self.device
        staged: torch.Tensor | None = None  # the current tensor's bytes, while partly copied
        at = 0
        while at < len(entries):
            entry = entries[at]
            if entry.end == entry.begin:  # empty: no bytes to wait for
                yield entry.name, torch.empty(entry.shape, dtype=entry.dtype, device=device)
                at += 1
                continue
            chunk = filled.get()
            if isinstance(chunk, BaseException):
                raise chunk
            if chunk is None:
                raise SafetensorsError(f"the reader ended before the bytes of tensor {entry.name!r}")
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
            copied = None
            if device.type == "cuda":
                copied = torch.cuda.Event()
                copied.record()
            free.put((chunk.buffer, copied))
