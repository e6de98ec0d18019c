"""Images and video through the vision tower, golden against HF transformers'
`Qwen3_5ForConditionalGeneration` (CPU, fp32): the tower alone; the executor's every-position
logprobs for one image, two of different sizes, images mid-conversation and a short video,
whole, chunked mid-image, and decode steps after them; then the engine with real rank
processes at TP 1 and 2, chunked by its planner, with prefix caching on (a changed image is a
miss)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from engine_helpers import PlanLog, collect, engine_config
from transformers import Qwen3_5ForConditionalGeneration
from vision_helpers import chat, data_url, hf_logprobs, image, processor, video

from deltaserve.engine.events import FinishedEvent
from deltaserve.engine.rank.executor import Executor, ExecutorConfig
from deltaserve.engine.rank.vision import VisionTower
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.vision_config import VisionConfig
from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem
from deltaserve.tools.golden import compare_logprobs

BOUND = 1e-3
TOP = 8
LOREM = (
    "Describe what you see in the picture below, then compare it with the one before, and say "
    "in two short sentences which of them has more red in it."
)


def assert_golden(ours: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    report = compare_logprobs(ours, reference)
    print(f"{what}: {json.dumps(report.as_dict())}")
    assert report.argmax_mismatches == 0, f"{what}: argmax differs from HF ({report})"
    assert report.max_abs_diff <= BOUND, f"{what}: logprobs differ from HF by {report.max_abs_diff}"


@pytest.fixture(scope="module")
def vision(tiny_vlm_model_dir) -> VisionConfig:
    return VisionConfig.from_model_dir(tiny_vlm_model_dir)


@pytest.fixture(scope="module")
def hf(tiny_vlm_model_dir):
    return Qwen3_5ForConditionalGeneration.from_pretrained(
        tiny_vlm_model_dir, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def media(tiny_vlm_model_dir):
    return processor(tiny_vlm_model_dir)


@pytest.fixture(scope="module")
def executor(tiny_vlm_model_dir):
    return Executor(
        ExecutorConfig(str(tiny_vlm_model_dir), max_num_seqs=4, num_kv_blocks=256, block_size=16)
    )


CASES = {
    "one image": [LOREM, image(64, 64, 1), " What is it?"],
    "two images of different sizes": [
        "First: ",
        image(48, 80, 2),
        " and second: ",
        image(96, 64, 3),
        " " + LOREM,
    ],
    "an image mid-conversation": [
        LOREM,
        "<|im_end|>\n<|im_start|>assistant\nIt is noise, mostly red.<|im_end|>\n<|im_start|>user\n",
        image(64, 96, 4),
        " And this one?",
    ],
    "a short video": ["Watch: ", video(8, 48, 64, 4.0, 5), " " + LOREM],
}


def build(media, parts):
    text, images, videos = chat(parts)
    return media.process(text, images, videos)


class TestTower:
    def test_tower_matches_hf(self, tiny_vlm_model_dir, hf, vision):
        """Images of different sizes and a video's frames, in one batch, as HF's tower."""
        tower = VisionTower(vision, torch.float32, torch.device("cpu"))
        tower.load_state_dict(hf.model.visual.state_dict(), strict=False)
        grids = [(1, 4, 6), (1, 8, 4), (2, 4, 4)]
        gen = torch.Generator().manual_seed(0)
        pixels = torch.randn(sum(t * h * w for t, h, w in grids), vision.patch_dim, generator=gen)
        with torch.inference_mode():
            ref = hf.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
            ours = tower(pixels, grids)
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


class TestExecutorGolden:
    @pytest.mark.parametrize("case", list(CASES))
    def test_every_position(self, case, executor, hf, media, vision):
        prompt = build(media, CASES[case])
        assert len(prompt.media) == sum(not isinstance(p, str) for p in CASES[case])
        item = StepItem(
            1,
            0,
            list(prompt.ids),
            True,
            NewRequest(
                len(prompt.ids) + 8, SamplingSpec(seed=0), vision_spans=prompt.vision_spans()
            ),
            media=[m.wire(True) for m in prompt.media],
        )
        try:
            ours = executor.forward([item], every_position=True)
        finally:
            executor.drop([1])
        assert_golden(ours, hf_logprobs(hf, prompt, vision), case)

    @pytest.mark.parametrize("case", ["two images of different sizes", "a short video"])
    def test_chunked_mid_image_then_decode(self, case, executor, hf, media, vision):
        """Chunks that end inside images (each medium sent with the chunk that holds its first
        token), then greedy decode steps, whose positions are shifted after the images."""
        prompt = build(media, CASES[case])
        ids = list(prompt.ids)
        cuts = sorted(
            {0, len(ids)} | {m.first + 2 for m in prompt.media} | {m.end - 1 for m in prompt.media}
        )
        rows, reserve, steps = [], len(ids) + 8, 4
        try:
            for start, end in zip(cuts, cuts[1:], strict=False):
                item = StepItem(
                    1,
                    start,
                    ids[start:end],
                    end == len(ids),
                    NewRequest(reserve, SamplingSpec(seed=0), vision_spans=prompt.vision_spans())
                    if start == 0
                    else None,
                    media=[m.wire(True) for m in prompt.media if start <= m.first < end],
                )
                rows.append(executor.forward([item], every_position=True))
            generated = []
            for step in range(steps):
                token = int(rows[-1][-1].argmax())
                generated.append(token)
                rows.append(executor.forward([StepItem(1, len(ids) + step, [token], True)]))
        finally:
            executor.drop([1])
        assert any(m.first < cut < m.end for m in prompt.media for cut in cuts), "no cut mid-image"
        reference = hf_logprobs(hf, prompt, vision, generated)
        assert_golden(
            torch.cat(rows), reference, f"{case}, chunked at {cuts}, then {steps} decodes"
        )


@pytest.mark.parametrize("tp_size", [1, 2], ids=["tp1", "tp2"])
async def test_engine_golden_with_prefix_caching(tp_size, tiny_vlm_model_dir, hf, media, vision):
    """Real ranks (TP 1 and 2, gloo), the planner chunking prompts mid-image under a small
    budget; each token's top logprobs as HF's; the same prompt again reuses its saved state,
    one that differs only in its image does not (and is answered as HF answers it)."""
    from deltaserve.engine.async_engine import AsyncEngine

    engine = await AsyncEngine.start(
        engine_config(
            tiny_vlm_model_dir,
            tp_size=tp_size,
            max_num_batched_tokens=48,
            enable_prefix_caching=True,
        )
    )
    plans = PlanLog(engine)
    params = SamplingParams(max_tokens=4, logprobs=TOP, temperature=0.0)
    try:
        # a 6 x 6-patch image (36 patches, 9 tokens) right after a short text: the planner's
        # first chunk can afford its patches only by ending inside it
        parts = ["Look at this: ", image(96, 96, 7), " and this: ", image(48, 80, 2), " " + LOREM]
        first = build(media, parts)
        changed = build(media, [*parts[:3], image(48, 80, 99), parts[4]])
        assert first.ids == changed.ids and first.media[1].key != changed.media[1].key
        outcomes = []
        # the second sight of a prompt saves its state
        # where its full blocks end; the third starts there
        for prompt in (first, first, first, changed):
            tokens, finished = await collect(engine.generate(prompt, params))
            generated = [t.token_id for t in tokens]
            reference = hf_logprobs(hf, prompt, vision, generated[:-1])[len(prompt.ids) - 1 :]
            for row, token in enumerate(tokens):
                ids = torch.tensor([token_id for token_id, _ in token.top_logprobs])
                ours = torch.tensor([logprob for _, logprob in token.top_logprobs])
                assert len(ids) == TOP and int(ids[0]) == int(reference[row].argmax())
                diff = (ours - reference[row, ids]).abs().max().item()
                assert diff <= BOUND, f"engine tp{tp_size}, token {row}: {diff} from HF"
            outcomes.append((generated, finished.cached_tokens))
        assert outcomes[0][0] == outcomes[1][0] == outcomes[2][0]
        assert outcomes[2][1] > first.media[-1].end, "the same prompt again: its saved state"
        assert outcomes[3][1] <= changed.media[1].first, "a changed image: never the saved state"
        spans = [(m.first, m.end) for m in first.media]
        cuts = {c.start + c.num_tokens for plan in plans.plans for c in plan.chunks}
        assert any(lo < cut < hi for lo, hi in spans for cut in cuts), "no chunk ended mid-image"
        load = engine.load()  # idle: only the saved states hold blocks, as many on every rank
        held = load.num_blocks - load.free_blocks
        for snap in await engine.rank_snapshots():
            assert (snap.request_ids, snap.slots_used, snap.blocks_used) == ([], 0, held), snap
    finally:
        await engine.shutdown()


def image_chats(media, n: int) -> list:
    """n one-image chats, 24 and 36 patches (6 and 9 tokens) by turns."""
    return [
        build(media, [f"Picture {i}: ", image(96, 64 + 32 * (i % 2), i), " describe it."])
        for i in range(n)
    ]


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["recompute", "prefix_cached"])
async def test_image_chats_preempted_come_out_as_alone(tiny_vlm_model_dir, media, prefix_caching):
    """Image chats whose lifetimes do not fit the cache together: admitted by present need,
    the youngest are preempted and recomputed (their images encoded again), and each comes out
    as it did alone: greedy and seeded tokens, logprobs within the recompute's rounding. Then
    the ranks hold nothing but saved prefixes."""
    from deltaserve.engine.async_engine import AsyncEngine

    prompts = image_chats(media, 6)
    params = [
        SamplingParams(max_tokens=40, temperature=0.8 * (i % 2), seed=100 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    budget = dict(max_model_len=4096, max_num_seqs=6, max_num_batched_tokens=40, block_size=4)
    engine = await AsyncEngine.start(engine_config(tiny_vlm_model_dir, num_kv_blocks=256, **budget))
    try:  # one at a time, in room for every lifetime
        alone = [
            await collect(engine.generate(p, sp)) for p, sp in zip(prompts, params, strict=True)
        ]
    finally:
        await engine.shutdown()
    # 6 lifetimes of 16 or 17 blocks in 48 blocks
    tight = engine_config(
        tiny_vlm_model_dir,
        num_kv_blocks=48,
        kv_watermark=0.0,
        enable_prefix_caching=prefix_caching,
        **budget,
    )
    engine = await AsyncEngine.start(tight)
    try:
        together = await asyncio.gather(
            *(collect(engine.generate(p, sp)) for p, sp in zip(prompts, params, strict=True))
        )
        assert engine.metrics.num_preemptions_total > 0
        load = engine.load()
        held = load.num_blocks - load.free_blocks if prefix_caching else 0
        for snap in await engine.rank_snapshots():
            assert (snap.request_ids, snap.slots_used, snap.blocks_used) == ([], 0, held), snap
    finally:
        await engine.shutdown()
    for i, ((mine, end), (theirs, end_alone)) in enumerate(zip(together, alone, strict=True)):
        assert [t.token_id for t in mine] == [t.token_id for t in theirs], f"chat {i}"
        assert end.reason == end_alone.reason == "length"
        for a, b in zip(mine, theirs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=2e-3), f"chat {i}"


async def test_an_image_a_step_cannot_start_is_refused(tiny_vlm_model_dir, media):
    """A step starts a medium with its first token and its patches: an image of as many
    patches as max_num_batched_tokens could never be planned (it waited forever, and every
    prompt behind it), so it is refused naming the medium; one patch less is served."""
    from deltaserve.engine.async_engine import AsyncEngine

    fits, too_big = (build(media, ["Look: ", image(96, w, 1), " now."]) for w in (64, 96))
    assert [m.num_patches for m in (*fits.media, *too_big.media)] == [24, 36]
    engine = await AsyncEngine.start(engine_config(tiny_vlm_model_dir, max_num_batched_tokens=25))
    try:
        tokens, end = await collect(engine.generate(fits, SamplingParams(max_tokens=2)))
        assert isinstance(end, FinishedEvent) and len(tokens) == 2
    finally:
        await engine.shutdown()
    engine = await AsyncEngine.start(engine_config(tiny_vlm_model_dir, max_num_batched_tokens=36))
    try:
        with pytest.raises(ValueError, match=r"media 0: 36 patches .*max_num_batched_tokens 36"):
            engine.generate(too_big, SamplingParams(max_tokens=2))
    finally:
        await engine.shutdown()


@pytest.fixture(scope="module")
def tiny_vlm_agree_dir(tmp_path_factory):
    """The tiny VLM with make_model's "agree" MTP head, whose drafts are often accepted."""
    from deltaserve.tools.make_model import make_model

    return make_model(
        tmp_path_factory.mktemp("vlm_agree"),
        preset="tiny",
        dtype="fp32",
        vlm_names=True,
        mtp="agree",
    )


