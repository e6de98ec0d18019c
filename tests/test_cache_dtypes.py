"""Smaller request state on the rank: DeltaNet states kept in bf16 (--mamba-ssm-cache-dtype)
and an FP8 KV cache (--kv-cache-dtype fp8, --calculate-kv-scales), on the CPU path (the torch
references), the GPU path under Triton's interpreter, and through rank processes; each
kernel's own check is in tests/test_kernels.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import collect, engine_config, ids_of

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.model_config import ConfigError, ModelConfig
from deltaserve.engine.rank.executor import Executor, ExecutorConfig, resolve_state_dtype
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.kernels.kv_quant import FP8
from deltaserve.tools.gate_bf16 import engine_reference, our_logits, prompt_ids
from deltaserve.tools.golden import compare_logprobs


def executor(model_dir, **fields) -> Executor:
    return Executor(
        ExecutorConfig(str(model_dir), max_num_seqs=2, num_kv_blocks=64, block_size=16, **fields)
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


def test_an_fp8_cache_costs_little_and_calibrates_once(tiny_model_dir):
    """An FP8 cache holds a quarter of an fp32 one's bytes; its scales are 1.0, or with
    calculate_kv_scales set by the first prompt step (every layer, every head) and kept after;
    the logits stay near the fp32 cache's."""
    fp32 = executor(tiny_model_dir)
    plain = executor(tiny_model_dir, kv_cache_dtype="fp8")
    calibrated = executor(tiny_model_dir, kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert plain.cache.kv.dtype == FP8 and 4 * plain.cache.kv.nbytes == fp32.cache.kv.nbytes
    ids = prompt_ids(100, seed=1)
    want, tokens = our_logits(fp32, 1, ids)
    reports = {}
    for name, ex in (("plain", plain), ("calibrated", calibrated)):
        got, _ = our_logits(ex, 1, ids, tokens)
        reports[name] = compare_logprobs(got, want)
    assert torch.equal(plain.cache.kv_scale, torch.ones_like(plain.cache.kv_scale))
    scales = calibrated.cache.kv_scale.clone()
    assert (scales != 1.0).all() and not calibrated.kv_scales_pending
    our_logits(calibrated, 2, prompt_ids(30, seed=2))  # a later prompt: scales kept
    assert torch.equal(calibrated.cache.kv_scale, scales)
    # measured on this checkpoint: mean 0.017, p99 0.06 either way (e4m3's precision is relative:
    # a scale matters where values would leave its range)
    for report in reports.values():
        assert 0 < report.mean_abs_diff < 0.05 and report.p99_abs_diff < 0.2, reports


def test_gpu_path_with_an_fp8_cache_matches_cpu_path(kernels, tiny_model_dir, monkeypatch):
    """The layers' GPU path under Triton's interpreter (the FP8 store in norm_rope, the decode
    kernel reading FP8, the prompt paths' round trip) gives the CPU path's logits with the same
    FP8 cache and calibrated scales, over mixed steps. (bf16 states are not compared so: a
    last-bit difference in fp32 rounds to a different bf16 state, which moves logits by as much
    as bf16 states do; tests/test_kernels.py holds the decode kernel to the reference.)"""
    from test_gpu_path import _assert_steps_match, _run_steps, interpreter_only

    from deltaserve.kernels import triton_compat

    if interpreter_only.args[0]:
        pytest.skip(interpreter_only.kwargs["reason"])
    fields = dict(kv_cache_dtype="fp8", calculate_kv_scales=True)
    cpu, _ = _run_steps(str(tiny_model_dir), "cpu", **fields)
    monkeypatch.setattr(triton_compat, "GPU_PATH_ON_CPU", True)
    gpu, _ = _run_steps(str(tiny_model_dir), "cpu", **fields)
    _assert_steps_match(gpu, cpu, 2e-3, "GPU path with an FP8 KV cache vs cpu")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "fields",
    [
        {"mamba_ssm_cache_dtype": "bfloat16"},
        {"kv_cache_dtype": "fp8", "calculate_kv_scales": True},
    ],
    ids=["bf16_states", "fp8_kv"],
)
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


def test_flags_that_ask_for_nothing_are_refused(tiny_model_dir):
    """Scales for a cache that has none, and cache dtypes not offered: refused naming the field."""
    with pytest.raises(ValueError, match="calculate_kv_scales sets the scales of an FP8"):
        engine_config(tiny_model_dir, calculate_kv_scales=True)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        engine_config(tiny_model_dir, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype must be one of"):
        engine_config(tiny_model_dir, mamba_ssm_cache_dtype="float16")


def test_the_accuracy_tool_reports_every_variant(tiny_model_dir, tmp_path, capsys):
    """tools/cache_accuracy.py's CPU form: each variant against fp32 states and the model-dtype
    KV cache, with the golden metric, in JSON and as the Markdown table docs/GPU.md carries."""
    import json

    from deltaserve.tools import cache_accuracy

    out = tmp_path / "accuracy.json"
    args = ["--model", str(tiny_model_dir), "--device", "cpu", "--prompt-lengths", "70"]
    assert cache_accuracy.main([*args, "--out", str(out)]) == 0
    report, printed = json.loads(out.read_text())["report"], capsys.readouterr().out
    assert list(report) == list(cache_accuracy.VARIANTS)[1:]
    for name, row in report.items():
        assert row["positions"] == 64 + 64 and 0 < row["mean_abs_diff"] <= row["max_abs_diff"]
        assert f"| {name} | {row['mean_abs_diff']:.2e} |" in printed
