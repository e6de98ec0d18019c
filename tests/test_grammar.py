"""GBNF and Lark grammars as llguidance compiles them (engine/guided/gbnf.py: GBNF through
llguidance's converter, Lark as it is): the strings a grammar derives, and only those, are
whole outputs of it (llguidance's matcher is the judge, tests/guide_helpers.py); recursion
has no depth bound (an Earley parser, not a regex); and whatever the text, compiling it (as
the worker does) gives a grammar or an error, never an exception (which was a 500)."""

from __future__ import annotations

import random

import pytest
from guide_helpers import accepts, assert_language
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.engine.grammar_worker import Job, Setup, compile_job
from deltaserve.engine.guided.grammar import constraint_grammar
from deltaserve.engine.guided.runtime import byte_tokenizer

SQL = r"""
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""  # vLLM's documentation example

ARITHMETIC = r"""
root ::= expr   # sums of products
expr ::= term (("+" | "-") term)*
term ::= factor ("*" factor)*
factor ::= [0-9]+ | "(" expr ")"
"""

JSON = r"""
root ::= value
value ::= object | array | string | number | ("true" | "false" | "null")
object ::= "{" ws ( string ws ":" ws value ws ("," ws string ws ":" ws value ws)* )? "}"
array  ::= "[" ws ( value ws ("," ws value ws)* )? "]"
string ::= "\"" ( [^"\\\x00-\x1f] | "\\" ["\\/bfnrt] )* "\""
number ::= "-"? [0-9]+ ("." [0-9]+)?
ws ::= [ \t\n]*
"""

# a rule that begins with itself, 200 times over: Earley parses it as it comes
LEFT = 'root ::= list\nlist ::= list "," item | item\nitem ::= [a-z]+\n'


def grammar(text: str) -> str:
    return constraint_grammar("grammar", text, None)


@pytest.mark.parametrize(
    "text, yes, no",
    [
        (
            SQL,
            ["SELECT col_1  from table_2  where col_2 = 1 "],
            [
                "SELECT col_3  from table_2  where col_2 = 1 ",
                "SELECT col_1  from table_2  where col_2 = 1",
            ],
        ),
        (
            ARITHMETIC,
            ["1", "12+3*4", "(1+2)*3", "((((7))))", "(((((((((7)))))))))", "1-(2*(3+4))"],
            ["", "1+", "(1", "1)", "a"],
        ),
        (
            JSON,
            ['{"a": [1, 2.5, {"b": null}], "c": "x\\"y"}', "[]", "-3", '"t"', "[[[[[[1]]]]]]"],
            ['{"a" 1}', "[1,]", "tru", '"\x01"'],
        ),
        (
            r'root ::= "a"{2,3} "b"? [x-z]* .',
            ["aab!", "aaazx!", "aabzzé", "aab"],
            ["ab!", "aaaa!", "aa"],
        ),
        (
            r'root ::= [^a-c\u005d] "\x41\u00e9\U0001F600\n\t\"\\"',
            ['dAé😀\n\t"\\'],
            ['aAé😀\n\t"\\', ']Aé😀\n\t"\\'],
        ),
        ('root ::= ("x" | "y" root)', ["x", "yx", "y" * 30 + "x"], ["y", "xy"]),
        (LEFT, ["a", "a,bc," * 200 + "d"], ["", "a,", ",a"]),
    ],
)
def test_derived_strings_and_only_those(text, yes, no):
    assert_language(grammar(text), yes, no)


def derive(
    rules: dict[str, list[list[str]]], name: str, rng: random.Random, budget: list[int]
) -> str:
    """A random string of a small grammar (rules: lists of alternatives of symbols, a quoted
    symbol a literal); past `budget` expansions, the all-literal alternative each rule has."""
    budget[0] -= 1
    options = rules[name] if budget[0] > 0 else [rules[name][-1]]
    option = rng.choice(options)
    return "".join(s[1:-1] if s.startswith('"') else derive(rules, s, rng, budget) for s in option)


def test_random_derivations_match():
    """Random recursive grammars: every string they derive is an output of their grammar."""
    rng = random.Random(0)
    for _ in range(30):
        names = ["root", "a", "b"]
        rules = {
            name: [
                [rng.choice([f'"{rng.choice("xyz()")}"', *names]) for _ in range(rng.randint(1, 3))]
                for _ in range(rng.randint(1, 2))
            ]
            for name in names
        }
        for name in names:  # every rule can end: one all-literal alternative, last
            rules[name].append([f'"{name}"'])
        text = "\n".join(
            f"{n} ::= " + " | ".join(" ".join(option) for option in options)
            for n, options in rules.items()
        )
        g = grammar(text)
        for _ in range(10):
            derived = derive(rules, "root", rng, [40])
            assert accepts(g, derived), (text, derived)


LARK_JSON = r"""
?start: value
?value: dict
      | list
      | string
      | SIGNED_NUMBER      -> number
      | "true"             -> true
      | "false"            -> false
      | "null"             -> null

