"""Loading the model folder's tokenizer and its end-of-sequence ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deltaserve.engine.rank.model_config import ModelConfig


def load_tokenizer(model_dir: str | Path) -> Any:
    """The folder's HF fast tokenizer (tokenizer.json); a slow one is refused."""
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in model folder {model_dir}")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"the tokenizer in {model_dir} is not a fast (tokenizers) tokenizer")
    return tokenizer


def eos_token_ids(model_dir: str | Path, model_config: ModelConfig) -> frozenset[int]:
    """Ids that end generation (unless ignore_eos): generation_config.json's eos_token_id
    (as vLLM adds them to the stop ids) together with the model config's."""
    ids = set(model_config.eos_token_ids)
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            ids.update(int(i) for i in (eos if isinstance(eos, list) else [eos]))
    return frozenset(ids)
