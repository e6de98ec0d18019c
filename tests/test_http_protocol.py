"""Request parsing for the OpenAI endpoints (http/protocol.py): what is honoured, what is
refused with a 400 naming the field. Pure: no server, no engine."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from router_structs import (
    SGLANG_ROUTER_CHAT,
    SGLANG_ROUTER_COMPLETION,
    VLLM_ROUTER_CHAT,
    VLLM_ROUTER_COMPLETION,
)

from deltaserve.http.errors import ApiError
from deltaserve.http.protocol import parse_chat_request, parse_completion_request
from deltaserve.http.responses import TokenStrings, clamp_logprob

REPO = Path(__file__).resolve().parents[1]


def refused(parse, body, param: str | None = None, words: str = "") -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    err = info.value
    assert err.status == 400, err.message
    if param is not None:
        assert err.param == param, (err.param, err.message)
    assert words.lower() in err.message.lower(), err.message
    return err


class TestCompletionPrompt:
    def test_forms(self):
        assert parse_completion_request({"prompt": "hi"}).prompts == ("hi",)
        assert parse_completion_request({"prompt": [1, 2, 3]}).prompts == ((1, 2, 3),)
        many = parse_completion_request({"prompt": ["a", [5, 6], "b"]}).prompts
        assert many == ("a", (5, 6), "b")
        assert parse_completion_request({"prompt": [[7], [8, 9]]}).prompts == ((7,), (8, 9))

    @pytest.mark.parametrize(
        "prompt, words",
        [
            (None, "required"),
            ("", "empty"),
            ([], "non-empty"),
            ([[]], "empty list"),
            ([1, -2], "prompt[1]"),
            ([1, True], "prompt[1]"),
            (["a", 3.5], "prompt[1]"),
            ({"text": "x"}, "prompt must be"),
        ],
    )
    def test_bad_prompts(self, prompt, words):
        refused(parse_completion_request, {"prompt": prompt}, "prompt", words)


class TestCompletionFields:
    def test_defaults(self):
        r = parse_completion_request({"model": "m", "prompt": "x"})
        s = r.sampling
        assert (r.model, r.stream, r.include_usage) == ("m", False, False)
        assert (s.max_tokens, s.temperature, s.n, s.logprobs, s.stop) == (16, 1.0, 1, None, ())

    def test_everything_honoured(self):
        r = parse_completion_request(
            {
                "prompt": "x",
                "max_tokens": 5,
                "temperature": 0,
                "top_p": 0.5,
                "n": 2,
                "seed": 7,
                "stop": "\n",
                "logprobs": 3,
                "presence_penalty": 0.1,
                "frequency_penalty": -0.2,
                "top_k": 4,
                "min_p": 0.05,
                "repetition_penalty": 1.1,
                "ignore_eos": True,
                "stop_token_ids": [9],
                "stream": True,
                "stream_options": {"include_usage": True},
                "user": "u",
                "echo": False,
                "best_of": 1,
                "logit_bias": {},
                "suffix": None,
            }
        )
        s = r.sampling
        assert (r.stream, r.include_usage) == (True, True)
        assert (s.max_tokens, s.temperature, s.top_p, s.n, s.seed) == (5, 0.0, 0.5, 2, 7)
        assert (s.stop, s.logprobs, s.top_k, s.min_p) == (("\n",), 3, 4, 0.05)
        assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.1, -0.2, 1.1)
        assert (s.ignore_eos, s.stop_token_ids) == (True, (9,))
        assert s.stop == ("\n",) and s.n == 2 and s.logprobs == 3 and s.temperature == 0.0

    @pytest.mark.parametrize(
        "extra, param, words",
        [
            ({"best_of": 3}, "best_of", "best_of"),
            ({"logit_bias": {"x5": 1}}, "logit_bias", "not a token id"),
            ({"logit_bias": {"-5": 1}}, "logit_bias", "not a token id"),
            ({"logit_bias": {"1" * 5000: 1}}, "logit_bias", "not a token id"),  # int() would raise
            ({"logit_bias": [[5, 1]]}, "logit_bias", "object"),
            ({"logit_bias": {"5": "1"}}, "logit_bias", "number"),
            ({"logit_bias": {"5": True}}, "logit_bias", "number"),
            ({"min_tokens": 1.5}, "min_tokens", "integer"),
            ({"include_stop_str_in_output": 1}, "include_stop_str_in_output", "boolean"),
            ({"skip_special_tokens": "no"}, "skip_special_tokens", "boolean"),
            ({"spaces_between_special_tokens": "true"}, "spaces_between_special_tokens", "boolean"),
            ({"suffix": "tail"}, "suffix", "suffix"),
            ({"frobnicate": 1}, "frobnicate", "unknown"),
            ({"messages": []}, "messages", "unknown"),
            ({"logprobs": True}, "logprobs", "integer"),
            ({"max_tokens": "5"}, "max_tokens", "integer"),
            ({"max_tokens": 2.5}, "max_tokens", "integer"),
            ({"temperature": "hot"}, "temperature", "number"),
            ({"stream": "yes"}, "stream", "boolean"),
            ({"stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
            (
                {"stream": True, "stream_options": {"continuous_usage_stats": "no"}},
                "stream_options.continuous_usage_stats",
                "boolean",
            ),
            (
                {"stream": True, "stream_options": {"usage": True}},
                "stream_options.usage",
                "include_usage",
            ),
            ({"stop": ["a", 3]}, "stop", "stop[1]"),
            ({"stop": [""]}, "stop", "empty"),
            ({"stop_token_ids": [1, "x"]}, "stop_token_ids", "stop_token_ids[1]"),
            ({"model": 3}, "model", "string"),
        ],
    )
    def test_refusals_name_the_field(self, extra, param, words):
        refused(parse_completion_request, {"prompt": "x", **extra}, param, words)

    def test_vllm_sampling_extras_honoured(self):
        """min_tokens, logit_bias (ids as strings, biases clamped to [-100, 100] as vLLM
        clamps them), include_stop_str_in_output, skip_special_tokens and
        spaces_between_special_tokens (no effect with a fast tokenizer) reach SamplingParams;
        on both endpoints. Their ranges are SamplingParams' checks, refused naming the field."""
        extras = {
            "min_tokens": 3,
            "logit_bias": {"7": 2.5, "0012": -300, "5": 10**400},
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
        }
        bodies = ((parse_completion_request, {"prompt": "x"}), (parse_chat_request, CHAT_BODY))
        for parse, body in bodies:
            p = parse({**body, **extras, "max_tokens": 5}).sampling
            assert (p.min_tokens, p.logit_bias) == (3, ((5, 100.0), (7, 2.5), (12, -100.0)))
            assert (p.include_stop_str_in_output, p.skip_special_tokens) == (True, False)
            assert parse({**body, "spaces_between_special_tokens": True}) == parse(body)
        err = refused(  # as vLLM: min_tokens past max_tokens is refused
            parse_completion_request,
            {"prompt": "x", "min_tokens": 6, "max_tokens": 5},
            "min_tokens",
        )
        assert re.match(r"^min_tokens must be .* \[0, max_tokens=5\]", err.message), err.message
        err = refused(
            parse_completion_request,
            {"prompt": "x", "logit_bias": {"12": 1, "012": 2}},
            "logit_bias",
        )
        assert err.message.startswith("logit_bias has token id 12 twice"), err.message

    def test_no_op_values_vllm_accepts(self):
        """continuous_usage_stats=false is the default (usage only at the end); any int64
        seed is taken (its range is SamplingParams' check)."""
        r = parse_completion_request(
            {
                "prompt": "x",
                "stream": True,
                "seed": -(2**63),
                "stream_options": {"continuous_usage_stats": False},
            }
        )
        assert (r.stream, r.include_usage) == (True, False)
        assert r.sampling.seed == -(2**63)
        err = refused(parse_completion_request, {"prompt": "x", "seed": -(2**63) - 1}, "seed")
        assert err.message.startswith("seed must"), err.message

    def test_body_must_be_object(self):
        refused(parse_completion_request, ["prompt"], None, "JSON object")

    def test_engine_ranges_name_the_field(self):
        """Ranges are the engine's SamplingParams' job; its ParamError names the field, and
        so does the 400 (in a chat, the field the chat sent: top_logprobs for logprobs). The
        engine's own limits (max_logprobs) are checked at submission: tests/test_bad_input.py."""
        err = refused(parse_completion_request, {"prompt": "x", "temperature": -1}, "temperature")
        assert err.message.startswith("temperature"), err.message
        err = refused(parse_completion_request, {"prompt": "x", "n": 0}, "n")
        assert err.message.startswith("n must"), err.message
        err = refused(parse_chat_request, {**CHAT_BODY, "max_completion_tokens": 0})
        assert err.param == "max_completion_tokens", err.message
        assert err.message.startswith("max_completion_tokens must be an integer >= 1"), err


