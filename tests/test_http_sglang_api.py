"""SGLang's native API (`/generate`, `/abort_request`, `/health_generate`, `/get_model_info`,
`/get_server_info`) on one real server (tiny random model, an API key).

/generate is the completion route under a translation, so the strong check is agreement:
greedy, its output ids, text and every logprob equal /v1/completions' for the same prompt
(which the HF golden tests hold to transformers). Then what only this API has: its shapes
(batches, n, cumulative streams), SGLang's finish reasons, the prompt alone
(max_new_tokens 0), aborting by rid, and refusals that name SGLang's fields.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import in_process_server, wait_idle
from test_http_structured_output import SCHEMA, valid

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.tokenizer import load_tokenizer
from deltaserve.http.server import ServerConfig

aio = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny"
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [9707, 11, 1879, 0, 358, 1079, 264, 1273]  # token ids
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=1024, max_num_seqs=4)
    async with in_process_server(config, ServerConfig(MODEL, api_key=KEY)) as s:
        yield s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gpt(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    yield client
    await client.close()


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def leaves_the_engine_idle(server):
    yield
    await wait_idle(server.engine, timeout_s=30)


async def post(
    server: Any, body: dict, path: str = "/generate", headers: dict | None = None
) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.post(
            server.url + path, json=body, headers=AUTH if headers is None else headers
        ) as reply:
            text = await reply.text()
            return reply.status, json.loads(text) if text else None


async def stream(server: Any, body: dict) -> list[Any]:
    """The SSE events' payloads, `[DONE]` as the string."""
    events = []
    async with aiohttp.ClientSession() as session:
        async with session.post(
            server.url + "/generate", json={**body, "stream": True}, headers=AUTH
        ) as reply:
            assert reply.status == 200 and reply.headers["Content-Type"].startswith(
                "text/event-stream"
            )
            async for line in reply.content:
                if line.startswith(b"data: "):
                    payload = line[6:].strip()
                    events.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return events


def token_ids(logprobs: Any) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens]


