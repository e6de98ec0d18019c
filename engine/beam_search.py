"""Beam search over the engine, as vLLM's frontend runs it (`use_beam_search`): each step asks
for one token of every live beam with its 2 x width best logprobs (the model's raw
distribution), keeps the `width` best extensions by cumulative logprob and sets aside each
beam an EOS would end; the answer is the `width` best of those and the live beams by
cumulative logprob / length ** length_penalty, the length counting the prompt and no EOS
(vLLM's `get_beam_search_score`).

Each step's prompt is the last one and one token more, so with prefix caching a beam's next
step starts from the state its last step saved. Nothing of a step's own sample is used: it
runs greedy (temperature changes no candidate, as in vLLM, whose candidates come from raw
logprobs too).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from deltaserve.engine.events import ErrorEvent, FinishedEvent, TokenEvent
from deltaserve.engine.sampling_params import ParamError, SamplingParams


@dataclass(frozen=True, slots=True)
class Beam:
    tokens: tuple[int, ...]  # the output's tokens (an ending EOS only where include_stop)
    # each token's (an ending EOS's where it is not kept: only in cum_logprob)
    logprobs: tuple[float, ...]
    cum_logprob: float
    finish_reason: Literal["stop", "length"]
    score: float
    stop_reason: int | None = None  # the EOS id that ended it


class BeamSearchError(RuntimeError):
    """A step of the search failed in the engine (its ErrorEvent's message)."""


def check_beam_search(engine: Any, prompt: list[int], width: int, max_tokens: int) -> None:
    """Raise what would stop a search of `prompt` midway, before it starts: a ParamError for a
    width past what the engine's max_logprobs leaves, or a prompt and max_tokens that do not
    fit (`engine.check`, as for any request, which raises QueueFullError and EngineDeadError
    too)."""
    if not 1 <= 2 * width <= engine.max_logprobs:
        raise ParamError(
            "n",
            f"n (the beam width) must be in 1..{engine.max_logprobs // 2}: each step asks for "
            f"2 x n logprobs, at most --max-logprobs ({engine.max_logprobs})",
        )
    engine.check([prompt], [SamplingParams(max_tokens=max_tokens)])


async def beam_search(
    engine: Any,
    prompt: list[int],
    width: int,
    max_tokens: int,
    eos_ids: Collection[int],
    *,
    length_penalty: float = 1.0,
    ignore_eos: bool = False,
    include_stop: bool = False,
    request_id: str = "beam",
) -> list[Beam]:
    """The `width` best beams of `prompt`, best first. `engine`: an AsyncEngine (its
    `generate`); refused up front as `check_beam_search` refuses."""
    check_beam_search(engine, prompt, width, max_tokens)
    step = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2 * width)
    # tokens, their logprobs, sum
    live: list[tuple[tuple[int, ...], tuple[float, ...], float]] = [((), (), 0.0)]
    done: list[Beam] = []

    def scored(
        tokens: tuple[int, ...],
        logprobs: tuple[float, ...],
        cum: float,
        reason: Literal["stop", "length"],
        eos: int | None,
    ) -> Beam:
        length = len(prompt) + len(tokens) - (eos is not None and include_stop)
        return Beam(tokens, logprobs, cum, reason, cum / length**length_penalty, eos)

    for n in range(max_tokens):
        tops = await asyncio.gather(
            *(
                _best_next(engine, prompt + list(tokens), step, f"{request_id}-{n}-{i}")
                for i, (tokens, _, _) in enumerate(live)
            )
        )
        candidates = []
        for (tokens, logprobs, cum), top in zip(live, tops, strict=True):
            for token, logprob in top:
                if token in eos_ids and not ignore_eos:
                    kept = (token,) * include_stop, (logprob,) * include_stop
                    done.append(
                        scored(tokens + kept[0], logprobs + kept[1], cum + logprob, "stop", token)
                    )
                else:
                    candidates.append((cum + logprob, tokens + (token,), logprobs + (logprob,)))
        candidates.sort(key=lambda c: -c[0])
        live = [(tokens, logprobs, cum) for cum, tokens, logprobs in candidates[:width]]
        if not live:
            break
    beams = done + [scored(tokens, logprobs, cum, "length", None) for tokens, logprobs, cum in live]
    return sorted(beams, key=lambda b: b.score, reverse=True)[:width]


async def _best_next(
    engine: Any, ids: list[int], params: SamplingParams, request_id: str
) -> list[tuple[int, float]]:
    """The best next tokens after `ids` and their logprobs, best first."""
    stream = engine.generate(ids, params, request_id=request_id)
    top: list[tuple[int, float]] = []
    try:
        async for ev in stream:
            if isinstance(ev, TokenEvent):
                top = ev.top_logprobs
            elif isinstance(ev, ErrorEvent):
                raise BeamSearchError(ev.message)
            elif isinstance(ev, FinishedEvent) and ev.reason == "abort":
                raise BeamSearchError("a step of the beam search was aborted")
    finally:
        await stream.aclose()
    return top


__all__ = ["Beam", "BeamSearchError", "beam_search"]
