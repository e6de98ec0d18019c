"""Structured outputs in the engine: the compile worker's bounds (a compile past its time or
memory gets the worker killed and replaced, the request a 400's error), its cache (a text is
compiled once, a failure too), and the per-request failure path: a guided request past a
bound on rank 0 ends alone with an ErrorEvent, every rank drops it, the others carry on."""

from __future__ import annotations

import asyncio
import os
import re
from dataclasses import replace

import pytest
from engine_helpers import assert_idle_and_empty, collect, engine_config

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.events import ErrorEvent, FinishedEvent
from deltaserve.engine.grammar_worker import Setup
from deltaserve.engine.guides import Guides
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.structured_config import StructuredOutputsConfig


def _guides(model_dir, **bounds) -> Guides:
    setup = Setup(
        str(model_dir / "tokenizer.json"), 248320, [248044, 248046], 50_000, 250.0, os.getpid()
    )
    return Guides(setup, StructuredOutputsConfig(**bounds))


def _bound(guides: Guides, config: StructuredOutputsConfig) -> None:
    """New bounds for the compiles that follow (the started worker kept)."""
    guides.config = guides.worker._config = config


class TestWorker:
    async def test_each_text_compiles_once_failures_too(self, tiny_model_dir):
        guides = _guides(tiny_model_dir)
        try:
            params = SamplingParams(guided_regex="(yes|no)")
            first, again = await guides.prepare(params), await guides.prepare(params)
            assert first.guide_grammar == again.guide_grammar != ""
            assert first.guide_limits.max_lexer_states == 50_000
            for _ in range(2):
                with pytest.raises(ValueError, match=r"^guided_regex: .*unclosed group"):
                    await guides.prepare(SamplingParams(guided_regex="(a"))
            assert guides.worker.jobs == 2 and guides.worker.restarts == 0
        finally:
            await guides.close()

    async def test_bounds_up_front(self, tiny_model_dir):
        """Past a size or nesting bound nothing is compiled: the field and the bound named."""
        guides = _guides(tiny_model_dir, max_grammar_bytes=64, max_nesting_depth=3)
        try:
            for extra, words in [
                (
                    dict(guided_regex="a" * 65),
                    "guided_regex: 65 bytes; .* max_grammar_bytes \\(64\\)",
                ),
                (dict(guided_json={"a": [[[1]]]}), "guided_json: nested 4 .* max_nesting_depth"),
                (dict(stop_regex=["((((a))))"]), "stop_regex: nested 4"),
            ]:
                with pytest.raises(ValueError, match=words):
                    await guides.prepare(SamplingParams(**extra))
            assert guides.worker.jobs == 0
        finally:
            await guides.close()

    async def test_past_its_time_or_memory_the_worker_is_replaced(self, tiny_model_dir):
        """A compile past compile_timeout_s (1 ms) or growing the worker past
        max_grammar_memory_mb (1 MiB), both a 2,000-property schema's, kills the worker; the
        request gets the bound named; the next compile starts a fresh worker and succeeds."""
        schema = {
            "type": "object",
            "properties": {f"p{i}": {"type": "integer"} for i in range(2000)},
        }
        for bounds, extra, words in [
            (dict(compile_timeout_s=0.001), dict(guided_json=schema), "compile_timeout_s"),
            (dict(max_grammar_memory_mb=1), dict(guided_json=schema), "max_grammar_memory_mb"),
        ]:
            guides = _guides(tiny_model_dir, max_grammar_bytes=2**20)
            try:
                await guides.prepare(SamplingParams(guided_choice=["a"]))  # started, unbounded
                first = guides.worker.pid
                _bound(guides, replace(guides.config, **bounds))
                with pytest.raises(ValueError, match=words):
                    await guides.prepare(SamplingParams(**extra))
                assert guides.worker.restarts == 1 and guides.worker.pid is None
                _bound(guides, StructuredOutputsConfig(max_grammar_bytes=2**20))
                await guides.prepare(SamplingParams(guided_choice=["b"]))
                assert guides.worker.pid not in (None, first)
            finally:
                await guides.close()

    async def test_a_worker_lost_mid_job_fails_that_compile_only(self, tiny_model_dir):
        guides = _guides(tiny_model_dir)
        try:
            await guides.prepare(SamplingParams(guided_choice=["a"]))
            os.kill(guides.worker.pid, 9)
            with pytest.raises(ValueError, match="guided_choice: the compiler failed on it"):
                await guides.prepare(SamplingParams(guided_choice=["b"]))
            assert (await guides.prepare(SamplingParams(guided_choice=["c"]))).guide_grammar
        finally:
            await guides.close()