list : "[" [value ("," value)*] "]"
dict : "{" [pair ("," pair)*] "}"
pair : string ":" value
string : ESCAPED_STRING

%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
"""  # the JSON example of vLLM's Lark-era documentation

LARK_ARITHMETIC = r"""
start: expr  // sums of products, as ARITHMETIC above
expr: term (("+" | "-") term)*
term: factor ("*" factor)*
factor: /[0-9]+/ | "(" expr ")"
"""


@pytest.mark.parametrize(
    "text, yes, no",
    [
        (
            LARK_JSON,
            ['{"a":[1,2.5e3,{"b":null}],"c":"x\\"y"}', "[]", "-3", "true", '{"a": 1}'],
            ['{"a" 1}', "[1,]", "tru"],
        ),  # %ignore WS: llguidance allows the blanks between tokens
        (
            LARK_ARITHMETIC,
            ["1", "12+3*4", "(1+2)*3", "((((7))))", "(((((7)))))"],
            ["", "1+", "(1", "a"],
        ),
        (
            'start: [sign] INT\nsign: "+" | "-"\n%import common (INT, WS)',
            ["+12", "7", "-0"],
            ["+", "1.5", "--1"],
        ),
        ('start: /\\/\\/[a-z]*/ "!"', ["//ab!", "//!"], ["/a!", "//A!"]),
    ],
)
def test_lark_derived_strings_and_only_those(text, yes, no):
    assert_language(grammar(text), yes, no)


def test_lark_and_gbnf_of_one_language_agree():
    """ARITHMETIC in either syntax: the same verdict on 1,000 random strings of its alphabet."""
    lark, gbnf = grammar(LARK_ARITHMETIC), grammar(ARITHMETIC)
    rng = random.Random(0)
    texts = ["".join(rng.choices("12+-*()", k=rng.randint(0, 9))) for _ in range(1000)]
    verdicts = [(accepts(lark, t), accepts(gbnf, t)) for t in texts]
    assert all(a == b for a, b in verdicts) and sum(a for a, _ in verdicts) > 30


SETUP = Setup("", 257, [256], 50_000, 1000.0, 0)


def compiled(kind: str, text: str) -> tuple[str, str]:
    """(grammar, error) as the compile worker answers, on a byte vocabulary."""
    outcome = compile_job(Job(kind, text), byte_tokenizer(), SETUP)
    return outcome.grammar, outcome.error


@pytest.mark.parametrize(
    "text, words",
    [
        ("", "Empty grammar"),
        ("root ::= 'a'", "not a GBNF grammar: Expected name"),
        ("root ::= x", "not a GBNF grammar: Rule 'x' not found"),
        ('root ::= ("a"', "not a GBNF grammar"),
        ("start: INT", "INT"),
        ("start: item\n%declare item", "declare statement not supported"),
        ("start: /a(?=b)/", "look-around"),
    ],
)
def test_errors_say_what(text, words):
    grammar_text, error = compiled("grammar", text)
    assert not grammar_text and words in error, error


TEXTS = st.lists(
    st.sampled_from(
        [
            "root",
            " ::= ",
            "start",
            ": ",
            "a",
            '"x"',
            '"\\\\"',
            '"\\u00e9"',
            "[a-c]",
            "[^\\n]",
            "[-]",
            ".",
            "|",
            "(",
            ")",
            "*",
            "+",
            "?",
            "{2}",
            "{1,3}",
            "/[a-c]+/",
            "%ignore WS\n",
            "%import common.INT\n",
            "~",
            "\n",
            " ",
            "#c\n",
            "'",
            "\\",
        ]
    ),
    max_size=14,
).map("".join)


@settings(max_examples=200, deadline=None, database=None)
@given(TEXTS)
def test_any_text_is_a_grammar_or_an_error(text):
    """Whatever the text: the worker answers a grammar or an error, never raises."""
    grammar_text, error = compiled("grammar", text)
    assert bool(grammar_text) != bool(error)
