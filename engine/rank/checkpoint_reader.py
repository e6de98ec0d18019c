"""Read a safetensors file onto the device: on CUDA in large reads, a thread ahead of the
copies; on the CPU through the safetensors library.

Why: safetensors' own path maps the file, faults each page in and copies pageable memory to
the GPU, one tensor at a time (~5 GB/s for the 4B checkpoint on the H200's host). Here a few
threads read the file's data in chunks with `preadv` (no page faults, the GIL let go) into
reused host buffers, pinned on CUDA, while the main thread copies finished chunks to the
device without waiting. A tensor is handed out once all its bytes are on the device. Into
host memory that path costs a copy more than the library's, which is faster there
(tools/bench_checkpoint_read.py, 512 MiB from the page cache on a shared 2-core host: median
0.16 GB/s ours, 0.36 the library's, best 0.33 and 1.09; bench/results/checkpoint_read_cpu.json).

The format (github.com/huggingface/safetensors, README): 8 bytes of little-endian header
length, a JSON header mapping each name to dtype, shape and [begin, end) offsets into the
data that follows, and an optional `__metadata__` entry. The header is the safetensors
library's to read and check (`read_header`, engine/checkpoint_files.py); the reads here only
take the byte ranges of tensors it accepted.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from deltaserve.engine.checkpoint_files import SafetensorsError, TensorEntry, read_header

CHUNK_BYTES = 32 << 20
BUFFERS = 8
# The 4B checkpoint from the page cache to an H200 (16-core host): 1 reader 5.0 GB/s, 4
# readers 14-15, 8 readers 18-21; safetensors' mmap path 7.1-7.3.
READERS = min(8, os.cpu_count() or 1)


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
    ~5 GB/s. `parallel` (default: on CUDA only) picks that path over the library's."""

    def __init__(
        self,
        device: torch.device,
        chunk_bytes: int = CHUNK_BYTES,
        buffers: int = BUFFERS,
        readers: int = READERS,
        parallel: bool | None = None,
    ) -> None:
        self.device = device
        self.readers = readers
        self.parallel = device.type == "cuda" if parallel is None else parallel
        pinned = device.type == "cuda"
        self.buffers = (
            [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(buffers)]
            if self.parallel
            else []
        )

    def tensors(
        self, path: Path, wanted: Callable[[str], bool]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor on the device) for each wanted tensor of a safetensors file, in file
        order. Each is a fresh tensor for the caller to copy where it belongs and drop;
        unwanted tensors are not read."""
        entries = [entry for entry in read_header(path) if wanted(entry.name)]
        if not self.parallel:
            with safe_open(path, framework="pt", device=str(self.device)) as f:
                for entry in entries:
                    yield entry.name, f.get_tensor(entry.name)
            return
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
