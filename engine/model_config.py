"""The Qwen3.5 text model's shape, read from an HF `config.json`.

Torch-free so that the controller can check a tensor-parallel size against the head counts
before any rank starts. A leaf: it imports nothing of ours, and every layer may import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TypeVar

ACCEPTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
VLM_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")  # their text model's settings are in text_config

# transformers' Qwen3_5TextConfig defaults, used for keys a config.json leaves out (HF reads
# such a config with these; head_dim in particular is 256, not hidden_size // heads)
TEXT_DEFAULTS = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
}
# transformers' Qwen3_5MoeTextConfig defaults where they differ (Qwen3.5-35B-A3B's shape); a
# mixture-of-experts config names no intermediate_size: every layer's MLP is its experts
MOE_TEXT_DEFAULTS = {
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "intermediate_size": 0,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}
POSITIVE_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "max_position_embeddings",
)
MOE_KEYS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
MTP_LAYERS = 1  # mtp_num_hidden_layers that speculative decoding runs
JSON_KINDS = {
    type(None): "null",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "an object",
}


class ConfigError(ValueError):
    """A config.json that is not a Qwen3.5 text model's as we read it; names the key (and the
    file, from `from_model_dir`)."""


def json_kind(value: object) -> str:
    return JSON_KINDS.get(type(value), type(value).__name__)


Number = TypeVar("Number", int, float)


def to_number(value: object, key: str, kind: type[Number]) -> Number:
    """`value` of config key `key` as an int or float, or a ConfigError naming the key (never
    int()'s TypeError or ValueError, which name neither)."""
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"{key} is {value!r:.60} ({json_kind(value)}), not {what}") from None


def read_json_object(path: Path) -> dict:
    """The JSON object in `path` (config.json, generation_config.json); a ConfigError naming
    the file if it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a JSON object but {json_kind(raw)}")
    return raw


def token_ids(value: object, key: str) -> tuple[int, ...]:
    """A config's token id or list of ids (eos_token_id, absent = none) as ints."""
    listed = [] if value is None else value if isinstance(value, list) else [value]
    return tuple(to_number(token, key, int) for token in listed)


# the DeltaNet state dtypes a checkpoint's mamba_ssm_dtype may name
MAMBA_SSM_DTYPES = ("float32", "bfloat16")

# an FP8 checkpoint's quant_method -> the suffix of its scale tensors' names (weight name + it)
FP8_SCALE_SUFFIXES = {"fp8": "_scale_inv", "compressed-tensors": "_scale"}


def read_fp8(quant: object) -> tuple[tuple[int, int], str] | None:
    """An FP8 checkpoint's scale blocks (a side of 0: the whole dimension) and the suffix of its
    scale tensors' names (engine/rank/fp8.py); None: no quantization_config. Anything else that
    is quantized is refused by name: its tensors would otherwise fail obscurely or load as
    garbage."""
    if not quant:
        return None
    method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
    if isinstance(quant, dict) and method == "compressed-tensors":
        return read_compressed_tensors(quant), FP8_SCALE_SUFFIXES[method]
    if not isinstance(quant, dict) or method != "fp8":
        raise ConfigError(
            f"quantized checkpoints other than FP8 are not supported (quantization_config: "
            f"{method!r:.40}); serve the bf16 or FP8 release of the model"
        )
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(
            f"quantization_config: activation_scheme {quant['activation_scheme']!r:.40} is not "
            f"supported (only 'dynamic': no input scales)"
        )
    block = quant.get("weight_block_size")
    if block is None:
        raise ConfigError(
            "quantization_config: FP8 with one scale per tensor (no weight_block_size) is not "
            "supported, only block scales such as Qwen's [128, 128]"
        )
    return block_sizes(block, "weight_block_size"), FP8_SCALE_SUFFIXES[method]


def block_sizes(block: object, key: str) -> tuple[int, int]:
    if not isinstance(block, list) or len(block) != 2:
        raise ConfigError(f"quantization_config: {key} is {block!r:.40}, not [rows, columns]")
    rows, cols = (to_number(size, key, int) for size in block)
    if rows < 1 or cols < 1:
        raise ConfigError(f"quantization_config: {key} is {block}, not two positive integers")
    return rows, cols


# compressed-tensors' FP8 weight strategies -> the block a scale covers (0: the whole dimension)
COMPRESSED_TENSORS_BLOCKS = {"tensor": (0, 0), "channel": (1, 0)}


