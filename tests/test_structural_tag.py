"""Structural tags as regexes (engine/structural_tag.py): the free text between structures holds
no trigger (checked against a brute-force search on random words and texts), each trigger
opens a structure whose JSON follows its schema, the engine's automaton agrees with Python's
`re`, and a bad spec is an error naming the field."""

from __future__ import annotations

import json
import random
import re

import pytest

from deltaserve.engine.regex_automaton import DEAD, START, ByteAutomaton
from deltaserve.engine.structural_tag import StructuralTagError, structural_tag_regex, text_without

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
TOOLS = {
    "structures": [
        {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
        {"begin": "<function=now>", "schema": {"type": "object", "properties": {}}, "end": "</function>"},
        {"begin": "<tool_call>", "end": "</tool_call>"},  # no schema: any JSON value
    ],
    "triggers": ["<function=", "<tool_call>"],
}


def test_text_without_holds_no_word():
    """Random words over a small alphabet, overlapping ones too: a text matches exactly when no
    word occurs in it."""
    rng = random.Random(0)
    for _ in range(200):
        words = sorted({"".join(rng.choices("ab<", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))})
        pattern = re.compile(text_without(words))
        automaton = ByteAutomaton(pattern.pattern)
        for _ in range(100):
            text = "".join(rng.choices("ab<\nx", k=rng.randint(0, 10)))
            free = not any(w in text for w in words)
            assert bool(pattern.fullmatch(text)) == free, (words, text)
            assert automaton.accepting[automaton.step(START, text.encode())] == free, (words, text)


@pytest.mark.parametrize("spec, yes, no", [
    (TOOLS, ["", "Sunny.\n", 'Let me look. <function=get_weather>{"city": "Oslo"}</function> Done',
             '<function=now>{}</function><tool_call>[1, "a"]</tool_call>', "a < b, <function"],
            ["<function=get_weather>", '<function=get_weather>{"city": "Rome"}</function>',
             "<function=later>{}</function>", "<tool_call>x</tool_call>", '<function=now>{}</function']),
    ({**TOOLS, "at_least_one": True}, ['x <function=now>{}</function>'], ["", "Sunny."]),
])  # fmt: skip
def test_structures_and_free_text(spec, yes, no):
    pattern = structural_tag_regex(spec)
    automaton = ByteAutomaton(pattern)
    for text in yes:
        assert re.fullmatch(pattern, text), text
        assert automaton.accepting[automaton.step(START, text.encode())], text
    for text in no:
        assert not re.fullmatch(pattern, text), text


def test_a_trigger_commits_to_a_structure():
    """What the rank's mask sees: after a trigger only a structure's way on stays open."""
    automaton = ByteAutomaton(structural_tag_regex(TOOLS))
    assert automaton.step(START, b'ok <function=get_weather>{"city": "Pa') != DEAD
    assert automaton.step(START, b"ok <function=get_") != DEAD
    assert automaton.step(START, b"ok <function=x") == DEAD
    assert automaton.step(START, b"ok <tool_call>{") != DEAD


@pytest.mark.parametrize("spec, words", [
    ([], "an object with structures and triggers"),
    ({"type": "structural_tag", "format": {"type": "triggered_tags"}}, "'format' form"),
    ({"structures": [], "triggers": ["<"]}, "structures must be a non-empty list"),
    ({"structures": TOOLS["structures"], "triggers": []}, "triggers must be"),
    ({"structures": TOOLS["structures"], "triggers": ["<function=", ""]}, "triggers must be"),
    ({**TOOLS, "at_least_one": 1}, "at_least_one must be a boolean"),
    ({**TOOLS, "stop_after_first": True}, "unknown structural tag field 'stop_after_first'"),
    ({"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<g"]}, "structures[0].begin '<f>' starts with none"),
    ({"structures": [{"begin": "<f>", "end": 3}], "triggers": ["<f"]}, "structures[0] must be an object with string"),
    ({"structures": [{"begin": "<f>", "end": "", "args": {}}], "triggers": ["<f"]}, "structures[0]: unknown field 'args'"),
    ({"structures": [{"begin": "<f>", "end": "", "schema": {"type": "nope"}}], "triggers": ["<f"]}, "structures[0].schema:"),
    ({"structures": [{"begin": "<f>", "end": ""}], "triggers": ["<" * 300]}, "longer than 256"),
])  # fmt: skip
def test_errors_name_the_field(spec, words):
    with pytest.raises(StructuralTagError, match=re.escape(words)):
        structural_tag_regex(spec)


def test_sampling_params_take_json_text_or_a_dict():
    from deltaserve.engine.sampling_params import SamplingParams

    as_text = SamplingParams(max_tokens=8, guided_structural_tag=json.dumps(TOOLS))
    as_dict = SamplingParams(max_tokens=8, guided_structural_tag=TOOLS)
    assert as_text.guide_regex == as_dict.guide_regex == structural_tag_regex(TOOLS)
    with pytest.raises(ValueError, match="guided_structural_tag: not a structural tag"):
        SamplingParams(max_tokens=8, guided_structural_tag="{oops")
    with pytest.raises(ValueError, match="one structured-output constraint"):
        SamplingParams(max_tokens=8, guided_structural_tag=TOOLS, guided_regex="a")
