"""Guided decoding's silent parts: the byte automaton against Python's `re`, the vectorised
vocabulary walk against a token-by-token one on the real 248k vocabulary, and rank 0's
sampler keeping guided rows on their pattern beside unguided ones."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from deltaserve.engine.rank import vocab_cache
from deltaserve.engine.rank.grammar_mask import DEAD, START, Guide
from deltaserve.engine.rank.sampler import Sampler
from deltaserve.engine.rank.token_bytes import read_token_bytes
from deltaserve.engine.rank.token_trie import TokenTrie
from deltaserve.engine.rank.vocab_cache import cache_dir, load_trie
from deltaserve.engine.regex_automaton import (
    ByteAutomaton,
    RegexError,
    choice_regex,
    utf8_sequences,
)
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.ipc.messages import SamplingSpec


def _matches(automaton: ByteAutomaton, text: str) -> bool:
    state = automaton.step(START, text.encode())
    return state != DEAD and automaton.accepting[state]


def _random_pattern(rng: random.Random, depth: int = 0) -> str:
    """Groups take only bounded repeats: Python's backtracking `re` takes exponential time
    over nested unbounded ones."""
    atoms = ["a", "b", "é", "中", "[ab]", "[^a]", "[a-cé]", ".", r"\d", r"\.", "x"]
    if depth > 1 or rng.random() < 0.5:
        return rng.choice(atoms) + rng.choice(
            ["", "", "*", "+", "?", "{2}", "{1,3}", "{,2}", "{2,}"]
        )
    parts = [_random_pattern(rng, depth + 1) for _ in range(rng.randint(1, 3))]
    group = "(?:" + "|".join(parts) + ")" if rng.random() < 0.5 else "(" + "".join(parts) + ")"
    return group + rng.choice(["", "?", "{2}", "{1,2}"])


class TestAutomaton:
    def test_agrees_with_python_re(self):
        """Random patterns of the dialect and random strings over their alphabet (multi-byte
        characters included): fullmatch exactly when Python's re does."""
        rng = random.Random(0)
        alphabet = ["a", "b", "c", "é", "中", "1", ".", "x", "\n"]
        for _ in range(300):
            pattern = "".join(_random_pattern(rng) for _ in range(rng.randint(1, 3)))
            automaton = ByteAutomaton(pattern)
            for _ in range(30):
                text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
                assert _matches(automaton, text) == bool(re.fullmatch(pattern, text)), (
                    pattern,
                    text,
                )

    def test_utf8_sequences_spell_exactly_the_range(self):
        rng = random.Random(1)
        for lo, hi in [
            (0, 0x10FFFF),
            (0x80, 0x7FF),
            (0x3B1, 0x3C9),
            (0xD000, 0xE000),
            (0xFFFF, 0x10001),
        ]:
            sequences = utf8_sequences(lo, hi)
            for code in [lo, hi, lo - 1, hi + 1, *rng.sample(range(0x110000), 2000)]:
                if not 0 <= code <= 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                    continue
                data = chr(code).encode()
                spelled = any(
                    len(s) == len(data)
                    and all(a <= b <= c for (a, c), b in zip(s, data, strict=True))
                    for s in sequences
                )
                assert spelled == (lo <= code <= hi), hex(code)

    def test_dead_ends_are_pruned(self):
        """A branch no string can finish leaves no live state behind: after "a" only "b"."""
        automaton = ByteAutomaton("a[^\x00-\U0010ffff]|ab")
        after_a = automaton.step(START, b"a")
        assert [b for b, s in enumerate(automaton.row(after_a)) if s != DEAD] == [ord("b")]
        assert (
            ByteAutomaton("[^\x00-\U0010ffff]").matches_nothing()
            and not ByteAutomaton("").matches_nothing()
        )

    @pytest.mark.parametrize(
        "pattern",
        [
            "^a",
            "a$",
            "(?=a)",
            "a*?",
            "a++",
            r"\b",
            "(a",
            "a)",
            "[a",
            "*",
            r"\1",
            "(?P<x>a)",
            "a{3,2}",
            "a{1001}",
            r"\u12",
        ],
    )
    def test_refused(self, pattern):
        with pytest.raises(RegexError):
            ByteAutomaton(pattern)


@pytest.fixture(scope="module")
def walk(tiny_model_dir) -> TokenTrie:
    return TokenTrie(read_token_bytes(tiny_model_dir))


