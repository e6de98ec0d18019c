"""OpenAI `/v1/completions` and `/v1/chat/completions` request bodies: their typed structs,
and the request each becomes.

Pure (no aiohttp, no engine calls): a JSON value in, decoded by request_body.py (which holds
the unknown-field policy: a field we take only at its default is declared `only(...)` here),
and out a frozen request whose `sampling` is the engine's `SamplingParams`, or an `ApiError`
(400) that names the offending field. SamplingParams checks the sampling fields' ranges (its
`ParamError`, answered naming the field the request sent); the engine's own limits
(max_logprobs, the context) are checked at submission; the OpenAI-only ones here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from deltaserve.engine.sampling_params import DEFAULT_MAX_TOKENS, ParamError, SamplingParams
from deltaserve.http.errors import bad_request, refused_param, unsupported
from deltaserve.http.media_parts import OPENAI_MEDIA_PARTS, template_part
from deltaserve.http.request_body import decode, expect, only
from deltaserve.http.structured_output import STRUCTURED_OUTPUT_KEYS, Guided, parse_guided
from deltaserve.http.tool_protocol import history_tool_calls, parse_tool_fields

if TYPE_CHECKING:
    from deltaserve.http.tool_protocol import ToolChoice

TEXT_PART_SEPARATOR = "\n"  # between a message's text parts, as vLLM joins them
# the engine's names of a chat's fields -> the chat's (its errors name those)
_CHAT_NAMES = {"logprobs": "top_logprobs", "prompt": "messages"}
# OpenAI's newer name for the system message (as vLLM, we take it): the template sees "system".
_ROLE_ALIASES = {"developer": "system"}

TokenId = Annotated[int, msgspec.Meta(ge=0)]


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # usage in every chunk (with include_usage)


class TextPart(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    text: str


Url = Annotated[str, expect("a non-empty string", min_length=1)]


class MediaUrl(msgspec.Struct, forbid_unknown_fields=True):
    url: Url
    detail: Annotated[
        str | None,
        only(
            "auto",
            why="only 'auto': images are resized to the model's pixel budget "
            "(--mm-processor-kwargs)",
        ),
    ] = None


class ImagePart(msgspec.Struct, tag_field="type", tag="image_url", forbid_unknown_fields=True):
    """An image (media_parts.py fetches it): `{"url": ...}` or the URL as a string."""

    image_url: Url | MediaUrl


class VideoPart(msgspec.Struct, tag_field="type", tag="video_url", forbid_unknown_fields=True):
    video_url: Url | MediaUrl


Content = str | list[TextPart | ImagePart | VideoPart]


class _Message(msgspec.Struct, tag_field="role", kw_only=True, forbid_unknown_fields=True):
    """A chat message. `name` is handed to the template, as vLLM hands it (Qwen's ignores it).
    The fields the SDK's model_dump() of a reply carries (refusal, annotations, audio, ...)
    come back null in history: accepted as any unknown null field is."""

    content: Content
    name: str | None = None
    tool_calls: Annotated[
        list[Any] | None,
        only([], why="messages carry only role, content and name: an assistant's calls tools"),
    ] = None


class SystemMessage(_Message, tag="system"):
    pass


class DeveloperMessage(_Message, tag="developer"):
    pass


class UserMessage(_Message, tag="user"):
    pass


class AssistantMessage(_Message, tag="assistant"):
    """Its thinking, as a reasoning parser returned it (`reasoning`, or its older name), goes
    to the template under both names, as vLLM passes it (Qwen3.5's template renders
    `reasoning_content` in the turns after the last user message)."""

    content: Content | None = None  # OpenAI allows null; vLLM renders ""
    tool_calls: list[Any] | None = None  # tool_protocol.py's history_tool_calls reads them
    reasoning: str | None = None
    reasoning_content: str | None = None


class ToolMessage(_Message, tag="tool"):
    tool_call_id: str | None = None


Message = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


class _Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The fields both routes take: OpenAI's, vLLM's extras, and what routers send at their
    defaults (sglang-router, vllm-router: they forward whole request structs)."""

    model: str | None = None
    user: str | None = None  # metadata, unused: still a string, as OpenAI's
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    # the sampling fields: their ranges are SamplingParams' checks
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: Annotated[str | list[str] | None, expect("a string or a list of strings")] = None
    stop_regex: Annotated[str | list[str] | None, expect("a string or a list of strings")] = None
    stop_token_ids: Annotated[list[TokenId] | None, expect("a list of token ids")] = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, Annotated[int | float, expect("a number")]] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # vLLM's; it acts in slow (Python) tokenizers only; Qwen's fast one puts no space between
    # special tokens either way (engine/detokenizer.py): taken, of its type, at any value
    spaces_between_special_tokens: bool | None = None
    allowed_token_ids: Annotated[list[TokenId] | None, expect("a list of token ids")] = None
    bad_words: Annotated[list[str] | None, expect("a list of strings")] = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    thinking_budget: int | None = None
    # structured outputs: each its own shape, read by structured_output.py
    structured_outputs: Any = None
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None
    use_beam_search: bool | None = None  # vLLM's: http/beam_completions.py
    length_penalty: float | None = None
    return_tokens_as_token_ids: bool | None = None
    priority: int | None = None
    # SGLang's, as sglang-router sends them
    no_stop_trim: Annotated[bool | None, only(False)] = None
    return_hidden_states: Annotated[bool | None, only(False)] = None

    def given(self) -> dict[str, Any]:
        """The fields the body gives (not null)."""
        return {
            name: value
            for name in self.__struct_fields__
            if (value := getattr(self, name)) is not None
        }

    def structured(self) -> dict[str, Any]:
        """The structured-output fields given, as structured_output.py reads them."""
        return {name: getattr(self, name) for name in STRUCTURED_OUTPUT_KEYS}


