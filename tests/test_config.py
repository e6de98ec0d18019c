"""One configuration from the command line to the rank: every EngineConfig field has one flag
(its `dest` the field's name), a setting keeps its name (vLLM's) on the way, the replica's and
the rank's views are computed from the config and the limits resolved at start, and what
reaches a rank process decodes strictly. No processes."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields

import msgspec
import pytest

from deltaserve.engine.config import (
    EngineConfig,
    EngineLimits,
    executor_config,
    replica_config,
)
from deltaserve.engine.config_flags import UNFLAGGED, add_engine_flags, engine_config
from deltaserve.engine.media import DEFAULT_LIMITS
from deltaserve.engine.speculative_config import SpeculativeConfig
from deltaserve.http import serve
from deltaserve.ipc.launch import rank_config_decoder
from deltaserve.ipc.messages import ExecutorConfig

LIMITS = EngineLimits(max_model_len=512, num_kv_blocks=40, max_logprobs=20)


def test_every_field_has_one_flag_and_every_flag_one_field():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    dests = [a.dest for a in parser._actions if a.dest != "help"]
    wanted = {f.name for f in fields(EngineConfig)} - UNFLAGGED
    assert set(dests) == wanted, set(dests) ^ wanted
    # two spellings of one flag are one action; an old negative spelling is a second action
    # of the same field, which sets nothing unless given
    again = {d for d in dests if dests.count(d) > 1}
    assert again == {"async_scheduling", "overlap_steps"}, again
    for action in parser._actions:
        if action.dest in again and not action.option_strings[0].startswith("--no-"):
            assert action.default is not argparse.SUPPRESS


@pytest.mark.parametrize(
    ("flags", "field", "value"),
    [
        (["--enforce-eager"], "enforce_eager", True),
        (["--no-async-scheduling"], "async_scheduling", False),
        (["--no-pipelining"], "async_scheduling", False),  # the spelling scripts still pass
        ([], "async_scheduling", True),
        (["--no-overlap-steps"], "overlap_steps", False),
        (["--no-overlap"], "overlap_steps", False),
        (["--overlap-steps"], "overlap_steps", True),
        ([], "overlap_steps", None),
        (["--num-gpu-blocks-override", "7"], "num_kv_blocks", 7),  # vLLM's
        (["--num-kv-blocks", "7"], "num_kv_blocks", 7),
        (["--tensor-parallel-size", "2"], "tp_size", 2),
        (["--tp-size", "2"], "tp_size", 2),
        (["--tp", "2"], "tp_size", 2),
        (["--data-parallel-size", "2"], "data_parallel_size", 2),
        (["--limit-mm-per-prompt", '{"image": 4}'], "limit_mm_per_prompt", {"image": 4}),
        (["--mm-processor-kwargs", '{"fps": 2}'], "mm_processor_kwargs", {"fps": 2}),
        ([], "limit_mm_per_prompt", {}),
        (["--allowed-local-media-path", "/srv"], "allowed_local_media_path", "/srv"),
        (["--monitor-endpoint", "off"], "monitor_endpoint", None),
        ([], "monitor_endpoint", "auto"),
    ],
)
def test_each_spelling_sets_its_field(flags, field, value):
    config = engine_config(serve.parse_args(["/m", "--device", "cpu", *flags]))
    assert getattr(config, field) == value


def test_a_setting_reaches_the_rank_under_its_name():
    """--enforce-eager was `cuda_graphs` (inverted) on the rank, --max-num-seqs `num_slots`,
    --num-kv-blocks `num_blocks` (0 for none); each is now the flag's name, end to end, and
    the rank process decodes what it is sent strictly."""
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    args = serve.parse_args(
        ["/m", "--device", "cpu", "--enforce-eager", "--max-num-seqs", "3", "--fp8-weights", "keep"]
        + ["--speculative-config", spec]
    )
    config = engine_config(args, enable_prefix_caching=True, prefix_cache_states=5)
    replica = replica_config(config, LIMITS)
    rank = replica.rank_config(
        0,
        "cpu",
        "/tmp/run",
        command_endpoint="ipc:///tmp/run/cmd0",
        reply_endpoint="ipc:///tmp/run/reply",
        gate_name="gate",
        receipt_fd=3,
        release_fd=4,
    )
    sent = rank_config_decoder.decode(msgspec.msgpack.encode(rank))
    assert sent == rank
    executor = sent.executor
    assert (executor.enforce_eager, executor.max_num_seqs, executor.fp8_weights) == (
        True,
        3,
        "keep",
    )
    assert executor.speculative_config == SpeculativeConfig("mtp", 2)
    assert executor.num_speculative_tokens == 2
    # resolved at start, never written into the config
    assert (executor.max_model_len, executor.num_kv_blocks) == (512, 40)
    assert (config.max_model_len, config.num_kv_blocks) == (None, None)
    assert executor.prefix_cache_states == 5
    off = executor_config(engine_config(args), LIMITS)
    assert off.prefix_cache_states == 0  # prefix caching off: no saved states
    unknown = msgspec.msgpack.encode({**msgspec.to_builtins(rank), "cuda_graphs": True})
    with pytest.raises(msgspec.ValidationError, match="cuda_graphs"):
        rank_config_decoder.decode(unknown)


def test_every_rank_field_is_a_setting_or_resolved():
    """Each ExecutorConfig field is an EngineConfig field of the same name (passed on as it
    is), a limit resolved at start, or the rank's place; nothing else reaches a rank."""
    settings = {f.name for f in fields(EngineConfig)}
    resolved = {"max_model_len", "num_kv_blocks", "prefix_cache_states"}
    place = {"rank"}
    rank_fields = set(ExecutorConfig.__struct_fields__)
    assert rank_fields - settings <= place, rank_fields - settings
    config = EngineConfig(model="/m", block_size=32, dtype="bf16", gpu_memory_utilization=0.5)
    executor = executor_config(config, LIMITS)
    for name in rank_fields & settings - resolved:
        assert getattr(executor, name) == getattr(config, name), name


