"""SGLang's native `POST /generate` body as the completion requests that serve it, one per
prompt, so the completion route's checks and refusals hold here too (their fields renamed),
as the Responses and Messages APIs are served by the chat route's.

SGLang's fields (sglang/srt/managers/io_struct.py `GenerateReqInput`,
sglang/srt/sampling/sampling_params.py): `text` or `input_ids`, one prompt or a batch; one
`sampling_params` for every prompt or one each; `return_logprob`, `logprob_start_len`,
`top_logprobs_num`, `return_text_in_logprobs`, `stream`, `rid`. Where SGLang ignores an
unknown field (or fails with a 500 on one in sampling_params), it is refused here, naming it
(request_body.py's policy); so is a body with both text and input_ids (SGLang silently takes
the ids).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from deltaserve.http.errors import bad_request
from deltaserve.http.request_body import decode, only

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
# SGLang's sampling_params key -> the completion field that honours it (its value checked there)
_SAMPLING = {
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "n": "n",
    "logit_bias": "logit_bias",
    "sampling_seed": "seed",
    "stop_regex": "stop_regex",
}
# SGLang's constraints -> structured_outputs' kinds
_GUIDED = {
    "json_schema": "json",
    "regex": "regex",
    "ebnf": "grammar",
    "structural_tag": "structural_tag",
}
# the completion route's field names in its refusals -> SGLang's
RENAMED = (
    (r"\bmax_tokens\b", "sampling_params.max_new_tokens"),
    (r"\bmin_tokens\b", "sampling_params.min_new_tokens"),
    (r"\binclude_stop_str_in_output\b", "sampling_params.no_stop_trim"),
    (r"\bseed\b", "sampling_params.sampling_seed"),
    (r"\bstructured_outputs\.json\b", "sampling_params.json_schema"),
    (r"\bstructured_outputs\.regex\b", "sampling_params.regex"),
    (r"\bstructured_outputs\.grammar\b", "sampling_params.ebnf"),
    (r"\bstructured_outputs\.structural_tag\b", "sampling_params.structural_tag"),
    (r"(?<![\w.])stop_regex\b", "sampling_params.stop_regex"),
    (r"\b(prompt_)?logprobs\b", "top_logprobs_num"),
    (
        r"(?<![\w.])(temperature|top_p|top_k|min_p|frequency_penalty|presence_penalty|"
        r"repetition_penalty|stop_token_ids|logit_bias|n)\b",
        r"sampling_params.\1",
    ),
)


class SglangSampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's sampling_params; each value is checked by the completion field it becomes."""

    # absent: SGLang's 128; null: up to the context; 0: the prompt alone (its logprobs)
    max_new_tokens: Annotated[int, msgspec.Meta(ge=0)] | None | msgspec.UnsetType = msgspec.UNSET
    min_new_tokens: Any = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    min_p: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    repetition_penalty: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    no_stop_trim: Any = None
    n: Any = None
    logit_bias: Any = None
    sampling_seed: Any = None
    stop_regex: Any = None
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    stream_interval: Annotated[int | None, only(1, why="every token is streamed as it comes")] = (
        None
    )
    custom_params: Annotated[Any, only(why="custom logit processors are not supported")] = None


class GenerateBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # one prompt's ids, or a list of them
    sampling_params: SglangSampling | list[SglangSampling] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | None = None
    logprob_start_len: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    top_logprobs_num: Annotated[int, msgspec.Meta(ge=0)] | None = None
    return_text_in_logprobs: bool | None = None
    stream: bool | None = None
    priority: Any = None  # the completion route's
    # SGLang's other fields, taken at their default (as clients that always send them do)
    log_metrics: Annotated[bool | None, only(True)] = None
    return_hidden_states: Annotated[bool | None, only(False)] = None
    return_routed_experts: Annotated[bool | None, only(False)] = None
    return_entropy: Annotated[bool | None, only(False)] = None
    return_prompt_token_ids: Annotated[bool | None, only(False)] = None
    return_bytes: Annotated[bool | None, only(False)] = None
    return_flat_raw_top_logprobs: Annotated[bool | None, only(False)] = None
    return_sampling_mask: Annotated[bool | None, only(False)] = None
    no_logs: Annotated[bool | None, only(False)] = None
    background: Annotated[bool | None, only(False)] = None
    require_reasoning: Annotated[bool | None, only(False)] = None
    use_audio_in_video: Annotated[bool | None, only(False)] = None


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """`bodies`: one completion request per prompt (no max_tokens: what the context leaves).
    `max_new_tokens` per prompt: None up to the context, 0 the prompt alone (scoring its
    logprobs: one token sampled, not returned)."""

    bodies: tuple[dict[str, Any], ...]
    max_new_tokens: tuple[int | None, ...]
    rids: tuple[str, ...]  # each prompt's, the engine's request id (/abort_request takes it)
    listed: bool  # the answer is a list: a batch of prompts, or n > 1
    stream: bool
    return_logprob: bool
    logprob_start_len: int  # -1: the prompt's last token only (SGLang's default)
    top_logprobs_num: int
    text_in_logprobs: bool


