"""Multimodal rotary positions (MRoPE) of a request whose prompt holds images or video frames.

As transformers' `Qwen3_5Model.get_rope_index`: every token has three positions (temporal,
height, width). A text token's three are equal and count up by one. A vision span of
`height x width` tokens (one image, or one frame group of a video: a video's groups are apart,
separated by their timestamps' text) starting where the text count is `c` gives token (i, j)
the positions (c, c + i, c + j), and the text after it goes on from c + max(height, width).
So every text token after a span is shifted from its index by the same `delta`; decode steps
too (their positions are index + the request's whole delta).

The text model's rotary frequencies take the three positions interleaved
(`axis_of_frequencies`); where all three are equal that is plain 1-D RoPE at the text
position, so only steps that hold vision tokens need the three rows (`frequency_positions`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class VisionSpan:
    """One image's (or video frame group's) placeholder tokens in a request's prompt."""

    offset: int  # index of its first token in the request
    height: int  # tokens per column: the patch grid's height over the spatial merge
    width: int

    @property
    def length(self) -> int:
        return self.height * self.width

    @property
    def end(self) -> int:
        return self.offset + self.length


class RequestPositions:
    """The rotary positions of one request's tokens, from its vision spans (sorted, apart)."""

    def __init__(self, spans: list[VisionSpan]) -> None:
        self.spans = spans
        self.offsets = [span.offset for span in spans]
        self.deltas = [0]  # deltas[i]: the shift of text after the first i spans
        for span in spans:
            self.deltas.append(self.deltas[-1] + max(span.height, span.width) - span.length)

    @property
    def delta(self) -> int:
        """The shift of every token after the last span (decode steps included)."""
        return self.deltas[-1]

    def span_at(self, index: int) -> int | None:
        """Which span holds token `index`, or None (text)."""
        i = bisect.bisect_right(self.offsets, index) - 1
        return i if i >= 0 and index < self.spans[i].end else None

    def text_position(self, index: int) -> int:
        """The (equal) positions of text token `index`; of a vision token, its temporal one."""
        i = bisect.bisect_right(self.offsets, index)
        if i and index < self.spans[i - 1].end:  # inside span i - 1: where its text count was
            return self.spans[i - 1].offset + self.deltas[i - 1]
        return index + self.deltas[i]

    def rows(self, start: int, end: int) -> tuple[list[int], list[int], list[int]]:
        """(temporal, height, width) positions of tokens start .. end-1."""
        t, h, w = [], [], []
        for index in range(start, end):
            base = self.text_position(index)
            t.append(base)
            i = self.span_at(index)
            if i is None:
                h.append(base)
                w.append(base)
            else:
                row, col = divmod(index - self.spans[i].offset, self.spans[i].width)
                h.append(base + row)
                w.append(base + col)
        return t, h, w


def axis_of_frequencies(num_frequencies: int, section: tuple[int, int, int]) -> torch.Tensor:
    """[F] int64: which of the three positions each rotary frequency turns by (transformers'
    interleaved layout: frequency j is height's where j % 3 == 1 and j < 3 * section[1],
    width's where j % 3 == 2 and j < 3 * section[2], else temporal's)."""
    axis = []
    for j in range(num_frequencies):
        if j % 3 == 1 and j < 3 * section[1]:
            axis.append(1)
        elif j % 3 == 2 and j < 3 * section[2]:
            axis.append(2)
        else:
            axis.append(0)
    return torch.tensor(axis, dtype=torch.int64)


def frequency_positions(rows: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    """[T, F]: the position each token's frequency j turns by, from `rows` [3, T]."""
    return rows.T[:, axis]
