"""SGLang's `/generate` answer, from engine events: per choice `{"text", "output_ids",
"meta_info"}`, one object for one prompt and one choice, else a list (prompt-major); streamed
as SGLang streams by default, each event the choice so far (text, ids and logprobs
cumulative), with its `index` when the answer is a list, and `data: [DONE]` at the end.

`output_ids` holds every sampled token, the EOS or stop token that ended the choice too (its
text is not in `text`). `finish_reason` is SGLang's: `{"type": "length", "length": N}`,
`{"type": "stop", "matched": <token id or stop string>}`, or `{"type": "abort", ...}`
(/abort_request). Logprob entries are `[logprob, token_id, text or null]`; the prompt's start
at `logprob_start_len` (its last token by default) and, as SGLang's, the first has no logprob.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from deltaserve.http.dialects.sglang_request import GenerateRequest
from deltaserve.http.errors import ApiError
from deltaserve.http.responses import SSE_DONE, ChoiceState, TokenStrings, clamp_logprob, sse


class GenerateFormatter:
    """The hooks server.py's `_respond` calls, for SGLang's shape."""

    finishes_aborts = True  # an aborted choice answers with its abort, as SGLang's (not an error)

    def __init__(
        self, req: GenerateRequest, n: int, strings: TokenStrings, weight_version: Callable[[], str]
    ) -> None:
        self.id = req.rids[0]
        self._weight_version = weight_version  # the name of the weights serving now
        self._req, self._n, self._strings = req, n, strings
        self._started = time.monotonic()
        choices = len(req.rids) * n
        self._ids: list[list[int]] = [[] for _ in range(choices)]
        self._logprobs: list[list[list[Any]]] = [[] for _ in range(choices)]
        self._top: list[list[list[list[Any]]]] = [[] for _ in range(choices)]
        self._finish: list[dict[str, Any] | None] = [None] * choices

    # ---- events -------------------------------------------------------------------------

    def start(self, index: int, state: ChoiceState | None = None) -> None:
        return None

    def prompt(self, index: int, ev: Any, state: ChoiceState) -> None:
        state.prompt_logprobs = ev

    def token(self, index: int, ev: Any, state: ChoiceState) -> dict[str, Any] | None:
        if self._req.max_new_tokens[index // self._n] == 0:
            return None  # the prompt alone: the token sampled after it is not an output
        self._ids[index].append(ev.token_id)
        state.add_text(ev.text)
        if self._req.return_logprob:
            self._logprobs[index].append(self._entry(ev.token_id, ev.logprob))
            if self._req.top_logprobs_num:
                self._top[index].append([self._entry(t, lp) for t, lp in ev.top_logprobs])
        return self._choice(index, state) if self._req.stream else None

    def finish(self, index: int, ev: Any, state: ChoiceState) -> dict[str, Any] | None:
        ids, alone = self._ids[index], self._req.max_new_tokens[index // self._n] == 0
        if ev.reason == "abort":
            reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        elif alone:
            reason = {"type": "length", "length": 0}
        elif ev.reason == "length":
            reason = {"type": "length", "length": len(ids)}
        else:  # a stop string or stop_token_ids id as vLLM's stop_reason names it, else the EOS
            reason = {
                "type": "stop",
                "matched": ev.stop_reason if ev.stop_reason is not None else ids[-1],
            }
        if reason["type"] != "abort" and not alone:
            state.add_text(ev.text)
        self._finish[index] = reason
        return self._choice(index, state) if self._req.stream else None

    # ---- bodies -------------------------------------------------------------------------

    def response(self, states: list[ChoiceState], usage_json: dict[str, int]) -> Any:
        choices = [self._choice(i, s) for i, s in enumerate(states)]
        return choices if self._req.listed else choices[0]

    def encode(self, chunk: dict[str, Any]) -> bytes:
        return sse(chunk)

    def stream_end(self, usage_json: dict[str, int], include_usage: bool) -> bytes:
        return SSE_DONE

    def stream_error(self, err: ApiError) -> bytes:
        """As SGLang's: the error as an event (its message under `error`), then [DONE]."""
        return sse(err.body()) + SSE_DONE

    def _choice(self, index: int, state: ChoiceState) -> dict[str, Any]:
        finish = self._finish[index]
        meta: dict[str, Any] = {
            "id": self._req.rids[index // self._n],
            "finish_reason": finish,
            "prompt_tokens": state.prompt_tokens,
            "weight_version": self._weight_version(),
        }
        if self._req.return_logprob:
            meta.update(self._input_logprobs(state))
            meta["output_token_logprobs"] = list(self._logprobs[index])
            if self._req.top_logprobs_num:
                meta["output_top_logprobs"] = list(self._top[index])
        meta["completion_tokens"] = len(self._ids[index])
        meta["cached_tokens"] = state.cached_tokens
        if finish is not None:
            meta["e2e_latency"] = time.monotonic() - self._started
        choice = {
            "text": "".join(state.text),
            "output_ids": list(self._ids[index]),
            "meta_info": meta,
        }
        if self._req.stream and self._req.listed:
            choice["index"] = index
        return choice

    def _input_logprobs(self, state: ChoiceState) -> dict[str, Any]:
        """From logprob_start_len to the prompt's end; entry 0 without a logprob (as SGLang's)."""
        ids, ev = state.prompt_ids, state.prompt_logprobs
        start = len(ids) - 1 if self._req.logprob_start_len < 0 else self._req.logprob_start_len
        # the engine's prompt logprobs: entry i is prompt token i + 1's
        token = [self._entry(ids[start], None)]
        token += [
            self._entry(ids[pos], ev.token_logprobs[pos - 1]) for pos in range(start + 1, len(ids))
        ]
        out: dict[str, Any] = {"input_token_logprobs": token}
        if self._req.top_logprobs_num:
            out["input_top_logprobs"] = [None] + [
                [self._entry(t, lp) for t, lp in ev.top_logprobs[pos - 1]]
                for pos in range(start + 1, len(ids))
            ]
        return out

    def _entry(self, token_id: int, logprob: float | None) -> list[Any]:
        text = self._strings.text(token_id) if self._req.text_in_logprobs else None
        return [None if logprob is None else clamp_logprob(logprob), token_id, text]


__all__ = ["GenerateFormatter"]