# With use_beam_search (vLLM's BeamSearchParams), the sampling fields a search does not use:
# given, they are refused (it takes n, max_tokens, temperature, ignore_eos,
# include_stop_str_in_output and skip_special_tokens).
_UNUSED_BY_BEAMS = frozenset(
    {
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "stop",
        "stop_regex",
        "stop_token_ids",
        "min_tokens",
        "logit_bias",
        "spaces_between_special_tokens",
        "allowed_token_ids",
        "bad_words",
        "truncate_prompt_tokens",
        "prompt_logprobs",
        "thinking_budget",
        "logprobs",
        "top_logprobs",
        *STRUCTURED_OUTPUT_KEYS,
    }
)


class CompletionBody(_Body):
    prompt: Annotated[
        str | list[Any], expect("a string, a list of token ids, or a non-empty list of either")
    ]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: Annotated[
        int | None, only(1, why="only best_of=1 is supported; use n for several samples")
    ] = None
    suffix: Annotated[str | None, only("", why="insertion (suffix) is not supported")] = None
    # vLLM adds special tokens to a completion's prompt (not to a rendered chat): the Qwen
    # tokenizer adds none when encoding, so the prompt is the same either way
    add_special_tokens: Annotated[bool | None, only(True)] = None
    include_reasoning: Annotated[bool | None, only(True)] = None  # vllm-router's