@pytest.mark.parametrize("tp_size", [1, 2], ids=["tp1", "tp2"])
async def test_image_chats_with_mtp_equal_them_without(tiny_vlm_agree_dir, media, tp_size):
    """Speculative decoding with the checkpoint's MTP head over image prompts (the head's
    catch-up runs over the image's positions): drafts are accepted, and greedy output equals
    the output without speculation, token for token."""
    from deltaserve.engine.async_engine import AsyncEngine
    from deltaserve.engine.speculative_config import SpeculativeConfig

    prompts = image_chats(media, 4)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs, accepted = [], 0
    for speculative in (None, SpeculativeConfig(num_speculative_tokens=2)):
        engine = await AsyncEngine.start(
            engine_config(
                tiny_vlm_agree_dir,
                tp_size=tp_size,
                max_model_len=1024,
                max_num_batched_tokens=64,
                num_kv_blocks=128,
                enable_prefix_caching=True,
                speculative_config=speculative,
            )
        )
        try:
            runs = await asyncio.gather(*(collect(engine.generate(p, params)) for p in prompts))
            outputs.append([[t.token_id for t in tokens] for tokens, _ in runs])
            accepted = engine.metrics.spec_decode_num_accepted_tokens_total
        finally:
            await engine.shutdown()
    assert outputs[0] == outputs[1]
    assert accepted > 0