@aio
async def test_generate_equals_the_completion_route(server, gpt):
    """Greedy, with the prompt's logprobs from position 2 and two alternatives everywhere."""
    status, out = await post(
        server,
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "top_logprobs_num": 2,
            "logprob_start_len": 2,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 10, **GREEDY},
        },
    )
    assert status == 200, out
    ref = await gpt.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True, "prompt_logprobs": 2, "return_tokens_as_token_ids": True},
    )
    choice, meta = ref.choices[0], out["meta_info"]
    assert out["text"] == choice.text and out["output_ids"] == token_ids(choice.logprobs)
    assert (
        meta["finish_reason"] == {"type": "length", "length": 10}
        and meta["completion_tokens"] == 10
    )
    assert (
        meta["prompt_tokens"] == len(PROMPT)
        and meta["cached_tokens"] == 0
        and meta["e2e_latency"] > 0
    )
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(
        choice.logprobs.token_logprobs, abs=1e-6
    )
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert "".join(e[2] for e in meta["output_token_logprobs"]) == out["text"]
    for top, ref_top in zip(meta["output_top_logprobs"], choice.logprobs.top_logprobs, strict=True):
        assert {f"token_id:{e[1]}": e[0] for e in top} == pytest.approx(ref_top, abs=1e-6)
    # the prompt from position 2: entry 0 without a
    # logprob (as SGLang's), then vLLM's prompt logprobs
    prompt_lps = choice.model_extra["prompt_logprobs"]
    assert [e[1] for e in meta["input_token_logprobs"]] == PROMPT[2:]
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    for pos, entry, top in zip(
        range(3, len(PROMPT)),
        meta["input_token_logprobs"][1:],
        meta["input_top_logprobs"][1:],
        strict=True,
    ):
        ref_entry = prompt_lps[pos]
        assert entry[0] == pytest.approx(ref_entry[str(PROMPT[pos])]["logprob"], abs=1e-6)
        assert {str(e[1]): e[0] for e in top} == pytest.approx(
            {k: v["logprob"] for k, v in ref_entry.items() if v["rank"] <= 2}, abs=1e-6
        )
    # text is tokenized as the completion route tokenizes it; by default only the last prompt token
    text = "The capital of France is"
    status, by_text = await post(
        server,
        {"text": text, "return_logprob": True, "sampling_params": {"max_new_tokens": 6, **GREEDY}},
    )
    ref = await gpt.completions.create(
        model=MODEL,
        prompt=text,
        max_tokens=6,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    assert (
        by_text["output_ids"] == token_ids(ref.choices[0].logprobs)
        and by_text["text"] == ref.choices[0].text
    )
    assert by_text["meta_info"]["prompt_tokens"] == ref.usage.prompt_tokens
    assert (
        len(by_text["meta_info"]["input_token_logprobs"]) == 1
        and "output_top_logprobs" not in by_text["meta_info"]
    )


@aio
async def test_batches_n_and_cumulative_streams(server):
    """A batch of two prompts (each its own sampling_params) with n=2 is a list, prompt-major,
    each prompt's choices the single request's; its stream carries each choice so far."""
    singles = [
        (await post(server, {"input_ids": p, "sampling_params": {"max_new_tokens": k, **GREEDY}}))[
            1
        ]
        for p, k in ((PROMPT, 5), (PROMPT[:4], 7))
    ]
    body = {
        "input_ids": [PROMPT, PROMPT[:4]],
        "rid": "batch",
        "sampling_params": [
            {"max_new_tokens": 5, "n": 2, **GREEDY},
            {"max_new_tokens": 7, "n": 2, **GREEDY},
        ],
    }
    status, out = await post(server, body)
    assert status == 200 and len(out) == 4, out
    for i, choice in enumerate(out):
        single = singles[i // 2]
        assert (choice["text"], choice["output_ids"]) == (single["text"], single["output_ids"])
        assert choice["meta_info"]["id"] == f"batch_{i // 2}" and "index" not in choice
    events = await stream(server, {**body, "rid": "batch2"})
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])
    for index in range(4):
        mine = [e for e in events[:-1] if e["index"] == index]
        # an event per token, then the finish's (the same output, its finish_reason set)
        assert [len(e["output_ids"]) for e in mine] == [
            *range(1, len(out[index]["output_ids"]) + 1),
            5 + index // 2 * 2,
        ]
        for before, after in zip(
            mine, mine[1:], strict=False
        ):  # cumulative: each event extends the one before
            assert (
                after["text"].startswith(before["text"])
                and before["meta_info"]["finish_reason"] is None
            )
        assert (mine[-1]["text"], mine[-1]["output_ids"]) == (
            out[index]["text"],
            out[index]["output_ids"],
        )
        assert mine[-1]["meta_info"]["finish_reason"] == out[index]["meta_info"]["finish_reason"]
    # one prompt, n = 1: one object, streamed without an index
    single_events = await stream(
        server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, **GREEDY}}
    )
    assert (
        single_events[-2]["output_ids"] == singles[0]["output_ids"]
        and "index" not in single_events[-2]
    )


@aio
async def test_stop_regex(server, gpt, tiny_model_dir):
    """SGLang's stop_regex, on /generate and (its extension) the completions route: the output
    ends with the first token whose text completes a match, kept, and names the regex."""
    status, free = await post(
        server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, **GREEDY}}
    )
    ids, text = free["output_ids"], free["text"]
    decode = load_tokenizer(tiny_model_dir).decode
    word = next(w for w in text.split() if len(w) > 2 and text.index(w) > 0)
    pattern = re.escape(word[:2]) + "|[0-9]{6}"
    first = next(k for k in range(1, len(ids) + 1) if re.search(pattern, decode(ids[:k])))
    status, out = await post(
        server,
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 12, "stop_regex": pattern, **GREEDY},
        },
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}, out
    assert out["output_ids"] == ids[:first] and out["text"] == decode(ids[:first])
    done = await gpt.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_regex": [pattern], "ignore_eos": True},
    )
    choice = done.choices[0]
    assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (
        decode(ids[:first]),
        "stop",
        pattern,
    )