class ChatBody(_Body):
    messages: Annotated[list[Message], expect("a non-empty list of messages", min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None  # tool_protocol.py reads tools and tool_choice
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: Annotated[dict[str, Any] | None, expect("an object")] = None
    include_reasoning: bool | None = None  # vLLM's: False leaves a reasoning parser's out
    # vLLM's: the template's generation prompt, or the last message continued (an answer's
    # start given, the output goes on from it)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: Annotated[bool | None, only(False)] = None  # see CompletionBody's
    separate_reasoning: Annotated[bool | None, only(True)] = None  # SGLang's, as for the parser
    stream_reasoning: Annotated[bool | None, only(True)] = None  # SGLang's: reasoning streamed


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """`prompts` holds each prompt as text or token ids; choices are indexed prompt-major:
    choice `p * n + i` is the i-th sample of prompt p."""

    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]
    sampling: SamplingParams
    guided: Guided = Guided()  # where sampling's constraint came from
    # the engine's names of fields -> this request's (`errors.refused_param`)
    param_names: dict[str, str] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)
    truncate_prompt_tokens: int | None = None  # keep the last N prompt tokens; -1: what fits
    echo: bool = False  # each choice's text (and logprobs) starts with its prompt's
    # logprobs say "token_id:{id}"; None: the server's flag
    return_tokens_as_token_ids: bool | None = None
    priority: int = 0  # vLLM's: lower is admitted first (--scheduling-policy priority)
    beam_search: bool = False  # vLLM's use_beam_search: n beams, engine/beam_search.py
    length_penalty: float = 1.0  # a beam's score: cumulative logprob / length ** length_penalty


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """`messages` are normalised to `{"role", "content": str}` (and `"name"`, an assistant's
    reasoning and tool calls, a tool message's `tool_call_id`, when given); `logprobs` asks
    for the chat logprobs shape (then `sampling.logprobs` is the number of alternatives).
    `sampling.max_tokens` None: what the context leaves after the rendered prompt. `tools`
    (for the template) and `tool_choice`: tool_protocol.py's `ToolFields`."""

    model: str | None
    messages: tuple[dict[str, Any], ...]
    sampling: SamplingParams
    guided: Guided = Guided()  # as CompletionRequest's
    param_names: dict[str, str] = field(default_factory=dict)  # as CompletionRequest's
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    truncate_prompt_tokens: int | None = None  # of the rendered template's tokens
    logprobs: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    include_reasoning: bool = True
    tools: tuple[dict[str, Any], ...] | None = None
    # "auto": the output read by the parser; "required", named: forced
    tool_choice: ToolChoice = "none"
    parallel_tool_calls: bool = True  # False: only the first call is returned (as vLLM)
    return_tokens_as_token_ids: bool | None = None  # as CompletionRequest's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    priority: int = 0  # as CompletionRequest's
    beam_search: bool = False  # as CompletionRequest's: its n beams are the choices
    length_penalty: float = 1.0


# ---- entry points ------------------------------------------------------------------------


def parse_completion_request(
    body: object,
    defaults: Mapping[str, float] | None = None,
    *,
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
) -> CompletionRequest:
    """`defaults`: sampling settings (temperature, top_p, top_k, min_p, repetition_penalty)
    taken where the body leaves them out or null: the model's generation_config.json, as
    vLLM takes it. `default_max_tokens`: where the body gives none (OpenAI's 16; None: what the
    context leaves, SGLang's /generate)."""
    b = decode(body, CompletionBody)
    stream, include_usage, continuous = _stream(b)
    prompt_logprobs = _prompt_logprobs(b, stream)
    if prompt_logprobs is None and b.echo:  # as vLLM: echoed logprobs cover the prompt's too
        prompt_logprobs = b.logprobs
    beam_search, length_penalty = _beam_search(b)
    guided = parse_guided(b.structured())
    names = guided.param_names()
    max_tokens = b.max_tokens if b.max_tokens is not None else default_max_tokens
    return CompletionRequest(
        model=b.model,
        prompts=_prompts(b.prompt),
        sampling=_sampling(b, max_tokens, b.logprobs, prompt_logprobs, defaults, guided, names),
        guided=guided,
        param_names=names,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        truncate_prompt_tokens=_truncate(b),
        echo=bool(b.echo),
        return_tokens_as_token_ids=b.return_tokens_as_token_ids,
        priority=b.priority or 0,
        beam_search=beam_search,
        length_penalty=length_penalty,
    )


