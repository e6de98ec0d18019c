"""A prompt with images or video: its token ids (each image's placeholder run expanded as the
checkpoint's processor expands it) and its media, each the processor's pixels and where its
tokens are. Made by engine/media.py; the scheduler sends each medium's pixels with the chunk
that holds its first token (ipc/messages.py `MediaInput`).

Torch-free: the tick never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from deltaserve.engine.encoder_cache import EncoderCacheIndex
from deltaserve.ipc.messages import MediaInput

if TYPE_CHECKING:
    from deltaserve.engine.planner import PlannedChunk


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One image or video: `grid` (frames, height, width) in patches; `offsets`: where each frame
    group's run of placeholder tokens starts in the prompt; `pixels` the processor's patches,
    raw, in `dtype`; `key` the SHA-256 of them (the encoder cache's and prefix cache's key)."""

    key: bytes
    grid: tuple[int, int, int]
    offsets: tuple[int, ...]
    merge: int  # the spatial merge: a run is (height / merge) x (width / merge) tokens
    pixels: bytes
    dtype: str

    @property
    def num_patches(self) -> int:
        """Patches the tower encodes: its share of a step's token budget."""
        t, h, w = self.grid
        return t * h * w

    @property
    def span_shape(self) -> tuple[int, int]:
        return self.grid[1] // self.merge, self.grid[2] // self.merge

    @property
    def span_length(self) -> int:
        height, width = self.span_shape
        return height * width

    @property
    def num_tokens(self) -> int:
        return self.span_length * len(self.offsets)

    @property
    def first(self) -> int:
        return self.offsets[0]

    @property
    def end(self) -> int:
        """One past its last placeholder token."""
        return self.offsets[-1] + self.span_length

    def wire(self, with_pixels: bool) -> MediaInput:
        return MediaInput(
            self.key,
            self.grid,
            list(self.offsets),
            self.pixels if with_pixels else b"",
            self.dtype if with_pixels else "",
        )


@dataclass(frozen=True, slots=True)
class MultimodalPrompt:
    """Token ids and the media whose placeholder runs they hold, in order."""

    ids: tuple[int, ...]
    media: tuple[MediaItem, ...]

    def vision_spans(self) -> list[tuple[int, int, int]]:
        """(first token, height, width) of every frame group's run, in order (NewRequest's)."""
        return [(offset, *item.span_shape) for item in self.media for offset in item.offsets]

    def cache_ids(self) -> tuple[int, ...]:
        """The ids the prefix cache keys on: each placeholder token replaced by a value drawn
        from its medium's key (negative: never a token id), so prompts that differ only in an
        image never share a saved state."""
        ids = list(self.ids)
        for item in self.media:
            mark = -1 - int.from_bytes(item.key[:8], "little")
            for offset in item.offsets:
                ids[offset : offset + item.span_length] = [mark] * item.span_length
        return tuple(ids)


def chunk_media(
    prompt: MultimodalPrompt | None,
    chunk: PlannedChunk,
    first_chunk: bool,
    index: EncoderCacheIndex,
) -> list[MediaInput]:
    """The media a planned prompt chunk (start, num_tokens, is_decode) sends: those whose first
    token it holds, and for a request's first chunk (after a saved prefix) any it holds part
    of; each with its pixels unless the ranks keep its encoding (`index`, updated here as
    each rank updates its own: engine/encoder_cache.py)."""
    if prompt is None or chunk.is_decode:
        return []
    start, end = chunk.start, chunk.start + chunk.num_tokens
    sent = []
    for item in prompt.media:
        if start <= item.first < end or (first_chunk and item.first < start < item.end):
            sent.append(item.wire(with_pixels=item.key not in index))
            index.use(item.key, item.num_tokens)
    return sent
