"""Tool calling in chat completions (`--enable-auto-tool-choice --tool-call-parser`), beside
the parsers (tests/test_http_tool_parsers.py): the request side (tools, tool_choice,
parallel_tool_calls and tool history, as vLLM checks them), the response from engine events,
the flags; then one real server: the prompt it renders with tools and tool history is
transformers' rendering of vLLM's conversation, and a greedy answer read for tool calls is
what the parser makes of the same request's raw text, streamed or not.
"""

from __future__ import annotations

import json

import openai
import pytest
import pytest_asyncio
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from serve_helpers import in_process_server
from test_http_tool_parsers import SEARCH, TOOLS, WEATHER, calls_of, xml_call

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import FinishedEvent, TokenEvent
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.http.errors import ApiError
from deltaserve.http.listen import start_server
from deltaserve.http.protocol import parse_chat_request
from deltaserve.http.reasoning import ReasoningParser
from deltaserve.http.responses import ChatFormatter, ChoiceState, TokenStrings
from deltaserve.http.server import ServerConfig, build_app
from deltaserve.http.tool_parsers import ToolCallReader, parse_tool_calls

# ---- request side ------------------------------------------------------------------------

USER = [{"role": "user", "content": "hi"}]


def refused(body: dict, param: str, words: str) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_chat_request(body)
    err = info.value
    assert err.status == 400 and err.param == param and words in err.message, (
        err.param,
        err.message,
    )
    return err


