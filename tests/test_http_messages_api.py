"""Anthropic's Messages API through the official `anthropic` client, on one real server (tiny
random model, a reasoning parser, a template that renders thinking and tool calls, an API key).

As with the Responses API, the Messages API is the chat route under a translation, so the
strong check is agreement: greedy, a message's text and token counts equal the chat
completion's for the messages the request stands for. Then what only this API has: content
blocks, stop reasons, the stream's events (through the SDK's accumulator), count_tokens,
Anthropic's error shape and its `x-api-key` header.
"""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import pytest_asyncio
from serve_helpers import in_process_server, wait_idle
from test_http_responses_api import TEMPLATE
from test_http_structured_output import SCHEMA, valid

from deltaserve.engine.config import EngineConfig
from deltaserve.http.server import ServerConfig

aio = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny"
KEY = "sk-test"
GREEDY = {"temperature": 0}  # the SDK no longer names sampling fields: sent as extra_body
LOOKUP = {
    "name": "lookup",
    "description": "A city's forecast.",
    "input_schema": {
        "type": "object",
        "required": ["city", "days"],
        "properties": {
            "city": {"enum": ["Paris", "Oslo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
    },
}
CHAT_LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": LOOKUP["description"],
        "parameters": LOOKUP["input_schema"],
    },
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=1024, max_num_seqs=4)
    server_config = ServerConfig(
        MODEL,
        chat_template=TEMPLATE,
        reasoning_parser="qwen3",
        api_key=KEY,
        default_chat_template_kwargs={"enable_thinking": False},
    )
    async with in_process_server(config, server_config) as s:
        yield s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def clients(server):
    claude = anthropic.AsyncAnthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)
    gpt = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    yield claude, gpt
    await claude.close()
    await gpt.close()


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def leaves_the_engine_idle(server):
    yield
    await wait_idle(server.engine, timeout_s=30)


async def message(
    claude: anthropic.AsyncAnthropic, messages: list[dict], max_tokens: int = 12, **body: Any
) -> Any:
    extra = {**GREEDY, **body.pop("extra_body", {})}
    return await claude.messages.create(
        model=MODEL, max_tokens=max_tokens, messages=messages, extra_body=extra, **body
    )


async def chat(
    gpt: openai.AsyncOpenAI, messages: list[dict], max_tokens: int = 12, **body: Any
) -> Any:
    return await gpt.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **body
    )


@aio
async def test_text_as_the_chat_completion_and_the_stream_the_same(clients):
    """system + user is the chat's [system, user]: greedy, the same text and token counts;
    cut by max_tokens: "max_tokens". Streamed, the SDK's accumulator builds the same message,
    and the raw events open with message_start and close with message_stop."""
    claude, gpt = clients
    user = [{"role": "user", "content": "What is the weather?"}]
    m = await message(claude, user, system="Answer briefly.")
    c = await chat(gpt, [{"role": "system", "content": "Answer briefly."}, *user])
    [block] = m.content
    assert block.type == "text" and block.text == c.choices[0].message.content and block.text
    assert (m.usage.input_tokens, m.usage.output_tokens) == (
        c.usage.prompt_tokens,
        c.usage.completion_tokens,
    )
    assert (m.stop_reason, m.role, m.model, m.id[:4]) == ("max_tokens", "assistant", MODEL, "msg_")
    async with claude.messages.stream(
        model=MODEL, max_tokens=12, messages=user, system="Answer briefly.", extra_body=GREEDY
    ) as stream:
        events = [e async for e in stream]
        final = await stream.get_final_message()
    assert (
        final.content[0].text == block.text
        and final.usage.output_tokens == 12
        and final.stop_reason == "max_tokens"
    )
    kinds = [e.type for e in events]
    assert (
        kinds[0] == "message_start"
        and kinds[-1] == "message_stop"
        and "content_block_stop" in kinds
    )
    counted = await claude.messages.count_tokens(
        model=MODEL, messages=user, system="Answer briefly."
    )
    assert counted.input_tokens == m.usage.input_tokens


