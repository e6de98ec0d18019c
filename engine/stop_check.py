"""Whether a sampled token ends its request, and the text it adds: the scheduler's stop
checks, as vLLM's `check_stop` (vllm/v1/core/sched/utils.py) and its detokenizer's stop strings.

In order: a stop token (an EOS id unless ignore_eos, or one of `stop_token_ids`) ends the
request, its text left out unless `include_stop_str_in_output` (as vLLM's detokenizer skips a
stop-terminated token only then); a guided-choice request's EOS ends it even with ignore_eos
(the rank allows one only at a whole choice). Else a stop string or stop regex in the text; else a
whole choice that no longer one extends ("stop", its last token's text kept); else max_tokens.
Before min_tokens tokens the rank has masked every stop token, and the detokenizer looks for no stop
string, so nothing here needs to count them.
"""

from __future__ import annotations

from collections.abc import Collection

from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.request import FinishReason, Request


def check_stop(
    request: Request,
    token: int,
    eos_token_ids: Collection[int],
    detokenizer: IncrementalDetokenizer,
) -> tuple[FinishReason | None, str | None]:
    """(why `request` ends with `token`, its newest output token, or None; the token's text,
    or None where nothing in it can end the request: then it is detokenized later, off the
    step's path)."""
    params = request.params
    # a guided request's EOS is its constraint's end: it ends even with ignore_eos
    if (
        (not params.ignore_eos or params.guide_grammar) and token in eos_token_ids
    ) or token in params.stop_token_ids:
        return "stop", detokenizer.add(token) if params.include_stop_str_in_output else ""
    at_length = request.num_output_tokens >= params.max_tokens
    if not (params.stop or params.stop_regex or at_length):
        return None, None
    text = detokenizer.add(token)
    if detokenizer.stop_matched is not None:
        return "stop", text
    return ("length" if at_length else None), text


def matched_stop(
    request: Request, token: int, detokenizer: IncrementalDetokenizer
) -> str | int | None:
    """vLLM's stop_reason for a request that ended with `token`: the stop string its text
    matched, or the token when it is one of stop_token_ids (an EOS: None)."""
    if detokenizer.stop_matched is not None:
        return detokenizer.stop_matched
    return token if token in request.params.stop_token_ids else None
