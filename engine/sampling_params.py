"""Per-request sampling parameters, checked once at construction.

Every refusal is a `ParamError` naming the field (the HTTP layer answers it as a 400 with
that `param`). Ranges follow vLLM's `SamplingParams` (the float knobs' ranges: ipc/messages.py
`SAMPLING_RANGES`); logprobs and prompt_logprobs up to the engine's max_logprobs (20 by
default), which `AsyncEngine.generate` checks, as it checks that the prompt and max_tokens fit.
Conventions chosen here, and refused otherwise:
- `max_tokens` None: whatever the context leaves after the prompt (the engine resolves it,
  `resolve_max_tokens`, as vLLM does for a chat that gives none).
- `top_k = 0` disables top-k, and so does -1, as in vLLM (clients built for it send -1).
- a temperature near 0 is greedy (ipc/messages.py `is_greedy`, the rank's rule too); `seed`
  only matters for random sampling.
- `stop` is a sequence of non-empty strings (a bare string is refused: it is a common slip
  that would otherwise be read as one stop string per character).
- `min_tokens` (<= max_tokens): until that many tokens were sampled the rank masks the EOS ids
  and `stop_token_ids` (the EOS ids even with ignore_eos, as vLLM's `all_stop_token_ids`), and
  stop strings are not looked for (vLLM's detokenizer: only in the text of later tokens).
- `logit_bias` maps token ids to a bias in [-100, 100] (OpenAI's range; the HTTP layer clamps
  to it as vLLM does), added to the logits before penalties and temperature; a dict or
  (id, bias) pairs, frozen into pairs in id order.
- `allowed_token_ids` (non-empty; frozen sorted and unique): only these can be sampled (vLLM
  masks every other logit); `bad_words`: the engine tokenizes them (`tokenize_bad_words`, as
  vLLM's update_from_tokenizer) and the rank forbids a sequence's last token wherever the output
  so far ends with the rest. Both are masks on the rank, like min_tokens': logprobs stay raw.
- Structured outputs (vLLM's StructuredOutputsParams), at most one of: `guided_choice` (the
  output is one of these strings; at most MAX_GUIDED_CHOICES), `guided_regex` (the whole output
  matches it), `guided_json` (a JSON schema, as JSON text or a dict: the output is a JSON text
  valid for it), `guided_json_object` (some JSON object), `guided_grammar` (a GBNF or Lark
  grammar), `guided_structural_tag` (JSON text or a dict of structures and triggers, or a
  format: engine/structural_tag.py); `guided_whitespace` is the pattern of the whitespace
  allowed between JSON tokens (vLLM's whitespace_pattern). They are checked here for their
  shape only: the engine compiles them (`AsyncEngine.prepare`, engine/guided.py, on
  llguidance) into `guide_grammar`, and the rank masks every token that cannot continue the
  output towards a match; where the output is a match the EOS ids stay allowed, and where
  nothing may follow they alone are (vLLM's grammar too ends with EOS). The request ends at
  that EOS even with ignore_eos (the constraint's end); stop strings, stop_token_ids and
  max_tokens ("length", the output cut) may end it earlier. Refused with allowed_token_ids,
  bad_words and min_tokens (masks of their own, whose intersection with the constraint's could
  leave nothing to sample); logit_bias (finite: the mask still wins), penalties, temperature
  and the filters act on the allowed tokens, as vLLM's. Logprobs stay raw.
- `prompt_logprobs` (vLLM's): the logprob and rank of every prompt token after the first,
  with that many alternatives, of the model's raw distribution (`PromptLogprobsEvent`); such a
  request reuses no saved prefix (its positions' logits are needed).
- `thinking_budget` (>= 0): the output starts inside a think block (the prompt opened it); once
  that many tokens were sampled without `</think>`, the rank forces `</think>` (its id resolved
  from the tokenizer by the engine, `resolve_thinking_end`), and the answer follows. Refused
  with a guided constraint (the forced token may not continue it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple, NoReturn

from deltaserve.ipc.messages import (
    SAMPLING_RANGES,
    GuideLimits,
    SamplingRange,
    SamplingSpec,
    is_greedy,
)

if TYPE_CHECKING:
    from deltaserve.engine.guided.stop_regex import StopTemplate

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 16
MAX_STOP_STRINGS = 16
# A request's seed is any int64, as vLLM's (negative ones included).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# The largest wire seed: the engine sends (seed + choice index) modulo MAX_SEED + 1 = 2**64
# (`wire_seed`), which maps the int64 seeds one to one onto msgpack's uint64 range; the rank
# sampler reads a seed modulo 2**64 too (so -1 and 2**64 - 1 are one stream, by design).
MAX_SEED = 2**64 - 1
# top_k at or above the vocabulary size means "off" on the rank; larger values are sent as
# this (msgpack cannot carry ints past 2**64, and one such request used to kill the engine).
MAX_WIRE_TOP_K = 2**31 - 1
LOGIT_BIAS_RANGE = SamplingRange(-100.0, 100.0)  # OpenAI's bound on a logit_bias value
# Token ids past any vocabulary are refused here (the engine checks the model's own), so that
# whatever these params hold can go on the wire (msgpack ints stop at 2**64).
MAX_TOKEN_ID = 2**31 - 1
# vLLM's VLLM_MAX_NUM_BAD_WORDS default: token sequences the bad words may give (each word
# gives one or two), so a request cannot make the rank check thousands each token.
MAX_BAD_WORD_SEQUENCES = 128
# guided_choice: an alternation of this many strings at most
MAX_GUIDED_CHOICES = 256
GUIDED_FIELDS = (  # SamplingParams' field of each constraint kind (engine/guide_grammar.py)
    ("guided_choice", "choice"),
    ("guided_regex", "regex"),
    ("guided_json", "json"),
    ("guided_json_object", "json_object"),
    ("guided_grammar", "grammar"),
    ("guided_structural_tag", "structural_tag"),
)


class ParamError(ValueError):
    """A request refused for one of its parameters: `param` names it (a SamplingParams field,
    or "prompt", "priority", "request_id" for `generate`'s own arguments), the message says
    why; the HTTP layer answers it as a 400 naming the field the client sent."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Constraint(NamedTuple):
    """A request's structured-output constraint as the compile worker takes it: `text` is the
    choices as a JSON list, the regex, the schema's or tag's JSON text, the grammar."""

    field: str
    kind: str
    text: str
    whitespace: str | None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, int | float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int | None = DEFAULT_MAX_TOKENS  # None: what the context leaves
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # SGLang's: a match in the output ends it, kept (engine/stop_regex.py)
    stop_regex: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # or a dict {token id: bias}
    include_stop_str_in_output: bool = False  # the matched stop string (or token) stays in the text
    skip_special_tokens: bool = True
    allowed_token_ids: tuple[int, ...] | None = None  # None: every token
    bad_words: tuple[str, ...] = ()
    # bad_words as token-id sequences: set by `tokenize_bad_words` (the engine calls it)
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    # None: off; k: each prompt token's logprob and k alternatives
    prompt_logprobs: int | None = None
    guided_choice: tuple[str, ...] = ()  # empty: unconstrained; else the output is one of these
    guided_regex: str | None = None  # the whole output matches this regex
    # a JSON schema (JSON text, or a dict): the output is valid for it
    guided_json: str | None = None
    guided_json_object: bool = False  # the output is a JSON object
    # a GBNF or Lark grammar (vLLM's grammar, SGLang's ebnf): the output is its root's
    guided_grammar: str | None = None
    # a structural tag, JSON text {structures, triggers} (engine/structural_tag.py): free text
    # whose triggers start tagged JSON structures
    guided_structural_tag: str | None = None
    # regex of the whitespace between JSON tokens; None: the default
    guided_whitespace: str | None = None
    # the most tokens the output may think for: it starts inside a think block (the prompt
    # opened it), and once this many were sampled without </think>, </think> is forced
    thinking_budget: int | None = None
    # the </think> token id: set by `resolve_thinking_end` (the engine calls it)
    thinking_end_id: int | None = None
    # set by the engine's compile (`AsyncEngine.prepare`, engine/guided.py): the constraint's
    # llguidance grammar ("" for none; None: not compiled yet), the bounds rank 0 holds it to,
    # and each stop regex's matcher
    guide_grammar: str | None = None
    guide_limits: GuideLimits | None = None
    stop_regex_templates: tuple[StopTemplate, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _refuse("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        for name, allowed in SAMPLING_RANGES.items():
            _check_range(name, getattr(self, name), allowed)
        if not _is_int(self.top_k) or self.top_k < -1:
            _refuse(
                "top_k", f"must be an integer >= -1 (0 or -1 disables top-k), got {self.top_k!r}"
            )
        if self.seed is not None and (
            not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            _refuse(
                "seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}] or None, got {self.seed!r}"
            )
        if isinstance(self.stop, str) or not isinstance(self.stop, tuple | list):
            _refuse("stop", f"must be a list or tuple of strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            _refuse("stop", f"has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} allowed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ParamError("stop", f"stop strings must be non-empty strings, got {s!r}")
        if isinstance(self.stop_regex, str):
            object.__setattr__(self, "stop_regex", (self.stop_regex,))
        if not isinstance(self.stop_regex, tuple | list):
            _refuse("stop_regex", f"must be a list of regexes, got {self.stop_regex!r}")
        for pattern in self.stop_regex:  # their number and size: the engine's bounds
            if not isinstance(pattern, str) or not pattern:
                _refuse("stop_regex", f"must hold non-empty strings, got {pattern!r}")
        object.__setattr__(self, "stop_regex", tuple(self.stop_regex))
        if isinstance(self.stop_token_ids, str) or not isinstance(
            self.stop_token_ids, tuple | list
        ):
            _refuse(
                "stop_token_ids", f"must be a list or tuple of ints, got {self.stop_token_ids!r}"
            )
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t <= MAX_TOKEN_ID:
                _refuse(
                    "stop_token_ids",
                    f"must hold token ids in [0, {MAX_TOKEN_ID}] (no vocabulary is larger), "
                    f"got {t!r}",
                )
        for name in ("logprobs", "prompt_logprobs"):  # at most the engine's max_logprobs
            if (value := getattr(self, name)) is not None and (not _is_int(value) or value < 0):
                _refuse(name, f"must be an integer >= 0 or None, got {value!r}")
        if self.thinking_budget is not None and (
            not _is_int(self.thinking_budget) or self.thinking_budget < 0
        ):
            _refuse(
                "thinking_budget", f"must be an integer >= 0 or None, got {self.thinking_budget!r}"
            )
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            _refuse("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= (
            self.max_tokens or self.min_tokens
        ):
            _refuse(
                "min_tokens",
                f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
            )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _refuse(name, f"must be a bool, got {getattr(self, name)!r}")
        # Lists (and the bias dict) are accepted for convenience and frozen here into tuples.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _allowed(self.allowed_token_ids))
        if (
            isinstance(self.bad_words, str)
            or not isinstance(self.bad_words, tuple | list)
            or not all(isinstance(w, str) for w in self.bad_words)
        ):
            _refuse("bad_words", f"must be a list of strings, got {self.bad_words!r}")
        # as vLLM: once each
        object.__setattr__(self, "bad_words", tuple(dict.fromkeys(self.bad_words)))
        if self.bad_words_token_ids is not None:
            object.__setattr__(
                self,
                "bad_words_token_ids",
                _sequences(self.bad_words_token_ids, "bad_words_token_ids"),
            )
        object.__setattr__(self, "guided_choice", _choices(self.guided_choice))
        for name in ("guided_json", "guided_structural_tag"):
            if isinstance(value := getattr(self, name), Mapping | bool):
                object.__setattr__(self, name, _json_text(value, name))
        for name in (
            "guided_regex",
            "guided_json",
            "guided_whitespace",
            "guided_grammar",
            "guided_structural_tag",
        ):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                _refuse(name, f"must be a string or None, got {getattr(self, name)!r}")
        if not isinstance(self.guided_json_object, bool):
            _refuse("guided_json_object", f"must be a bool, got {self.guided_json_object!r}")
        given = [name for name, _ in GUIDED_FIELDS if getattr(self, name)]
        if len(given) > 1:
            raise ParamError(
                given[1], f"give one structured-output constraint, not {' and '.join(given)}"
            )
        if self.guided_whitespace is not None and not (self.guided_json or self.guided_json_object):
            _refuse("guided_whitespace", "applies to guided_json and guided_json_object only")
        if given:
            for name, used in (
                ("allowed_token_ids", self.allowed_token_ids is not None),
                ("bad_words", bool(self.bad_words)),
                ("min_tokens", self.min_tokens > 0),
                ("thinking_budget", self.thinking_budget is not None),
            ):
                if used:
                    raise ParamError(
                        given[0], f"structured outputs (guided_*) cannot be combined with {name}"
                    )

    def constraint(self) -> Constraint | None:
        """The structured-output constraint given, if any, as the compile worker takes it."""
        for name, kind in GUIDED_FIELDS:
            if value := getattr(self, name):
                text = (
                    json.dumps(list(value))
                    if kind == "choice"
                    else ""
                    if kind == "json_object"
                    else value
                )
                return Constraint(name, kind, text, self.guided_whitespace)
        return None

    @property
    def is_guided(self) -> bool:
        """A constraint guides the output: its EOS ends it (even with ignore_eos)."""
        return bool(self.guide_grammar) or self.constraint() is not None

    @property
    def is_prepared(self) -> bool:
        """Compiled by the engine (`AsyncEngine.prepare`) where there is anything to compile."""
        return (self.guide_grammar is not None or self.constraint() is None) and len(
            self.stop_regex_templates
        ) == len(self.stop_regex)

    def resolve_thinking_end(self, end_id: int | None) -> SamplingParams:
        """These params with the tokenizer's </think> id (`end_id`, None: it has none) where a
        thinking budget needs it."""
        if self.thinking_budget is None or self.thinking_end_id is not None:
            return self
        if end_id is None:
            raise ParamError(
                "thinking_budget",
                "thinking_budget needs a </think> token, which this tokenizer lacks",
            )
        return replace(self, thinking_end_id=end_id)

    def tokenize_bad_words(self, encode: Callable[[str], list[int]]) -> SamplingParams:
        """These params with `bad_words_token_ids` set, as vLLM's update_from_tokenizer: each word
        (leading spaces stripped) alone, and after a space when that starts with another token
        and gives as many (so the word is caught at the text's start and mid-text)."""
        if not self.bad_words or self.bad_words_token_ids is not None:
            return self
        sequences: list[tuple[int, ...]] = []
        for word in self.bad_words:
            alone = tuple(encode(word.lstrip()))
            if not alone:
                raise ParamError(
                    "bad_words", f"bad_words entry {word!r} must tokenize to at least one token"
                )
            spaced = tuple(encode(" " + word.lstrip()))
            sequences.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
            if len(sequences) > MAX_BAD_WORD_SEQUENCES:
                raise ParamError(
                    "bad_words",
                    f"bad_words give more than {MAX_BAD_WORD_SEQUENCES} token sequences; "
                    "send fewer words",
                )
        return replace(self, bad_words_token_ids=tuple(sequences))

    @property
    def is_greedy(self) -> bool:
        return is_greedy(self.temperature)

    def resolve_max_tokens(self, prompt_len: int, longest_sequence: int) -> SamplingParams:
        """These params with max_tokens None resolved to what a sequence of at most
        `longest_sequence` positions leaves after the prompt (at least 1: a prompt that leaves
        none is then refused, naming it, by the engine's check that the two fit)."""
        if self.max_tokens is not None:
            return self
        return replace(self, max_tokens=max(1, longest_sequence - prompt_len))

    def to_spec(self, seed: int, eos_token_ids: Collection[int] = ()) -> SamplingSpec:
        """The rank-side part of these parameters, with the seed resolved by the engine; the
        rank masks `eos_token_ids` and the stop ids until min_tokens tokens were sampled."""
        masked = tuple(sorted({*eos_token_ids, *self.stop_token_ids})) if self.min_tokens else ()
        if self.bad_words and self.bad_words_token_ids is None:
            raise ValueError("bad_words must be tokenized first (tokenize_bad_words)")
        if self.thinking_budget is not None and self.thinking_end_id is None:
            raise ValueError("thinking_budget needs its end token first (resolve_thinking_end)")
        if not self.is_prepared:
            raise ValueError(
                "structured outputs and stop_regex are compiled first: "
                "params = await engine.prepare(params)"
            )
        return SamplingSpec(
            seed=seed,
            temperature=float(self.temperature),
            top_k=min(max(self.top_k, 0), MAX_WIRE_TOP_K),  # the wire's "off" is 0 alone
            top_p=float(self.top_p),
            min_p=float(self.min_p),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            num_logprobs=self.logprobs or 0,
            min_tokens=self.min_tokens if masked else 0,
            stop_token_ids=masked,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids or (),
            bad_words=self.bad_words_token_ids or (),
            guide_grammar=self.guide_grammar or "",
            guide_end_ids=tuple(sorted(eos_token_ids)) if self.guide_grammar else (),
            guide_limits=self.guide_limits if self.guide_grammar else None,
            think_budget=-1 if self.thinking_budget is None else self.thinking_budget,
            think_end_id=-1 if self.thinking_end_id is None else self.thinking_end_id,
        )


def wire_seed(seed: int, index: int = 0) -> int:
    """The seed that choice `index` of a request seeded with `seed` samples with, in
    [0, MAX_SEED]: distinct int64 seeds give distinct wire seeds."""
    return (seed + index) % (MAX_SEED + 1)


def _allowed(ids: object) -> tuple[int, ...]:
    if isinstance(ids, str) or not isinstance(ids, tuple | list):
        _refuse("allowed_token_ids", f"must be a list of token ids, got {ids!r}")
    if not ids:  # vLLM's "allowed_token_ids is not None and empty!"
        _refuse("allowed_token_ids", "is empty: no token could be sampled")
    for t in ids:
        if not _is_int(t) or not 0 <= t <= MAX_TOKEN_ID:
            _refuse("allowed_token_ids", f"must hold token ids in [0, {MAX_TOKEN_ID}], got {t!r}")
    return tuple(sorted(set(ids)))


def _choices(value: object) -> tuple[str, ...]:
    """guided_choice as given: distinct non-empty strings, once each, in their order."""
    if (
        isinstance(value, str)
        or not isinstance(value, tuple | list)
        or not all(isinstance(c, str) and c for c in value)
    ):
        _refuse("guided_choice", f"must be a list of non-empty strings, got {value!r}")
    choices = tuple(dict.fromkeys(value))
    if len(choices) > MAX_GUIDED_CHOICES:
        _refuse(
            "guided_choice", f"has {len(choices)} choices; at most {MAX_GUIDED_CHOICES} allowed"
        )
    return choices


def _json_text(value: object, name: str) -> str:
    """A dict (or true/false) given for a JSON field, as JSON text; a value nested past the
    encoder's recursion is refused here, naming the field (the engine bounds nesting far
    lower)."""
    try:
        return json.dumps(value)
    except RecursionError:
        raise ParamError(name, f"{name} is nested too deep") from None
    except (TypeError, ValueError) as exc:
        raise ParamError(name, f"{name} is not JSON: {exc}") from None


def _sequences(value: object, name: str) -> tuple[tuple[int, ...], ...]:
    """Token-id sequences as given (by `tokenize_bad_words`, or a caller of its own): each a
    non-empty run of token ids."""
    if not isinstance(value, tuple | list) or not all(
        isinstance(seq, tuple | list)
        and seq
        and all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in seq)
        for seq in value
    ):
        _refuse(name, f"must be non-empty lists of token ids, got {value!r}")
    return tuple(tuple(seq) for seq in value)


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token id, bias) pairs in id order; ParamError naming the bad entry."""
    if isinstance(bias, str) or not isinstance(bias, Mapping | tuple | list):
        _refuse("logit_bias", f"must map token ids to biases, got {bias!r}")
    entries = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
    pairs = {}
    for entry in entries:
        if not isinstance(entry, tuple | list) or len(entry) != 2:
            _refuse("logit_bias", f"entries must be (token id, bias) pairs, got {entry!r}")
        token_id, value = entry
        if not _is_int(token_id) or not 0 <= token_id <= MAX_TOKEN_ID:
            _refuse(
                "logit_bias",
                f"keys must be token ids in [0, {MAX_TOKEN_ID}] (no vocabulary is larger), "
                f"got {token_id!r}",
            )
        if token_id in pairs:
            _refuse("logit_bias", f"has token id {token_id} twice")
        _check_range(f"logit_bias of token {token_id}", value, LOGIT_BIAS_RANGE, "logit_bias")
        pairs[token_id] = float(value)
    return tuple(sorted(pairs.items()))


def _refuse(name: str, why: str) -> NoReturn:
    raise ParamError(name, f"{name} {why}")


def _check_range(name: str, value: object, allowed: SamplingRange, param: str = "") -> None:
    """Raise ParamError naming `param` (else `name`) unless `value` is a number `allowed`."""
    if not _is_number(value) or not math.isfinite(value):
        raise ParamError(param or name, f"{name} must be a finite number, got {value!r}")
    if not allowed.admits(value):
        raise ParamError(param or name, f"{name} must be in {allowed}, got {value!r}")
