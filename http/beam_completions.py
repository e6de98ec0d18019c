"""/v1/completions with use_beam_search (vLLM's): each prompt's n beams
(engine/beam_search.py), answered whole as n choices, best first, prompt-major as the
completion route indexes them (choice p * n + i)."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from typing import Any

from deltaserve.engine.beam_search import BeamSearchError, beam_search
from deltaserve.engine.events import EngineDeadError, QueueFullError
from deltaserve.http import errors
from deltaserve.http.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    CompletionRequest,
    truncate_prompt,
)


async def beam_completions(engine: Any, req: CompletionRequest, model: str) -> dict[str, Any]:
    """The completion body; an ApiError for a refused prompt, a full queue or a dead engine."""
    width = req.sampling.n
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.sampling.max_tokens is None else req.sampling.max_tokens
    fit = functools.partial(truncate_prompt, keep=req.truncate_prompt_tokens, max_tokens=max_tokens,
                            max_model_len=engine.max_model_len)  # fmt: skip
    request_id = f"cmpl-{uuid.uuid4().hex}"
    try:
        prompts = [fit(await engine.encode(p) if isinstance(p, str) else list(p)) for p in req.prompts]
        if longest := max((len(ids) for ids in prompts if len(ids) + max_tokens > engine.max_model_len), default=0):
            raise errors.bad_request(f"a prompt of {longest} tokens + max_tokens ({max_tokens}) is more than "
                                     f"max_model_len ({engine.max_model_len})", "max_tokens")  # fmt: skip
        searches = [beam_search(engine, ids, width, max_tokens, engine.eos_token_ids,
                                length_penalty=req.length_penalty, ignore_eos=req.sampling.ignore_eos,
                                include_stop=req.sampling.include_stop_str_in_output, request_id=f"{request_id}-{p}")
                    for p, ids in enumerate(prompts)]  # fmt: skip
        results = await asyncio.gather(*searches)
    except QueueFullError as e:
        raise errors.queue_full(str(e)) from None
    except (EngineDeadError, BeamSearchError) as e:
        raise errors.engine_dead(engine.dead_reason or str(e)) from None
    except ValueError as e:
        raise errors.bad_request(str(e), "prompt") from None
    choices = []
    for p, beams in enumerate(results):
        for i, beam in enumerate(beams):
            text = await engine.run_tokenizer(functools.partial(
                _decode, ids=list(beam.tokens), skip_special=req.sampling.skip_special_tokens), len(beam.tokens))  # fmt: skip
            choices.append({"index": p * width + i, "text": text, "logprobs": None, "finish_reason": beam.finish_reason,
                            "stop_reason": beam.stop_reason})  # fmt: skip
    prompt_tokens = sum(len(ids) for ids in prompts)  # each prompt once, as the completion route counts it
    completion_tokens = sum(len(beam.tokens) for beams in results for beam in beams)
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                          "total_tokens": prompt_tokens + completion_tokens}}  # fmt: skip


def _decode(tokenizer: Any, ids: list[int], skip_special: bool) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special)


__all__ = ["beam_completions"]
