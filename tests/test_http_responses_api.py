"""OpenAI's Responses API through the official `openai` client, on one real server (tiny random
model, a reasoning parser, a template that renders thinking and tool calls).

The Responses API is served by the chat route under a translation, so the strongest check is
agreement: greedy, a response's text and input tokens equal the chat completion's for the
messages the Responses request stands for (instructions, input items, a previous response's
history). Then what only this API has: output items (reasoning, message, function_call), the
stream's events (checked by the SDK's own stream accumulator), stored responses, refusals.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from serve_helpers import in_process_server, wait_idle
from test_http_structured_output import SCHEMA, valid

from deltaserve.engine.config import EngineConfig
from deltaserve.http.server import ServerConfig

aio = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny"
# ChatML with thinking (as Qwen3.5's: `enable_thinking`, reasoning_content in history) and
# tool calls and results written out, so that every message field reaches the prompt
TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'tool' -%}{{- '[' + message['tool_call_id'] + '] ' -}}{%- endif -%}"
    "{%- if message['role'] == 'assistant' and message['reasoning_content'] -%}"
    "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- message['content'] or '' -}}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{{- '<tool_call>' + (call['function'] | tojson) + '</tool_call>' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
LOOKUP = {
    "type": "function",
    "name": "lookup",
    "description": "A city's forecast.",
    "parameters": {
        "type": "object",
        "required": ["city", "days"],
        "properties": {
            "city": {"enum": ["Paris", "Oslo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
    },
}
THINKING = {"chat_template_kwargs": {"enable_thinking": True}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=1024, max_num_seqs=4)
    server_config = ServerConfig(
        MODEL,
        chat_template=TEMPLATE,
        reasoning_parser="qwen3",
        default_chat_template_kwargs={"enable_thinking": False},
    )
    async with in_process_server(config, server_config) as s:
        yield s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(server):
    client = openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60
    )
    yield client
    await client.close()


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def leaves_the_engine_idle(server):
    yield
    await wait_idle(server.engine, timeout_s=30)


async def respond(client: openai.AsyncOpenAI, **body: Any) -> Any:
    body.setdefault("max_output_tokens", 12)
    return await client.responses.create(model=MODEL, temperature=0, **body)


async def chat(
    client: openai.AsyncOpenAI, messages: list[dict], max_tokens: int = 12, **extra: Any
) -> Any:
    return await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **extra
    )


@aio
async def test_text_as_the_chat_completion_of_the_same_messages(client):
    """Instructions and a text input are a system and a user message: greedy, the same text
    and token counts as chat; cut by max_output_tokens: "incomplete", as OpenAI's."""
    r = await respond(client, instructions="Answer briefly.", input="What is the weather?")
    c = await chat(
        client,
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the weather?"},
        ],
    )
    assert r.output_text == c.choices[0].message.content and r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (
        c.usage.prompt_tokens,
        c.usage.completion_tokens,
    )
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert (r.status, r.incomplete_details.reason, r.model, r.object) == (
        "incomplete",
        "max_output_tokens",
        MODEL,
        "response",
    )
    [message] = r.output
    assert (
        message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    )
    assert (
        r.id.startswith("resp_")
        and r.instructions == "Answer briefly."
        and r.max_output_tokens == 12
    )


