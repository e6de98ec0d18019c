"""Parse and check OpenAI `/v1/completions` and `/v1/chat/completions` request bodies.

Pure (no aiohttp, no engine): a JSON value in, a frozen request description out, or an
`ApiError` (400) that names the offending field. Every field is on an explicit list: fields we
honour are parsed, fields we cannot honour are refused unless they carry their no-op value,
and unknown fields are refused. Value ranges that the engine's `SamplingParams` checks are left
to it (its ValueError names the field); the OpenAI-only limits are checked here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deltaserve.http.errors import ApiError, bad_request, unsupported
from deltaserve.http.json_fields import (
    is_int,
    json_object,
    json_type,
    opt_bool,
    opt_float,
    opt_int,
    opt_str,
)
from deltaserve.http.media_parts import OPENAI_MEDIA_PARTS, openai_part
from deltaserve.http.structured_output import STRUCTURED_OUTPUT_KEYS, Guided, parse_guided
from deltaserve.http.tool_protocol import TOOL_MESSAGE_KEYS, parse_tool_fields, tool_message_fields

if TYPE_CHECKING:
    from deltaserve.engine.sampling_params import SamplingParams
    from deltaserve.http.tool_protocol import ToolChoice, ToolFields

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs (the engine's `max_logprobs` is passed in)
TEXT_PART_SEPARATOR = "\n"  # between a message's text parts, as vLLM joins them
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# Sampling fields shared by both endpoints (OpenAI names plus the vLLM extras).
_SAMPLING_KEYS = frozenset(
    {
        "temperature",
        "top_p",
        "n",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "stop_token_ids",
        "min_tokens",
        "logit_bias",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "allowed_token_ids",
        "bad_words",
        "truncate_prompt_tokens",
        "prompt_logprobs",
        "thinking_budget",
        "stop_regex",
        *STRUCTURED_OUTPUT_KEYS,
    }
)
# Harmless metadata: accepted and not used for generation.
_METADATA_KEYS = frozenset({"user"})
# vLLM's extra fields that clients send at their defaults, each the way this server works
# anyway: accepted at that value (or null), refused at any other. add_special_tokens: vLLM
# adds them to a completion's prompt, not to a rendered chat. The Qwen tokenizer adds none
# when encoding, so the prompt is the same either way.
_COMPLETION_DEFAULTS = {"add_special_tokens": True}
_CHAT_DEFAULTS = {"add_special_tokens": False}
_BEAM_SEARCH_KEYS = frozenset(
    {"use_beam_search", "length_penalty"}
)  # vLLM's: http/beam_completions.py
_COMPLETION_KEYS = (
    _SAMPLING_KEYS
    | _METADATA_KEYS
    | frozenset(_COMPLETION_DEFAULTS)
    | _BEAM_SEARCH_KEYS
    | {
        "model",
        "prompt",
        "max_tokens",
        "stream",
        "stream_options",
        "logprobs",
        "echo",
        "best_of",
        "logit_bias",
        "suffix",
        "return_tokens_as_token_ids",
        "priority",
    }
)
# With use_beam_search (vLLM's BeamSearchParams): what a search uses; any other sampling field
# given is refused, as the search would not honour it.
_BEAM_KEYS = frozenset(
    {
        "use_beam_search",
        "length_penalty",
        "n",
        "max_tokens",
        "temperature",
        "ignore_eos",
        "include_stop_str_in_output",
        "skip_special_tokens",
    }
)
_CHAT_KEYS = (
    _SAMPLING_KEYS
    | _METADATA_KEYS
    | frozenset(_CHAT_DEFAULTS)
    | _BEAM_SEARCH_KEYS
    | {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "stream",
        "stream_options",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "chat_template_kwargs",
        "include_reasoning",
        "return_tokens_as_token_ids",
        "add_generation_prompt",
        "continue_final_message",
        "priority",
    }
)
_ROLES = ("system", "user", "assistant", "developer", "tool")
# Message fields taken only when null (or []): tool calls, and what the SDK's model_dump() of
# a reply carries (annotations, audio, ...) when a client sends it back as history.
_NULL_MESSAGE_KEYS = frozenset({"tool_calls", "function_call", "refusal", "annotations", "audio"})
# An assistant message's thinking, as a reasoning parser returned it (`reasoning`, or its
# older name): the template gets it under both names, as vLLM passes it (Qwen3.5's template
# renders `reasoning_content` in the turns after the last user message).
_REASONING_KEYS = ("reasoning", "reasoning_content")
# OpenAI's newer name for the system message (as vLLM, we take it): the template sees "system".
_ROLE_ALIASES = {"developer": "system"}


@dataclass(frozen=True, slots=True)
class SamplingFields:
    """The sampling knobs of one request, type-checked, in `SamplingParams` terms.

    `max_tokens` None means "whatever context is left after the prompt" (resolved by the
    server once the prompt is tokenized)."""

    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_regex: tuple[str, ...] = ()  # SGLang's (engine/stop_regex.py)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, rank and alternatives
    thinking_budget: int | None = (
        None  # the most tokens the output thinks for (then </think> is forced)
    )
    guided: Guided = (
        Guided()
    )  # vLLM's structured outputs, forced tool calls (http/structured_output.py)

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """Build the engine's params (which check ranges and raise ValueError naming the
        field)."""
        from deltaserve.engine.sampling_params import SamplingParams

        knobs = {
            name: getattr(self, name)
            for name in self.__dataclass_fields__
            if name not in ("max_tokens", "guided")
        }
        return SamplingParams(max_tokens=max_tokens, **knobs, **self.guided.params())


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """`prompts` holds each prompt as text or token ids; choices are indexed prompt-major:
    choice `p * n + i` is the i-th sample of prompt p."""

    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]
    sampling: SamplingFields
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)
    truncate_prompt_tokens: int | None = None  # keep the last N prompt tokens; -1: what fits
    echo: bool = False  # each choice's text (and logprobs) starts with its prompt's
    return_tokens_as_token_ids: bool | None = (
        None  # logprobs say "token_id:{id}"; None: the server's flag
    )
    priority: int = 0  # vLLM's: lower is admitted first (--scheduling-policy priority)
    beam_search: bool = False  # vLLM's use_beam_search: n beams, engine/beam_search.py
    length_penalty: float = 1.0  # a beam's score: cumulative logprob / length ** length_penalty


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """`messages` are normalised to `{"role", "content": str}` (and `"name"` when given, and
    the tool fields of tool_protocol.py's `tool_message_fields`); `logprobs` asks for the chat
    logprobs shape (then `sampling.logprobs` is the number of alternatives, 0..max_logprobs). `tools`
    (for the template) and `tool_choice`: tool_protocol.py's `ToolFields`."""

    model: str | None
    messages: tuple[dict[str, Any], ...]
    sampling: SamplingFields
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    truncate_prompt_tokens: int | None = None  # of the rendered template's tokens
    logprobs: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    include_reasoning: bool = True  # vLLM's: False leaves a reasoning parser's reasoning out
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: ToolChoice = (
        "none"  # "auto": the output read by the parser; "required", named: forced
    )
    parallel_tool_calls: bool = True  # False: only the first call is returned (as vLLM)
    return_tokens_as_token_ids: bool | None = None  # as CompletionRequest's
    # vLLM's: the template's generation prompt, or the last message continued (an answer's
    # start given, the output goes on from it)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    priority: int = 0  # as CompletionRequest's
    beam_search: bool = False  # as CompletionRequest's: its n beams are the choices
    length_penalty: float = 1.0


# ---- entry points ------------------------------------------------------------------------


def parse_completion_request(
    body: object, defaults: Mapping[str, float] | None = None, *, max_logprobs: int = MAX_LOGPROBS
) -> CompletionRequest:
    """`defaults`: sampling settings (temperature, top_p, top_k, min_p, repetition_penalty)
    taken where the body leaves them out or null: the model's generation_config.json, as
    vLLM takes it. `max_logprobs`: the engine's bound on logprobs and prompt_logprobs."""
    obj = json_object(body)
    _refuse_unknown(obj, _COMPLETION_KEYS)
    _refuse_non_defaults(obj, _COMPLETION_DEFAULTS)
    opt_str(obj, "user")  # metadata, unused: still a string, as OpenAI's
    echo = opt_bool(obj, "echo", default=False)
    if obj.get("best_of") not in (None, 1):
        raise unsupported("best_of", "only best_of=1 is supported; use n for several samples")
    if obj.get("suffix") not in (None, ""):
        raise unsupported("suffix", "insertion (suffix) is not supported")
    logprobs = opt_int(obj, "logprobs")
    if logprobs is not None and not 0 <= logprobs <= max_logprobs:
        raise bad_request(f"logprobs must be in 0..{max_logprobs}, got {logprobs}", "logprobs")
    max_tokens = opt_int(obj, "max_tokens", default=DEFAULT_COMPLETION_MAX_TOKENS)
    stream, include_usage, continuous = _stream(obj)
    prompt_logprobs = _prompt_logprobs(obj, stream, max_logprobs)
    if prompt_logprobs is None and echo:  # as vLLM: echoed logprobs cover the prompt's tokens too
        prompt_logprobs = logprobs
    beam_search, length_penalty = _beam_search(obj, max_logprobs)
    return CompletionRequest(
        model=opt_str(obj, "model"),
        prompts=_prompts(obj),
        sampling=_sampling(
            obj,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            defaults=defaults,
        ),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        truncate_prompt_tokens=_truncate(obj),
        echo=echo,
        return_tokens_as_token_ids=opt_bool(obj, "return_tokens_as_token_ids", default=None),
        priority=opt_int(obj, "priority", default=0),
        beam_search=beam_search,
        length_penalty=length_penalty,
    )


def _beam_search(obj: dict[str, Any], max_logprobs: int) -> tuple[bool, float]:
    """vLLM's use_beam_search and length_penalty. A search takes n, max_tokens, temperature (no
    effect: candidates come from raw logprobs, as vLLM's), ignore_eos, include_stop_str_in_output,
    skip_special_tokens and length_penalty; its answer comes whole, without logprobs (chat's
    `logprobs: false` is none)."""
    length_penalty = opt_float(obj, "length_penalty", 1.0)
    if not opt_bool(obj, "use_beam_search", default=False):
        if length_penalty != 1.0:
            raise unsupported("length_penalty", "it scores beams: only with use_beam_search")
        return False, length_penalty
    for key, value in obj.items():
        given = value is not None and not (key == "logprobs" and value is False)
        if (
            given
            and (key in _SAMPLING_KEYS or key in ("logprobs", "top_logprobs"))
            and key not in _BEAM_KEYS
        ):
            raise unsupported(
                key,
                "beam search does not use it (use_beam_search takes n, max_tokens, temperature, "
                "ignore_eos, include_stop_str_in_output, skip_special_tokens and length_penalty)",
            )
    for key, value in (("stream", False), ("echo", False), ("priority", 0)):
        if obj.get(key) not in (None, value):
            raise unsupported(
                key,
                "beam search answers whole, at priority 0 and without echo: "
                f"{key} must be {str(value).lower()}",
            )
    if obj.get("max_tokens") is not None and opt_int(obj, "max_tokens") < 1:
        raise bad_request("max_tokens must be at least 1 for a beam search", "max_tokens")
    width = opt_int(obj, "n", default=1)
    if width is None or not 1 <= 2 * width <= max_logprobs:
        raise bad_request(
            f"n (the beam width) must be in 1..{max_logprobs // 2}: each step asks for 2 x n "
            f"logprobs, at most --max-logprobs ({max_logprobs})",
            "n",
        )
    return True, length_penalty


def parse_chat_request(
    body: object, defaults: Mapping[str, float] | None = None, *, max_logprobs: int = MAX_LOGPROBS
) -> ChatRequest:
    """`defaults`, `max_logprobs`: as parse_completion_request's."""
    obj = json_object(body)
    _refuse_unknown(obj, _CHAT_KEYS)
    _refuse_non_defaults(obj, _CHAT_DEFAULTS)
    opt_str(obj, "user")  # metadata, unused: still a string, as OpenAI's
    tool_fields = parse_tool_fields(obj)
    logprobs = opt_bool(obj, "logprobs", default=False)
    top_logprobs = opt_int(obj, "top_logprobs")
    if top_logprobs is not None:
        if not logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if not 0 <= top_logprobs <= max_logprobs:
            raise bad_request(
                f"top_logprobs must be in 0..{max_logprobs}, got {top_logprobs}", "top_logprobs"
            )
    max_tokens = opt_int(obj, "max_tokens")
    max_completion_tokens = opt_int(obj, "max_completion_tokens")
    if (
        max_completion_tokens is not None and max_completion_tokens < 1
    ):  # else refused naming max_tokens
        raise bad_request(
            f"max_completion_tokens must be >= 1, got {max_completion_tokens}",
            "max_completion_tokens",
        )
    if (
        max_tokens is not None
        and max_completion_tokens is not None
        and max_tokens != max_completion_tokens
    ):
        raise bad_request(
            f"max_tokens ({max_tokens}) and max_completion_tokens ({max_completion_tokens}) "
            "disagree; send one",
            "max_completion_tokens",
        )
    template_kwargs = obj.get("chat_template_kwargs")
    if template_kwargs is None:
        template_kwargs = {}
    elif not isinstance(template_kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    stream, include_usage, continuous = _stream(obj)
    generation = opt_bool(obj, "add_generation_prompt", default=True)
    continuation = opt_bool(obj, "continue_final_message", default=False)
    if generation and continuation:  # vLLM's words
        raise bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    beam_search, length_penalty = _beam_search(obj, max_logprobs)
    sampling = _sampling(
        obj,
        max_tokens=max_completion_tokens if max_completion_tokens is not None else max_tokens,
        logprobs=(top_logprobs or 0) if logprobs else None,
        defaults=defaults,
        tools=tool_fields,
        prompt_logprobs=_prompt_logprobs(obj, stream, max_logprobs),
    )
    if beam_search and sampling.guided.param is not None:  # a forced tool call
        raise unsupported(
            sampling.guided.param,
            "beam search does not constrain its output; "
            "a forced tool call needs sampling (use_beam_search false)",
        )
    return ChatRequest(
        model=opt_str(obj, "model"),
        messages=_messages(obj),
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        truncate_prompt_tokens=_truncate(obj),
        logprobs=logprobs,
        chat_template_kwargs=dict(template_kwargs),
        include_reasoning=opt_bool(obj, "include_reasoning", default=True),
        tools=tool_fields.tools,
        tool_choice=tool_fields.tool_choice,
        parallel_tool_calls=tool_fields.parallel_tool_calls,
        return_tokens_as_token_ids=opt_bool(obj, "return_tokens_as_token_ids", default=None),
        add_generation_prompt=generation,
        continue_final_message=continuation,
        priority=opt_int(obj, "priority", default=0),
        beam_search=beam_search,
        length_penalty=length_penalty,
    )


# ---- pieces ------------------------------------------------------------------------------


def _refuse_unknown(obj: dict[str, Any], known: frozenset[str]) -> None:
    for key in obj:
        if key not in known:
            raise unsupported(key, "unknown or unsupported parameter")


def _refuse_non_defaults(obj: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Each field of `defaults` present must be null or its default, of the default's JSON
    type (1 is not true, false is not 0)."""
    for name, default in defaults.items():
        value = obj.get(name)
        if value is None:
            continue
        if isinstance(default, bool) or isinstance(value, bool):
            same = value is default
        else:
            same = isinstance(value, int | float | list | str) and value == default
        if not same:
            shown = "null" if default is None else json.dumps(default)
            raise unsupported(name, f"only its default ({name}={shown}) is supported")


def _logit_bias(obj: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's {token id as a string: bias}, as (id, bias) pairs; a bias past [-100, 100] is
    clamped to it, as vLLM clamps it. Ids outside the vocabulary are the engine's check."""
    value = obj.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request(f"logit_bias must be an object, got {json_type(value)}", "logit_bias")
    pairs = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:  # int() refuses 4300 digits
            raise bad_request(f"logit_bias key {key[:20]!r} is not a token id", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            got = json_type(bias)
            raise bad_request(f"logit_bias[{key!r}] must be a number, got {got}", "logit_bias")
        if isinstance(bias, float) and not math.isfinite(bias):
            raise bad_request(f"logit_bias[{key!r}] must be finite, got {bias}", "logit_bias")
        pairs.append((int(key), float(min(100.0, max(-100.0, bias)))))  # ints of any size compare
    return tuple(pairs)


def _stream(obj: dict[str, Any]) -> tuple[bool, bool, bool]:
    """stream, include_usage, continuous usage: as vLLM's should_include_usage, usage in every
    chunk only with include_usage too."""
    stream = opt_bool(obj, "stream", default=False)
    options = obj.get("stream_options")
    if options is None:
        return stream, False, False
    if not stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    for key in options:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise unsupported(
                f"stream_options.{key}",
                "only include_usage and continuous_usage_stats are supported",
            )
        if options[key] is not None and not isinstance(options[key], bool):
            raise bad_request(f"stream_options.{key} must be a boolean", f"stream_options.{key}")
    include_usage = bool(options.get("include_usage"))
    return stream, include_usage, include_usage and bool(options.get("continuous_usage_stats"))


def _prompt_logprobs(obj: dict[str, Any], stream: bool, max_logprobs: int) -> int | None:
    """vLLM's check (and words) for a stream, which has no field for them; its -1 (the whole
    vocabulary) is past the engine's bound."""
    k = opt_int(obj, "prompt_logprobs")
    if k is not None and stream and (k > 0 or k == -1):
        raise bad_request(
            "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
        )
    if k is not None and not 0 <= k <= max_logprobs:
        raise bad_request(
            f"prompt_logprobs must be in 0..{max_logprobs}, got {k}", "prompt_logprobs"
        )
    return k


def _truncate(obj: dict[str, Any]) -> int | None:
    keep = opt_int(obj, "truncate_prompt_tokens")
    if keep is not None and keep < 1 and keep != -1:  # vLLM's 0 leaves no prompt at all
        raise bad_request(
            f"truncate_prompt_tokens must be >= 1 or -1, got {keep}", "truncate_prompt_tokens"
        )
    return keep


def truncate_prompt(
    ids: list[int], keep: int | None, max_tokens: int | None, max_model_len: int
) -> list[int]:
    """The last `keep` prompt tokens, as vLLM's (newer) TokenizeParams: -1 keeps what the context
    leaves after max_tokens, and more than that is refused."""
    if keep is None:
        return ids
    limit = max_model_len - (max_tokens or 0)
    if keep == -1:
        keep = limit
    if not 1 <= keep <= limit:
        raise bad_request(
            f"truncate_prompt_tokens={keep} cannot be greater than max_model_len - max_tokens "
            f"= {limit}; request a smaller truncation size",
            "truncate_prompt_tokens",
        )
    return ids[-keep:] if keep < len(ids) else ids


def _sampling(
    obj: dict[str, Any],
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    defaults: Mapping[str, float] | None = None,
    tools: ToolFields | None = None,
) -> SamplingFields:
    d = SamplingFields(**(defaults or {}))
    # vLLM's spaces_between_special_tokens acts in slow (Python) tokenizers only; Qwen's fast
    # one puts no space between special tokens either way (engine/detokenizer.py): type only
    opt_bool(obj, "spaces_between_special_tokens", default=True)
    allowed = obj.get("allowed_token_ids")  # ids past the vocabulary: the engine's check
    return SamplingFields(
        max_tokens=max_tokens,
        temperature=opt_float(obj, "temperature", d.temperature),
        top_p=opt_float(obj, "top_p", d.top_p),
        top_k=opt_int(obj, "top_k", default=d.top_k),
        min_p=opt_float(obj, "min_p", d.min_p),
        seed=opt_int(obj, "seed"),
        presence_penalty=opt_float(obj, "presence_penalty", d.presence_penalty),
        frequency_penalty=opt_float(obj, "frequency_penalty", d.frequency_penalty),
        repetition_penalty=opt_float(obj, "repetition_penalty", d.repetition_penalty),
        stop=_stop(obj),
        stop_regex=_stop(obj, "stop_regex"),
        stop_token_ids=_token_ids(obj.get("stop_token_ids") or [], "stop_token_ids", empty_ok=True),
        ignore_eos=opt_bool(obj, "ignore_eos", default=False),
        logprobs=logprobs,
        n=opt_int(obj, "n", default=d.n),
        min_tokens=opt_int(obj, "min_tokens", default=0),
        logit_bias=_logit_bias(obj),
        include_stop_str_in_output=opt_bool(obj, "include_stop_str_in_output", default=False),
        skip_special_tokens=opt_bool(obj, "skip_special_tokens", default=True),
        allowed_token_ids=None if allowed is None else _token_ids(allowed, "allowed_token_ids"),
        bad_words=_strings(obj, "bad_words"),
        prompt_logprobs=prompt_logprobs,
        thinking_budget=opt_int(obj, "thinking_budget"),
        guided=parse_guided(obj, tools),
    )


def _stop(obj: dict[str, Any], name: str = "stop") -> tuple[str, ...]:
    """`stop` (strings) or SGLang's `stop_regex`: one string or a list of non-empty ones."""
    value = obj.get(name)
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise bad_request(
            f"{name} must be a string or a list of strings, got {json_type(value)}", name
        )
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise bad_request(f"{name}[{i}] must be a string, got {json_type(s)}", name)
        if not s:
            raise bad_request(f"{name}[{i}] is an empty string", name)
    return tuple(items)


def _strings(obj: dict[str, Any], name: str) -> tuple[str, ...]:
    value = obj.get(name)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_request(f"{name} must be a list of strings, got {json_type(value)}", name)
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise bad_request(f"{name}[{i}] must be a string, got {json_type(s)}", name)
    return tuple(value)


def _prompts(obj: dict[str, Any]) -> tuple[str | tuple[int, ...], ...]:
    if "prompt" not in obj or obj["prompt"] is None:
        raise bad_request("prompt is required", "prompt")
    prompt = obj["prompt"]
    if isinstance(prompt, str):
        return (_text_prompt(prompt, "prompt"),)
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(
            "prompt must be a string, a list of token ids, or a non-empty list of either",
            "prompt",
        )
    if isinstance(prompt[0], int | float):  # one prompt as token ids
        return (_token_ids(prompt, "prompt"),)
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            out.append(_text_prompt(item, f"prompt[{i}]"))
        elif isinstance(item, list):
            out.append(_token_ids(item, f"prompt[{i}]"))
        else:
            raise bad_request(
                f"prompt[{i}] must be a string or a list of token ids, got {json_type(item)}",
                "prompt",
            )
    return tuple(out)


def _text_prompt(text: str, name: str) -> str:
    if not text:
        raise bad_request(f"{name} is empty", "prompt")
    return text


def _token_ids(value: object, name: str, *, empty_ok: bool = False) -> tuple[int, ...]:
    param = name.split("[")[0]
    if not isinstance(value, list):
        raise bad_request(f"{name} must be a list of token ids, got {json_type(value)}", param)
    if not value and not empty_ok:
        raise bad_request(f"{name} is an empty list of token ids", param)
    for i, t in enumerate(value):
        if not is_int(t) or t < 0:
            raise bad_request(
                f"{name}[{i}] must be a non-negative integer token id, got {t!r}", param
            )
    return tuple(value)


def _messages(obj: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object, got {json_type(m)}", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise bad_request(
                f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", "messages"
            )
        for key, value in m.items():
            if key in ("role", "content", "name") or (
                key in _NULL_MESSAGE_KEYS and value in (None, [])
            ):
                continue
            if key in _REASONING_KEYS and role == "assistant":
                continue
            if key in TOOL_MESSAGE_KEYS.get(role, ()):
                continue
            raise unsupported(f"{where}.{key}", "messages carry only role, content and name")
        content = m.get("content")
        if content is None and role == "assistant":  # OpenAI allows it; vLLM renders ""
            content = ""
        message = {"role": _ROLE_ALIASES.get(role, role), "content": _content(content, where)}
        message.update(tool_message_fields(m, role, where))
        name = m.get("name")
        if name is not None:  # for the template, as vLLM passes it (Qwen's ignores it)
            if not isinstance(name, str):
                raise bad_request(
                    f"{where}.name must be a string, got {json_type(name)}", "messages"
                )
            message["name"] = name
        reasoning = m.get("reasoning")
        if reasoning is None:
            reasoning = m.get("reasoning_content")
        if reasoning is not None:  # an assistant's: other roles' were refused above
            if not isinstance(reasoning, str):
                got = json_type(reasoning)
                raise bad_request(f"{where}.reasoning must be a string, got {got}", "messages")
            message["reasoning"] = message["reasoning_content"] = reasoning
        out.append(message)
    return tuple(out)


def _content(content: object, where: str) -> str | list[dict[str, Any]]:
    """A message's text; with images or video, its parts as the template takes them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(
            f"{where}.content must be a string or a list of content parts, got "
            f"{json_type(content)}",
            "messages",
        )
    texts, parts = [], []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise bad_request(f"{at} must be an object, got {json_type(part)}", "messages")
        if part.get("type") in OPENAI_MEDIA_PARTS:
            parts.append(openai_part(part, at))
            continue
        if part.get("type") != "text":
            raise unsupported(
                f"{at}.type",
                f"only text, image_url and video_url content parts are supported, got "
                f"{part.get('type')!r}",
            )
        for key in part:
            if key not in ("type", "text"):
                raise unsupported(f"{at}.{key}", "text parts carry only type and text")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{at}.text must be a string, got {json_type(text)}", "messages")
        texts.append(text)
        parts.append({"type": "text", "text": text})
    if len(parts) > len(texts):  # images or video: the parts, in order, for the template
        return parts
    return TEXT_PART_SEPARATOR.join(texts)


__all__ = [
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "SamplingFields",
    "parse_chat_request",
    "parse_completion_request",
    "truncate_prompt",
]