@aio
async def test_history_of_thinking_tool_use_and_tool_results(clients):
    """An assistant turn's thinking, text and tool_use blocks, and a user turn's tool_result
    and text, are the chat's reasoning, content, tool_calls, tool message and user message."""
    claude, gpt = clients
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": ""},
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "call_1",
                    "name": "lookup",
                    "input": {"city": "Paris", "days": 1},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "call_1",
                    "content": [{"type": "text", "text": "sunny"}],
                },
                {"type": "text", "text": "And", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "tomorrow?"},
            ],
        },
    ]
    as_chat = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning": "Look it up.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"city": "Paris", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "And"}, {"type": "text", "text": "tomorrow?"}],
        },
    ]
    m = await message(claude, history, tools=[LOOKUP], tool_choice={"type": "none"})
    c = await chat(gpt, as_chat, tools=[CHAT_LOOKUP], tool_choice="none")
    assert (
        m.content[0].text == c.choices[0].message.content
        and m.usage.input_tokens == c.usage.prompt_tokens
    )


@aio
async def test_thinking_block_as_chat_reasoning_and_its_budget(clients):
    """thinking adaptive turns the template's thinking on: the text before </think> is a
    thinking block (none closes it here: an empty text block follows), as chat's reasoning.
    enabled with budget_tokens 3: </think> is forced after 3 thinking tokens, so the thinking
    is the unbudgeted one's start and an answer follows. A budget where the prompt opens no
    think block is refused, naming it."""
    claude, gpt = clients
    user = [{"role": "user", "content": "Think first."}]
    m = await message(claude, user, thinking={"type": "adaptive"})
    c = await chat(gpt, user, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    thinking, text = m.content
    reasoning = c.choices[0].message.reasoning
    assert thinking.type == "thinking" and thinking.thinking == reasoning
    assert text.type == "text" and text.text == ""
    budgeted = await message(claude, user, thinking={"type": "enabled", "budget_tokens": 3})
    thinking, text = budgeted.content
    assert reasoning.startswith(thinking.thinking) and 0 < len(thinking.thinking) < len(reasoning)
    assert text.type == "text" and text.text and budgeted.usage.output_tokens == 12
    with pytest.raises(openai.BadRequestError, match="think block") as info:
        # the server's default: thinking off
        await chat(gpt, user, extra_body={"thinking_budget": 3})
    assert info.value.body["param"] == "thinking_budget"


@aio
async def test_stop_sequence_tools_and_json(clients):
    """A stop sequence found in the greedy text ends it there ("stop_sequence", named); tool
    choice "any" gives valid tool_use blocks, a named tool "tool_use" as the stop reason,
    streamed too; output_config.format a valid document ("end_turn")."""
    claude, _ = clients
    user = [{"role": "user", "content": "Tell me a story."}]
    text = (await message(claude, user, max_tokens=16)).content[0].text
    assert len(text) >= 8
    cut = await message(claude, user, max_tokens=16, stop_sequences=["never-seen", text[4:8]])
    assert (cut.stop_reason, cut.stop_sequence, cut.content[0].text) == (
        "stop_sequence",
        text[4:8],
        text[: text.index(text[4:8])],
    )
    calls = await message(
        claude,
        user,
        max_tokens=320,
        tools=[LOOKUP],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    [call] = calls.content
    assert calls.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "lookup"
    assert call.input["city"] in ("Paris", "Oslo") and 1 <= call.input["days"] <= 7
    async with claude.messages.stream(
        model=MODEL,
        max_tokens=320,
        messages=user,
        tools=[LOOKUP],
        extra_body=GREEDY,
        tool_choice={"type": "tool", "name": "lookup"},
    ) as stream:
        named = await stream.get_final_message()
    assert named.stop_reason == "tool_use" and [b.type for b in named.content] == ["tool_use"]
    assert named.content[0].input["city"] in ("Paris", "Oslo")
    document = await message(
        claude,
        user,
        max_tokens=320,
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
    )
    assert document.stop_reason == "end_turn" and valid(
        json.loads(document.content[0].text), SCHEMA
    )


@aio
@pytest.mark.parametrize(
    "body, words",
    [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "url", "url": "u"}}],
                    }
                ]
            },
            "has no vision tower",  # a text-only checkpoint
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "client tools"),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 0}},
            "budget_tokens must be an integer >= 1",
        ),
        ({"output_config": {"effort": "high"}}, "output_config.format"),
        ({"speed": "fast"}, "'speed'"),
        ({"max_tokens": None}, "max_tokens is required"),
        ({"messages": [{"role": "system", "content": "x"}]}, "role 'user' or 'assistant'"),
        # refused by the chat route's checks, naming the Messages API's fields
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        (
            {"tools": [{"name": "", "input_schema": {"type": "object"}}]},
            "tools[0].name must be a non-empty",
        ),
        (
            {"tools": [{"name": "f", "input_schema": "x"}]},
            "tools[0].input_schema must be a JSON Schema",
        ),
        (
            {
                "output_config": {
                    "format": {
                        "type": "json_schema",
                        "schema": {"type": "string", "format": "color"},
                    }
                }
            },
            "output_config.format",
        ),
        (
            {
                "thinking": {"type": "enabled", "budget_tokens": 8},
                "output_config": {"format": {"type": "json_schema", "schema": {"type": "integer"}}},
            },
            "thinking.budget_tokens",
        ),
    ],
)
async def test_refused_in_anthropics_error_shape(server, clients, body, words):
    """A 400 as Anthropic's API gives one (`{"type": "error", "error": {type, message}}`),
    naming the problem; the engine stays healthy."""
    full = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
        **body,
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(
            server.url + "/v1/messages", json=full, headers={"x-api-key": KEY}
        ) as reply:
            answer = await reply.json()
    assert (
        reply.status == 400 and answer["type"] == "error" and words in answer["error"]["message"]
    ), answer
    assert not {"response_format", "function", "thinking_budget"} & set(
        re.findall(r"\w+", answer["error"]["message"])
    )
    assert answer["error"]["type"] == "invalid_request_error"
    assert (
        await message(clients[0], [{"role": "user", "content": "hi"}], max_tokens=2)
    ).usage.output_tokens == 2


