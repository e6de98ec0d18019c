"""What the vision tests share: images and videos made here, a multimodal prompt made by the
checkpoint's processor (engine/media.py), and HF transformers' logits for it."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch
from PIL import Image

from deltaserve.engine.media import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    MediaConfig,
    MediaProcessor,
    Video,
)
from deltaserve.engine.media_prompt import MultimodalPrompt
from deltaserve.engine.tokenizer import load_tokenizer
from deltaserve.engine.vision_config import VisionConfig

# small pixel budgets: a few patches an image, so the tiny model's tests stay fast
TEST_PROCESSOR_KWARGS = {"min_pixels": 32 * 32, "max_pixels": 96 * 96}


def image(height: int, width: int, seed: int) -> Image.Image:
    gen = np.random.default_rng(seed)
    return Image.fromarray(gen.integers(0, 256, (height, width, 3), dtype=np.uint8))


def png(picture: Image.Image) -> bytes:
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return out.getvalue()


def data_url(picture: Image.Image) -> str:
    """The picture as a PNG `data:` URL, as a client sends it."""
    return "data:image/png;base64," + base64.b64encode(png(picture)).decode()


def video(frames: int, height: int, width: int, fps: float, seed: int) -> Video:
    gen = np.random.default_rng(seed)
    return Video(gen.integers(0, 256, (frames, height, width, 3), dtype=np.uint8), fps)


def processor(model_dir, dtype: str = "float32") -> MediaProcessor:
    return MediaProcessor(
        str(model_dir),
        load_tokenizer(model_dir),
        VisionConfig.from_model_dir(model_dir),
        MediaConfig(processor_kwargs=TEST_PROCESSOR_KWARGS),
        dtype,
    )


def chat(parts: list[str | Image.Image | Video]) -> tuple[str, list, list]:
    """A ChatML prompt of one user turn whose parts are text, images and videos, placed as
    the checkpoint's template places them; (text, images, videos)."""
    text, images, videos = "<|im_start|>user\n", [], []
    for part in parts:
        if isinstance(part, str):
            text += part
        elif isinstance(part, Video):
            text += VIDEO_PLACEHOLDER
            videos.append(part)
        else:
            text += IMAGE_PLACEHOLDER
            images.append(part)
    return text + "<|im_end|>\n<|im_start|>assistant\n", images, videos


def hf_inputs(prompt: MultimodalPrompt, vision: VisionConfig, extra_ids: list[int] = ()) -> dict:
    """`Qwen3_5ForConditionalGeneration`'s inputs for the prompt (and tokens after it)."""
    ids = [*prompt.ids, *extra_ids]
    types = [
        1 if t == vision.image_token_id else 2 if t == vision.video_token_id else 0 for t in ids
    ]
    inputs = {
        "input_ids": torch.tensor([ids]),
        "mm_token_type_ids": torch.tensor([types]),
    }
    for kind, key, grid_key in (
        ("image", "pixel_values", "image_grid_thw"),
        ("video", "pixel_values_videos", "video_grid_thw"),
    ):
        token = vision.image_token_id if kind == "image" else vision.video_token_id
        items = [m for m in prompt.media if prompt.ids[m.first] == token]
        if items:
            inputs[key] = torch.cat(
                [
                    torch.frombuffer(bytearray(m.pixels), dtype=torch.float32).view(
                        m.num_patches, -1
                    )
                    for m in items
                ]
            )
            inputs[grid_key] = torch.tensor([m.grid for m in items])
    return inputs


def hf_logprobs(
    model, prompt: MultimodalPrompt, vision: VisionConfig, extra_ids=()
) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(**hf_inputs(prompt, vision, list(extra_ids))).logits[0]
    return logits.float().log_softmax(-1)