def test_the_engines_defaults_are_the_ranks():
    """A setting's default is defined once: the engine's is the rank's."""
    rank = ExecutorConfig("/m")
    config = EngineConfig(model="/m")
    for name in ("block_size", "max_num_seqs", "gpu_memory_utilization", "prompt_graph_tokens"):
        assert getattr(config, name) == getattr(rank, name), name


def test_the_media_view_takes_the_limits_not_named_from_their_defaults():
    """--limit-mm-per-prompt '{"image": 4}' leaves video at its default, as vLLM's does."""
    media = EngineConfig(model="/m", limit_mm_per_prompt={"image": 4}).media
    assert media.limits == {**DEFAULT_LIMITS, "image": 4} and media.limits["video"] > 0


def test_a_flag_that_takes_json_names_itself(capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["/m", "--limit-mm-per-prompt", "4"])
    assert "--limit-mm-per-prompt takes a JSON object, got '4'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("fields_", "words"),
    [
        ({"block_size": 0}, "block_size must be an integer >= 1, got 0"),
        ({"max_num_seqs": 2.0}, "max_num_seqs must be an integer >= 1, got 2.0"),
        ({"dtype": "fp16"}, "dtype must be one of auto, float32, fp32, bfloat16, bf16"),
        ({"fp8_weights": "drop"}, "fp8_weights must be one of widen, keep"),
        ({"mamba_ssm_cache_dtype": "float16"}, "mamba_ssm_cache_dtype must be one of auto"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype must be one of auto, fp8, fp8_e4m3"),
        ({"calculate_kv_scales": True}, "calculate_kv_scales sets the scales of an FP8 KV"),
        ({"kv_watermark": 1.0}, "kv_watermark must be a number in [0, 1), got 1.0"),
        ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization must be a number"),
        ({"tp_size": True}, "tp_size must be an integer >= 1, got True"),
        ({"data_parallel_size": 0}, "data_parallel_size must be an integer >= 1, got 0"),
        ({"prefix_cache_states": -1}, "prefix_cache_states must be an integer >= 0"),
        ({"limit_mm_per_prompt": {"audio": 1}}, "limit_mm_per_prompt: 'audio': 1"),
        ({"mm_processor_kwargs": {"size": 2}}, "mm_processor_kwargs: 'size' is not one of"),
        ({"mm_processor_kwargs": [1]}, "mm_processor_kwargs must be a JSON object"),
    ],
)
def test_a_bad_setting_is_refused_at_construction_naming_its_field(fields_, words):
    """The settings the ranks run are checked by ExecutorConfig when the config is made: the
    start is refused before any rank runs, with the field's (= the flag's) name."""
    with pytest.raises(ValueError, match=re.escape(words)):
        EngineConfig(model="/m", **fields_)
