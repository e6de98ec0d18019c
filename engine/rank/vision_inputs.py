"""A rank's side of images and video: encodes a step's media with the tower (all of them in one
forward), keeps each request's embeddings until its chunks have consumed them, keeps recent
encodings by key (engine/encoder_cache.py), and adds a step's vision rows and multimodal
rotary positions to its plan.

The executor calls it; it knows nothing of sockets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaserve.engine.encoder_cache import EncoderCacheIndex
from deltaserve.engine.model_config import ModelConfig
from deltaserve.engine.rank.batch import StepPlan, StepVision
from deltaserve.engine.rank.mrope import (
    RequestPositions,
    VisionSpan,
    axis_of_frequencies,
    frequency_positions,
)
from deltaserve.engine.rank.vision import VisionTower, build_tower
from deltaserve.engine.vision_config import VisionConfig
from deltaserve.ipc.messages import MediaInput, StepItem

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MediaError(ValueError):
    """Media of a step this rank cannot take as sent (a StepError for the executor)."""


@dataclass(slots=True)
class RequestVision:
    """A request's vision spans, and the embeddings of those its chunks have yet to run,
    by the span's first token index."""

    positions: RequestPositions
    pending: dict[int, torch.Tensor] = field(default_factory=dict)

    def release_through(self, num_tokens: int) -> None:
        """Forget the embeddings of spans that end at or before `num_tokens`."""
        for offset in [o for o in self.pending if o + self.pending[o].shape[0] <= num_tokens]:
            del self.pending[offset]


def wire_dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in WIRE_DTYPES.items() if d == dtype)


class RankVision:
    def __init__(
        self,
        model_dir: str,
        config: VisionConfig,
        text: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.device = device
        self.tower: VisionTower = build_tower(model_dir, config, text, dtype, device)
        self.axis = axis_of_frequencies(text.rotary_dim // 2, config.mrope_section).to(device)
        self.index = EncoderCacheIndex()
        self.encoded: dict[bytes, torch.Tensor] = {}  # key -> its embeddings [tokens, hidden]

    def new_request(self, spans: list[tuple[int, int, int]]) -> RequestVision | None:
        if not spans:
            return None
        vision = [VisionSpan(*span) for span in spans]
        for before, after in zip(vision, vision[1:], strict=False):
            if after.offset < before.end:
                raise MediaError(f"vision spans {before} and {after} overlap or are out of order")
        if any(span.height < 1 or span.width < 1 or span.offset < 0 for span in vision):
            raise MediaError(f"vision spans {spans} hold an empty or negative span")
        return RequestVision(RequestPositions(vision))

    def tokens_of(self, media: MediaInput) -> int:
        t, h, w = media.grid
        return t * h * w // self.config.merge_unit

    def check(self, media: MediaInput, vision: RequestVision | None, fresh: set[bytes]) -> None:
        """Raise MediaError unless `media` fits its request's spans and its pixels (or an
        encoding held, or one made earlier in the step: `fresh`) are there."""
        t, h, w = media.grid
        m = self.config.spatial_merge_size
        if min(media.grid) < 1 or h % m or w % m or len(media.offsets) != t:
            raise MediaError(f"media grid {media.grid} with {len(media.offsets)} offsets")
        spans = {} if vision is None else {s.offset: s for s in vision.positions.spans}
        for offset in media.offsets:
            span = spans.get(offset)
            if span is None or (span.height, span.width) != (h // m, w // m):
                raise MediaError(
                    f"media at {offset} ({media.grid}) is not one of the request's spans"
                )
        if media.pixels:
            dtype = WIRE_DTYPES.get(media.dtype)
            size = t * h * w * self.config.patch_dim * (dtype.itemsize if dtype else 0)
            if dtype is None or len(media.pixels) != size:
                raise MediaError(
                    f"media pixels: {len(media.pixels)} bytes of {media.dtype!r}, expected "
                    f"{size} for grid {media.grid}"
                )
            fresh.add(media.key)
        elif media.key not in self.encoded and media.key not in fresh:
            raise MediaError(
                f"media {media.key.hex()[:16]} sent without pixels is not encoded here"
            )

    def encode(self, items: list[StepItem], vision_of: dict[int, RequestVision]) -> None:
        """Encode the step's new media in one tower forward, then hand each request its
        embeddings and update the encoder cache, item by item in order (as the scheduler did)."""
        new = {}  # key -> media, first sending
        for item in items:
            for media in item.media:
                if media.pixels and media.key not in new:
                    new[media.key] = media
        outputs: dict[bytes, torch.Tensor] = {}
        if new:
            pixels = torch.cat(
                [
                    torch.frombuffer(bytearray(m.pixels), dtype=WIRE_DTYPES[m.dtype])
                    .view(-1, self.config.patch_dim)
                    .to(self.device)
                    for m in new.values()
                ]
            )
            embeds = self.tower(pixels, [m.grid for m in new.values()])
            rows = [self.tokens_of(m) for m in new.values()]
            outputs = dict(zip(new, embeds.split(rows), strict=True))
        for item in items:
            for media in item.media:
                embeds = outputs.get(media.key) if media.pixels else self.encoded[media.key]
                if media.pixels:
                    self.encoded[media.key] = embeds
                for evicted in self.index.use(media.key, self.tokens_of(media)):
                    self.encoded.pop(evicted, None)
                per_group = embeds.shape[0] // len(media.offsets)
                for i, offset in enumerate(media.offsets):
                    vision_of[item.request_id].pending[offset] = embeds[
                        i * per_group : (i + 1) * per_group
                    ]

    def add_rows(
        self, plan: StepPlan, vision: RequestVision | None, start: int, length: int, offset: int
    ) -> None:
        """The item's tokens (positions start.., flat rows offset..) into `plan`: rotary
        positions, and its vision rows with their embeddings and height and width positions."""
        end = start + length
        if vision is None:
            plan.positions.extend(range(start, end))
            return
        positions = vision.positions
        t, h, w = positions.rows(start, end)
        plan.positions.extend(t)
        for span in positions.spans:
            lo, hi = max(start, span.offset), min(end, span.end)
            if lo >= hi:
                continue
            embeds = vision.pending.get(span.offset)
            if embeds is None:
                raise MediaError(
                    f"tokens {lo}..{hi - 1}: the image at {span.offset} was never sent"
                )
            plan.vision_rows.extend(range(offset + lo - start, offset + hi - start))
            plan.vision_embeds.append(embeds[lo - span.offset : hi - span.offset])
            plan.vision_heights.extend(h[lo - start : hi - start])
            plan.vision_widths.extend(w[lo - start : hi - start])

    def step_vision(self, plan: StepPlan) -> StepVision | None:
        if not plan.vision_rows:
            return None
        rows = torch.tensor(plan.positions, dtype=torch.int64).repeat(3, 1)
        index = torch.tensor(plan.vision_rows)
        rows[1, index] = torch.tensor(plan.vision_heights)
        rows[2, index] = torch.tensor(plan.vision_widths)
        return StepVision(
            index.to(self.device),
            torch.cat(plan.vision_embeds),
            frequency_positions(rows.to(self.device), self.axis),
        )
