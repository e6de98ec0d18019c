"""Prompt logprobs (`SamplingParams.prompt_logprobs`) end to end: real rank processes, CPU at
TP=1 and TP=2 (gloo), CUDA where there is one; HF transformers in fp32 is the reference.

What must hold: every choice gets one PromptLogprobsEvent before its first token, whose
logprob, rank and alternatives of each prompt token after the first are HF's at the position
before it, with the prompt cut into chunks (the logprob of a chunk's last position is of the
next chunk's first token) and a decoding request in the same steps; a request that asks for
them starts from no saved prefix.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import pytest_asyncio
import torch
from engine_helpers import PLACEMENTS, start_placed
from transformers import Qwen3_5ForCausalLM

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.events import FinishedEvent, PromptLogprobsEvent, TokenEvent
from deltaserve.engine.sampling_params import SamplingParams

module_loop = pytest.mark.asyncio(loop_scope="module")
K = 5


@pytest_asyncio.fixture(scope="module", loop_scope="module", **PLACEMENTS)
async def engine(request, tiny_model_dir):
    engine = await start_placed(
        request.param,
        tiny_model_dir,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
        prefix_cache_states=4,
    )
    yield engine
    await engine.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    """On the CPU in fp32, on GPU machines too: transformers (>= 5.25) sends CPU inputs to its
    torch path even with fla installed, whose CUDA kernels compute chunks in tf32 (0.105 nat
    off at logprobs near -40 on an H100, against an engine on the CPU)."""
    return Qwen3_5ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """HF's logprobs [len(prompt) - 1, vocab]: row i is the distribution prompt[i + 1] came from."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0, :-1]
        return logits.float().log_softmax(dim=-1).cpu()


def tolerance(engine: AsyncEngine) -> float:
    if engine.config.device.startswith("cuda"):  # its kernels' rounding
        return 5e-2
    return 1e-3  # the golden gate's bound (tests/test_golden.py)


async def run(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> list:
    return await asyncio.wait_for(_drain(engine.generate(prompt, params)), 120)


async def _drain(stream) -> list:
    return [event async for event in stream]


def prompt_events(events: list, n: int) -> list[PromptLogprobsEvent]:
    """Each choice's one PromptLogprobsEvent, checked to come before its first token."""
    found: dict[int, PromptLogprobsEvent] = {}
    for event in events:
        if isinstance(event, PromptLogprobsEvent):
            assert event.index not in found, f"choice {event.index} got two PromptLogprobsEvents"
            found[event.index] = event
        elif isinstance(event, TokenEvent):
            assert event.index in found, (
                f"choice {event.index}'s first token came before its prompt logprobs"
            )
    assert sorted(found) == list(range(n))
    return [found[i] for i in range(n)]


def assert_as_hf(
    engine: AsyncEngine, hf_model, prompt: list[int], event: PromptLogprobsEvent
) -> None:
    """Each logprob HF's; each rank between the counts of tokens HF finds surely likelier and
    maybe likelier (a random model's tokens are close: rounding may swap neighbours); the
    alternatives HF's best, best first, with HF's logprobs."""
    reference, tol = hf_logprobs(hf_model, prompt), tolerance(engine)
    target = reference.gather(1, torch.tensor(prompt[1:])[:, None])
    assert (
        len(event.token_logprobs) == len(event.ranks) == len(event.top_logprobs) == len(prompt) - 1
    )
    assert event.token_logprobs == pytest.approx(target[:, 0].tolist(), abs=tol)
    surely = (reference > target + tol).sum(dim=-1) + 1
    maybe = (reference > target - tol).sum(dim=-1) + 1
    assert all(
        lo <= rank <= hi
        for lo, rank, hi in zip(surely.tolist(), event.ranks, maybe.tolist(), strict=True)
    )
    kth_best = reference.topk(K).values[:, -1]
    for row, top in enumerate(event.top_logprobs):
        assert len(top) == K and len({t for t, _ in top}) == K
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        for token, logprob in top:
            assert logprob == pytest.approx(reference[row, token].item(), abs=tol)
            assert logprob >= kth_best[row].item() - tol, (
                f"position {row}: token {token} is not among HF's best {K}"
            )


@module_loop
async def test_prompt_logprobs_match_hf_across_chunks_beside_a_decode(engine, hf_model):
    gen = random.Random(5)
    prompt = [gen.randrange(1000, 240000) for _ in range(61)]  # three chunks of at most 24 tokens
    other = [gen.randrange(1000, 240000) for _ in range(10)]
    decoding = asyncio.create_task(
        run(engine, other, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    )
    await asyncio.sleep(0.05)  # its decode steps carry the chunks below
    params = SamplingParams(max_tokens=3, temperature=0.0, n=2, prompt_logprobs=K, ignore_eos=True)
    events = await run(engine, prompt, params)
    for event in prompt_events(events, 2):
        assert_as_hf(engine, hf_model, prompt, event)
    assert all(not isinstance(e, PromptLogprobsEvent) for e in await decoding)


@module_loop
async def test_prompt_logprobs_start_from_no_saved_prefix(engine, hf_model):
    gen = random.Random(6)
    prompt = [gen.randrange(1000, 240000) for _ in range(40)]
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    await run(engine, prompt[:33], plain)  # saved: the next prompt begins with it
    events = await run(
        engine, prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=K)
    )
    finished = [e for e in events if isinstance(e, FinishedEvent)]
    assert finished[0].cached_tokens == 0
    assert_as_hf(engine, hf_model, prompt, prompt_events(events, 1)[0])
    again = await run(engine, prompt, plain)  # without prompt logprobs the prefix is reused
    assert [e for e in again if isinstance(e, FinishedEvent)][0].cached_tokens > 0


@module_loop
async def test_one_token_prompt_has_no_prompt_logprobs(engine):
    events = await run(engine, [1234], SamplingParams(max_tokens=2, prompt_logprobs=0))
    (event,) = prompt_events(events, 1)
    assert (event.token_logprobs, event.ranks, event.top_logprobs) == ([], [], [])
