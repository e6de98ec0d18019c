"""The demo checkpoint's chat template (tools/tokenizer_files.py `CHATML_TEMPLATE`): plain
conversations render as they always did (cached prompts and every test depend on it), and a
conversation with tools renders them and its tool-call history in the qwen3_coder format that
`--tool-call-parser qwen3_coder` reads back. No server: transformers renders the template with
the demo tokenizer's files, as the server does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltaserve.http.tool_parsers import parse_tool_calls
from deltaserve.tools.tokenizer_files import write_tokenizer_files

# The template before tools were rendered: plain conversations must still render to these bytes.
OLD_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
PLAIN_CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": "2+2?", "name": "ann"},
        {"role": "assistant", "content": "4", "reasoning": "easy", "reasoning_content": "easy"},
        {"role": "user", "content": "  émoji 😀\n\n<tool_call> as text </tool_call>\t"},
        {"role": "assistant", "content": ""},
    ],
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "ratio": {"type": "number"},
                "hourly": {"type": "boolean"},
                "hours": {"type": "array"},
                "where": {"type": "object"},
                "code": {"type": "string"},
                "note": {"type": "string"},
            },
        },
    },
}
# As the server hands a tool without description or parameters to the template (tool_protocol.py).
PING = {"type": "function", "function": {"name": "ping", "description": None, "parameters": None}}
TOOLS = [WEATHER, PING]
# Arguments as objects, as the server hands an assistant's calls to the template.
WEATHER_ARGS = {
    "city": "Zürich",
    "days": 2,
    "ratio": 0.5,
    "hourly": True,
    "hours": [6, 12],
    "where": {"lat": 47.4, "tags": ["a b", "c"]},
    "code": "42",
    "note": "line one\nline two",
}
CALLS = [("get_weather", WEATHER_ARGS), ("ping", {})]
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
            for i, (name, args) in enumerate(CALLS)
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "call_0"},
    {"role": "tool", "content": "pong", "tool_call_id": "call_1"},
    {"role": "user", "content": "Thanks."},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """The demo checkpoint's tokenizer (make_model writes these same files)."""
    from transformers import AutoTokenizer

    out: Path = tmp_path_factory.mktemp("demo_tokenizer")
    write_tokenizer_files(out)
    return AutoTokenizer.from_pretrained(out)


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **kwargs
    )


@pytest.mark.parametrize("conversation", PLAIN_CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, []])
def test_no_tools_renders_as_before(tokenizer, conversation, add_generation_prompt, tools):
    """Without tools or tool messages the prompt is the old template's, byte for byte."""
    kwargs = {"add_generation_prompt": add_generation_prompt, "tokenize": False}
    new = tokenizer.apply_chat_template(conversation, tools=tools, **kwargs)
    old = tokenizer.apply_chat_template(conversation, chat_template=OLD_TEMPLATE, **kwargs)
    assert new == old


def test_tool_call_history_reads_back_with_qwen3_coder(tokenizer):
    """The assistant's calls, rendered, parse back (qwen3_coder) to the same names and
    arguments: string values as they are, the others as JSON, typed by the tools' schemas."""
    text = render(tokenizer, TOOL_CONVERSATION, tools=TOOLS)
    start = text.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    segment = text[start : text.index("<|im_end|>", start)]
    parsed = parse_tool_calls("qwen3_coder", segment, TOOLS)
    assert parsed.content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == CALLS
    assert "<parameter=code>\n42\n</parameter>" in segment  # a string as it is, not JSON
    assert "<parameter=hourly>\ntrue\n</parameter>" in segment
    # <tool_call> is one added token, as the model writes it
    ids = tokenizer.encode(segment, add_special_tokens=False)
    assert ids.count(tokenizer.convert_tokens_to_ids("<tool_call>")) == len(CALLS)


def test_tools_in_the_system_turn_and_tool_results_as_one_user_turn(tokenizer):
    """The tools' JSON, one per line, in a system turn that keeps the first system message's
    text; consecutive tool messages are one user turn of <tool_response> blocks."""
    text = render(tokenizer, TOOL_CONVERSATION, tools=TOOLS)
    system = text[: text.index("<|im_end|>\n") + len("<|im_end|>\n")]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n")
    lines = system.splitlines()
    for tool in TOOLS:
        assert json.dumps(tool, ensure_ascii=False) in lines
    assert "<function=NAME>" in system  # the format the parser reads
    assert text.count("Be brief.") == 1 and text.count("<|im_start|>system") == 1
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\npong\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nThanks.<|im_end|>\n<|im_start|>assistant\n"
    )
    # No system message: the tools' system turn comes first, alone.
    bare = render(tokenizer, TOOL_CONVERSATION[1:2], tools=TOOLS)
    assert bare.startswith("<|im_start|>system\n# Tools\n")
    assert bare.endswith(
        "<|im_end|>\n<|im_start|>user\nWeather in Zürich?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_demo_folder_changes_with_the_template(monkeypatch):
    """A demo made with an earlier template is not reused (its tokenizer_config.json holds the
    template it was made with): the folder's name follows the template."""
    from deltaserve.tools import demo_model, tokenizer_files

    before = demo_model.demo_name()
    monkeypatch.setattr(tokenizer_files, "CHATML_TEMPLATE", tokenizer_files.CHATML_TEMPLATE + " ")
    assert demo_model.demo_name() != before