class TestChat:
    def test_messages_and_parts(self):
        r = parse_chat_request(
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    },
                    {"role": "assistant", "content": "ok", "tool_calls": None},
                ],
                "max_completion_tokens": 9,
                "logprobs": True,
                "top_logprobs": 2,
            }
        )
        assert r.messages == (
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "a\nb"},
            {"role": "assistant", "content": "ok"},
        )
        assert (r.sampling.max_tokens, r.logprobs, r.sampling.logprobs) == (9, True, 2)

    @pytest.mark.parametrize(
        "extra",
        [{"tool_choice": "none"}, {"tool_choice": "none", "tools": None}, {"tool_choice": None}],
    )
    def test_tool_choice_without_tools_is_a_no_op(self, extra):
        """No tools: "none" (or null) calls none, as vLLM takes them ("auto" without tools and
        `tools: []` are refused, as vLLM's: tests/test_http_tools.py)."""
        r = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **extra})
        assert r.messages == ({"role": "user", "content": "hi"},)

    def test_developer_is_system(self):
        """OpenAI's developer role is the system message for the template (as vLLM's)."""
        dev = parse_chat_request(
            {
                "messages": [
                    {"role": "developer", "content": "be brief"},
                    {"role": "user", "content": "hi"},
                ]
            }
        )
        assert dev.messages == (
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
        )

    def test_max_tokens_default_and_logprobs_off(self):
        r = parse_chat_request({"messages": [{"role": "user", "content": "hi"}]})
        assert r.sampling.max_tokens is None  # resolved to the context left by the server
        assert (r.logprobs, r.sampling.logprobs) == (False, None)
        r = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "logprobs": True})
        assert r.sampling.logprobs == 0

    @pytest.mark.parametrize(
        "extra, param, words",
        [
            ({"tools": [{"type": "function"}]}, "tools", "tool"),
            ({"tool_choice": "required"}, "tool_choice", "tool"),
            (
                {"tool_choice": {"type": "function", "function": {"name": "f"}}},
                "tool_choice",
                "tool",
            ),
            ({"tool_choice": "auto", "tools": [{"type": "function"}]}, "tools", "tool"),
            ({"tool_choice": "none", "tools": [{"type": "function"}]}, "tools", "tool"),
            ({"tool_choice": 3}, "tool_choice", "tool"),
            (
                {"response_format": {"type": "json_schema", "json_schema": {}}},
                "response_format",
                "name",
            ),
            ({"logit_bias": {"1": float("nan")}}, "logit_bias", "finite"),
            ({"top_logprobs": 3}, "top_logprobs", "logprobs=true"),
            ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", "disagree"),
            ({"prompt": "x"}, "prompt", "unknown"),
            ({"echo": True}, "echo", "unknown"),
            ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "object"),
        ],
    )
    def test_refusals(self, extra, param, words):
        body = {"messages": [{"role": "user", "content": "hi"}], **extra}
        refused(parse_chat_request, body, param, words)

    @pytest.mark.parametrize(
        "messages, param, words",
        [
            ([], "messages", "non-empty"),
            ("hi", "messages", "non-empty"),
            ([{"role": "function", "content": "x"}], "messages", "messages[0].role"),
            ([{"role": "user"}], "messages", "messages[0].content"),
            (
                [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                "messages",
                "messages[0].content[0].image_url.url is required",
            ),
            (
                [{"role": "user", "content": [{"type": "video_url", "video_url": ""}]}],
                "messages",
                "messages[0].content[0].video_url must be a string of length >= 1",
            ),
            (
                [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
                "messages[0].content[0].type",
                "image_url",
            ),
            (
                [{"role": "user", "content": "x", "name": 5}],
                "messages",
                "messages[0].name must be a string",
            ),
            (
                [{"role": "user", "content": "x", "audio": {"id": "a"}}],
                "messages[0].audio",
                "role, content and name",
            ),
            ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages", "text must"),
        ],
    )
    def test_bad_messages(self, messages, param, words):
        refused(parse_chat_request, {"messages": messages}, param, words)


# vLLM's extra request fields and their defaults: what this server does anyway
# (use_beam_search and length_penalty are taken at any value: tests/test_http_beam_search.py).
COMPLETION_DEFAULTS = {"add_special_tokens": True}
CHAT_DEFAULTS = {"add_special_tokens": False}
# A value other than the default, of the right type and of a wrong one.
OTHER = {"add_special_tokens": [None]}
CHAT_BODY = {"messages": [{"role": "user", "content": "hi"}]}


class TestVllmExtras:
    """vLLM's extra fields, as clients send them: at their default (what we do anyway)
    accepted, at any other value refused naming the field (we would not honour it)."""

    @pytest.mark.parametrize(
        "parse, body, defaults",
        [
            (parse_completion_request, {"prompt": "x"}, COMPLETION_DEFAULTS),
            (parse_chat_request, CHAT_BODY, CHAT_DEFAULTS),
        ],
    )
    def test_defaults_accepted(self, parse, body, defaults):
        assert parse({**body, **defaults}) == parse(body)
        for name, value in defaults.items():
            assert parse({**body, name: value}) == parse(body), name
            assert parse({**body, name: None}) == parse(body), name

    @pytest.mark.parametrize(
        "parse, body, defaults",
        [
            (parse_completion_request, {"prompt": "x"}, COMPLETION_DEFAULTS),
            (parse_chat_request, CHAT_BODY, CHAT_DEFAULTS),
        ],
    )
    def test_other_values_refused(self, parse, body, defaults):
        for name in defaults:
            others = [v for v in OTHER[name] if v is not None] or [not defaults[name]]
            for value in others:
                refused(parse, {**body, name: value}, name, "default")

    def test_add_special_tokens_defaults_differ(self):
        """vLLM adds special tokens to a completion's prompt, not to a rendered chat."""
        refused(
            parse_completion_request,
            {"prompt": "x", "add_special_tokens": False},
            "add_special_tokens",
            "default",
        )
        refused(
            parse_chat_request,
            {**CHAT_BODY, "add_special_tokens": True},
            "add_special_tokens",
            "default",
        )


def test_continue_final_message_fields():
    """vLLM's template flags on chat: taken (the route renders with them), checked as booleans,
    not both true."""
    r = parse_chat_request(
        {**CHAT_BODY, "add_generation_prompt": False, "continue_final_message": True}
    )
    assert (r.add_generation_prompt, r.continue_final_message) == (False, True)
    assert (
        parse_chat_request(CHAT_BODY).add_generation_prompt,
        parse_chat_request(CHAT_BODY).continue_final_message,
    ) == (True, False)
    refused(
        parse_chat_request,
        {**CHAT_BODY, "continue_final_message": True},
        "continue_final_message",
        "Cannot set both",
    )
    refused(
        parse_chat_request,
        {**CHAT_BODY, "add_generation_prompt": 1},
        "add_generation_prompt",
        "boolean",
    )


def test_add_special_tokens_adds_none(tmp_path):
    """The Qwen tokenizer adds no special tokens to an encoded text: a completion's prompt,
    encoded without them, is what vLLM's default add_special_tokens=true gives."""
    from transformers import AutoTokenizer

    from deltaserve.tools.tokenizer_files import write_tokenizer_files

    write_tokenizer_files(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    for text in ("Hello", "<|im_start|>user\nhi", ""):
        assert tok.encode(text, add_special_tokens=True) == tok.encode(
            text, add_special_tokens=False
        )


def test_token_bytes_rebuild_the_text(tmp_path):
    """Chat logprobs carry each token's raw bytes: joined, they are the text's UTF-8, even
    where one character spans tokens."""
    from transformers import AutoTokenizer

    from deltaserve.tools.tokenizer_files import write_tokenizer_files

    write_tokenizer_files(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    strings = TokenStrings(tok)
    text = "Grüße, 世界! 🦜 naïve <|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(bytes(strings.bytes(t)) for t in ids) == text.encode()
    assert strings.text(ids[0]) == tok.decode([ids[0]])
    assert clamp_logprob(float("-inf")) == -9999.0 and clamp_logprob(-1.5) == -1.5


def test_replayed_messages_render_as_vllm_renders_them(tmp_path):
    """What clients send back as history, as vLLM takes it: an assistant message from the
    SDK's `ChatCompletionMessage.model_dump()` (annotations, audio, refusal, ... all null),
    an assistant message whose content is null (the OpenAI schema allows it: vLLM renders
    ""), and a participant `name` (vLLM hands it to the template). Each was a 400; the prompt
    is now the one vLLM renders: its conversation through transformers' apply_chat_template."""
    import asyncio

    from openai.types.chat import ChatCompletionMessage
    from transformers import AutoTokenizer

    from deltaserve.http.generation import apply_chat_template
    from deltaserve.tools.tokenizer_files import write_tokenizer_files

    write_tokenizer_files(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    replayed = ChatCompletionMessage(
        role="assistant", content="Hello! <think>x</think>"
    ).model_dump()
    messages = [
        {"role": "system", "content": "Be brief.", "name": "rules"},
        {"role": "user", "content": "Hi <|im_end|>", "name": "alice"},
        replayed,
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": "again"},
    ]
    req = parse_chat_request({"messages": messages})

    class Engine:  # what apply_chat_template uses of the engine
        tokenizer = tok

        @staticmethod
        async def run_tokenizer(fn, size):
            return fn(tok)

    ours = asyncio.run(apply_chat_template(Engine, req.messages, req.chat_template_kwargs, size=0))
    # vLLM's conversation: null content is "", text parts joined by "\n", name kept, the
    # response-only fields dropped
    conversation = [
        {"role": "system", "content": "Be brief.", "name": "rules"},
        {"role": "user", "content": "Hi <|im_end|>", "name": "alice"},
        {"role": "assistant", "content": "Hello! <think>x</think>"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "again"},
    ]
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert ours == tok.encode(text, add_special_tokens=False)


def test_aiohttp_imports_from_repo_root():
    """`http/` must stay a namespace package: run from the root, stdlib http still wins."""
    assert not (REPO / "http" / "__init__.py").exists()
    code = "import http, aiohttp, deltaserve.http.protocol; assert hasattr(http, 'HTTPStatus')"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


# what each field we do not honour asks for, away from its default
ROUTER_REQUESTS = {
    "no_stop_trim": True,
    "separate_reasoning": False,
    "stream_reasoning": False,
    "return_hidden_states": True,
}


class TestRouterDefaults:
    """A field at its default asks for nothing: the routers' full structs parse as the plain
    request; a value that asks for what we would not do is refused, naming the field."""

    @pytest.mark.parametrize(
        "parse, routed, plain",
        [
            (
                parse_chat_request,
                SGLANG_ROUTER_CHAT,
                {"model": "m", "messages": CHAT_BODY["messages"], "max_completion_tokens": 8},
            ),
            (
                parse_chat_request,
                VLLM_ROUTER_CHAT,
                {"model": "m", "messages": CHAT_BODY["messages"], "max_completion_tokens": 8},
            ),
            (parse_completion_request, SGLANG_ROUTER_COMPLETION, {"model": "m", "prompt": "x"}),
            (parse_completion_request, VLLM_ROUTER_COMPLETION, {"model": "m", "prompt": "x"}),
        ],
    )
    def test_forwarded_defaults_are_the_plain_request(self, parse, routed, plain):
        assert parse(routed) == parse({**plain, "max_tokens": 8} if "prompt" in plain else plain)

    @pytest.mark.parametrize("routed", [VLLM_ROUTER_CHAT, VLLM_ROUTER_COMPLETION])
    def test_other_values_refused(self, routed):
        parse = parse_chat_request if "messages" in routed else parse_completion_request
        for name, value in ROUTER_REQUESTS.items():
            if name in routed:
                refused(parse, {**routed, name: value}, name, name)
        if "prompt" in routed:  # a completion has no reasoning to leave out
            refused(parse, {**routed, "include_reasoning": False}, "include_reasoning")

    def test_unknown_fields_null_only(self):
        assert parse_chat_request({**VLLM_ROUTER_CHAT, "lora_path": None}) == parse_chat_request(
            VLLM_ROUTER_CHAT
        )
        refused(parse_chat_request, {**VLLM_ROUTER_CHAT, "lora_path": "a"}, "lora_path")
        refused(
            parse_chat_request,
            {**VLLM_ROUTER_CHAT, "messages": [{"role": "user", "content": "x", "extra": 1}]},
            "messages[0].extra",
            "carries only role, content and name",
        )


def test_each_default_only_field_allows_values_of_its_type():
    """`only(default, why=...)`: a reason passed where a value goes would be allowed as a
    value (a suffix of that text taken); every allowed value must be of the field's type."""
    import msgspec
    import msgspec.inspect as mi

    from deltaserve.http import protocol
    from deltaserve.http.dialects import (
        anthropic_request,
        responses_request,
        rl_routes,
        sglang_request,
        tokenize_routes,
    )

    modules = (protocol, anthropic_request, responses_request, rl_routes, sglang_request)
    structs = {
        value
        for module in (*modules, tokenize_routes)
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, msgspec.Struct)
    }
    checked = 0
    for struct in structs:
        for field in msgspec.structs.fields(struct):
            info = mi.type_info(field.type)
            if isinstance(info, mi.Metadata) and "only" in (info.extra or {}):
                for allowed in info.extra["only"]:
                    msgspec.convert(allowed, field.type)  # raises if not of the field's type
                    checked += 1
    assert checked >= 20