async def test_a_request_past_its_bound_ends_alone(tiny_model_dir):
    """The lazy regex with max_lexer_states 2000: it ends with an ErrorEvent naming the bound
    (reported by rank 0 in its step result, not a replica error), dropped on every rank; the
    request beside it and the one after it finish; unprepared params are refused."""
    config = engine_config(
        tiny_model_dir, structured_outputs_config=StructuredOutputsConfig(max_lexer_states=2000)
    )
    async with await AsyncEngine.start(config) as engine:
        with pytest.raises(ValueError, match="engine.prepare"):
            engine.generate([1, 2, 3], SamplingParams(guided_regex="a"))
        lazy = await engine.prepare(
            SamplingParams(
                max_tokens=60, temperature=1.0, seed=1, guided_regex=r"[\s\S]*[aeiou][\s\S]{300}"
            )
        )
        plain = SamplingParams(max_tokens=40, temperature=1.0, seed=2, ignore_eos=True)
        prompt = await engine.encode("The weather today is")
        (tokens, end), (_, other) = await asyncio.gather(
            collect(engine.generate(prompt, lazy)), collect(engine.generate(prompt, plain))
        )
        assert isinstance(end, ErrorEvent) and end.bound, end
        assert "went past max_lexer_states (2000)" in end.message and len(tokens) < 60
        assert isinstance(other, FinishedEvent) and other.reason == "length"
        assert not engine.is_dead
        await assert_idle_and_empty(engine)
        _, after = await collect(engine.generate(prompt, plain))
        assert isinstance(after, FinishedEvent)
        assert engine.metrics.request_success_total["error"] == 1


class TestConfig:
    """--structured-outputs-config as vLLM spells it: JSON or key=value pairs, each bound a
    field; a backend not built in, an unknown field or a bad value is refused by name."""

    def test_from_the_command_line(self, tiny_model_dir):
        from deltaserve.engine.config_flags import engine_config
        from deltaserve.http import serve

        args = serve.parse_args(
            [str(tiny_model_dir), "--structured-outputs-config", "backend=guidance,max_mask_ms=80"]
        )
        config = engine_config(args).structured_outputs_config
        assert (config.backend, config.max_mask_ms, config.max_stop_regexes) == (
            "guidance",
            80,
            16,
        )
        assert engine_config(serve.parse_args([str(tiny_model_dir)])).structured_outputs_config == (
            StructuredOutputsConfig()
        )
        assert StructuredOutputsConfig.parse('{"max_lexer_states": 9}').max_lexer_states == 9

    @pytest.mark.parametrize(
        "text, words",
        [
            ("backend=xgrammar", "backend 'xgrammar' is not built into this server"),
            ("backend=nope", "backend must be one of auto, guidance"),
            ("max_states=3", "no field 'max_states'"),
            ("max_mask_ms=0", "max_mask_ms must be a positive number"),
            ("max_lexer_states=1.5", "max_lexer_states must be a positive integer"),
            ("max_lexer_states", "is not key=value"),
            ("{oops", "not valid JSON"),
        ],
    )
    def test_refused(self, text, words):
        with pytest.raises(ValueError, match=re.escape(words)):
            StructuredOutputsConfig.parse(text)


async def test_one_text_compiled_at_once_is_compiled_once(tiny_model_dir):
    """Requests of the same new text at once wait for one compile (failures alike)."""
    guides = _guides(tiny_model_dir)
    try:
        await guides.prepare(SamplingParams(guided_choice=["a"]))
        same = SamplingParams(guided_regex="(sunny|rainy) [0-9]")
        prepared = await asyncio.gather(*(guides.prepare(same) for _ in range(4)))
        assert len({p.guide_grammar for p in prepared}) == 1 and guides.worker.jobs == 2
        bad = SamplingParams(guided_regex="(a")
        failed = await asyncio.gather(
            *(guides.prepare(bad) for _ in range(3)), return_exceptions=True
        )
        assert all(isinstance(e, ValueError) for e in failed) and guides.worker.jobs == 3
    finally:
        await guides.close()