class TestVocabularyWalk:
    def test_token_bytes_spell_what_the_tokenizer_encodes(self, tiny_model_dir, walk):
        from deltaserve.engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tiny_model_dir)
        text = 'Grüße, 世界! {"a": [1, 2.5e3, "ü€😀"]}\n\tend <tool_call>'
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(walk.token_bytes[i] for i in ids) == text.encode()
        assert walk.token_bytes[tokenizer.convert_tokens_to_ids("<|im_end|>")] is None  # special

    def test_token_bytes_read_whatever_the_member_order(self, tiny_model_dir, walk, tmp_path):
        """The reader stops once it has what it needs; files that put the model first
        (read past it), or sort every object's keys (merges before vocab) and indent, read
        the same."""
        data = json.loads((tiny_model_dir / "tokenizer.json").read_text(encoding="utf-8"))
        model_first = {"model": data["model"], **{k: v for k, v in data.items() if k != "model"}}
        for text in (json.dumps(model_first), json.dumps(data, sort_keys=True, indent=1)):
            (tmp_path / "tokenizer.json").write_text(text, encoding="utf-8")
            assert read_token_bytes(tmp_path) == walk.token_bytes

    def test_vocabulary_cache_reads_back_the_same_trie(
        self, tiny_model_dir, walk, tmp_path, monkeypatch
    ):
        """The trie is kept on disk, keyed by tokenizer.json's bytes: a second server reads it
        (not tokenizer.json) and gets the trie built from scratch, masks and all; a damaged
        file is built again and replaced; a folder that cannot be written costs only the
        cache."""
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        assert load_trie(tiny_model_dir).num_nodes == walk.num_nodes
        [cached] = cache_dir().glob("*.npz")

        def no_reading(model_dir):
            raise AssertionError("tokenizer.json's vocabulary read again")

        with monkeypatch.context() as patch:
            patch.setattr(vocab_cache, "read_token_bytes", no_reading)
            again = load_trie(tiny_model_dir)
        assert again.token_bytes == walk.token_bytes and again.level_start == walk.level_start
        assert all(
            np.array_equal(getattr(again, name), getattr(walk, name)) for name in TokenTrie.ARRAYS
        )
        pattern = r'\{"name": "[^"\\]{0,12}"\}'
        assert (
            Guide(pattern, again).allowed_tokens(START)
            == Guide(pattern, walk).allowed_tokens(START)
        ).all()
        whole = cached.read_bytes()
        for damaged in (b"damaged", whole[: len(whole) // 2]):  # not an npz; a cut zip (BadZipFile)
            cached.write_bytes(damaged)
            assert load_trie(
                tiny_model_dir
            ).num_nodes == walk.num_nodes and cached.stat().st_size == len(whole)
        (tmp_path / "a file").write_text("")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a file"))
        assert load_trie(tiny_model_dir).num_nodes == walk.num_nodes

    @pytest.mark.parametrize(
        "pattern, prefix",
        [
            (r'\{"name": "[^"\\]{0,12}", "age": (?:0|[1-9][0-9]{0,2})\}', '{"name": "Ad'),
            (r"(?:yes|no|maybe)", "ma"),
            (r"[α-ω]+ [0-9]+", "αβ"),
        ],
    )
    def test_every_token_walked_at_once_as_one_by_one(self, walk, pattern, prefix):
        """The mask of each state along a prefix is exactly the tokens whose bytes, stepped
        through the automaton one token at a time, leave it live (248k tokens checked)."""
        guide = Guide(pattern, walk)
        state = START
        for step in range(len(prefix) + 1):
            allowed = guide.allowed_tokens(state)
            expected = [
                guide.automaton.step(state, b) != DEAD if b else False for b in walk.token_bytes
            ]
            assert allowed.tolist() == expected, (pattern, step)
            assert allowed.any()
            if step < len(prefix):
                state = guide.automaton.step(state, prefix[step].encode())

    def test_random_vocabularies_walked_as_one_by_one(self):
        """Small random vocabularies (tokens that are prefixes of others, split characters,
        long ones) under random patterns: the trie walk, sparse and by whole levels, allows
        exactly the tokens a one-by-one walk does, in every state along random outputs."""
        rng = random.Random(2)
        pieces = [b"a", b"b", b"x", b".", b"1", "é".encode(), "中".encode(), b"\xc3", b"\xa9"]
        for _ in range(40):
            words = {
                b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 6))) for _ in range(80)
            }
            vocab = [None, *sorted(words), None]
            guide = Guide(
                "".join(_random_pattern(rng) for _ in range(rng.randint(1, 3))), TokenTrie(vocab)
            )
            state = START
            for _ in range(6):
                allowed = guide.allowed_tokens(state).tolist()
                assert allowed == [
                    bool(b) and guide.automaton.step(state, b) != DEAD for b in vocab
                ]
                if not any(allowed):
                    break
                state = guide.advance(state, rng.choice([i for i, ok in enumerate(allowed) if ok]))

    def test_mask_offers_the_end_ids_where_the_output_may_end(self, walk):
        guide = Guide(choice_regex(("no", "now")), walk)
        cpu = torch.device("cpu")
        width = len(walk.token_bytes) + 3
        after_no = guide.automaton.step(START, b"no")
        mask = guide.mask(after_no, (7, 9), width, cpu)
        assert mask.shape == (width,) and mask[7] and mask[9] and mask.sum() >= 3  # "w" too
        final = guide.automaton.step(START, b"now")
        assert guide.mask(final, (7,), width, cpu).nonzero().flatten().tolist() == [7]
        assert guide.mask(DEAD, (7,), width, cpu).nonzero().flatten().tolist() == [7]
        assert not guide.mask(START, (7,), width, cpu)[7]