@aio
async def test_stops_seeds_and_the_prompt_alone(server):
    status, free = await post(
        server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, **GREEDY}}
    )
    ids, text = free["output_ids"], free["text"]
    # a stop token: matched by id, in output_ids, its text left out
    status, out = await post(
        server,
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 12, "stop_token_ids": [ids[3]], **GREEDY},
        },
    )
    assert (
        out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[3]}
        and out["output_ids"] == ids[:4]
    )
    # a stop string: matched by text, trimmed unless no_stop_trim
    word = next(w for w in text.split() if len(w) > 2 and text.index(w) > 0)
    cut = text.index(word)
    status, out = await post(
        server,
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "stop": [word], **GREEDY}},
    )
    assert (
        out["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
        and out["text"] == text[:cut]
    )
    status, out = await post(
        server,
        {
            "input_ids": PROMPT,
            "sampling_params": {
                "max_new_tokens": 12,
                "stop": [word],
                "no_stop_trim": True,
                **GREEDY,
            },
        },
    )
    assert out["text"] == text[: cut + len(word)]
    # sampling_seed: the same draws for the same seed
    sampled = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    draws = [
        (
            await post(
                server, {"input_ids": PROMPT, "sampling_params": {**sampled, "sampling_seed": s}}
            )
        )[1]
        for s in (7, 7, 8)
    ]
    assert draws[0]["output_ids"] == draws[1]["output_ids"] != draws[2]["output_ids"]
    # max_new_tokens 0: the prompt's logprobs alone, no output (SGLang's scoring call)
    status, scored = await post(
        server,
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0},
        },
    )
    status, ref = await post(
        server,
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, **GREEDY},
        },
    )
    meta = scored["meta_info"]
    assert (scored["text"], scored["output_ids"], meta["completion_tokens"]) == ("", [], 0)
    assert (
        meta["finish_reason"] == {"type": "length", "length": 0}
        and meta["output_token_logprobs"] == []
    )
    assert meta["input_token_logprobs"] == ref["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in meta["input_token_logprobs"]] == PROMPT and meta["input_token_logprobs"][
        0
    ][0] is None


@aio
async def test_structured_output(server):
    schema = {
        "input_ids": PROMPT,
        "sampling_params": {
            "max_new_tokens": 200,
            "temperature": 0,
            "json_schema": json.dumps(SCHEMA),
        },
    }
    status, out = await post(server, schema)
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "stop", out
    assert valid(json.loads(out["text"]), SCHEMA)
    status, out = await post(
        server,
        {
            "input_ids": PROMPT,
            "sampling_params": {
                "max_new_tokens": 20,
                "temperature": 0,
                "regex": "(yes|no)-[0-9]{3}",
            },
        },
    )
    assert status == 200 and out["text"] in {
        f"{w}-{n:03d}" for w in ("yes", "no") for n in range(1000)
    }, out


