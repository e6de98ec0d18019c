"""Speculative decoding's settings: `--speculative-config` as vLLM spells it, a JSON object
such as `{"method": "mtp", "num_speculative_tokens": 3}`.

The drafts come from the checkpoint's own multi-token-prediction head (engine/rank/mtp.py);
the engine verifies them and keeps the target's tokens exactly (engine/rank/speculative.py),
and turns speculation down where it would cost more than it saves (engine/speculation.py).
A leaf (tests/test_architecture.py): the ranks are given it inside their ExecutorConfig
(ipc/messages.py), as a msgspec struct decoded strictly; torch-free, the HTTP front parses the
flag before anything loads.
"""

from __future__ import annotations

import json

import msgspec

# vLLM's names for the checkpoint's own MTP head ("qwen3_next_mtp" its older one)
METHODS = ("mtp", "qwen3_next_mtp")
MAX_SPECULATIVE_TOKENS = 8
# Speculation is off for a step whose decoding batch is at or above this (vLLM's
# disable_by_batch_size). Measured by tools/bench_mtp.py (its `disable_by_batch_size`: the
# smallest concurrency at which the best k no longer beats MTP off at acceptance 0.7); until
# an H100 run records it, this is the memory-roofline estimate for the random 4B in bf16: at
# batch 16 a verify's extra rows, the rollback's extra state read (~50 MB a request) and k
# drafts' lm_head reads (1.27 GB each) cost about what acceptance 0.7 saves.
DEFAULT_DISABLE_BY_BATCH_SIZE = 16
# vLLM keys that ask for nothing else here when given these values (routers and launch
# scripts send them); any other value of them is refused by name
NEUTRAL_KEYS = {
    "model": (None,),
    "draft_tensor_parallel_size": (None, 1),  # the head runs at the target's TP, as vLLM's MTP
    "quantization": (None,),
    "enforce_eager": (None, False),
    "disable_padded_drafter_batch": (None, False, True),
}


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    method: str = "mtp"
    num_speculative_tokens: int = 1  # drafts per step at most (k)
    # no drafts in a step of this many decoding requests or more; None: the default above
    disable_by_batch_size: int | None = None
    # the head drafts among the first this many token ids only; None: the whole vocabulary
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method {self.method!r} is not supported: the drafts come "
                f"from the checkpoint's MTP head ({' or '.join(METHODS)})"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be an integer in "
                f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}"
            )
        limit = self.disable_by_batch_size
        if limit is not None and (
            not isinstance(limit, int) or isinstance(limit, bool) or limit < 1
        ):
            raise ValueError(
                f"speculative_config.disable_by_batch_size must be an integer >= 1, got {limit!r}"
            )
        rows = self.draft_vocab_size
        if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 1):
            raise ValueError(
                f"speculative_config.draft_vocab_size must be an integer >= 1, got {rows!r}"
            )

    @property
    def off_at_batch(self) -> int:
        """The smallest decoding batch that does not speculate."""
        limit = self.disable_by_batch_size
        return DEFAULT_DISABLE_BY_BATCH_SIZE if limit is None else limit

    def draft_vocab(self, vocab_size: int) -> int:
        """How many of the model's `vocab_size` token ids the head drafts among: the first
        `draft_vocab_size` (FR-Spec's frequent-token subset, engine/rank/speculative.py)."""
        rows = self.draft_vocab_size
        if rows is None:
            return vocab_size
        if rows > vocab_size:
            raise ValueError(
                f"speculative_config.draft_vocab_size {rows} is above the model's vocabulary "
                f"of {vocab_size} tokens"
            )
        return rows


def parse_speculative_config(value: str | dict) -> SpeculativeConfig:
    """`--speculative-config`'s JSON (or its object): a ValueError naming the key for anything
    we would not do as asked."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(
            f"speculative_config must be a JSON object such as "
            f'{{"method": "mtp", "num_speculative_tokens": 3}}, got {type(value).__name__}'
        )
    known = {"method", "num_speculative_tokens", "disable_by_batch_size", "draft_vocab_size"}
    for key, given in value.items():
        if key in known:
            continue
        if key not in NEUTRAL_KEYS:
            raise ValueError(f"speculative_config.{key} is not supported")
        if (type(given), given) not in {(type(v), v) for v in NEUTRAL_KEYS[key]}:
            raise ValueError(
                f"speculative_config.{key} {given!r} is not supported (the drafts come from "
                "the served checkpoint's MTP head, on its devices)"
            )
    if "method" not in value:
        raise ValueError('speculative_config.method is required ("mtp")')
    return SpeculativeConfig(**{key: value[key] for key in known if key in value})