# ---- rank 0's sampler with a made-up vocabulary ----------------------------------------------

VOCAB = [None, b"a", b"b", b"ab", b"c", b"{", b"}", b'"', b"1", b"12", b"x"]  # token 0: EOS
EOS = 0


def _sampler() -> Sampler:
    return Sampler(lambda: TokenTrie(VOCAB))


def _logits(favour: dict[int, float], width: int = 16) -> torch.Tensor:
    """One row: token 10 ("x", never allowed) far ahead of all, then the `favour`ed ones."""
    row = torch.zeros(1, width)
    row[0, 10] = 20.0
    for token, value in favour.items():
        row[0, token] = value
    return row


def _walk(spec: SamplingSpec, rows: list[torch.Tensor], device: str = "cpu") -> list[int]:
    """Request 1's tokens, one per row, batched behind an unguided greedy request 2 whose token
    (the row's argmax) must not change; request 1's logprobs stay raw."""
    sampler = _sampler()
    sampler.add(1, spec)
    sampler.add(2, SamplingSpec(seed=0))
    tokens = []
    for row in rows:
        logits = torch.cat([row, row]).to(device)
        other, sample = sampler.sample([2, 1], logits)
        assert other.token_id == int(row.argmax())
        assert sample.logprob == pytest.approx(
            float(logits[1].log_softmax(-1)[sample.token_id]), abs=1e-5
        )
        tokens.append(sample.token_id)
    return tokens


class TestSampler:
    @pytest.mark.parametrize("device", ["cpu", "cuda"])
    def test_greedy_follows_the_pattern_against_the_logits(self, device):
        if device == "cuda" and not torch.cuda.is_available():
            pytest.skip("no GPU")
        spec = SamplingSpec(seed=0, guide_regex="(?:ab|c)+", guide_end_ids=(EOS,))
        # "ab" as one token or two; at a match the EOS competes with going on
        rows = [_logits({3: 2.0, 1: 1.0}), _logits({EOS: 1.0, 4: 2.0}), _logits({EOS: 3.0})]
        assert _walk(spec, rows, device) == [3, 4, EOS]
        assert _walk(spec, [_logits({1: 2.0}), _logits({2: 0.5, 4: 3.0}), _logits({})], device) == [
            1,
            2,
            EOS,
        ]

    def test_logit_bias_chooses_among_the_allowed_only(self):
        """A bias moves the choice between the pattern's tokens ("c" over "ab" here) and can
        never lift one the pattern does not allow (token 10, "x", biased far ahead)."""
        spec = SamplingSpec(
            seed=0,
            guide_regex="(?:ab|c)+",
            guide_end_ids=(EOS,),
            logit_bias=((4, 5.0), (10, 100.0)),
        )
        assert _walk(spec, [_logits({3: 2.0}), _logits({3: 2.0}), _logits({EOS: 9.0})]) == [
            4,
            4,
            EOS,
        ]

    @pytest.mark.parametrize("device", ["cpu", "cuda"])
    def test_thinking_budget_forces_the_end_of_thinking(self, device):
        """With a budget of 2, the third token is think_end_id whatever the logits (token 10
        far ahead); after it nothing is forced. Its end sampled early, none is forced."""
        if device == "cuda" and not torch.cuda.is_available():
            pytest.skip("no GPU")
        spec = SamplingSpec(seed=0, think_budget=2, think_end_id=4)
        assert _walk(spec, [_logits({}) for _ in range(5)], device) == [10, 10, 4, 10, 10]
        assert _walk(spec, [_logits({4: 30.0}), *(_logits({}) for _ in range(4))], device) == [
            4,
            10,
            10,
            10,
            10,
        ]
        random = SamplingSpec(seed=3, temperature=1.0, think_budget=0, think_end_id=7)
        g = torch.Generator().manual_seed(0)
        assert _walk(random, [torch.randn(1, 16, generator=g) for _ in range(3)])[0] == 7

    def test_a_complete_output_offers_only_the_end(self):
        spec = SamplingSpec(seed=0, guide_regex="12?", guide_end_ids=(EOS,))
        assert _walk(spec, [_logits({9: 1.0}), _logits({8: 5.0})]) == [9, EOS]

    def test_random_rows_stay_on_the_pattern(self):
        """Seeded random sampling over random logits: every output of each seed matches."""
        pattern = r'\{"(?:a|b)*"\}'
        seen = set()
        for seed in range(30):
            spec = SamplingSpec(
                seed=seed, temperature=1.5, top_p=0.95, guide_regex=pattern, guide_end_ids=(EOS,)
            )
            g = torch.Generator().manual_seed(seed)
            out = _walk(spec, [torch.randn(1, 16, generator=g) for _ in range(12)])
            text = b"".join(VOCAB[t] for t in out[: out.index(EOS)] if t) if EOS in out else None
            assert text is None or re.fullmatch(pattern, text.decode()), out
            if text is not None:
                seen.add(text)
        assert len(seen) > 3

    def test_guides_are_shared_and_refused_without_a_vocabulary(self):
        sampler = _sampler()
        sampler.add(1, SamplingSpec(seed=0, guide_regex="a+"))
        sampler.add(2, SamplingSpec(seed=1, guide_regex="a+"))
        assert sampler._requests[1].guide is sampler._requests[2].guide
        with pytest.raises(ValueError, match="token bytes"):
            Sampler().add(1, SamplingSpec(seed=0, guide_regex="a+"))