async def test_an_image_past_a_step_is_resized_to_fit_unless_max_pixels_is_set(tiny_vlm_model_dir):
    """The checkpoint's own pixel bound lets an image have more patches than a step encodes:
    without an operator's max_pixels the engine resizes it to fit (and serves it); with one,
    an image past the step is refused naming its part."""
    from deltaserve.engine.async_engine import AsyncEngine
    from deltaserve.engine.media import MediaError, MediaSource

    text, _, _ = chat(["Look: ", image(8, 8, 0), " now."])
    source = MediaSource("image", data_url(image(512, 384, 3)), "messages[0].content[1]")
    params = SamplingParams(max_tokens=2)
    for kwargs in ({}, {"max_pixels": 512 * 384}):
        engine = await AsyncEngine.start(
            engine_config(tiny_vlm_model_dir, max_num_batched_tokens=64, mm_processor_kwargs=kwargs)
        )
        try:
            if kwargs:
                with pytest.raises(MediaError, match=r"content\[1\]: 768 patches .* 64\)"):
                    await engine.media_prompt(text, [source])
            else:
                prompt = await engine.media_prompt(text, [source])
                assert 36 <= prompt.media[0].num_patches <= 63  # resized: 1 + patches <= 64
                tokens, end = await collect(engine.generate(prompt, params))
                assert isinstance(end, FinishedEvent) and len(tokens) == 2
        finally:
            await engine.shutdown()