class TestToolFields:
    def test_tools_as_vllm_hands_them_to_the_template(self):
        """Each tool as vLLM's request model dumps it: description and parameters null when
        left out, `strict: false` kept; tool_choice "auto" by default when tools are given."""
        r = parse_chat_request(
            {
                "messages": USER,
                "tools": [
                    {"function": {"name": "f", "strict": False}},
                    {
                        "type": "function",
                        "function": {
                            "parameters": {"type": "object"},
                            "name": "g",
                            "description": "G",
                        },
                    },
                ],
            }
        )
        assert r.tools == (
            {
                "type": "function",
                "function": {"name": "f", "description": None, "parameters": None, "strict": False},
            },
            {
                "type": "function",
                "function": {"name": "g", "description": "G", "parameters": {"type": "object"}},
            },
        )
        assert (r.tool_choice, r.parallel_tool_calls) == ("auto", True)

    @pytest.mark.parametrize(
        "extra, tools, choice, parallel",
        [
            ({}, None, "none", True),
            ({"tool_choice": None}, None, "none", True),
            ({"tool_choice": "none"}, None, "none", True),
            ({"tools": None, "parallel_tool_calls": False}, None, "none", False),
            ({"tools": [SEARCH], "tool_choice": None}, (SEARCH,), "auto", True),
            ({"tools": [SEARCH], "tool_choice": "none"}, (SEARCH,), "none", True),
            (
                {"tools": [SEARCH], "tool_choice": "auto", "parallel_tool_calls": False},
                (SEARCH,),
                "auto",
                False,
            ),
        ],
    )
    def test_choices(self, extra, tools, choice, parallel):
        r = parse_chat_request({"messages": USER, **extra})
        assert (r.tools, r.tool_choice, r.parallel_tool_calls) == (tools, choice, parallel)

    @pytest.mark.parametrize(
        "extra, param, words",
        [
            ({"tools": []}, "tools", "must not be an empty array"),
            ({"tools": {"a": 1}}, "tools", "must be an array"),
            ({"tools": ["f"]}, "tools", "tools[0] must be an object"),
            (
                {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
                "tools[0].type",
                "only function tools",
            ),
            ({"tools": [{"type": "function"}]}, "tools", "tools[0].function must be an object"),
            (
                {"tools": [{"function": {"description": "d"}}]},
                "tools",
                "name must be a non-empty string",
            ),
            ({"tools": [{"function": {"name": ""}}]}, "tools", "name must be a non-empty string"),
            (
                {"tools": [{"function": {"name": "f", "parameters": "{}"}}]},
                "tools",
                "JSON Schema object",
            ),
            (
                {"tools": [{"function": {"name": "f", "description": 3}}]},
                "tools",
                "description must be a string",
            ),
            (
                {"tools": [{"function": {"name": "f", "strict": True}}]},
                "tools[0].function.strict",
                "not 'auto'",
            ),
            (
                {"tools": [{"function": {"name": "f", "strict": "no"}}]},
                "tools",
                "strict must be a boolean",
            ),
            (
                {"tools": [{"function": {"name": "f", "examples": []}}]},
                "tools[0].function.examples",
                "only name",
            ),
            (
                {"tools": [{"function": {"name": "f"}, "cache_control": {}}]},
                "tools[0].cache_control",
                "only type",
            ),
            ({"tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
            (
                {
                    "tools": [SEARCH],
                    "tool_choice": {"type": "function", "function": {"name": "find"}},
                },
                "tool_choice",
                "does not match any",
            ),
            (
                {"tools": [SEARCH], "tool_choice": {"type": "function", "function": {}}},
                "tool_choice",
                "Expected field `name`",
            ),
            ({"tool_choice": "any"}, "tool_choice", "Invalid value for `tool_choice`"),
            ({"tool_choice": 3}, "tool_choice", "Invalid value for `tool_choice`"),
            ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        ],
    )
    def test_refusals(self, extra, param, words):
        refused({"messages": USER, **extra}, param, words)


CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


class TestToolHistory:
    def test_calls_and_results_as_vllm_hands_them_to_the_template(self):
        """An assistant's calls with `arguments` parsed to an object (empty: {}), null content
        as ""; a tool message's `tool_call_id`; empty calls left out."""
        empty = {
            "id": "call_2",
            "type": "function",
            "function": {"name": "search", "arguments": ""},
        }
        as_object = {"id": "call_3", "function": {"name": "search", "arguments": {"q": "x"}}}
        r = parse_chat_request(
            {
                "messages": [
                    *USER,
                    {"role": "assistant", "content": None, "tool_calls": [CALL, empty, as_object]},
                    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
                    {"role": "tool", "content": [{"type": "text", "text": "none"}]},
                    {"role": "assistant", "content": "ok", "tool_calls": []},
                ]
            }
        )
        assert r.messages[1:] == (
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {**empty, "function": {"name": "search", "arguments": {}}},
                    {"id": "call_3", "function": {"name": "search", "arguments": {"q": "x"}}},
                ],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
            {"role": "tool", "content": "none"},
            {"role": "assistant", "content": "ok"},
        )

    @pytest.mark.parametrize(
        "message, param, words",
        [
            (
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{x"}}],
                },
                "messages",
                "arguments is not valid JSON",
            ),
            (
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}],
                },
                "messages",
                "must be a JSON object",
            ),
            (
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": CALL["function"]}],
                },
                "messages",
                "tool_calls[0].id must be a string",
            ),
            (
                {"role": "assistant", "tool_calls": [{**CALL, "index": 0}]},
                "messages[1].tool_calls[0].index",
                "only id",
            ),
            (
                {"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]},
                "messages[1].tool_calls[0].type",
                "only function",
            ),
            (
                {"role": "assistant", "tool_calls": [{**CALL, "function": {"arguments": "{}"}}]},
                "messages",
                "name must be",
            ),
            (
                {"role": "assistant", "tool_calls": {"id": "x"}},
                "messages",
                "tool_calls must be an array",
            ),
            (
                {"role": "user", "content": "x", "tool_calls": [CALL]},
                "messages[1].tool_calls",
                "role, content and name",
            ),
            (
                {"role": "user", "content": "x", "tool_call_id": "c"},
                "messages[1].tool_call_id",
                "role, content and name",
            ),
            (
                {"role": "tool", "content": "x", "tool_call_id": 7},
                "messages",
                "tool_call_id must be a string",
            ),
            ({"role": "tool", "tool_call_id": "c"}, "messages", "messages[1].content is required"),
        ],
    )
    def test_refusals(self, message, param, words):
        refused({"messages": [*USER, message]}, param, words)


# ---- the response, from engine events ----------------------------------------------------

SAY_AND_CALL = (
    "I'll check both.\n\n"
    + xml_call("get_weather", city="Paris", days="3")
    + xml_call("search", q="x")
)
SAY_AND_CALL_PARSED = (
    "I'll check both.\n\n",
    [("get_weather", '{"city": "Paris", "days": 3}'), ("search", '{"q": "x"}')],
)


