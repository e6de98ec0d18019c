"""min_tokens, logit_bias, allowed_token_ids, bad words and guided decoding (choice, regex, JSON
schema) through the engine on CUDA (graphs, pipelined and overlapped steps), nine requests at once:
`python -m tools.sampling_check MODEL_DIR OUT.json` (exit 1 on a failed check). The CPU tests check
the same rules exactly (tests/test_sampler.py, tests/test_engine_sampling.py); this runs them where
the decode step is a graph replay."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import FinishedEvent, TokenEvent
from deltaserve.engine.sampling_params import SamplingParams

X, Y = 1234, 5678  # two ordinary token ids
CHOICES = ("red apple", "green pear", "blue")  # guided_choice
REGEX = r"[a-z]{2,8}@[a-z]{2,6}\.(?:com|org)"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "kind", "ok"],
}


async def _run(engine: AsyncEngine, prompt: str, params: SamplingParams) -> tuple[list[int], str]:
    tokens, reason = [], ""
    params = await engine.prepare(params)  # guided ones: compiled first
    async for ev in engine.generate(prompt, params):
        if isinstance(ev, TokenEvent):
            tokens.append(ev.token_id)
        elif isinstance(ev, FinishedEvent):
            reason = ev.reason
    return tokens, reason


def _valid(doc: object) -> bool:
    return (
        isinstance(doc, dict)
        and set(doc) == {"name", "kind", "ok"}
        and isinstance(doc["name"], str)
        and len(doc["name"]) <= 12
        and doc["kind"] in ("cat", "dog")
        and isinstance(doc["ok"], bool)
    )


async def main(model: str, out: str) -> bool:
    engine = await AsyncEngine.start(EngineConfig(model=model, device="cuda", max_num_seqs=16))
    eos = sorted(engine.eos_token_ids)[0]
    cases = {
        "bias_X": SamplingParams(max_tokens=6, temperature=0.0, logit_bias={X: 100.0}),
        "stop_Y_min4": SamplingParams(
            max_tokens=10, temperature=0.0, stop_token_ids=[Y], logit_bias={Y: 100.0}, min_tokens=4
        ),
        "eos_min3_random": SamplingParams(
            max_tokens=10, temperature=1.0, seed=7, logit_bias={eos: 100.0}, min_tokens=3
        ),
        "eos_nomin": SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0}),
        "plain1": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        "plain2": SamplingParams(max_tokens=24, temperature=0.8, seed=1, ignore_eos=True),
        "allowed_XY": SamplingParams(
            max_tokens=8, temperature=0.0, allowed_token_ids=[X, Y], ignore_eos=True
        ),
        "allowed_random": SamplingParams(
            max_tokens=8, temperature=1.0, seed=3, allowed_token_ids=[X, Y], ignore_eos=True
        ),
        "bad_XX": SamplingParams(
            max_tokens=8,
            temperature=0.0,
            logit_bias={X: 100.0},
            allowed_token_ids=[X, Y],
            bad_words_token_ids=[[X, X]],
            ignore_eos=True,
        ),  # X, then Y where X is barred
        "choice_greedy": SamplingParams(max_tokens=24, temperature=0.0, guided_choice=CHOICES),
        "choice_random": SamplingParams(
            max_tokens=24, temperature=1.0, seed=5, guided_choice=CHOICES
        ),
        "regex_random": SamplingParams(max_tokens=32, temperature=1.0, seed=6, guided_regex=REGEX),
        "json_random": SamplingParams(max_tokens=96, temperature=1.0, seed=8, guided_json=SCHEMA),
    }
    start = time.perf_counter()
    runs = [_run(engine, f"Prompt {i}: tell me a story", p) for i, p in enumerate(cases.values())]
    got = dict(zip(cases, await asyncio.gather(*runs), strict=True))
    await engine.shutdown()
    stop_y, eos_min = got["stop_Y_min4"][0], got["eos_min3_random"][0]

    def text(name: str) -> str:
        return engine.tokenizer.decode(got[name][0], skip_special_tokens=True)

    checks = {
        "bias_X": got["bias_X"] == ([X] * 6, "length"),
        "stop_Y_min4": len(stop_y) == 5
        and Y not in stop_y[:4]
        and stop_y[4] == Y
        and got["stop_Y_min4"][1] == "stop",
        "eos_min3_random": len(eos_min) == 4
        and eos_min[3] == eos
        and got["eos_min3_random"][1] == "stop",
        "eos_nomin": got["eos_nomin"] == ([eos], "stop"),
        "plain1": len(got["plain1"][0]) == 24,
        "plain2": len(got["plain2"][0]) == 24,
        "allowed_XY": len(got["allowed_XY"][0]) == 8 and set(got["allowed_XY"][0]) <= {X, Y},
        "allowed_random": len(got["allowed_random"][0]) == 8
        and set(got["allowed_random"][0]) <= {X, Y},
        "bad_XX": got["bad_XX"][0] == [X, Y] * 4,
        **{
            name: got[name][1] == "stop" and text(name) in CHOICES
            for name in ("choice_greedy", "choice_random")
        },
        "regex_random": got["regex_random"][1] == "stop"
        and re.fullmatch(REGEX, text("regex_random")) is not None,
        "json_random": got["json_random"][1] == "stop" and _valid(json.loads(text("json_random"))),
    }
    record = {
        "eos": eos,
        "checks": checks,
        "seconds": time.perf_counter() - start,
        "results": {k: {"tokens": v[0], "reason": v[1]} for k, v in got.items()},
    }
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    for name, ok in checks.items():
        print(f"{name:18s} {'ok' if ok else 'FAIL'} {got[name][1]} {got[name][0][:12]}")
    return all(checks.values())


if __name__ == "__main__":
    sys.exit(0 if asyncio.run(main(sys.argv[1], sys.argv[2])) else 1)
