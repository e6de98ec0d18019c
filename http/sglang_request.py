"""SGLang's native `POST /generate` body as the completion requests that serve it, one per
prompt, so the completion route's checks and refusals hold here too (their fields renamed),
as the Responses and Messages APIs are served by the chat route's.

SGLang's fields (sglang/srt/managers/io_struct.py `GenerateReqInput`,
sglang/srt/sampling/sampling_params.py): `text` or `input_ids`, one prompt or a batch; one
`sampling_params` for every prompt or one each; `return_logprob`, `logprob_start_len`,
`top_logprobs_num`, `return_text_in_logprobs`, `stream`, `rid`. Where SGLang ignores an
unknown field (or fails with a 500 on one in sampling_params), it is refused here, naming it;
so is a body with both text and input_ids (SGLang silently takes the ids).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from deltaserve.http.errors import bad_request, unsupported
from deltaserve.http.json_fields import is_int, json_object, json_type, opt_bool, opt_int
from deltaserve.http.protocol import _refuse_non_defaults, _refuse_unknown

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
_SAMPLING = {  # SGLang's sampling_params key -> the completion field that honours it
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
_GUIDED = {
    "json_schema": "json",
    "regex": "regex",
    "ebnf": "grammar",  # -> structured_outputs' kinds
    "structural_tag": "structural_tag",
}
_REFUSED_SAMPLING = {
    "custom_params": "custom logit processors are not supported",
}
_KEYS = frozenset(
    {
        "text",
        "input_ids",
        "sampling_params",
        "rid",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "return_text_in_logprobs",
        "stream",
        "priority",
    }
)
# SGLang's other fields, taken at their default (as clients that always send them send them)
_DEFAULTS = {
    "log_metrics": True,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "return_entropy": False,
    "return_prompt_token_ids": False,
    "return_bytes": False,
    "return_flat_raw_top_logprobs": False,
    "return_sampling_mask": False,
    "no_logs": False,
    "background": False,
    "require_reasoning": False,
    "use_audio_in_video": False,
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
        r"(?<![\w.])(temperature|top_p|top_k|min_p|frequency_penalty|presence_penalty|repetition_penalty|"
        r"stop_token_ids|logit_bias|n)\b",
        r"sampling_params.\1",
    ),
)


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """`bodies`: one completion request per prompt (max_tokens left to the route: it needs
    the prompt's length). `max_new_tokens` per prompt: None up to the context, 0 the prompt
    alone (scoring its logprobs)."""

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
    body = json_object(body)
    _refuse_non_defaults(body, _DEFAULTS)
    # null: unsent
    _refuse_unknown({k: v for k, v in body.items() if v is not None}, _KEYS | frozenset(_DEFAULTS))
    prompts, batch = _prompts(body)
    sampling = body.get("sampling_params")
    if isinstance(sampling, list):
        if len(sampling) != len(prompts):
            raise bad_request(
                f"sampling_params has {len(sampling)} entries for {len(prompts)} prompts",
                "sampling_params",
            )
    elif sampling is None or isinstance(sampling, dict):
        sampling = [sampling or {}] * len(prompts)
    else:
        raise bad_request(
            f"sampling_params must be an object or a list of them, got {json_type(sampling)}",
            "sampling_params",
        )
    return_logprob = bool(opt_bool(body, "return_logprob", default=False))
    start = opt_int(body, "logprob_start_len", default=-1)
    top = opt_int(body, "top_logprobs_num", default=0)
    if start < -1:
        raise bad_request(f"logprob_start_len must be >= -1, got {start}", "logprob_start_len")
    if top < 0:
        raise bad_request(f"top_logprobs_num must be >= 0, got {top}", "top_logprobs_num")
    if top and not return_logprob:
        raise bad_request("top_logprobs_num needs return_logprob=true", "top_logprobs_num")
    bodies, limits = [], []
    for prompt, params in zip(prompts, sampling, strict=True):
        completion, limit = _completion(prompt, params, body)
        if return_logprob:
            completion["logprobs"] = top
            if (
                start >= 0
            ):  # the prompt's logprobs from `start` on (checked against its length later)
                completion["prompt_logprobs"] = top
        bodies.append(completion)
        limits.append(limit)
    choices = [b.get("n", 1) for b in bodies]  # each checked as the completion route checks n
    if any(n != choices[0] for n in choices):
        raise bad_request("every prompt's sampling_params.n must be the same", "sampling_params")
    return GenerateRequest(
        bodies=tuple(bodies),
        max_new_tokens=tuple(limits),
        rids=_rids(body.get("rid"), len(prompts), batch),
        listed=batch or choices[0] != 1,
        stream=bool(opt_bool(body, "stream", default=False)),
        return_logprob=return_logprob,
        logprob_start_len=start,
        top_logprobs_num=top,
        text_in_logprobs=bool(opt_bool(body, "return_text_in_logprobs", default=False)),
    )


def _prompts(body: dict[str, Any]) -> tuple[list[str | list[int]], bool]:
    """The prompts, and whether they came as a batch (a list of texts, of id lists)."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad_request(
            "send text or input_ids (one prompt, or a list of them), not both"
            if text is not None
            else "text or input_ids is required",
            "text",
        )
    if text is not None:
        if isinstance(text, str):
            return [text], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return list(text), True
        raise bad_request("text must be a string or a non-empty list of strings", "text")
    if isinstance(ids, list) and ids and all(is_int(t) for t in ids):
        return [ids], False
    if (
        isinstance(ids, list)
        and ids
        and all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in ids)
    ):
        return list(ids), True
    raise bad_request(
        "input_ids must be a non-empty list of token ids, or a non-empty list of them", "input_ids"
    )


