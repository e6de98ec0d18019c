"""Structural tags as llguidance grammars (engine/guided/structural_tag.py): free text holds no
excluded string and no trigger (checked against a brute-force search on random words and
texts), each trigger opens a structure whose JSON follows its schema, llguidance's matcher
is the judge (tests/guide_helpers.py), and a bad spec is an error naming the field."""

from __future__ import annotations

import json
import random
import re

import pytest
from guide_helpers import accepts, assert_language, prefix_ok

from deltaserve.engine.guided.grammar import WHITESPACE
from deltaserve.engine.guided.structural_tag import StructuralTagError, structural_tag_grammar


def structural_tag_regex(spec: object) -> str:
    """The grammar of a structural tag with the default blanks between JSON tokens."""
    return structural_tag_grammar(spec, WHITESPACE)


WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
}
TOOLS = {
    "structures": [
        {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
        {
            "begin": "<function=now>",
            "schema": {"type": "object", "properties": {}},
            "end": "</function>",
        },
        {"begin": "<tool_call>", "end": "</tool_call>"},  # no schema: any JSON value
    ],
    "triggers": ["<function=", "<tool_call>"],
}


def test_free_text_holds_no_excluded_word():
    """Random words over a small alphabet, overlapping ones too: any_text takes a text exactly
    when no word occurs in it."""
    rng = random.Random(0)
    for _ in range(60):
        words = sorted(
            {"".join(rng.choices("ab<", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))}
        )
        grammar = structural_tag_regex(
            {"type": "structural_tag", "format": {"type": "any_text", "excludes": words}}
        )
        for _ in range(40):
            text = "".join(rng.choices("ab<\nx", k=rng.randint(0, 10)))
            assert accepts(grammar, text) == (not any(w in text for w in words)), (words, text)


@pytest.mark.parametrize(
    "spec, yes, no",
    [
        (
            TOOLS,
            [
                "",
                "Sunny.\n",
                'Let me look. <function=get_weather>{"city": "Oslo"}</function> Done',
                '<function=now>{}</function><tool_call>[1, "a"]</tool_call>',
                "a < b, <function",
            ],
            [
                "<function=get_weather>",
                '<function=get_weather>{"city": "Rome"}</function>',
                "<function=later>{}</function>",
                "<tool_call>x</tool_call>",
                "<function=now>{}</function",
            ],
        ),
        # at_least_one (xgrammar's): a tag first, no free text before it
        (
            {**TOOLS, "at_least_one": True},
            ["<function=now>{}</function> then text"],
            ["", "Sunny.", "x <function=now>{}</function>"],
        ),
    ],
)
def test_structures_and_free_text(spec, yes, no):
    assert_language(structural_tag_regex(spec), yes, no)


def test_a_trigger_commits_to_a_structure():
    """What the rank's mask sees: after a trigger only a structure's way on stays open."""
    grammar = structural_tag_regex(TOOLS)
    assert prefix_ok(grammar, 'ok <function=get_weather>{"city": "Pa')
    assert prefix_ok(grammar, "ok <function=get_")
    assert not prefix_ok(grammar, "ok <function=x")
    assert prefix_ok(grammar, "ok <tool_call>{")


@pytest.mark.parametrize(
    "spec, words",
    [
        ([], "a structural tag is an object"),
        ({"structures": [], "triggers": ["<"]}, "structures must be a non-empty list"),
        ({"structures": TOOLS["structures"], "triggers": []}, "triggers must be"),
        ({"structures": TOOLS["structures"], "triggers": ["<function=", ""]}, "triggers must be"),
        ({**TOOLS, "at_least_one": 1}, "at_least_one and stop_after_first must be booleans"),
        (
            {**TOOLS, "stop_after_first": True},
            "the structural tag: unknown field 'stop_after_first'",
        ),
        (
            {"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<g"]},
            "structures[0].begin '<f>' starts with none",
        ),
        (
            {"structures": [{"begin": "<f>", "end": 3}], "triggers": ["<f"]},
            "structures[0] must be an object with string",
        ),
        (
            {"structures": [{"begin": "<f>", "end": "", "args": {}}], "triggers": ["<f"]},
            "structures[0]: unknown field 'args'",
        ),
        (
            {
                "structures": [{"begin": "<f>", "end": "", "schema": {"type": "nope"}}],
                "triggers": ["<f"],
            },
            "structures[0].schema:",
        ),
    ],
)
def test_errors_name_the_field(spec, words):
    with pytest.raises(StructuralTagError, match=re.escape(words)):
        structural_tag_regex(spec)


def test_sampling_params_take_json_text_or_a_dict():
    from deltaserve.engine.sampling_params import SamplingParams

    as_text = SamplingParams(max_tokens=8, guided_structural_tag=json.dumps(TOOLS))
    as_dict = SamplingParams(max_tokens=8, guided_structural_tag=TOOLS)
    assert as_text.constraint() == as_dict.constraint()
    assert as_text.constraint().kind == "structural_tag"
    with pytest.raises(ValueError, match="one structured-output constraint"):
        SamplingParams(max_tokens=8, guided_structural_tag=TOOLS, guided_regex="a")


