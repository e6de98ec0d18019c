"""Incremental detokenization, stop strings and stop regexes, with the real Qwen3.5 vocabulary."""

from __future__ import annotations

import random
import re

import pytest
from transformers import AutoTokenizer

from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.guided.stop_regex import StopRegexError, stop_template

TEXTS = [
    "Hello, world! Plain ASCII text with numbers 12345.",
    "你好，世界！今天天气很好。这是一个测试。",
    "日本語のテキストと한국어 텍스트 mixed with English.",
    "Emoji: 🎉👍🏽👨‍👩‍👧‍👦 🇯🇵 and ✓ ∑ ∞ €.",
    "naïve café — Zürich; ﬁne ligatures and \u00a0spaces\n\ttabs",
    "🙂" * 7 + "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _stream(tokenizer, ids, stop=()):
    """Feed `ids` one by one; returns (deltas, flush, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, stop)
    deltas = [detok.add(t) for t in ids]
    return deltas, detok.flush(), detok


class TestIncremental:
    @pytest.mark.parametrize("text", TEXTS)
    def test_round_trip_token_by_token(self, tokenizer, text):
        """Deltas never carry half a character, and together give the whole text."""
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) > 3
        deltas, tail, _ = _stream(tokenizer, ids)
        assert all("\ufffd" not in d for d in deltas), deltas
        assert "".join(deltas) + tail == text
        assert tail == ""

    def test_split_characters_wait_for_completion(self, tokenizer):
        ids = tokenizer.encode("🎉👍🏽", add_special_tokens=False)
        deltas, tail, _ = _stream(tokenizer, ids)
        assert "" in deltas  # at least one token held back mid-character
        assert "".join(deltas) == "🎉👍🏽" and tail == ""

    def test_random_tokens_match_full_decode(self, tokenizer):
        """Any id sequence (byte fragments, special tokens, ids past the tokenizer's size):
        deltas + flush equal one decode of all ids with special tokens skipped."""
        rng = random.Random(0)
        vocab = len(tokenizer)
        for _ in range(200):
            ids = [
                rng.randrange(256) if rng.random() < 0.5 else rng.randrange(vocab + 200)
                for _ in range(rng.randrange(1, 25))
            ]
            deltas, tail, detok = _stream(tokenizer, ids)
            full = tokenizer.decode(ids, skip_special_tokens=True)
            assert "".join(deltas) + tail == full, ids
            assert detok.text == full

    def test_special_tokens_give_no_text(self, tokenizer):
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids = tokenizer.encode("ok", add_special_tokens=False) + [im_end]
        deltas, tail, _ = _stream(tokenizer, ids)
        assert "".join(deltas) + tail == "ok"

    def test_runs_of_textless_tokens_keep_the_window_short(self, tokenizer):
        """A long run of tokens that give no text (special tokens: a model that goes on after
        <|im_end|> with ignore_eos; ids past the tokenizer's size) is not decoded again at every
        token: each add used to decode the whole run since the last text, O(n^2) on the loop."""
        windows = []
        backend = tokenizer.backend_tokenizer

        class Counting:
            class backend_tokenizer:  # noqa: N801 (the attribute the detokenizer looks for)
                @staticmethod
                def decode(ids, skip_special_tokens):
                    windows.append(len(ids))
                    return backend.decode(ids, skip_special_tokens=skip_special_tokens)

        specials = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
        ids = tokenizer.encode("ok then", add_special_tokens=False)
        ids += [specials[i % 2] for i in range(300)] + [len(tokenizer) + 5] * 50
        ids += tokenizer.encode(" 你好🎉 done", add_special_tokens=False)
        detok = IncrementalDetokenizer(Counting())
        out = "".join(detok.add(t) for t in ids) + detok.flush()
        assert out == tokenizer.decode(ids, skip_special_tokens=True) == "ok then 你好🎉 done"
        assert max(windows) <= 8, max(windows)


class TestStopStrings:
    def _run(self, tokenizer, text, stop):
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer, stop)
        emitted = ""
        hold = max(len(s) for s in stop) - 1
        for i, t in enumerate(ids):
            emitted += detok.add(t)
            if detok.stop_matched is not None:
                return emitted + detok.flush(), detok, i + 1, len(ids)
            # Withheld text is bounded by the longest stop (plus any unfinished character).
            decoded = tokenizer.decode(ids[: i + 1])
            if not decoded.endswith("\ufffd"):
                assert len(decoded) - len(emitted) <= hold
        return emitted + detok.flush(), detok, len(ids), len(ids)

    def test_stop_spanning_tokens(self, tokenizer):
        text = "The quick brown fox jumps over the lazy dog and keeps running."
        stop = "ps over the la"
        out, detok, used, total = self._run(tokenizer, text, (stop,))
        assert out == text[: text.index(stop)]
        assert detok.stop_matched == stop
        assert used < total  # matched before the text ran out

    def test_stop_in_multibyte_text(self, tokenizer):
        text = "我们今天去公园散步，然后🎉回家吃饭。"
        out, detok, _, _ = self._run(tokenizer, text, ("🎉回",))
        assert out == "我们今天去公园散步，然后"
        assert detok.stop_matched == "🎉回"

    def test_earliest_of_several_stops_wins(self, tokenizer):
        text = "alpha beta gamma delta epsilon"
        out, detok, _, _ = self._run(tokenizer, text, ("delta", "a gam", "beta gamma delta ep"))
        assert out == "alpha bet"
        assert detok.stop_matched == "a gam"

    def test_no_match_flushes_withheld_text(self, tokenizer):
        text = "nothing to see here, move along"
        out, detok, _, _ = self._run(tokenizer, text, ("zzz-long-stop-string",))
        assert out == text and detok.stop_matched is None

    def test_stop_at_very_start(self, tokenizer):
        out, detok, used, _ = self._run(tokenizer, "Stop right there", ("Stop",))
        assert out == "" and detok.stop_matched == "Stop" and used == 1


class TestStopOptions:
    """vLLM's include_stop_str_in_output, min_tokens and skip_special_tokens=False."""

    def _feed(self, tokenizer, text, stop, **options):
        detok = IncrementalDetokenizer(tokenizer, stop, **options)
        ids = tokenizer.encode(text, add_special_tokens=False)
        emitted = []
        for t in ids:
            emitted.append(detok.add(t))
            if detok.stop_matched is not None:
                break
        return "".join(emitted) + detok.flush(), emitted, detok

    def test_include_stop_str_keeps_it_and_holds_nothing_back(self, tokenizer):
        text = "The quick brown fox jumps over the lazy dog and keeps running."
        stop = "ps over the la"
        out, emitted, detok = self._feed(tokenizer, text, (stop,), include_stop_str=True)
        assert out == text[: text.index(stop) + len(stop)] and detok.stop_matched == stop
        ids = tokenizer.encode(text, add_special_tokens=False)
        for i in range(len(emitted) - 1):  # every token's text at once: no stop string is cut out
            assert "".join(emitted[: i + 1]) == tokenizer.decode(ids[: i + 1])

    def test_min_tokens_hides_stop_strings_in_the_first_tokens(self, tokenizer):
        """As vLLM's detokenizer: no stop string is looked for until more than min_tokens
        tokens were added, and then only where it ends in their text; one that began in
        the first min_tokens tokens' text still counts."""
        text = "The quick brown fox jumps over the lazy dog; the quick end."
        k = len(tokenizer.encode("The quick brown", add_special_tokens=False))
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids[:k]) == "The quick brown"
        out, _, _ = self._feed(tokenizer, text, ("quick",))
        assert out == "The "
        out, _, detok = self._feed(tokenizer, text, ("quick",), min_tokens=k)
        assert out == text[: text.index("quick", 10)] and detok.stop_matched == "quick"
        out, _, _ = self._feed(tokenizer, text, ("quick", "brown fox"), min_tokens=k)
        assert out == "The quick "
        out, _, _ = self._feed(tokenizer, text, ("quick",), min_tokens=k, include_stop_str=True)
        assert out == text[: text.index("quick", 10) + len("quick")]

    def test_special_tokens_kept_when_not_skipped(self, tokenizer):
        """skip_special_tokens=False keeps special tokens' text, with no space between two of
        them: what the fast tokenizer's decode gives whatever spaces_between_special_tokens
        says (vLLM's fast detokenizer alike)."""
        text = "ok<|im_end|><|im_start|><think>x</think><|endoftext|>"
        ids = tokenizer.encode(text, add_special_tokens=False)
        out, _, _ = self._feed(tokenizer, text, (), skip_special_tokens=False)
        assert out == text
        for spaces in (True, False):
            kept = tokenizer.decode(
                ids, skip_special_tokens=False, spaces_between_special_tokens=spaces
            )
            assert kept == text
        assert self._feed(tokenizer, text, ())[0] == "ok<think>x</think>"


def _watching(*patterns: str) -> list:
    """The stop regexes' matchers, as the engine's prepare makes them."""
    return [stop_template(p, 50_000) for p in patterns]


class TestStopRegex:
    """SGLang's stop_regex (engine/guided/stop_regex.py, on llguidance): the first token whose text
    completes a match ends the output, the match kept; matches may span tokens and characters
    of several bytes."""

    @pytest.mark.parametrize(
        "text, pattern",
        [
            ("The answer is 42. Then more text follows", r"\d+\."),
            ("你好，世界！今天天气很好。这是一个测试。", "天气(很|不)好"),
            ("Emoji: 🎉👍🏽 and then more words here", "🎉[^ ]+ and"),
            ("alpha beta gamma delta", "gam|zzz"),
        ],
    )
    def test_ends_at_the_token_completing_the_first_match(self, tokenizer, text, pattern):
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer, stop_regex=_watching(pattern))
        out, used = "", 0
        while detok.stop_matched is None and used < len(ids):
            out += detok.add(ids[used])
            used += 1
        out += detok.flush()
        first = next(
            k for k in range(1, len(ids) + 1) if re.search(pattern, tokenizer.decode(ids[:k]))
        )
        assert detok.stop_matched == pattern and used == first
        assert out == tokenizer.decode(ids[:first])  # kept through that token

    def test_min_tokens_and_no_match(self, tokenizer):
        ids = tokenizer.encode("12. and then 34. again", add_special_tokens=False)
        detok = IncrementalDetokenizer(
            tokenizer, stop_regex=_watching(r"\d\d\."), min_tokens=len(ids) - 1
        )
        assert (
            "".join(detok.add(t) for t in ids[:-1]) + detok.flush() and detok.stop_matched is None
        )
        detok = IncrementalDetokenizer(
            tokenizer, stop_regex=_watching(r"\d\d\.", "xyz"), min_tokens=2
        )
        for t in ids:
            detok.add(t)
        assert detok.stop_matched == r"\d\d\."  # the second number, past min_tokens

    def test_a_backtracking_pattern_reads_each_byte_once(self, tokenizer):
        """`(a+)+b` against a run of a's (Python's re backtracks 2^n ways): no match, and one
        matcher of a few states, that a second request copies and reads alike."""
        template = stop_template("(a+)+b", 50_000)
        for _ in range(2):
            detok = IncrementalDetokenizer(tokenizer, stop_regex=[template])
            for t in tokenizer.encode("a" * 4000 + "c", add_special_tokens=False):
                detok.add(t)
            assert detok.stop_matched is None and not template.spent

    def test_past_its_bound_it_raises_and_is_spent(self, tokenizer):
        """The issue's `[aeiou][\\s\\S]{300}\\x00` over random words: its DFA grows by a state
        most bytes, until the lexer's work bound (llguidance's fuel) ends it, a few thousand
        bytes in. The watch raises (the scheduler ends that request alone) and the shared
        matcher is marked spent."""
        template = stop_template(r"[aeiou][\s\S]{300}\x00", 50_000)
        detok = IncrementalDetokenizer(tokenizer, stop_regex=[template])
        text = "".join(random.Random(0).choices("abcdefghijklmnopqrstuvwxyz ", k=12_000))
        with pytest.raises(StopRegexError, match="went past its bound"):
            for t in tokenizer.encode(text, add_special_tokens=False):
                detok.add(t)
        assert template.spent

    @pytest.mark.parametrize(
        "pattern, words",
        [
            ("a*", "matches the empty text"),
            ("(?=x)", "look-around"),
            ("(a", "unclosed group"),
        ],
    )
    def test_bad_patterns_are_refused(self, pattern, words):
        """As the compile worker answers (engine/grammar_worker.py)."""
        from deltaserve.engine.grammar_worker import Job, Setup, compile_job

        outcome = compile_job(
            Job("stop_regex", pattern), None, Setup("", 257, [256], 50_000, 1e3, 0)
        )
        assert words in outcome.error

    def test_an_empty_pattern_is_refused_by_name(self):
        from deltaserve.engine.sampling_params import SamplingParams

        with pytest.raises(ValueError, match="stop_regex must hold non-empty strings"):
            SamplingParams(max_tokens=4, stop_regex=[""])