def parse_chat_request(body: object, defaults: Mapping[str, float] | None = None) -> ChatRequest:
    """`defaults`: as parse_completion_request's."""
    b = decode(body, ChatBody)
    tool_fields = parse_tool_fields(b.tools, b.tool_choice, b.parallel_tool_calls)
    logprobs = bool(b.logprobs)
    if b.top_logprobs is not None and not logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    given = {
        k: v
        for k, v in (
            ("max_tokens", b.max_tokens),
            ("max_completion_tokens", b.max_completion_tokens),
        )
        if v is not None
    }
    if len(set(given.values())) > 1:
        raise bad_request(
            f"max_tokens ({b.max_tokens}) and max_completion_tokens ({b.max_completion_tokens}) "
            "disagree; send one",
            "max_completion_tokens",
        )
    stream, include_usage, continuous = _stream(b)
    generation = b.add_generation_prompt is not False
    if generation and b.continue_final_message:  # vLLM's words
        raise bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    beam_search, length_penalty = _beam_search(b)
    guided = parse_guided(b.structured(), tool_fields)
    if beam_search and guided.param is not None:  # a forced tool call
        raise unsupported(
            guided.param,
            "beam search does not constrain its output; "
            "a forced tool call needs sampling (use_beam_search false)",
        )
    names = {**_CHAT_NAMES, **guided.param_names()}
    if b.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    top = (b.top_logprobs or 0) if logprobs else None
    prompt_logprobs = _prompt_logprobs(b, stream)
    return ChatRequest(
        model=b.model,
        messages=tuple(_message(m, f"messages[{i}]") for i, m in enumerate(b.messages)),
        sampling=_sampling(
            b, next(iter(given.values()), None), top, prompt_logprobs, defaults, guided, names
        ),
        guided=guided,
        param_names=names,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        truncate_prompt_tokens=_truncate(b),
        logprobs=logprobs,
        chat_template_kwargs=dict(b.chat_template_kwargs or {}),
        include_reasoning=b.include_reasoning is not False,
        tools=tool_fields.tools,
        tool_choice=tool_fields.tool_choice,
        parallel_tool_calls=tool_fields.parallel_tool_calls,
        return_tokens_as_token_ids=b.return_tokens_as_token_ids,
        add_generation_prompt=generation,
        continue_final_message=bool(b.continue_final_message),
        priority=b.priority or 0,
        beam_search=beam_search,
        length_penalty=length_penalty,
    )


# ---- pieces ------------------------------------------------------------------------------


def _sampling(
    b: _Body,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    defaults: Mapping[str, float] | None,
    guided: Guided,
    names: Mapping[str, str],
) -> SamplingParams:
    """The engine's params of the request (which check the ranges: a refusal names the
    request's field, through `names`); `defaults` where the body gives none."""
    knobs = {
        name: value
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "n",
            "seed",
            "stop_token_ids",
            "ignore_eos",
            "min_tokens",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "allowed_token_ids",
            "bad_words",
            "thinking_budget",
        )
        if (value := getattr(b, name)) is not None
    }
    try:
        return SamplingParams(
            **{**(defaults or {}), **knobs},
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            stop=_strings(b.stop),
            stop_regex=_strings(b.stop_regex),
            logit_bias=_logit_bias(b.logit_bias),
            **guided.params(),
        )
    except ParamError as exc:
        raise refused_param(exc, names) from None


def _beam_search(b: _Body) -> tuple[bool, float]:
    """vLLM's use_beam_search and length_penalty. A search takes n, max_tokens, temperature (no
    effect: candidates come from raw logprobs, as vLLM's), ignore_eos, include_stop_str_in_output,
    skip_special_tokens and length_penalty; its answer comes whole, without logprobs (chat's
    `logprobs: false` is none). Its width's bound is the engine's (engine/beam_search.py)."""
    length_penalty = 1.0 if b.length_penalty is None else b.length_penalty
    if not b.use_beam_search:
        if length_penalty != 1.0:
            raise unsupported("length_penalty", "it scores beams: only with use_beam_search")
        return False, length_penalty
    for key, value in b.given().items():
        if key in _UNUSED_BY_BEAMS and not (key == "logprobs" and value is False):
            raise unsupported(
                key,
                "beam search does not use it (use_beam_search takes n, max_tokens, temperature, "
                "ignore_eos, include_stop_str_in_output, skip_special_tokens and length_penalty)",
            )
    for key, value in (("stream", False), ("echo", False), ("priority", 0)):
        if getattr(b, key, None) not in (None, value):
            raise unsupported(
                key,
                "beam search answers whole, at priority 0 and without echo: "
                f"{key} must be {str(value).lower()}",
            )
    return True, length_penalty


def _stream(b: _Body) -> tuple[bool, bool, bool]:
    """stream, include_usage, continuous usage: as vLLM's should_include_usage, usage in every
    chunk only with include_usage too."""
    stream, options = bool(b.stream), b.stream_options
    if options is None:
        return stream, False, False
    if not stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    include_usage = bool(options.include_usage)
    return stream, include_usage, include_usage and bool(options.continuous_usage_stats)


def _prompt_logprobs(b: _Body, stream: bool) -> int | None:
    """vLLM's check (and words) for a stream, which has no field for them (their range is the
    engine's: its max_logprobs)."""
    k = b.prompt_logprobs
    if k is not None and stream and (k > 0 or k == -1):
        raise bad_request(
            "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
        )
    return k