THINK = {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}
CALL = {
    "type": "triggered_tags",
    "triggers": ["<function="],
    "stop_after_first": True,
    "tags": [
        {
            "begin": "<function=now>",
            "content": {"type": "json_schema", "json_schema": {"type": "object"}},
            "end": "</function>",
        }
    ],
}
AB = [
    {
        "type": "tag",
        "begin": f"<{x}>",
        "content": {"type": "const_string", "value": v},
        "end": f"</{x}>",
    }
    for x, v in (("a", "1"), ("b", "2"))
]


@pytest.mark.parametrize(
    "fmt, yes, no",
    [
        (
            THINK,
            ["<think>a\nb</think>", "<think></think>"],
            ["<think>a</think>b</think>", "<think>a", "x<think></think>"],
        ),
        (
            {
                "type": "sequence",
                "elements": [THINK, CALL],
            },  # reasoning, then text and at most one call, then nothing
            ["<think>hm</think>ok <function=now>{}</function>", "<think></think>plain"],
            [
                "<think>hm</think>ok <function=now>{}</function> more",
                "<think>hm</think><function=later>{}</function>",
            ],
        ),
        (
            {"type": "tags_with_separator", "tags": AB, "separator": ","},
            ["", "<a>1</a>", "<b>2</b>,<a>1</a>,<a>1</a>"],
            ["<a>1</a><b>2</b>", "<a>2</a>", " <a>1</a>"],
        ),
        (
            {
                "type": "tags_with_separator",
                "tags": AB,
                "separator": ",",
                "at_least_one": True,
                "stop_after_first": True,
            },
            ["<a>1</a>", "<b>2</b>"],
            ["", "<a>1</a>,<b>2</b>"],
        ),
        (
            {
                "type": "sequence",
                "elements": [
                    {
                        "type": "repeat",
                        "min": 1,
                        "max": 2,
                        "content": {"type": "regex", "pattern": "[0-9]"},
                    },
                    {"type": "optional", "content": {"type": "const_string", "value": "!"}},
                    {
                        "type": "or",
                        "elements": [
                            {"type": "const_string", "value": "a"},
                            {"type": "grammar", "grammar": 'root ::= "b"+'},
                        ],
                    },
                    {"type": "star", "content": {"type": "const_string", "value": "."}},
                    {"type": "plus", "content": {"type": "const_string", "value": ";"}},
                ],
            },
            ["1a;", "12!bbb..;;"],
            ["123a;", "a;", "1a", "1c;"],
        ),
        (
            {
                "type": "tag",
                "begin": "<x>",
                "content": {"type": "any_text", "excludes": ["<"]},
                "end": ["</a>", "</b>"],
            },
            ["<x>hi</b>", "<x></a>"],
            ["<x>hi</a>there</b>", "<x>a<b</a>"],
        ),
    ],
)
def test_formats(fmt, yes, no):
    """xgrammar's format form: free text stops at its tag's end, flags bound the tags."""
    assert_language(structural_tag_regex({"type": "structural_tag", "format": fmt}), yes, no)


@pytest.mark.parametrize(
    "fmt, words",
    [
        ({"type": "token_triggered_tags"}, "format.type 'token_triggered_tags' is not supported"),
        ({"type": "dispatch", "rules": []}, "'dispatch' is not supported"),
        ({"type": "nope"}, "'nope' is not a structural tag format"),
        (
            {"type": "json_schema", "json_schema": {}, "style": "qwen_xml"},
            "format.style and any_order",
        ),
        ({"type": "any_text", "max_tokens": 5}, "format.max_tokens and max_chars"),
        ({"type": "tag", "begin": "<a>", "end": "</a>"}, "format.content is required"),
        ({"type": "repeat", "min": 3, "max": 2, "content": THINK}, "min <= max"),
        ({"type": "sequence", "elements": []}, "format.elements must be a non-empty list"),
        (
            {"type": "sequence", "elements": [{"type": "regex", "pattern": "(?=a)"}]},
            "format.elements[0].pattern:",
        ),
        (
            {"type": "or", "elements": [{"type": "grammar", "grammar": "root ::= x"}]},
            "format.elements[0].grammar:",
        ),
        (
            {**CALL, "triggers": ["<tool"]},
            "format.tags[0].begin '<function=now>' starts with none of the triggers",
        ),
        (
            {**THINK, "content": {"type": "const_string", "value": "x", "extra": 1}},
            "format.content: unknown field 'extra'",
        ),
    ],
)
def test_format_errors_name_the_path(fmt, words):
    with pytest.raises(StructuralTagError, match=re.escape(words)):
        structural_tag_regex({"type": "structural_tag", "format": fmt})