def formatted(text: str, reason: str, *, streaming: bool, parallel: bool = True, reasoning=None):
    """`text` through a chat formatter in 5-character token events, as the server drives it:
    the body (OpenAI's type), or each chunk (OpenAI's type) and its JSON."""
    reader = ToolCallReader("qwen3_coder", TOOLS, parallel)
    formatter = ChatFormatter(
        "chatcmpl-1",
        MODEL,
        TokenStrings(None),
        False,
        tool_calls=reader,
        streaming=streaming,
        reasoning=reasoning,
        prompt_ids=[1],
    )
    state, pieces = ChoiceState(), [text[i : i + 5] for i in range(0, len(text), 5)]
    chunks = [formatter.start(0)] + [
        formatter.token(0, TokenEvent(0, 0, p, 0.0, []), state) for p in pieces
    ]
    state.finish_reason, state.prompt_tokens, state.output_tokens = reason, 3, len(pieces)
    chunks.append(formatter.finish(0, FinishedEvent(0, reason, 3, len(pieces), ""), state))
    if streaming:
        return [(ChatCompletionChunk.model_validate(c), c) for c in chunks if c is not None]
    body = formatter.response(
        [state], {"prompt_tokens": 3, "completion_tokens": len(pieces), "total_tokens": 0}
    )
    return ChatCompletion.model_validate(body), body


def assembled(chunks) -> tuple[str, list[tuple[str, str]], list[str]]:
    """The content, calls and finish reasons a client assembles from the chunks; each call's
    first delta carries its id, type and name, and no chunk with calls carries empty content."""
    content, calls, finishes = [], [], []
    for chunk, raw in chunks:
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for d in delta.tool_calls or []:
            if d.id is not None:
                assert (
                    d.index == len(calls)
                    and d.type == "function"
                    and d.id.startswith("chatcmpl-tool-")
                )
                calls.append([d.function.name, ""])
            else:
                assert d.function.name is None and d.type is None
            calls[d.index][1] += d.function.arguments
        if delta.tool_calls:
            assert raw["choices"][0]["delta"].get("content", "x") != ""
        finishes += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    return "".join(content), [tuple(c) for c in calls], finishes


class TestResponse:
    def test_message_carries_the_calls(self):
        """The calls in message.tool_calls (vLLM's id form, type "function", arguments a JSON
        string), the text before them as content, finish_reason "tool_calls"."""
        completion, _ = formatted(SAY_AND_CALL, "stop", streaming=False)
        choice = completion.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert (choice.message.content, calls, choice.finish_reason) == (
            *SAY_AND_CALL_PARSED,
            "tool_calls",
        )
        assert all(
            c.type == "function" and c.id.startswith("chatcmpl-tool-")
            for c in choice.message.tool_calls
        )

    @pytest.mark.parametrize("streaming", [False, True])
    def test_content_null_length_and_no_call(self, streaming):
        """Nothing before the calls: content null (not streamed at all); a cut by max_tokens
        stays "length" (as vLLM's); text without calls is as it came, with no tool_calls."""
        cases = [
            (xml_call("search", q="x"), "stop", None, "tool_calls"),
            (xml_call("search", q="x")[:-20], "length", None, "length"),
            ("Just <b>text</b>.", "stop", "Just <b>text</b>.", "stop"),
        ]
        for text, reason, content, finish in cases:
            if streaming:
                got, calls, finishes = assembled(formatted(text, reason, streaming=True))
                assert (got, finishes) == (content or "", [finish])
            else:
                completion, body = formatted(text, reason, streaming=False)
                message = body["choices"][0]["message"]
                assert (message["content"], completion.choices[0].finish_reason) == (
                    content,
                    finish,
                )
                assert ("tool_calls" in message) == (finish != "stop")

    def test_stream_carries_the_calls(self):
        content, calls, finishes = assembled(formatted(SAY_AND_CALL, "stop", streaming=True))
        assert ((content, calls), finishes) == (SAY_AND_CALL_PARSED, ["tool_calls"])

    @pytest.mark.parametrize("streaming", [False, True])
    def test_parallel_tool_calls_false_keeps_the_first(self, streaming):
        if streaming:
            content, calls, _ = assembled(
                formatted(SAY_AND_CALL, "stop", streaming=True, parallel=False)
            )
        else:
            completion, _ = formatted(SAY_AND_CALL, "stop", streaming=False, parallel=False)
            message = completion.choices[0].message
            content, calls = (
                message.content,
                [(c.function.name, c.function.arguments) for c in message.tool_calls],
            )
        assert (content, calls) == (SAY_AND_CALL_PARSED[0], SAY_AND_CALL_PARSED[1][:1])

    @pytest.mark.parametrize(
        "parser, text, expected",
        [
            # a <tool_call> the thinking mentions is thinking; the calls come from the answer
            (
                "qwen3",
                "Maybe a <tool_call> with search?</think>" + SAY_AND_CALL,
                ("Maybe a <tool_call> with search?", *SAY_AND_CALL_PARSED),
            ),
            # Qwen3.5 calling without closing its thinking: the call ends it (vLLM's qwen3)
            (
                "qwen3",
                "I need the weather.\n" + xml_call("get_weather", city="Paris", days="3"),
                ("I need the weather.\n", "", SAY_AND_CALL_PARSED[1][:1]),
            ),
            (
                "deepseek_r1",
                "I need the weather.\n" + xml_call("get_weather", city="Paris"),
                ("I need the weather.\n" + xml_call("get_weather", city="Paris"), "", []),
            ),
        ],
    )
    @pytest.mark.parametrize("streaming", [False, True])
    def test_calls_are_read_from_the_content_after_the_reasoning(
        self, streaming, parser, text, expected
    ):
        """Both parsers on, the thinking opened by the prompt: the reasoning, then the content
        and calls read out of what follows it, streamed or not."""
        reasoning = ReasoningParser(parser, think_id=1, end_think_id=2)  # the prompt is [1]
        if streaming:
            chunks = formatted(text, "stop", streaming=True, reasoning=reasoning)
            thought = "".join(
                raw["choices"][0]["delta"].get("reasoning") or "" for _, raw in chunks
            )
            content, calls, finishes = assembled(chunks)
        else:
            completion, body = formatted(text, "stop", streaming=False, reasoning=reasoning)
            choice = completion.choices[0]
            thought, content = body["choices"][0]["message"]["reasoning"], choice.message.content
            calls = [
                (c.function.name, c.function.arguments) for c in choice.message.tool_calls or []
            ]
            finishes = [choice.finish_reason]
        assert (thought, content or "", calls) == expected
        assert finishes == ["tool_calls" if calls else "stop"]