@aio
async def test_abort_request_by_rid_and_all(server, gpt):
    """An aborted request answers with its abort (SGLang's finish reason, not an error); one of
    the OpenAI routes, with a 503 saying it was aborted."""
    long = {"sampling_params": {"max_new_tokens": 900, **GREEDY}}
    generated = server.engine.load().generation_tokens_total
    streamed = asyncio.ensure_future(stream(server, {"input_ids": PROMPT, "rid": "job", **long}))
    while (
        server.engine.load().generation_tokens_total == generated
    ):  # job runs before the rest come
        await asyncio.sleep(0.01)
    batch = asyncio.ensure_future(
        post(server, {"input_ids": [PROMPT, PROMPT[:3]], "rid": "pair", **long})
    )
    other = asyncio.ensure_future(post(server, {"input_ids": PROMPT, "rid": "other", **long}))
    completion = asyncio.ensure_future(
        gpt.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=900,
            **{"temperature": 0, "extra_body": {"ignore_eos": True}},
        )
    )
    while len(server.engine.request_ids()) < 5:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    assert (await post(server, {"rid": "job"}, "/abort_request")) == (200, None)
    events = await streamed
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(events[-2]["output_ids"]) < 900 and not other.done()
    assert (await post(server, {"rid": "pair"}, "/abort_request"))[0] == 200  # pair_0 and pair_1
    status, pair = await batch
    assert status == 200 and [c["meta_info"]["finish_reason"]["type"] for c in pair] == [
        "abort",
        "abort",
    ]
    assert (await post(server, {"abort_all": True}, "/abort_request"))[0] == 200
    status, rest = await other
    assert status == 200 and rest["meta_info"]["finish_reason"]["message"] == "Aborted"
    with pytest.raises(openai.APIStatusError) as info:
        await completion
    assert info.value.status_code == 503 and info.value.body["code"] == "aborted", info.value.body


@aio
@pytest.mark.parametrize(
    "body, words",
    [
        (
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "best_of": 2}},
            "sampling_params.best_of",
        ),
        ({"input_ids": PROMPT, "text": "hi"}, "text or input_ids"),
        (
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}},
            "sampling_params.max_new_tokens",
        ),
        (
            {"input_ids": PROMPT, "sampling_params": {"temperature": -1}},
            "sampling_params.temperature",
        ),
        (
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 5}},
            "sampling_params.min_new_tokens",
        ),
        (
            {"input_ids": PROMPT, "sampling_params": {"ebnf": "root ::= 'a'"}},
            "sampling_params.ebnf: not a GBNF grammar: Expected name at line 1",
        ),
        (
            {"input_ids": PROMPT, "sampling_params": {"structural_tag": "{}"}},
            "sampling_params.structural_tag: triggers",
        ),
        (
            {"input_ids": PROMPT, "sampling_params": {"stop_regex": ["(?=a)"]}},
            "sampling_params.stop_regex '(?=a)'",
        ),
        (
            {"input_ids": PROMPT, "sampling_params": {"json_schema": "{", "regex": "a"}},
            "only one of",
        ),
        (
            {"input_ids": PROMPT, "sampling_params": {"json_schema": "{"}},
            "sampling_params.json_schema",
        ),
        (
            {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 8},
            "logprob_start_len (8)",
        ),
        ({"input_ids": PROMPT, "image_data": "x.png"}, "'image_data'"),
        (
            {"input_ids": PROMPT, "return_hidden_states": True},
            "only its default (return_hidden_states=false)",
        ),
        (
            {"input_ids": [PROMPT, PROMPT], "sampling_params": [{"n": 1}, {"n": 2}]},
            "n must be the same",
        ),
        ({"input_ids": [10**9]}, "ids must be integers in [0, "),
    ],
)
async def test_refusals_name_sglang_fields(server, body, words):
    status, answer = await post(server, body)
    assert status == 400 and words in answer["error"]["message"], answer
    assert (
        "max_tokens" not in answer["error"]["message"]
        and "min_tokens" not in answer["error"]["message"]
    )
    defaults = {
        "return_hidden_states": False,
        "log_metrics": True,
        "lora_path": None,
        "stream": False,
    }
    assert (
        await post(
            server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, **defaults}
        )
    )[0] == 200


