"""GBNF grammars as regexes (engine/grammar.py): the strings a grammar derives, and only those,
match its regex (Python's `re` is the judge here, and the engine's automaton agrees), a
recursive rule nests at most MAX_DEPTH deep, and a grammar it cannot take is an error naming
the line and column."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.engine.grammar import MAX_DEPTH, GrammarError, grammar_regex
from deltaserve.engine.regex_automaton import START, ByteAutomaton

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


def matches(grammar: str, text: str) -> bool:
    return re.fullmatch(grammar_regex(grammar), text) is not None


@pytest.mark.parametrize(
    "grammar, yes, no",
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
            ["1", "12+3*4", "(1+2)*3", "((((7))))", "1-(2*(3+4))"],
            ["", "1+", "(1", "1)", "a", "(((((7)))))"],
        ),
        (
            JSON,
            ['{"a": [1, 2.5, {"b": null}], "c": "x\\"y"}', "[]", "-3", '"\\u"'[:0] + '"t"', "true"],
            ['{"a" 1}', "[1,]", "tru", '"\x01"', "[[[[[[1]]]]]]"],
        ),
        (
            r'root ::= "a"{2,3} "b"? [x-z\-]* .',
            ["aab!", "aaa-zx\n", "aabzz-é", "aab"],
            ["ab!", "aaaa!", "aa"],
        ),
        (r'root ::= [^a-c] "\x41\u00e9\U0001F600\n\t\"\\"', ['dAé😀\n\t"\\'], ['aAé😀\n\t"\\']),
        (
            'root ::= ("x" | "y" root)',
            ["x", "yx", "yyyyx"],
            ["yyyyyx", "y"],
        ),  # root opens itself 5 times at most
    ],
)
def test_derived_strings_and_only_those(grammar, yes, no):
    pattern = grammar_regex(grammar)
    automaton = ByteAutomaton(pattern)  # what the rank compiles: it takes the pattern too
    assert not automaton.matches_nothing()
    for text in yes:
        assert re.fullmatch(pattern, text), text
    for text in no:
        assert not re.fullmatch(pattern, text), text


def derive(
    node_rules: dict[str, list[list[str]]], name: str, rng: random.Random, open_: dict[str, int]
) -> str | None:
    """A random string of a small grammar (rules: lists of alternatives of symbols, a quoted
    symbol a literal), within the same bound as the engine's; None where the bound stops it."""
    if open_.get(name, 0) >= MAX_DEPTH:
        return None
    open_[name] = open_.get(name, 0) + 1
    try:
        for option in rng.sample(node_rules[name], len(node_rules[name])):
            parts = [
                s[1:-1] if s.startswith('"') else derive(node_rules, s, rng, open_) for s in option
            ]
            if None not in parts:
                return "".join(parts)
        return None
    finally:
        open_[name] -= 1


def test_random_derivations_match():
    """Random recursive grammars: every string derived within the bound matches. (Their
    regexes grow fast with references per rule: past two, most are refused as too large.)"""
    rng = random.Random(0)
    compiled = 0
    for _ in range(60):
        names = ["root", "a", "b"]
        rules = {
            name: [
                [rng.choice([f'"{rng.choice("xyz()")}"', *names]) for _ in range(rng.randint(1, 2))]
                for _ in range(rng.randint(1, 2))
            ]
            for name in names
        }
        for name in names:  # every rule can end: one all-literal alternative
            rules[name].append([f'"{name}"'])
        text = "\n".join(
            f"{n} ::= " + " | ".join(" ".join(option) for option in options)
            for n, options in rules.items()
        )
        try:
            pattern = grammar_regex(text)
        except GrammarError as e:
            assert "grows past" in str(e)
            continue
        compiled += 1
        for _ in range(20):
            derived = derive(rules, "root", rng, {})
            assert derived is not None and re.fullmatch(pattern, derived), (text, derived)
    assert compiled >= 40


@pytest.mark.parametrize(
    "grammar, words",
    [
        ("", "empty"),
        (
            'root ::= "a"\nitem: "b"',
            "line 2, column 5: unexpected ':' (GBNF's rules",
        ),  # Lark's ':' in GBNF
        ("root ::= 'a'", 'line 1, column 10: unexpected "\'"'),
        ('root ::= "a"\nroot ::= "b"', "line 2, column 1: rule 'root' is defined twice"),
        ("root ::= x", "'x', which is not defined"),
        ('item ::= "a"', "no 'root' rule"),
        ('root ::= ("a"', "never closed"),
        ("root ::= [z-a]", "out of order"),
        ('root ::= "\\q"', "escape \\q"),
        ('root ::= "a"{3,2}', "below the least"),
        ('root ::= "(" root ")"', "derives no string"),
        (
            'root ::= a\na ::= "(" a a a a a a a a a a a a a a a a a a a a a a a a a a a a a a a a ")"\n  | "x"',
            "grows past",
        ),
    ],
)
def test_errors_name_where(grammar, words):
    with pytest.raises(GrammarError, match=re.escape(words)):
        grammar_regex(grammar)