# ---- flags -------------------------------------------------------------------------------


class TestFlags:
    def test_flags_reach_the_server_config(self):
        from deltaserve.http.serve import _server_config, parse_args

        config = _server_config(
            parse_args(["m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
        )
        assert (config.enable_auto_tool_choice, config.tool_call_parser) == (True, "hermes")
        config = _server_config(parse_args(["m", "--tool-call-parser", "qwen3_coder"]))
        assert (config.enable_auto_tool_choice, config.tool_call_parser) == (False, "qwen3_coder")

    def test_auto_tool_choice_without_a_parser_does_not_start(self, tmp_path, capsys):
        """As vLLM's start: exit 2, before any weight loads."""
        from deltaserve.http.serve import serve_main

        assert serve_main([str(tmp_path), "--enable-auto-tool-choice"]) == 2
        assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err

    def test_unknown_parser(self, capsys):
        from deltaserve.http.serve import parse_args
        from deltaserve.http.server import ServerConfig

        with pytest.raises(SystemExit) as info:
            parse_args(["m", "--tool-call-parser", "mistral"])
        assert info.value.code == 2 and "qwen3_coder" in capsys.readouterr().err
        with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, qwen3_coder"):
            ServerConfig("m", tool_call_parser="mistral")


# ---- one real server ---------------------------------------------------------------------

MODEL = "tiny-tools"
aio = pytest.mark.asyncio(loop_scope="module")
# A tool-aware template written for this test: the tools as JSON, each past call as Qwen3.5's
# template writes one (its arguments an object), tool results as user turns.
TOOL_TEMPLATE = (
    "{%- if tools -%}{{- '<|im_start|>system\\n# Tools\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools><|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}{%- if message.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response id=\"' + (message.tool_call_id or '') + '\">\\n' -}}"
    "{{- message.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + message.role + '\\n' + message.content -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{{- '\\n<tool_call>\\n<function=' + call.function.name + '>\\n' -}}"
    "{%- for key, value in call.function.arguments.items() -%}"
    "{{- '<parameter=' + key + '>\\n' "
    "+ (value if value is string else value | tojson) + '\\n</parameter>\\n' -}}"
    "{%- endfor -%}{{- '</function>\\n</tool_call>' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# The conversation as a client sends it back, and as vLLM hands it to the template.
SENT_TOOLS = [WEATHER, {"type": "function", "function": {"name": "search"}}]
SENT_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            }
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "user", "content": "And Rome?"},
]
TEMPLATE_MESSAGES = [
    *SENT_MESSAGES[:2],
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
            }
        ],
    },
    *SENT_MESSAGES[3:],
]
TEMPLATE_TOOLS = [WEATHER, SEARCH]