def read_compressed_tensors(quant: dict) -> tuple[int, int]:
    """The scale block of llm-compressor's FP8 checkpoints (FP8_DYNAMIC, FP8_BLOCK): 8-bit float
    weights, symmetric, one strategy for every group; activations dynamic or not quantized."""
    where = "quantization_config"
    if quant.get("kv_cache_scheme"):
        raise ConfigError(f"{where}: kv_cache_scheme (a quantized KV cache) is not supported")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(
            f"{where}: config_groups is {groups!r:.40}, not an object of quantization groups"
        )
    blocks = set()
    for name, group in groups.items():
        at = f"{where}.config_groups.{name}"
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise ConfigError(f"{at}: no weights scheme")
        fmt = group.get("format") or quant.get("format")
        if (weights.get("type"), weights.get("num_bits"), fmt) != ("float", 8, "float-quantized"):
            raise ConfigError(
                f"{at}: {weights.get('num_bits')}-bit {weights.get('type')} weights ({fmt}) are "
                "not supported, only FP8 (8-bit float, float-quantized)"
            )
        if not weights.get("symmetric", True) or weights.get("dynamic"):
            raise ConfigError(f"{at}: only symmetric FP8 weights with stored scales are supported")
        inputs = group.get("input_activations")
        if (inputs and not inputs.get("dynamic")) or group.get("output_activations"):
            raise ConfigError(
                f"{at}: static activation scales are not supported (only dynamic ones)"
            )
        strategy = weights.get("strategy")
        if strategy == "block":
            blocks.add(
                block_sizes(
                    weights.get("block_structure"), f"config_groups.{name}.weights.block_structure"
                )
            )
        elif strategy in COMPRESSED_TENSORS_BLOCKS:
            blocks.add(COMPRESSED_TENSORS_BLOCKS[strategy])
        else:
            raise ConfigError(
                f"{at}: weight strategy {strategy!r:.40} is not supported "
                f"(tensor, channel and block are)"
            )
    if len(blocks) > 1:
        raise ConfigError(
            f"{where}: config groups of different weight strategies are not supported"
        )
    return blocks.pop()


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    # the DeltaNet recurrent state's dtype the checkpoint asks for (vLLM's `mamba_ssm_dtype`,
    # what --mamba-ssm-cache-dtype auto takes; float32 in the released Qwen3.5 configs)
    mamba_ssm_dtype: str = "float32"
    # an FP8 checkpoint's scale blocks (engine/rank/fp8.py)
    fp8_block: tuple[int, int] | None = None
    # its scale tensors' names: weight name + this
    fp8_scale_suffix: str = FP8_SCALE_SUFFIXES["fp8"]
    # mixture of experts (the qwen3_5_moe models): every layer's MLP is num_experts_per_tok of
    # num_experts routed experts plus a gated shared expert (engine/rank/moe.py); 0: dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # decoder layers of the multi-token-prediction head (`mtp.*`, engine/rank/mtp.py) the
    # checkpoint declares; 0: none (transformers' text configs leave the key out)
    mtp_num_hidden_layers: int = 0

    def differences(self, other: ModelConfig) -> list[str]:
        """The fields in which `other` is another model (the weights' dtype may differ: they
        are converted as they load; so may the state dtype asked for, chosen at start; the MTP
        head may be absent: a trainer's save drops it, and the served head keeps its weights)."""
        return [
            f.name
            for f in fields(self)
            if f.name not in ("torch_dtype", "mamba_ssm_dtype", "mtp_num_hidden_layers")
            and getattr(self, f.name) != getattr(other, f.name)
        ]

    def __post_init__(self) -> None:
        for key in POSITIVE_KEYS:  # a 0 would otherwise end in a ZeroDivisionError, here or later
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} is {getattr(self, key)}, not a positive integer")
        for key in (
            MOE_KEYS if self.num_experts or self.num_experts_per_tok else ("intermediate_size",)
        ):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} is {getattr(self, key)}, not a positive integer")
        if self.mtp_num_hidden_layers < 0:
            raise ConfigError(
                f"mtp_num_hidden_layers is {self.mtp_num_hidden_layers}, not an integer >= 0"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok {self.num_experts_per_tok} "
                f"is more than num_experts {self.num_experts}"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries, "
                f"num_hidden_layers is {self.num_hidden_layers}"
            )
        for kind in self.layer_types:
            if kind not in ("linear_attention", "full_attention"):
                raise ConfigError(f"unknown layer type {kind!r} in layer_types")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads {self.linear_num_key_heads}"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the DeltaNet conv1d: [Q | K | V] of all heads."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    def check_mtp_head(self) -> None:
        """ValueError naming `mtp_num_hidden_layers` unless the checkpoint declares the one MTP
        layer speculative decoding runs (engine/rank/mtp.py; every release declares 1)."""
        if self.mtp_num_hidden_layers != MTP_LAYERS:
            what = "no MTP head" if self.mtp_num_hidden_layers == 0 else "MTP layers"
            raise ValueError(
                f"speculative decoding (method mtp) needs the checkpoint's MTP head: its config "
                f"declares mtp_num_hidden_layers={self.mtp_num_hidden_layers} ({what}); only "
                f"{MTP_LAYERS} is supported"
            )

    def check_tp_size(self, tp_size: int) -> None:
        """Raise ValueError unless `tp_size` splits every head group evenly."""
        if tp_size < 1:
            raise ValueError(f"tensor-parallel size must be >= 1, got {tp_size}")
        counts = {
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
        }
        if self.num_experts:  # each expert's intermediate rows are split across ranks
            counts["moe_intermediate_size"] = self.moe_intermediate_size
            counts["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        for name, count in counts.items():
            if count % tp_size:
                raise ValueError(f"tensor-parallel size {tp_size} does not divide {name}={count}")

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        """Raises ConfigError (a ValueError) naming the key for a config we cannot read."""
        if not isinstance(raw, dict):
            raise ConfigError(f"not a JSON object but {json_kind(raw)}")
        model_type = raw.get("model_type")
        if model_type not in ACCEPTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}: deltaserve serves Qwen3.5 text models "
                f"(model_type one of {', '.join(ACCEPTED_MODEL_TYPES)})"
            )
        text_config = raw.get("text_config")
        if "text_config" in raw and not isinstance(text_config, dict):
            raise ConfigError(
                f"text_config is {json_kind(text_config)}, "
                "not an object of the text model's settings"
            )
        fp8 = read_fp8(
            raw.get("quantization_config") or (text_config or {}).get("quantization_config")
        )
        top_eos = raw.get("eos_token_id")
        if model_type in VLM_MODEL_TYPES:
            if text_config is None:
                raise ConfigError(f"model_type {model_type!r} config has no text_config")
            text = dict(text_config)
            # Qwen3_5ForConditionalGeneration ties by the top-level flag only (default False)
            tie = raw.get("tie_word_embeddings", False)
            dtype = raw.get("torch_dtype") or raw.get("dtype") or text.get("dtype")
        else:
            text = raw
            tie = raw.get("tie_word_embeddings", False)
            dtype = raw.get("torch_dtype") or raw.get("dtype")
        if dtype is not None and not isinstance(dtype, str):
            raise ConfigError(
                f"torch_dtype is {json_kind(dtype)}, not a dtype name such as 'bfloat16'"
            )
        moe = model_type.startswith("qwen3_5_moe")
        defaults = {**TEXT_DEFAULTS, **MOE_TEXT_DEFAULTS} if moe else TEXT_DEFAULTS
        text = {**defaults, **{key: value for key, value in text.items() if value is not None}}

        def integer(key: str) -> int:
            return to_number(text[key], key, int)

        n_layers = integer("num_hidden_layers")
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = to_number(
                text.get("full_attention_interval", 4), "full_attention_interval", int
            )
            if interval < 1:
                raise ConfigError(f"full_attention_interval is {interval}, not a positive integer")
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(n_layers)
            ]
        elif not isinstance(layer_types, list):
            raise ConfigError(
                f"layer_types is {json_kind(layer_types)}, not an array of layer type names"
            )
        # as transformers reads them: rope_scaling (the older key) wins, and theta defaults to 10k
        rope_key = "rope_scaling" if text.get("rope_scaling") else "rope_parameters"
        rope = text.get(rope_key) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{rope_key} is {json_kind(rope)}, not an object")
        rope = {key: value for key, value in rope.items() if value is not None}
        rope_theta = to_number(
            rope.get("rope_theta", text.get("rope_theta", 10_000.0)), "rope_theta", float
        )
        partial = to_number(
            rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)),
            "partial_rotary_factor",
            float,
        )
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ConfigError(f"unsupported rope_type {rope_type!r} in {rope_key}")
        eos = text.get("eos_token_id", top_eos)
        eos_ids = token_ids(eos, "eos_token_id")
        state_dtype = text.get("mamba_ssm_dtype", raw.get("mamba_ssm_dtype")) or "float32"
        if state_dtype not in MAMBA_SSM_DTYPES:
            raise ConfigError(
                f"mamba_ssm_dtype is {state_dtype!r:.40}, not one of {', '.join(MAMBA_SSM_DTYPES)}"
            )
        return cls(
            vocab_size=integer("vocab_size"),
            hidden_size=integer("hidden_size"),
            intermediate_size=integer("intermediate_size"),
            num_hidden_layers=n_layers,
            num_attention_heads=integer("num_attention_heads"),
            num_key_value_heads=integer("num_key_value_heads"),
            head_dim=integer("head_dim"),
            linear_num_key_heads=integer("linear_num_key_heads"),
            linear_num_value_heads=integer("linear_num_value_heads"),
            linear_key_head_dim=integer("linear_key_head_dim"),
            linear_value_head_dim=integer("linear_value_head_dim"),
            linear_conv_kernel_dim=integer("linear_conv_kernel_dim"),
            layer_types=tuple(layer_types),
            rms_norm_eps=to_number(text["rms_norm_eps"], "rms_norm_eps", float),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            max_position_embeddings=integer("max_position_embeddings"),
            tie_word_embeddings=bool(tie),
            eos_token_ids=eos_ids,
            torch_dtype=dtype or "bfloat16",
            mamba_ssm_dtype=state_dtype,
            fp8_block=fp8 and fp8[0],
            fp8_scale_suffix=fp8[1] if fp8 else FP8_SCALE_SUFFIXES["fp8"],
            mtp_num_hidden_layers=to_number(
                text.get("mtp_num_hidden_layers", 0), "mtp_num_hidden_layers", int
            ),
            **({key: integer(key) for key in MOE_KEYS} if moe else {}),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        """The folder's config.json; a ConfigError names the file and the key."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {model_dir}")
        raw = read_json_object(path)
        try:
            return cls.from_dict(raw)
        except ValueError as e:  # ConfigError, and __post_init__'s checks
            raise ConfigError(f"{path}: {e}") from None
