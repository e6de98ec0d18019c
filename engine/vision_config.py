"""The vision tower's shape and the multimodal token ids, read from a released Qwen3.5
checkpoint's `config.json` (`vision_config`, the top-level token ids, the text model's
`mrope_section`).

Torch-free: the engine reads it to preprocess images and place their tokens, the ranks to
build the tower (engine/rank/vision.py) and the rotary positions (engine/rank/mrope.py).
A text-only checkpoint has none (`VisionConfig.from_dict` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deltaserve.engine.model_config import (
    VLM_MODEL_TYPES,
    ConfigError,
    json_kind,
    read_json_object,
    to_number,
)

# transformers' Qwen3_5VisionConfig and Qwen3_5Config defaults, for keys a config leaves out
VISION_DEFAULTS = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
}
TOKEN_DEFAULTS = {
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
}
MROPE_SECTION_DEFAULT = (11, 11, 10)  # transformers' Qwen3_5TextRotaryEmbedding default
VISION_ROPE_THETA_DEFAULT = 10_000.0
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")  # the MLP's; the merger's is always exact GELU


@dataclass(frozen=True, slots=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    rope_theta: float
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    # rotary frequencies of the text model's attention taken from the height and width
    # positions (interleaved: frequency j is height's if j % 3 == 1 and j < 3 * section[1], ...)
    mrope_section: tuple[int, int, int]

    def __post_init__(self) -> None:
        for key in (*VISION_DEFAULTS, "depth"):
            if getattr(self, key) < 1:
                raise ConfigError(f"vision_config.{key} is {getattr(self, key)}, not positive")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ConfigError(
                f"vision_config.hidden_size {self.hidden_size} is not num_heads "
                f"{self.num_heads} times a multiple of 4 (the 2-D rotary halves)"
            )
        side = round(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ConfigError(
                "vision_config.num_position_embeddings "
                f"{self.num_position_embeddings} is not a square"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"vision_config.hidden_act {self.hidden_act!r} "
                f"is not one of {', '.join(ACTIVATIONS)}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one patch as the processor flattens it: channels x frames x pixels."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one token of the language model."""
        return self.spatial_merge_size**2

    @property
    def grid_side(self) -> int:
        """Side of the learned square grid of position embeddings."""
        return round(self.num_position_embeddings**0.5)

    @classmethod
    def from_dict(cls, raw: dict) -> VisionConfig | None:
        """None for a text-only config; a ConfigError naming the key for one we cannot read."""
        if raw.get("model_type") not in VLM_MODEL_TYPES or raw.get("vision_config") is None:
            return None
        vision = raw["vision_config"]
        if not isinstance(vision, dict):
            raise ConfigError(f"vision_config is {json_kind(vision)}, not an object")
        if vision.get("deepstack_visual_indexes"):
            raise ConfigError(
                "vision_config.deepstack_visual_indexes: deepstack features (Qwen3-VL) are not "
                "part of Qwen3.5 and not supported"
            )
        values = {**VISION_DEFAULTS, **{k: v for k, v in vision.items() if v is not None}}
        for key in ("patch_size", "temporal_patch_size"):
            if isinstance(values[key], list):  # transformers allows [n, n]
                if len(set(values[key])) != 1:
                    raise ConfigError(f"vision_config.{key} {values[key]} is not square")
                values[key] = values[key][0]
        rope = vision.get("rope_parameters") or {}
        text = raw.get("text_config") or {}
        text_rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if not isinstance(text_rope, dict):
            raise ConfigError(f"text_config.rope_parameters is {json_kind(text_rope)}")
        if text_rope.get("mrope_interleaved") is False:
            raise ConfigError(
                "text_config.rope_parameters.mrope_interleaved false: Qwen3.5 interleaves its "
                "multimodal rotary sections (transformers does so whatever the flag)"
            )
        section = text_rope.get("mrope_section", MROPE_SECTION_DEFAULT)
        if not isinstance(section, list | tuple) or len(section) != 3:
            raise ConfigError(
                f"text_config.rope_parameters.mrope_section {section!r:.40} is not 3 numbers"
            )
        tokens = {
            key: to_number(raw.get(key, default), key, int)
            for key, default in TOKEN_DEFAULTS.items()
        }
        return cls(
            **{key: to_number(values[key], f"vision_config.{key}", int) for key in VISION_DEFAULTS},
            hidden_act=str(values.get("hidden_act", "gelu_pytorch_tanh")),
            rope_theta=to_number(
                rope.get("rope_theta", VISION_ROPE_THETA_DEFAULT), "vision_config.rope_theta", float
            ),
            **tokens,
            mrope_section=tuple(to_number(s, "mrope_section", int) for s in section),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> VisionConfig | None:
        path = Path(model_dir) / "config.json"
        try:
            return cls.from_dict(read_json_object(path))
        except ValueError as e:
            raise ConfigError(f"{path}: {e}") from None