class TestParams:
    def test_one_pattern_per_constraint(self):
        assert SamplingParams(guided_choice=["yes", "no", "yes"]).guided_choice == ("yes", "no")
        assert SamplingParams(guided_choice=["a.b"]).guide_regex == r"(?:a\.b)"
        assert SamplingParams(guided_regex="[0-9]+").guide_regex == "[0-9]+"
        spec = SamplingParams(guided_regex="x").to_spec(1, eos_token_ids={5, 3})
        assert spec.guide_regex == "x" and spec.guide_end_ids == (3, 5)
        assert SamplingParams().to_spec(1, eos_token_ids={5}).guide_end_ids == ()
        biased = SamplingParams(guided_regex="a", logit_bias={7: 1.0}).to_spec(
            1, eos_token_ids={5}
        )  # as vLLM's
        assert biased.guide_regex == "a" and biased.logit_bias == ((7, 1.0),)

    @pytest.mark.parametrize(
        "extra, words",
        [
            (dict(guided_choice="yes"), "list of non-empty strings"),
            (dict(guided_choice=["yes", ""]), "list of non-empty strings"),
            (dict(guided_choice=[str(i) for i in range(257)]), "at most 256"),
            (dict(guided_choice=["yes"], guided_regex="y"), "not guided_choice and guided_regex"),
            (dict(guided_regex="a$"), "guided_regex: regex 'a$'"),
            (dict(guided_regex="[^\x00-\U0010ffff]"), "guided_regex: no output can match it"),
            (dict(guided_regex=5), "guided_regex must be a string"),
            (dict(guided_regex="a", guided_whitespace=" "), "guided_whitespace applies"),
            (dict(guided_json_object=True, guided_whitespace="(?= )"), "guided_whitespace: regex"),
            (dict(guided_json="{not json"), "guided_json: not a JSON schema"),
            (dict(guided_choice=["yes"], allowed_token_ids=[7]), "combined with allowed_token_ids"),
            (dict(guided_choice=["yes"], bad_words=["no"]), "combined with bad_words"),
            (dict(guided_regex="a", min_tokens=1), "combined with min_tokens"),
            (dict(guided_regex="a", thinking_budget=3), "combined with thinking_budget"),
            (dict(thinking_budget=-1), "thinking_budget must be an integer >= 0"),
        ],
    )
    def test_refused(self, extra, words):
        with pytest.raises(ValueError, match=re.escape(words)):
            SamplingParams(**extra)

    def test_thinking_budget_reaches_the_spec_with_its_end_token(self):
        params = SamplingParams(thinking_budget=5)
        with pytest.raises(ValueError, match="resolve_thinking_end"):
            params.to_spec(1)
        with pytest.raises(ValueError, match="lacks"):
            params.resolve_thinking_end(None)
        spec = params.resolve_thinking_end(42).to_spec(1)
        assert (spec.think_budget, spec.think_end_id) == (5, 42)
        assert SamplingParams().to_spec(1).think_budget == -1