def _truncate(b: _Body) -> int | None:
    keep = b.truncate_prompt_tokens
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


def _strings(value: str | list[str] | None) -> tuple[str, ...]:
    """`stop` or SGLang's `stop_regex`: one string or a list (each non-empty: SamplingParams')."""
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _logit_bias(value: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {token id as a string: bias}, as (id, bias) pairs; a bias past [-100, 100] is
    clamped to it, as vLLM clamps it. Ids outside the vocabulary are the engine's check."""
    pairs = []
    for key, bias in (value or {}).items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:  # int() refuses 4300 digits
            raise bad_request(f"logit_bias key {key[:20]!r} is not a token id", "logit_bias")
        if isinstance(bias, float) and not math.isfinite(bias):  # clamping would hide it
            raise bad_request(f"logit_bias[{key!r}] must be finite, got {bias}", "logit_bias")
        pairs.append((int(key), float(min(100.0, max(-100.0, bias)))))  # ints of any size compare
    return tuple(pairs)


def _prompts(prompt: str | list[Any]) -> tuple[str | tuple[int, ...], ...]:
    """One prompt (a text, or token ids) or a non-empty list of them."""
    if isinstance(prompt, str):
        return (_text_prompt(prompt, "prompt"),)
    if not prompt:
        raise bad_request(
            "prompt must be a string, a list of token ids, or a non-empty list of either",
            "prompt",
        )
    if isinstance(prompt[0], int | float):  # one prompt as token ids
        return (token_ids(prompt, "prompt"),)
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            out.append(_text_prompt(item, f"prompt[{i}]"))
        elif isinstance(item, list):
            out.append(token_ids(item, f"prompt[{i}]"))
        else:
            raise bad_request(
                f"prompt[{i}] must be a string or a list of token ids, got {_kind(item)}",
                "prompt",
            )
    return tuple(out)


def _text_prompt(text: str, name: str) -> str:
    if not text:
        raise bad_request(f"{name} is empty", "prompt")
    return text


def token_ids(value: list[Any], name: str, *, empty_ok: bool = False) -> tuple[int, ...]:
    """A list of token ids as given (`name` in the errors; the param up to its index): each a
    non-negative integer (the vocabulary's bound is the engine's)."""
    param = name.split("[")[0]
    if not value and not empty_ok:
        raise bad_request(f"{name} is an empty list of token ids", param)
    for i, t in enumerate(value):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise bad_request(
                f"{name}[{i}] must be a non-negative integer token id, got {t!r}", param
            )
    return tuple(value)


def _message(m: _Message, where: str) -> dict[str, Any]:
    """A message as the template takes it: text parts joined, developer as system."""
    role = m.__struct_config__.tag
    content = _content(m.content, where)
    message: dict[str, Any] = {"role": _ROLE_ALIASES.get(role, role), "content": content}
    if isinstance(m, ToolMessage) and m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if isinstance(m, AssistantMessage):
        if m.tool_calls:
            message["tool_calls"] = history_tool_calls(m.tool_calls, f"{where}.tool_calls")
    if m.name is not None:
        message["name"] = m.name
    if isinstance(m, AssistantMessage):
        reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
        if reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
    return message


def _content(content: Content | None, where: str) -> str | list[dict[str, Any]]:
    """A message's text parts joined; with images or video, its parts in order as the
    template takes them (each carrying its source, named for errors)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if all(isinstance(part, TextPart) for part in content):
        return TEXT_PART_SEPARATOR.join(part.text for part in content)
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, TextPart):
            parts.append({"type": "text", "text": part.text})
            continue
        tag = part.__struct_config__.tag
        media = part.image_url if isinstance(part, ImagePart) else part.video_url
        url = media if isinstance(media, str) else media.url
        parts.append(template_part(OPENAI_MEDIA_PARTS[tag], url, f"{where}.content[{j}].{tag}"))
    return parts


def _kind(value: object) -> str:
    return "a list" if isinstance(value, list) else type(value).__name__


__all__ = [
    "ChatBody",
    "ChatRequest",
    "CompletionBody",
    "CompletionRequest",
    "parse_chat_request",
    "parse_completion_request",
    "token_ids",
    "truncate_prompt",
]