@aio
async def test_stream_events_add_up_to_the_response(client):
    """The raw events: numbered from 0 in order, created first and incomplete last, every
    delta on the item added before it; the deltas add up to the non-streamed text."""
    whole = await respond(client, input="Tell me a story.")
    events = [e async for e in await respond(client, input="Tell me a story.", stream=True)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert [e.type for e in events[-4:]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    item_id = events[2].item.id
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert {e.item_id for e in deltas} == {item_id} and "".join(
        e.delta for e in deltas
    ) == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.id == events[0].response.id != whole.id
    assert final.usage.output_tokens == 12 and events[-2].item.status == "incomplete"


@aio
async def test_previous_response_continues_the_conversation(client):
    """A second turn on `previous_response_id` is the chat of the whole history (the first
    turn's instructions not carried, as OpenAI's), and so is the same turn sent with the
    first response's output items as input; the stored response can be fetched, deleted."""
    first = await respond(client, instructions="Be terse.", input="Name a city.")
    second = await respond(client, input="Why that one?", previous_response_id=first.id)
    history = [
        {"role": "user", "content": "Name a city."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Why that one?"},
    ]
    c = await chat(client, history)
    assert (
        second.output_text == c.choices[0].message.content
        and second.usage.input_tokens == c.usage.prompt_tokens
    )
    items = [
        {"role": "user", "content": "Name a city."},
        *(i.model_dump(exclude_none=True) for i in first.output),
        {"role": "user", "content": [{"type": "input_text", "text": "Why that one?"}]},
    ]
    assert (await respond(client, input=items)).output_text == second.output_text
    two = [
        {"type": "input_text", "text": "Why"},
        {"type": "input_text", "text": "that one?"},
    ]  # joined as chat joins parts
    split = await respond(client, input=[*items[:-1], {"role": "user", "content": two}])
    parts = await chat(
        client, [*history[:2], {"role": "user", "content": [{**p, "type": "text"} for p in two]}]
    )
    assert (
        split.output_text == parts.choices[0].message.content
        and split.usage.input_tokens == parts.usage.prompt_tokens
    )
    fetched = await client.responses.retrieve(first.id)
    assert fetched.output_text == first.output_text and fetched.usage == first.usage
    await client.responses.delete(first.id)
    for call in (
        client.responses.retrieve(first.id),
        respond(client, input="again", previous_response_id=first.id),
    ):
        with pytest.raises(openai.NotFoundError, match=first.id):
            await call
    unstored = await respond(client, input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)


@aio
async def test_reasoning_item_and_tool_history(client):
    """Thinking on: the text before </think> is a reasoning item (none closes it here, so the
    answer is an empty message), as chat's reasoning. Function calls and their outputs as
    input items are chat's assistant tool_calls and tool messages."""
    r = await respond(client, input="Think first.", extra_body=THINKING)
    c = await chat(client, [{"role": "user", "content": "Think first."}], extra_body=THINKING)
    reasoning, message = r.output
    assert (
        reasoning.type == "reasoning"
        and reasoning.content[0].text == c.choices[0].message.reasoning
    )
    assert (
        message.type == "message"
        and r.output_text == ""
        and r.usage.output_tokens_details.reasoning_tokens == 12
    )
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "lookup",
            "arguments": '{"city": "Paris", "days": 1}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"city": "Paris", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = await respond(client, input=items, tools=[LOOKUP], tool_choice="none")
    tools = [{"type": "function", "function": {k: v for k, v in LOOKUP.items() if k != "type"}}]
    c = await chat(client, messages, tools=tools, tool_choice="none")
    assert (
        r.output_text == c.choices[0].message.content
        and r.usage.input_tokens == c.usage.prompt_tokens
    )


@aio
async def test_structured_output_and_forced_tool_calls_through_the_sdk_stream(client):
    """text.format json_schema ends with a valid document ("completed"); a required tool
    choice gives function_call items with valid arguments. Streamed, the SDK's accumulator
    (which checks every event against the items before it) gives the same response."""
    text = {"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}}
    r = await respond(client, input="Weather?", text=text, max_output_tokens=320)
    assert r.status == "completed" and valid(json.loads(r.output_text), SCHEMA), r.output_text
    async with client.responses.stream(
        model=MODEL, input="Weather?", text=text, max_output_tokens=320, temperature=0
    ) as stream:
        final = await stream.get_final_response()
    assert final.output_text == r.output_text
    calls = await respond(
        client,
        input="Forecast?",
        tools=[LOOKUP],
        tool_choice="required",
        max_output_tokens=320,
        parallel_tool_calls=False,
    )
    [call] = calls.output
    assert calls.status == "completed" and call.type == "function_call" and call.name == "lookup"
    arguments = json.loads(call.arguments)
    assert arguments["city"] in ("Paris", "Oslo") and 1 <= arguments["days"] <= 7 and call.call_id
    async with client.responses.stream(
        model=MODEL,
        input="Forecast?",
        tools=[LOOKUP],
        temperature=0,
        tool_choice={"type": "function", "name": "lookup"},
        max_output_tokens=320,
    ) as stream:
        named = await stream.get_final_response()
    assert [i.type for i in named.output] == ["function_call"] and json.loads(
        named.output[0].arguments
    )["city"]


@aio
async def test_logprobs_of_the_output_text(client):
    """include message.output_text.logprobs: one entry per output token, its bytes adding up
    to the text, with top_logprobs alternatives, as chat's."""
    r = await respond(
        client, input="Count.", include=["message.output_text.logprobs"], top_logprobs=2
    )
    c = await chat(client, [{"role": "user", "content": "Count."}], logprobs=True, top_logprobs=2)
    part = r.output[0].content[0]
    assert len(part.logprobs) == 12 and all(len(e.top_logprobs) == 2 for e in part.logprobs)
    assert bytes(b for e in part.logprobs for b in e.bytes).decode() == part.text
    assert [e.logprob for e in part.logprobs] == [e.logprob for e in c.choices[0].logprobs.content]


@aio
@pytest.mark.parametrize(
    "body, status, param, words",
    [
        (
            {"input": "x", "tools": [{"type": "web_search"}]},
            400,
            "tools[0].type",
            "only function tools",
        ),
        ({"input": "x", "reasoning": {"effort": "high"}}, 400, "reasoning", "chat_template_kwargs"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            400,
            "input",
            "text parts",
        ),
        ({"input": [{"type": "web_search_call", "id": "w"}]}, 400, "input", "'web_search_call'"),
        ({"input": "x", "top_logprobs": 2}, 400, "top_logprobs", "include"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, 400, "include", "only"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format.type", "'xml'"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens", ">= 1"),
        ({"input": "x", "background": True}, 400, "background", "not supported"),
        ({"input": "x", "frobnicate": 1}, 400, "frobnicate", "frobnicate"),
        (
            {"input": "x", "previous_response_id": "resp_missing"},
            404,
            "previous_response_id",
            "resp_missing",
        ),
        (
            {
                "input": "x",
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "n",
                        "schema": {"type": "string", "format": "color"},
                    }
                },
            },
            400,
            "text.format",
            "Unknown format: color",
        ),
        (
            {"input": "x", "tools": [LOOKUP], "tool_choice": {"type": "function", "name": "nope"}},
            400,
            "tool_choice",
            "does not match",
        ),
        ({"input": "x", "tools": [{"type": "function"}]}, 400, "tools", "tools[0].name"),
        ({"input": "x", "max_output_tokens": 100000}, 400, "input", "max_output_tokens (100000)"),
        ({"input": []}, 400, "input", "non-empty"),
    ],
)
async def test_refused_naming_the_field(server, client, body, status, param, words):
    """Each a clear OpenAI-shaped error naming the Responses field; the engine stays healthy
    (the fixture waits for it idle, and the next test runs on it)."""
    async with aiohttp.ClientSession() as session:
        async with session.post(
            server.url + "/v1/responses", json={"model": MODEL, **body}
        ) as reply:
            error = (await reply.json())["error"]
            assert (reply.status, error["param"]) == (status, param) and words in error[
                "message"
            ], error
    assert (await respond(client, input="still here", max_output_tokens=2)).usage.output_tokens == 2