@pytest.fixture(scope="module")
def tool_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny checkpoint (its files linked) with TOOL_TEMPLATE as its tokenizer's template."""
    out = tmp_path_factory.mktemp("tiny_tools")
    for file in tiny_model_dir.iterdir():
        if file.name != "tokenizer_config.json":
            (out / file.name).symlink_to(file)
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": TOOL_TEMPLATE})
    )
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tool_model_dir):
    config = EngineConfig(model=str(tool_model_dir), max_model_len=1024, max_num_seqs=2)
    server_config = ServerConfig(
        MODEL, enable_auto_tool_choice=True, tool_call_parser="qwen3_coder"
    )
    async with in_process_server(config, server_config) as server:
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120
        )
        try:
            yield server, client
        finally:
            await client.close()


async def chat(client, **extra):
    body = {
        "model": MODEL,
        "messages": SENT_MESSAGES,
        "tools": SENT_TOOLS,
        "temperature": 0,
        "max_tokens": 24,
        **extra,
    }
    return await client.chat.completions.create(**body)


@aio
async def test_prompt_with_tools_and_history_is_transformers_rendering(served, tool_model_dir):
    """The server's prompt is transformers' apply_chat_template of the conversation vLLM makes
    (arguments objects, null content "", description/parameters null): the same number of
    tokens, and the same greedy answer as the engine gives those token ids."""
    from transformers import AutoTokenizer

    server, client = served
    tokenizer = AutoTokenizer.from_pretrained(tool_model_dir)
    text = tokenizer.apply_chat_template(
        TEMPLATE_MESSAGES, tools=TEMPLATE_TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert "<parameter=days>\n2\n</parameter>" in text and '"description": null' in text
    ids = tokenizer.encode(text, add_special_tokens=False)
    answer = []
    async for ev in server.engine.generate(ids, SamplingParams(max_tokens=24, temperature=0.0)):
        answer.append(ev.text)
    response = await chat(client, tool_choice="none")
    assert response.usage.prompt_tokens == len(ids)
    assert response.choices[0].message.content == "".join(answer)


@aio
@pytest.mark.parametrize("parallel", [True, False])
async def test_greedy_answer_round_trips(served, parallel):
    """tool_choice "auto" returns what the parser makes of the raw text of the same greedy
    request (tool_choice "none": same prompt, nothing read out of it), streamed or not."""
    _, client = served
    raw = (await chat(client, tool_choice="none")).choices[0]
    parsed = parse_tool_calls("qwen3_coder", raw.message.content, TEMPLATE_TOOLS)
    calls = calls_of(parsed)[: None if parallel else 1]
    finish = "tool_calls" if calls and raw.finish_reason == "stop" else raw.finish_reason
    content = parsed.content or (None if calls else "")
    extra = {} if parallel else {"parallel_tool_calls": False}
    got = (await chat(client, **extra)).choices[0]
    got_calls = [(c.function.name, c.function.arguments) for c in got.message.tool_calls or []]
    assert (got.message.content, got_calls, got.finish_reason) == (content, calls, finish)
    chunks = [chunk async for chunk in await chat(client, stream=True, **extra)]
    text, streamed_calls, finishes = [], {}, []
    for chunk in chunks:
        delta = chunk.choices[0].delta
        text.append(delta.content or "")
        for d in delta.tool_calls or []:
            if d.id is not None:
                streamed_calls[d.index] = [d.function.name, ""]
            streamed_calls[d.index][1] += d.function.arguments or ""
        finishes.append(chunk.choices[0].finish_reason)
    assert ("".join(text), [tuple(c) for c in streamed_calls.values()]) == (parsed.content, calls)
    assert [f for f in finishes if f] == [finish]


@aio
async def test_refusals(served):
    """Without --enable-auto-tool-choice, tool_choice "auto" (the default with tools) is
    refused in vLLM's words; "none" still renders the tools. A named tool_choice must name
    one of the tools."""
    server, client = served
    with pytest.raises(openai.BadRequestError) as info:
        await chat(client, tool_choice={"type": "function", "function": {"name": "find"}})
    assert (
        info.value.body["param"] == "tool_choice"
        and "does not match any" in info.value.body["message"]
    )
    runner, _ = await start_server(build_app(server.engine, ServerConfig(MODEL)), "127.0.0.1", 0)
    plain = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{runner.addresses[0][1]}/v1", api_key="x", max_retries=0
    )
    try:
        with pytest.raises(openai.BadRequestError) as info:
            await chat(plain)
        assert info.value.body["message"] == (
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )
        assert (await chat(plain, tool_choice="none", max_tokens=2)).choices[0].message.content
    finally:
        await plain.close()
        await runner.cleanup()