@aio
async def test_event_streams_declare_utf8(server):
    """Every stream says `text/event-stream; charset=utf-8`, as OpenAI, Anthropic and vLLM do:
    without the charset, clients that decode by the header (requests' `iter_lines(
    decode_unicode=True)`) read the UTF-8 as Latin-1, so every non-ASCII token came out
    mangled and lines split inside characters (Latin-1 byte 0x85 is a line break to
    str.splitlines). Each ends as its API ends a stream."""
    user = [{"role": "user", "content": "hi"}]
    for path, body, end in [
        ("/v1/chat/completions", {"messages": user, "max_tokens": 1}, b"data: [DONE]\n\n"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 1}, b'"response.incomplete"'),
        (
            "/v1/messages",
            {"model": MODEL, "messages": user, "max_tokens": 1},
            b"event: message_stop",
        ),
    ]:
        async with aiohttp.ClientSession() as s:
            async with s.post(
                server.url + path, json={**body, "stream": True}, headers={"x-api-key": KEY}
            ) as r:
                assert (r.status, r.content_type, r.charset) == (
                    200,
                    "text/event-stream",
                    "utf-8",
                ), (path, r.headers)
                data = await r.read()
        assert end in data[-4000:], (path, data[-300:])


@aio
async def test_api_key_as_anthropic_sends_it(server):
    """`x-api-key` is taken as a bearer token is (Anthropic's clients send it so); a wrong
    one is a 401 the SDK raises."""
    wrong = anthropic.AsyncAnthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        await wrong.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    await wrong.close()