def _completion(
    prompt: str | list[int], params: object, body: dict[str, Any]
) -> tuple[dict[str, Any], int | None]:
    """One prompt's completion body, and its max_new_tokens."""
    if not isinstance(params, dict):
        raise bad_request(
            f"sampling_params must be an object, got {json_type(params)}", "sampling_params"
        )
    completion: dict[str, Any] = {"prompt": prompt, "priority": body.get("priority")}
    guided: dict[str, Any] = {}
    for key, value in params.items():
        if value is None or key == "max_new_tokens":
            continue
        if key in _SAMPLING:
            completion[_SAMPLING[key]] = value
        elif key in _GUIDED:
            guided[_GUIDED[key]] = value
        elif key in _REFUSED_SAMPLING:
            raise unsupported(f"sampling_params.{key}", _REFUSED_SAMPLING[key])
        elif key == "stream_interval":
            if value != 1:
                raise unsupported(
                    "sampling_params.stream_interval", "every token is streamed as it comes"
                )
        else:
            raise unsupported(
                f"sampling_params.{key}", f"'{key}' is not a sampling parameter deltaserve supports"
            )
    if len(guided) > 1:
        raise bad_request(
            "only one of sampling_params.json_schema, regex, ebnf and structural_tag can be set",
            "sampling_params",
        )
    if guided:
        completion["structured_outputs"] = guided
    limit = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if limit is not None and (not is_int(limit) or limit < 0):
        raise bad_request(
            f"sampling_params.max_new_tokens must be an integer >= 0 or null, got {limit!r}",
            "sampling_params.max_new_tokens",
        )
    if limit == 0 and params.get("min_new_tokens"):
        raise bad_request(
            "sampling_params.min_new_tokens must be 0 when max_new_tokens is 0",
            "sampling_params.min_new_tokens",
        )
    return {k: v for k, v in completion.items() if v is not None}, limit


def _rids(rid: object, count: int, batch: bool) -> tuple[str, ...]:
    """Each prompt's id: SGLang's `rid`, a batch's `{rid}_{i}` from one (or one each), else new."""
    if rid is None:
        base = uuid.uuid4().hex
        return (base,) if not batch else tuple(f"{base}_{i}" for i in range(count))
    if isinstance(rid, str) and rid:
        return (rid,) if not batch else tuple(f"{rid}_{i}" for i in range(count))
    if (
        batch
        and isinstance(rid, list)
        and len(rid) == count
        and all(isinstance(r, str) and r for r in rid)
    ):
        if len(set(rid)) < count:
            raise bad_request(f"rid has duplicates: {rid}", "rid")
        return tuple(rid)
    raise bad_request("rid must be a non-empty string (or, for a batch, one per prompt)", "rid")


__all__ = ["DEFAULT_MAX_NEW_TOKENS", "RENAMED", "GenerateRequest", "parse_generate_request"]