@aio
async def test_info_health_and_the_key(server, tiny_model_dir):
    """Every route here needs the key (as SGLang's middleware asks it of all but /health and
    /metrics): /health_generate submits a request, the info routes name the model's path."""
    async with aiohttp.ClientSession() as session:
        for path in ("/health_generate", "/get_model_info", "/server_info", "/get_server_info"):
            async with session.get(server.url + path) as reply:
                assert reply.status == 401, path
        async with session.get(server.url + "/health_generate", headers=AUTH) as reply:
            assert reply.status == 200
        async with session.get(server.url + "/get_model_info", headers=AUTH) as reply:
            info = await reply.json()
        async with session.get(server.url + "/server_info", headers=AUTH) as reply:
            server_info = await reply.json()
    assert info["model_path"] == str(tiny_model_dir) and info["is_generation"] is True
    assert (
        info["model_type"] == json.loads((tiny_model_dir / "config.json").read_text())["model_type"]
    )
    assert server_info["context_length"] == 1024 and server_info["max_running_requests"] == 4
    assert server_info["internal_states"][0]["waiting_queue_size"] == 0 and server_info["version"]
    assert server_info["dp_size"] == len(server_info["internal_states"]) == 1
    for path in ("/generate", "/abort_request"):
        status, answer = await post(server, {"input_ids": PROMPT}, path, headers={})
        assert status == 401 and answer["error"]["code"] == "invalid_api_key", (path, answer)


# anything, small: a valid count here (n, max_new_tokens) stays cheap to serve
ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 6),
    st.floats(-3, 3),
    st.text(max_size=4),
    st.lists(st.integers(0, 300), max_size=3),
    st.just({}),
)
SAMPLING = {  # each field: a value in range, or anything
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.1, 1),
    "top_k": st.integers(-1, 50),
    "min_new_tokens": st.integers(0, 2),
    "stop": st.lists(st.text(min_size=1, max_size=2), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 1000), max_size=2),
    "n": st.integers(1, 2),
    "sampling_seed": st.integers(0, 100),
    "ebnf": st.just('root ::= "a" | "b" [0-9]'),
}


def in_range_or_any(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Half the time a value in range (`valid | ANY` would weigh each of ANY's kinds as much)."""
    return st.booleans().flatmap(lambda ok: valid if ok else ANY)


TOP = {
    "rid": st.text(min_size=1, max_size=4),
    "return_logprob": st.booleans(),
    "logprob_start_len": st.integers(-1, 1),
    "top_logprobs_num": st.integers(0, 2),
    "return_text_in_logprobs": st.booleans(),
    "stream": st.booleans(),
}


@aio
async def test_fuzz_bodies_answer_or_refuse(server):
    """Random /generate bodies (known fields with values in range or anything): SGLang's
    answer or a 4xx naming the problem, never a 5xx; a stream always ends with [DONE]."""
    # null: up to the context, slow
    limit = in_range_or_any(st.integers(0, 3)).filter(lambda v: v is not None)
    sampling = st.fixed_dictionaries(
        {"max_new_tokens": limit}, optional={k: in_range_or_any(v) for k, v in SAMPLING.items()}
    )
    prompt = st.lists(st.integers(0, 5000), min_size=1, max_size=5)
    body = st.fixed_dictionaries(
        {"input_ids": in_range_or_any(prompt), "sampling_params": sampling},
        optional={k: in_range_or_any(v) for k, v in TOP.items()},
    )
    loop = asyncio.get_running_loop()
    statuses = []

    async def fetch(sample: dict) -> tuple[int, str, bytes]:
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/generate", json=sample, headers=AUTH) as reply:
                return reply.status, reply.content_type, await reply.read()

    @settings(
        max_examples=80, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(body)
    def one(sample: dict) -> None:
        status, kind, raw = asyncio.run_coroutine_threadsafe(fetch(sample), loop).result(timeout=60)
        statuses.append(status)
        assert status == 200 or 400 <= status < 500, (status, sample, raw[:300])
        if status != 200:
            assert json.loads(raw)["error"]["message"], raw
            return
        if kind == "text/event-stream":
            events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
            assert events[-1] == b"[DONE]" and all(b'"error"' not in e[:10] for e in events[:-1]), (
                raw[-300:]
            )
            answer = [json.loads(e) for e in events[:-1]]
        else:
            answer = json.loads(raw)
        for choice in answer if isinstance(answer, list) else [answer]:
            assert {"text", "output_ids", "meta_info"} <= set(choice), choice

    await asyncio.to_thread(one)
    assert statuses.count(200) >= 5 and any(400 <= s < 500 for s in statuses), statuses
