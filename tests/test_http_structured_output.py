"""Structured outputs and forced tool calls over HTTP, through one real server (engine, rank
process, the tiny random model, CPU) and the openai client, as vLLM's OpenAI server takes them
(http/structured_output.py, http/tool_protocol.py): response_format, structured_outputs and
the fields vLLM 0.11 took (guided_*), on both endpoints; tool_choice "required" and a named
function, with no tool-call parser. The model is random: each test checks that whatever it
writes is valid for the constraint, never what it says.

The server is Qwen3.5's setup: a reasoning parser, a template that thinks unless told not to,
thinking off by default (a constraint where the chat opens a think block is refused).
"""

from __future__ import annotations

import json
import re
from typing import Any

import openai
import pytest
import pytest_asyncio
from serve_helpers import in_process_server, wait_idle
from test_http_reasoning import THINKING_TEMPLATE

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.tokenizer import load_tokenizer
from deltaserve.http.server import ServerConfig

aio = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "How is the weather today?"}]
PROMPT = "The weather today is"
# room for the JSON below, blanks and all (up to 20 a gap), from a model that picks at random
MAX_TOKENS = 320
# Small on purpose: enums, booleans, bounded strings and integers, so a random model ends it.
SCHEMA = {
    "type": "object",
    "properties": {
        "mood": {"enum": ["sunny", "rainy", "windy"]},
        "warm": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 6},
        "level": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["mood", "warm", "note", "level"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "metric": {"type": "boolean"}},
            "required": ["city", "metric"],
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["hour"],
        },
    },
}
TOOLS = [WEATHER, ALARM]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def valid(value: Any, schema: dict[str, Any]) -> bool:
    """`value` against the keywords used in this file's schemas."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        properties = schema["properties"]
        return (
            isinstance(value, dict)
            and set(schema.get("required", ())) <= set(value) <= set(properties)
            and all(valid(v, properties[k]) for k, v in value.items())
        )
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and schema.get("minimum", value) <= value <= schema.get("maximum", value)
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=512, max_num_seqs=4)
    server_config = ServerConfig(
        MODEL,
        chat_template=THINKING_TEMPLATE,
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


async def chat(client: openai.AsyncOpenAI, **extra: Any) -> Any:
    extra.setdefault("max_tokens", MAX_TOKENS)
    return await client.chat.completions.create(model=MODEL, messages=MESSAGES, **extra)


async def streamed(client: openai.AsyncOpenAI, **extra: Any) -> list[Any]:
    return [chunk async for chunk in await chat(client, stream=True, **extra)]


@aio
async def test_json_schema_on_both_endpoints(client):
    """response_format json_schema (chat and completions, as vLLM takes it on both) and
    structured_outputs.json: every choice parses and is valid, ended by its grammar."""
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True},
    }
    out = await chat(client, response_format=response_format, n=3, temperature=1.0, seed=1)
    texts = [c.message.content for c in out.choices]
    assert {c.finish_reason for c in out.choices} == {"stop"}, texts
    completion = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        seed=2,
        extra_body={"response_format": response_format},
    )
    legacy = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"guided_json": SCHEMA},
    )
    texts += [completion.choices[0].text, legacy.choices[0].text]
    assert {completion.choices[0].finish_reason, legacy.choices[0].finish_reason} == {"stop"}, texts
    for text in texts:
        assert valid(json.loads(text), SCHEMA), text
    compact = await chat(
        client,
        temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    )
    text = compact.choices[0].message.content
    assert valid(json.loads(text), SCHEMA) and not re.search(
        r"\s", re.sub(r'"(\\.|[^"\\])*"', "", text)
    ), text


@aio
async def test_json_object(client):
    """json_object: a JSON object, whole or cut by max_tokens (its strings are unbounded)."""
    out = await chat(client, response_format={"type": "json_object"}, temperature=0, max_tokens=48)
    text, reason = out.choices[0].message.content, out.choices[0].finish_reason
    assert text.lstrip().startswith("{") and reason in ("stop", "length"), text
    if reason == "stop":
        assert isinstance(json.loads(text), dict)


@aio
async def test_regex(client):
    """The whole output matches the regex (completions and chat, both spellings), streamed or
    not: with a seed, the same text."""
    pattern = r"(sunny|rainy) [0-9]{1,2}(\.[0-9])? ?C"
    body = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=24,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    completion = await client.completions.create(n=4, **body)
    answer = await chat(client, temperature=0, max_tokens=24, extra_body={"guided_regex": pattern})
    texts = [c.text for c in completion.choices] + [answer.choices[0].message.content]
    assert all(re.fullmatch(pattern, t) for t in texts), texts
    assert {c.finish_reason for c in completion.choices} | {answer.choices[0].finish_reason} == {
        "stop"
    }
    stream = await client.completions.create(stream=True, **body)
    assert (
        "".join([c.choices[0].text async for c in stream])
        == (await client.completions.create(**body)).choices[0].text
    )


TREE = """
# a sum tree two deep: a digit, or two digits or sums added in parentheses
root ::= tree
tree ::= [0-9] | "(" leaf "+" leaf ")"
leaf ::= [0-9] | "(" [0-9] "+" [0-9] ")"
"""
TREE_LARK = """
// the same trees in Lark's syntax (vLLM takes it beside GBNF)
start: tree
tree: /[0-9]/ | "(" leaf "+" leaf ")"
leaf: /[0-9]/ | "(" /[0-9]/ "+" /[0-9]/ ")"
"""


def tree_depth(text: str) -> int:
    """The nesting of a sum tree (0 for a digit), read by hand; ValueError if it is not one."""

    def tree(i: int) -> tuple[int, int]:
        if i < len(text) and text[i].isdigit():
            return 0, i + 1
        if not text.startswith("(", i):
            raise ValueError(f"{text!r} at {i}")
        left, i = tree(i + 1)
        if not text.startswith("+", i):
            raise ValueError(f"{text!r} at {i}")
        right, i = tree(i + 1)
        if not text.startswith(")", i):
            raise ValueError(f"{text!r} at {i}")
        return 1 + max(left, right), i + 1

    depth, end = tree(0)
    if end != len(text):
        raise ValueError(f"{text!r} goes on at {end}")
    return depth


@aio
async def test_grammar(client, tiny_model_dir):
    """A GBNF grammar (structured_outputs.grammar, guided_grammar) and the same in Lark's
    syntax: every output is a sum tree, read by a parser written here, nested at most 2 deep
    (as the grammar says: llguidance bounds no recursion, so a random model would nest on to
    max_tokens), and it ends where the tree does (nothing may follow it: the EOS)."""
    (paren,) = load_tokenizer(tiny_model_dir).encode("(")  # favoured, so that sums come
    body = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=120,
        temperature=1.0,
        seed=5,
        logit_bias={str(paren): 100},
        extra_body={"structured_outputs": {"grammar": TREE}},
    )
    completion = await client.completions.create(n=4, **body)
    lark = await client.completions.create(
        n=2, **body | {"extra_body": {"structured_outputs": {"grammar": TREE_LARK}}}
    )
    answer = await chat(
        client,
        temperature=0,
        max_tokens=120,
        logit_bias={str(paren): 100},
        extra_body={"guided_grammar": TREE},
    )
    outputs = [(c.text, c.finish_reason) for c in completion.choices + lark.choices]
    outputs.append((answer.choices[0].message.content, answer.choices[0].finish_reason))
    assert {finish for _, finish in outputs} == {"stop"}, outputs
    assert all(tree_depth(text) <= 2 for text, _ in outputs), outputs
    assert any(tree_depth(text) > 0 for text, _ in outputs), outputs  # not only single digits


# A structural tag whose trigger is a blank: every blank must open " <integer>;". Random text is
# full of blanks (most tokens start with one), so the constraint shows in every output.
SPACED = {
    "structures": [{"begin": " ", "schema": {"type": "integer"}, "end": ";"}],
    "triggers": [" "],
}
INTEGER = "-?(?:0|[1-9][0-9]*)"
SPACED_TEXT = re.compile(f"[^ ]*(?: {INTEGER};[^ ]*)*")
SPACED_CUT = re.compile(f"[^ ]*(?: {INTEGER};[^ ]*)*(?: -?[0-9]*)?")  # cut by max_tokens inside one


@aio
async def test_structural_tag(client, tiny_model_dir):
    """structured_outputs.structural_tag (JSON text, completions) and response_format's
    structural_tag (chat): each blank opens a tagged integer, where the same request without
    the constraint writes bare blanks. The blank token is favoured, so that structures come."""
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=3, n=4)
    free = await client.completions.create(**body)
    assert not all(SPACED_CUT.fullmatch(c.text) for c in free.choices), [
        c.text for c in free.choices
    ]
    (blank,) = load_tokenizer(tiny_model_dir).encode(" ")
    body["logit_bias"] = {str(blank): 100}
    tagged = await client.completions.create(
        **body, extra_body={"structured_outputs": {"structural_tag": json.dumps(SPACED)}}
    )
    answer = await chat(
        client,
        temperature=1.0,
        seed=3,
        max_tokens=40,
        logit_bias={str(blank): 100},
        response_format={"type": "structural_tag", **SPACED},
    )
    outputs = [(c.text, c.finish_reason) for c in tagged.choices]
    outputs.append((answer.choices[0].message.content, answer.choices[0].finish_reason))
    for text, finish in outputs:
        assert (SPACED_TEXT if finish == "stop" else SPACED_CUT).fullmatch(text), outputs
    assert any(" " in text for text, _ in outputs), outputs  # a structure was written
    one = {
        "type": "tags_with_separator",
        "separator": ",",
        "at_least_one": True,
        "stop_after_first": True,
        "tags": [{"begin": "<a>", "content": {"type": "regex", "pattern": "[0-9]"}, "end": "</a>"}],
    }
    spec = json.dumps({"type": "structural_tag", "format": one})
    formatted = await client.completions.create(
        **body | {"logit_bias": None}, extra_body={"structured_outputs": {"structural_tag": spec}}
    )
    assert all(
        re.fullmatch("<a>[0-9]</a>", c.text) and c.finish_reason == "stop"
        for c in formatted.choices
    ), formatted


@aio
async def test_stream_gives_the_non_stream_text(client):
    """Seeded: the same JSON text, the same finish, whether streamed or not."""
    body = dict(
        temperature=1.0,
        seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
    )
    whole = (await chat(client, **body)).choices[0]
    chunks = await streamed(client, **body)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "stop"


def calls_of_stream(chunks: list[Any]) -> list[tuple[str, str]]:
    """A stream's tool calls as (name, arguments): each call's first delta has its id and
    name, the rest pieces of its arguments."""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for call in chunk.choices[0].delta.tool_calls or ():
            if call.id is not None:
                assert call.index not in calls and call.type == "function"
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments or ""
    return [(name, arguments) for name, arguments in calls.values()]


@aio
async def test_tool_choice_required(client):
    """No tool-call parser: the calls are the guided JSON array, each naming a given tool with
    arguments valid for its schema; content "", finish "tool_calls" (vLLM's). Streamed: the
    same calls, no content. parallel_tool_calls=false: one call."""
    body = dict(tools=TOOLS, tool_choice="required", temperature=1.0, seed=11)
    out = (await chat(client, **body)).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in out.message.tool_calls]
    assert out.finish_reason == "tool_calls" and out.message.content == "" and calls, out
    for (name, arguments), call in zip(calls, out.message.tool_calls, strict=True):
        assert valid(json.loads(arguments), SCHEMAS[name]) and call.id.startswith(
            "chatcmpl-tool-"
        ), calls
    chunks = await streamed(client, **body)
    assert calls_of_stream(chunks) == calls
    assert not any(c.choices[0].delta.content for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    for seed in range(2):
        one = (
            await chat(
                client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed
            )
        ).choices[0]
        assert len(one.message.tool_calls) == 1 and one.finish_reason == "tool_calls"


@aio
async def test_named_tool_choice(client):
    """The output is the function's arguments: one call of that function, valid for its
    schema; finish "stop" (vLLM's and OpenAI's for a named function). Streamed: the same."""
    body = dict(
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "set_alarm"}},
        temperature=1.0,
        seed=4,
    )
    out = (await chat(client, n=2, **body)).choices
    for choice in out:
        (call,) = choice.message.tool_calls
        assert call.function.name == "set_alarm" and valid(
            json.loads(call.function.arguments), SCHEMAS["set_alarm"]
        )
        assert choice.finish_reason == "stop" and choice.message.content == ""
    chunks = await streamed(client, **body)
    assert calls_of_stream(chunks) == [
        ("set_alarm", out[0].message.tool_calls[0].function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "stop"
    cut = (await chat(client, **body, max_tokens=2)).choices[0]
    assert cut.finish_reason == "length" and cut.message.tool_calls[0].function.name == "set_alarm"


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
BOTH = ("completions", "chat")


@aio
@pytest.mark.parametrize(
    "endpoints, extra, param, words",
    [
        (
            BOTH,
            {"structured_outputs": {"grammar": "root ::= 'a'"}},
            "structured_outputs.grammar",
            "not a GBNF grammar: Expected name at line 1",
        ),
        (
            BOTH,
            {"structured_outputs": {"grammar": "start: item\n%declare item"}},
            "structured_outputs.grammar",
            "declare statement not supported",
        ),
        (
            BOTH,
            {"structured_outputs": {"structural_tag": "{}"}},
            "structured_outputs.structural_tag",
            "triggers must be",
        ),
        (
            BOTH,
            {"structured_outputs": {"structural_tag": json.dumps({**SPACED, "triggers": ["<"]})}},
            "structured_outputs.structural_tag",
            "structures[0].begin ' ' starts with none of the triggers",
        ),
        (
            BOTH,
            {"structured_outputs": {"json": SCHEMA, "regex": "a+"}},
            "structured_outputs.regex",
            "one kind",
        ),
        (
            BOTH,
            {"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
            "json",
        ),
        (
            BOTH,
            {
                "structured_outputs": {
                    "json_object": True,
                    "disable_any_whitespace": True,
                    "whitespace_pattern": " ",
                }
            },
            "structured_outputs.whitespace_pattern",
            "send one",
        ),
        (
            BOTH,
            {"structured_outputs": {"json": "{not json"}},
            "structured_outputs.json",
            "not valid JSON",
        ),
        (
            BOTH,
            {"structured_outputs": {"choice": ["a"], "backend": "xgrammar"}},
            "structured_outputs.backend",
            "unknown",
        ),
        (BOTH, {"guided_grammar": 'root ::= "a" x'}, "guided_grammar", "Rule 'x' not found"),
        (
            BOTH,
            {"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"},
            "guided_decoding_backend",
            "not supported",
        ),
        (BOTH, {"guided_json": SCHEMA, "guided_regex": "a+"}, "guided_regex", "one kind"),
        (BOTH, {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "json constraint"),
        (
            BOTH,
            {"guided_json": SCHEMA, "structured_outputs": {"json": SCHEMA}},
            "guided_json",
            "not both",
        ),
        (
            BOTH,
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
            "response_format",
            "not both",
        ),
        (
            BOTH,
            {"response_format": {"type": "structural_tag", "format": {"type": "dispatch"}}},
            "response_format",
            "format.type 'dispatch' is not supported",
        ),
        (
            BOTH,
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format",
            "name is required",
        ),
        (
            BOTH,
            {"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}},
            "response_format",
            "schema is required",
        ),
        (BOTH, {"response_format": {"type": "yaml"}}, "response_format", "must be"),
        # the engine's checks, naming the field the request used
        (
            BOTH,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "w",
                        "schema": {
                            "type": "object",
                            "properties": {"x": {"type": "string", "format": "color"}},
                        },
                    },
                }
            },
            "response_format",
            "Unknown format: color",
        ),
        (
            BOTH,
            {"structured_outputs": {"regex": "(a"}},
            "structured_outputs.regex",
            "structured_outputs.regex",
        ),
        (BOTH, {"guided_json": SCHEMA, "min_tokens": 3}, "guided_json", "min_tokens"),
        (
            ("chat",),
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "does not match any",
        ),
        (
            ("chat",),
            {"tools": TOOLS, "tool_choice": "required", "response_format": SCHEMA_FORMAT},
            "tool_choice",
            "not both",
        ),
        (("chat",), {"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        (
            ("chat",),
            {"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
            "tools[0].function.strict",
            "strict=true",
        ),
        # a chat that thinks first: the grammar would constrain the reasoning
        (
            ("chat",),
            {"response_format": SCHEMA_FORMAT, "chat_template_kwargs": {"enable_thinking": True}},
            "response_format",
            "reasoning",
        ),
        (
            ("chat",),
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "chat_template_kwargs": {"enable_thinking": True},
            },
            "tool_choice",
            "reasoning",
        ),
    ],
)
async def test_refused(client, endpoints, extra, param, words):
    for endpoint in endpoints:
        with pytest.raises(openai.BadRequestError) as info:
            if endpoint == "chat":
                await chat(client, max_tokens=4, extra_body=extra)
            else:
                await client.completions.create(
                    model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=extra
                )
        error = info.value.response.json()["error"]
        assert error["param"] == param and words in error["message"], (endpoint, error)


# ---- choices (vLLM's structured_outputs.choice, guided_choice) ---------------------------------

CHOICE_PROMPT = "The quick brown fox jumps over the lazy dog."
CHOICES = ["positive", "negative", "The quick brown fox"]


@aio
class TestChoice:
    async def test_greedy_and_seeded_outputs_are_choices(self, server, client):
        """Both spellings, both endpoints; the model left alone says none of them. Each output
        ends at its choice with "stop": an EOS, the only token the rank allows there."""
        free = await client.completions.create(
            model="tiny", prompt=CHOICE_PROMPT, max_tokens=4, temperature=0
        )
        assert free.choices[0].text not in CHOICES
        spellings = ({"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}})
        for extra in spellings:
            for sampling in (dict(temperature=0), dict(temperature=1.0, seed=3, n=6)):
                out = await client.completions.create(
                    model="tiny", prompt=CHOICE_PROMPT, max_tokens=24, extra_body=extra, **sampling
                )
                texts = [c.text for c in out.choices]
                assert set(texts) <= set(CHOICES) and {c.finish_reason for c in out.choices} == {
                    "stop"
                }, out
                chat = await client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": CHOICE_PROMPT}],
                    max_tokens=24,
                    extra_body=extra,
                    **sampling,
                )
                assert {c.message.content for c in chat.choices} <= set(CHOICES), chat
                assert {c.finish_reason for c in chat.choices} == {"stop"}

    async def test_choices_that_extend_others(self, server, client):
        """ "1" is the start of "12": after it the rank offers the EOS ids too, and either ending
        comes; ignore_eos keeps neither going (the EOS is the choice's end)."""
        choices = ["1", "12"]
        for ignore_eos in (False, True):
            out = await client.completions.create(
                model="tiny",
                prompt=CHOICE_PROMPT,
                max_tokens=8,
                temperature=2.0,
                seed=0,
                n=16,
                extra_body={"guided_choice": choices, "ignore_eos": ignore_eos},
            )
            assert {c.text for c in out.choices} == set(choices), out
            assert {c.finish_reason for c in out.choices} == {"stop"}

    async def test_stream_logprobs_and_length(self, server, client):
        extra = {"structured_outputs": {"choice": CHOICES}}
        stream = await client.completions.create(
            model="tiny",
            prompt=CHOICE_PROMPT,
            max_tokens=24,
            temperature=1.0,
            seed=5,
            logprobs=2,
            stream=True,
            extra_body=extra,
        )
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].text for c in chunks)
        assert text in CHOICES and chunks[-1].choices[0].finish_reason == "stop"
        spelled = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert "".join(spelled[:-1]) == text and spelled[-1] in (
            "<|endoftext|>",
            "<|im_end|>",
        )  # then the EOS
        messages = [{"role": "user", "content": CHOICE_PROMPT}]
        stream = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body=extra,
        )
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) in CHOICES
        assert chunks[-1].choices[0].finish_reason == "stop"
        out = await client.completions.create(
            model="tiny",
            prompt=CHOICE_PROMPT,
            max_tokens=2,
            temperature=0,
            extra_body={"guided_choice": ["The quick brown fox"]},
        )
        assert (
            "The quick brown fox".startswith(out.choices[0].text)
            and out.choices[0].finish_reason == "length"
        )

    @pytest.mark.parametrize(
        "extra, param, words",
        [
            ({"guided_choice": []}, "guided_choice", "non-empty list"),
            (
                {"structured_outputs": {"choice": ["yes", 1]}},
                "structured_outputs.choice",
                "[1] must be a non-empty string",
            ),
            (
                {"structured_outputs": {"choice": ["yes"], "regex": "y+"}},
                "structured_outputs.choice",
                "one kind",
            ),
            ({"structured_outputs": {}}, "structured_outputs", "needs one constraint"),
            (
                {"structured_outputs": {"choice": ["yes"]}, "guided_choice": ["yes"]},
                "guided_choice",
                "not both",
            ),
            (
                {"guided_choice": ["yes"], "bad_words": ["no"]},
                "guided_choice",
                "combined with bad_words",
            ),
            ({"guided_choice": [str(i) for i in range(257)]}, "guided_choice", "at most 256"),
        ],
    )
    async def test_refused(self, client, extra, param, words):
        for create in (client.completions.create, client.chat.completions.create):
            prompt = (
                {"prompt": CHOICE_PROMPT}
                if create == client.completions.create
                else {"messages": [{"role": "user", "content": "hi"}]}
            )
            with pytest.raises(openai.BadRequestError) as info:
                await create(model="tiny", max_tokens=2, extra_body=extra, **prompt)
            error = info.value.response.json()["error"]
            assert error["param"] == param and words in error["message"], error