def parse_generate_request(body: object) -> GenerateRequest:
    b = decode(body, GenerateBody)
    prompts, batch = _prompts(b)
    sampling = b.sampling_params
    if isinstance(sampling, list):
        if len(sampling) != len(prompts):
            raise bad_request(
                f"sampling_params has {len(sampling)} entries for {len(prompts)} prompts",
                "sampling_params",
            )
    else:
        sampling = [sampling or SglangSampling()] * len(prompts)
    return_logprob = bool(b.return_logprob)
    start = -1 if b.logprob_start_len is None else b.logprob_start_len
    top = b.top_logprobs_num or 0
    if top and not return_logprob:
        raise bad_request("top_logprobs_num needs return_logprob=true", "top_logprobs_num")
    bodies, limits = [], []
    for prompt, params in zip(prompts, sampling, strict=True):
        completion, limit = _completion(prompt, params, b.priority)
        if return_logprob:
            completion["logprobs"] = top
            if start >= 0:  # the prompt's logprobs from `start` on (checked against its length)
                completion["prompt_logprobs"] = top
        bodies.append(completion)
        limits.append(limit)
    choices = [body.get("n", 1) for body in bodies]  # each checked as the completion route does
    if any(n != choices[0] for n in choices):
        raise bad_request("every prompt's sampling_params.n must be the same", "sampling_params")
    return GenerateRequest(
        bodies=tuple(bodies),
        max_new_tokens=tuple(limits),
        rids=_rids(b.rid, len(prompts), batch),
        listed=batch or choices[0] != 1,
        stream=bool(b.stream),
        return_logprob=return_logprob,
        logprob_start_len=start,
        top_logprobs_num=top,
        text_in_logprobs=bool(b.return_text_in_logprobs),
    )


def _prompts(b: GenerateBody) -> tuple[list[str | list[int]], bool]:
    """The prompts, and whether they came as a batch (a list of texts, of id lists)."""
    text, ids = b.text, b.input_ids
    if (text is None) == (ids is None):
        raise bad_request(
            "send text or input_ids (one prompt, or a list of them), not both"
            if text is not None
            else "text or input_ids is required",
            "text",
        )
    if isinstance(text, str):
        return [text], False
    if text is not None:
        if not text:
            raise bad_request("text must be a string or a non-empty list of strings", "text")
        return list(text), True
    if ids and all(_is_id(t) for t in ids):
        return [ids], False
    if ids and all(isinstance(p, list) and p and all(_is_id(t) for t in p) for p in ids):
        return list(ids), True
    raise bad_request(
        "input_ids must be a non-empty list of token ids, or a non-empty list of them", "input_ids"
    )


def _completion(
    prompt: str | list[int], params: SglangSampling, priority: Any
) -> tuple[dict[str, Any], int | None]:
    """One prompt's completion body, and its max_new_tokens."""
    completion: dict[str, Any] = {"prompt": prompt, "priority": priority}
    for key, field in _SAMPLING.items():
        completion[field] = getattr(params, key)
    guided = {kind: v for key, kind in _GUIDED.items() if (v := getattr(params, key)) is not None}
    if len(guided) > 1:
        raise bad_request(
            "only one of sampling_params.json_schema, regex, ebnf and structural_tag can be set",
            "sampling_params",
        )
    if guided:
        completion["structured_outputs"] = guided
    limit = params.max_new_tokens
    if limit is msgspec.UNSET:
        limit = DEFAULT_MAX_NEW_TOKENS
    if limit == 0 and params.min_new_tokens:
        raise bad_request(
            "sampling_params.min_new_tokens must be 0 when max_new_tokens is 0",
            "sampling_params.min_new_tokens",
        )
    # 0: the prompt alone (its logprobs), one token sampled and not returned; None: what fits
    completion["max_tokens"] = 1 if limit == 0 else limit
    return {k: v for k, v in completion.items() if v is not None}, limit


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rids(rid: str | list[str] | None, count: int, batch: bool) -> tuple[str, ...]:
    """Each prompt's id: SGLang's `rid`, a batch's `{rid}_{i}` from one (or one each), else new."""
    if rid is None:
        base = uuid.uuid4().hex
        return (base,) if not batch else tuple(f"{base}_{i}" for i in range(count))
    if isinstance(rid, str) and rid:
        return (rid,) if not batch else tuple(f"{rid}_{i}" for i in range(count))
    if batch and isinstance(rid, list) and len(rid) == count and all(rid):
        if len(set(rid)) < count:
            raise bad_request(f"rid has duplicates: {rid}", "rid")
        return tuple(rid)
    raise bad_request("rid must be a non-empty string (or, for a batch, one per prompt)", "rid")


__all__ = ["DEFAULT_MAX_NEW_TOKENS", "RENAMED", "GenerateRequest", "parse_generate_request"]
