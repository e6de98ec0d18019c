"""Smaller request state on the rank: DeltaNet states kept in bf16 (--mamba-ssm-cache-dtype),
on the CPU path (the torch references); the kernels' side is in tests/test_kernels.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import collect, engine_config, ids_of

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.rank.executor import Executor, ExecutorConfig, resolve_state_dtype
from deltaserve.engine.rank.model_config import ConfigError, ModelConfig
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.tools.gate_bf16 import engine_reference, our_logits, prompt_ids
from deltaserve.tools.golden import compare_logprobs


def executor(model_dir, **fields) -> Executor:
    return Executor(
        ExecutorConfig(str(model_dir), num_slots=2, num_blocks=64, block_size=16, **fields)
    )


def test_the_state_dtype_is_the_checkpoints_unless_named(tiny_model_dir):
    """auto: the checkpoint's mamba_ssm_dtype (float32 when it names none, as the tiny one);
    a name wins; anything else is refused naming the field."""
    config = ModelConfig.from_model_dir(tiny_model_dir)
    assert config.mamba_ssm_dtype == "float32"
    assert resolve_state_dtype("auto", config) is torch.float32
    asks_bf16 = dataclasses.replace(config, mamba_ssm_dtype="bfloat16")
    assert resolve_state_dtype("auto", asks_bf16) is torch.bfloat16
    assert resolve_state_dtype("float32", asks_bf16) is torch.float32
    assert not config.differences(asks_bf16)  # the same model
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype 'float16' is not one of"):
        resolve_state_dtype("float16", config)
    raw = {**_raw_config(tiny_model_dir), "mamba_ssm_dtype": "int8"}
    with pytest.raises(ConfigError, match="mamba_ssm_dtype is 'int8'"):
        ModelConfig.from_dict(raw)


def _raw_config(model_dir) -> dict:
    import json

    return json.loads((model_dir / "config.json").read_text())


def test_bf16_states_cost_little_and_are_rounded(tiny_model_dir):
    """bf16 states hold half the bytes; the logits of 100 prompt positions and 64 decode steps,
    fed the fp32 run's tokens, stay near the fp32 states' (the golden metric), and differ (the
    states really are rounded); a saved prefix copies a bf16 state exactly."""
    fp32, bf16 = (
        executor(tiny_model_dir),
        executor(tiny_model_dir, mamba_ssm_cache_dtype="bfloat16"),
    )
    assert bf16.cache.recurrent.dtype is torch.bfloat16
    assert 2 * bf16.cache.recurrent.nbytes == fp32.cache.recurrent.nbytes
    ids = prompt_ids(100, seed=0)
    want, tokens = our_logits(fp32, 1, ids)
    got, _ = our_logits(bf16, 1, ids, tokens)
    report = compare_logprobs(got, want)
    # measured on this checkpoint: mean 0.030, p99 0.25 (its logits are peaked, std ~8)
    assert 0 < report.mean_abs_diff < 0.06 and report.p99_abs_diff < 0.5, report
    bf16.cache.recurrent[:, 0].normal_()
    bf16.cache.copy_state(0, 1)
    assert torch.equal(bf16.cache.recurrent[:, 1], bf16.cache.recurrent[:, 0])


@pytest.mark.asyncio
@pytest.mark.parametrize("fields", [{"mamba_ssm_cache_dtype": "bfloat16"}], ids=["bf16_states"])
async def test_the_engine_runs_the_ranks_with_the_cache_dtypes_asked(tiny_model_dir, fields):
    """Through real rank processes at TP 2: the greedy tokens of the in-process executor with
    the same cache dtypes (one prompt step, then a token a step, as the engine runs it)."""
    ids = prompt_ids(40, seed=3)
    reference = engine_reference(executor(tiny_model_dir, **fields), 1, ids, 12)
    config = engine_config(tiny_model_dir, tp_size=2, **fields)
    async with await AsyncEngine.start(config) as engine:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        tokens, _ = await collect(engine.generate(ids, params))
    assert ids_of(tokens) == reference