@settings(max_examples=300, deadline=None, database=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "root",
                " ::= ",
                "a",
                " ::= ",
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
                "{2,}",
                "\n",
                " ",
                "#c\n",
                ":",
                "'",
                "\\",
            ]
        ),
        max_size=14,
    ).map("".join)
)
def test_any_text_is_a_regex_or_a_grammar_error(text):
    """Whatever the text, a GrammarError naming the problem or a pattern both Python's `re`
    and the engine's automaton compile: never another exception (a 500 for a request)."""
    try:
        pattern = grammar_regex(text)
    except GrammarError as e:
        assert str(e)
        return
    re.compile(pattern)
    ByteAutomaton(pattern)


# -- Lark grammars (engine/lark_grammar.py) ------------------------------------------------------

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
    "grammar, yes, no",
    [
        (
            LARK_JSON,
            ['{"a":[1,2.5e3,{"b":null}],"c":"x\\"y"}', "[]", "-3", "true", '"\\u"'],
            ['{"a" 1}', "[1,]", "tru", '"a\nb"', "[[[[[[1]]]]]]", '{"a": 1}'],
        ),  # %ignore WS: no blanks
        (
            LARK_ARITHMETIC,
            ["1", "12+3*4", "(1+2)*3", "((((7))))"],
            ["", "1+", "(1", "a", "(((((7)))))"],
        ),
        (
            'start: "select"i " " NAME ~ 1..2\nNAME: ("a".."c")+ "_"?\n',
            ["SeLeCt ab_c", "select a", "SELECT cc_"],
            ["select ", "select d", "selec a", "select a__"],
        ),
        (
            'start: [sign] INT\nsign: "+" | "-"\n%import common (INT, WS)',
            ["+12", "7", "-0"],
            ["+", "1.5", "--1"],
        ),
        ("start: ID\n%import common.CNAME -> ID", ["_x1", "abc"], ["1x", ""]),
        (
            "greeting: 'hi' | 'yo' ' ' name\nname: 'al' 'x'?",
            ["hi", "yo alx", "yo al"],
            ["hi al", "yo"],
        ),  # vLLM's quotes, root
        ('start: /\\/\\/[a-z]*/ "!"', ["//ab!", "//!"], ["/a!", "//A!"]),
    ],
)
def test_lark_derived_strings_and_only_those(grammar, yes, no):
    pattern = grammar_regex(grammar)
    automaton = ByteAutomaton(pattern)
    for text in yes:
        assert re.fullmatch(pattern, text), (text, pattern[:200])
        assert automaton.accepting[automaton.step(START, text.encode())], text
    for text in no:
        assert not re.fullmatch(pattern, text), text


def test_lark_and_gbnf_of_one_language_agree():
    """ARITHMETIC in either syntax: the same verdict on 3,000 random strings of its alphabet."""
    lark, gbnf = re.compile(grammar_regex(LARK_ARITHMETIC)), re.compile(grammar_regex(ARITHMETIC))
    rng = random.Random(0)
    texts = ["".join(rng.choices("12+-*()", k=rng.randint(0, 9))) for _ in range(3000)]
    verdicts = [(bool(lark.fullmatch(t)), bool(gbnf.fullmatch(t))) for t in texts]
    assert all(a == b for a, b in verdicts) and sum(a for a, _ in verdicts) > 100


@pytest.mark.parametrize(
    "grammar, words",
    [
        ("%ignore WS\n// nothing else", "defines nothing"),
        ("start: INT", "'INT', which is not defined (import it: %import common.INT)"),
        ("start: item\n%declare item", "line 2, column 1: the directive %declare"),
        (
            '%import lark.X\nstart: "a"',
            "line 1, column 1: %import lark.X: only Lark's common terminals",
        ),
        ('%import common.FOO\nstart: "a"', "common.FOO is not one of"),
        ('start: x{1}\nx: "a"', "line 1, column 8: templates"),
        ("start: /a/i", "regex flags"),
        ("start: /a(?=b)/", "line 1, column 8: the regex /a(?=b)/"),
        ('start: "a" ~', "'~' needs a count"),
        ('start: "a" ~ 3..2', "below the least"),
        ('start: "ab".."c"', "one-character strings"),
        ('start: "z".."a"', "out of order"),
        ('start: ["a"', "never closed"),
        ('start: "a" ->', "alias name"),
        ('start: "a"\nstart: "b"', "line 2, column 1: 'start' is defined twice"),
        ('start: "(" start ")"', "derives no string"),
    ],
)
def test_lark_errors_name_where(grammar, words):
    with pytest.raises(GrammarError, match=re.escape(words)):
        grammar_regex(grammar)


@settings(max_examples=300, deadline=None, database=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "start",
                "x",
                "X",
                ": ",
                "?",
                "!",
                '"a"',
                '"b"i',
                "..",
                "/[a-c]+/",
                "/a/i",
                "[",
                "]",
                "(",
                ")",
                "|",
                "*",
                "+",
                "~",
                " 2",
                "..3",
                "->",
                " al",
                "{",
                "}",
                ",",
                "\n",
                "%import common.INT\n",
                "%ignore WS\n",
                "%import common (WS, DIGIT)\n",
                "// c\n",
                "INT",
                ".2",
                "\\",
                "'",
            ]
        ),
        max_size=14,
    ).map("".join)
)
def test_any_lark_text_is_a_regex_or_a_grammar_error(text):
    """As for GBNF: a GrammarError or a pattern that compiles, never another exception."""
    try:
        pattern = grammar_regex("start: " + text)
    except GrammarError as e:
        assert str(e)
        return
    re.compile(pattern)
    ByteAutomaton(pattern)
