"""What `deltaserve serve` configures in the HTTP front (`ServerConfig`), checked once at
construction, so a bad flag stops the start before any weight loads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltaserve.engine.sampling_params import SEED_MAX, SEED_MIN
from deltaserve.engine.tokenizer import check_chat_template
from deltaserve.http.cors import cors_list
from deltaserve.http.reasoning import REASONING_PARSERS
from deltaserve.http.tool_parsers import TOOL_CALL_PARSERS

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
# events a streamed request may have waiting for a client that does not read, per choice;
# past it the request is aborted (http/server.py, `_respond`)
DEFAULT_MAX_PENDING_STREAM_EVENTS = 1024
# Keys a client may not pass through chat_template_kwargs: they would change what the call
# returns or replace the template itself, or are apply_chat_template's tokenizer options
# (truncation, max_length, ...), which it ignores with tokenize=False: refused, not dropped.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "tokenize",
        "return_dict",
        "continue_final_message",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """`served_model_name`: one name or several (`--served-model-name a b`, as vLLM's), held
    as a tuple: requests may name any, responses carry the one named (the first when none)."""

    served_model_name: str | Sequence[str]
    api_key: str | None = None
    # the admin routes' key (SGLang's --admin-api-key); None: they take api_key
    admin_api_key: str | None = None
    # routed only when enabled (http/rl_routes.py): new weights, pauses, the cache flush
    # (vLLM's VLLM_SERVER_DEV_MODE), and sleep mode (vLLM's --enable-sleep-mode)
    enable_admin_routes: bool = False
    enable_sleep_mode: bool = False
    # the Host names served (http/request_guard.py); None: on loopback connections only IP
    # addresses, localhost and this machine's name (DNS rebinding)
    allowed_hosts: Sequence[str] | None = None
    # /update_weights_from_disk reads only checkpoint folders under this one; None: any
    allowed_weights_root: str | None = None
    max_pending_stream_events: int = DEFAULT_MAX_PENDING_STREAM_EVENTS
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # "auto": generation_config.json's sampling settings are the requests' defaults, as in
    # `vllm serve`; "vllm": ignored (vLLM's flag and values)
    generation_config: str = "auto"
    # --chat-template: what chats render with instead of the tokenizer's (or chat_template.json's)
    chat_template: str | None = None
    # --default-chat-template-kwargs: every chat's template variables; a request's own
    # chat_template_kwargs win key by key (vLLM merges them so)
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # --seed: the seeds of requests that give none are drawn from a generator seeded with it
    seed: int | None = None
    # chat messages carry the model's thinking apart from its answer (vLLM's parser names);
    # None: the text as generated, in `content`
    reasoning_parser: str | None = None
    # --enable-auto-tool-choice, --tool-call-parser: chats with tools get their output's tool
    # calls in message.tool_calls (tool_parsers.py; vLLM's flags and parser names)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # usage.prompt_tokens_details.cached_tokens: the prompt tokens a saved prefix held (vLLM's
    # flag; shown where there were any)
    enable_prompt_tokens_details: bool = False
    # logprobs name tokens "token_id:{id}" in requests that leave return_tokens_as_token_ids
    # out (vLLM's flag: a request's own value wins)
    return_tokens_as_token_ids: bool = False
    # CORS for browser front-ends (http/cors.py), vLLM's flags: lists of strings, "*" for
    # any; held as tuples. No origin by default (vLLM's is "*"): cross-site calls are refused
    allowed_origins: Sequence[str] = ()
    allowed_methods: Sequence[str] = ("*",)
    allowed_headers: Sequence[str] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        names = self.served_model_name
        names = (names,) if isinstance(names, str) else tuple(dict.fromkeys(names))
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(
                f"served_model_name must be non-empty strings, got {self.served_model_name!r}"
            )
        object.__setattr__(self, "served_model_name", names)
        for name in ("api_key", "admin_api_key"):
            if getattr(self, name) is not None and not getattr(self, name):
                raise ValueError(f"{name} must be non-empty when given")
        if self.allowed_hosts is not None:
            object.__setattr__(
                self, "allowed_hosts", cors_list("allowed_hosts", self.allowed_hosts)
            )
        root = self.allowed_weights_root
        if root is not None and not Path(root).is_dir():
            raise ValueError(f"allowed_weights_root {root!r} is not a directory")
        if self.max_pending_stream_events < 1:
            raise ValueError(
                f"max_pending_stream_events must be >= 1, got {self.max_pending_stream_events}"
            )
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(
                f"generation_config must be 'auto' or 'vllm', got {self.generation_config!r}"
            )
        if self.chat_template is not None:
            check_chat_template(self.chat_template)
        kwargs = self.default_chat_template_kwargs
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError(
                f"default_chat_template_kwargs must map names to values, got {kwargs!r}"
            )
        if reserved := sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs)):
            raise ValueError(
                f"default_chat_template_kwargs: {', '.join(reserved)} reserved by the "
                "server, as in a request's chat_template_kwargs"
            )
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise ValueError(
                f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] or None, got {self.seed!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:  # vLLM's words
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            object.__setattr__(self, name, cors_list(name, getattr(self, name)))
        if not isinstance(self.allow_credentials, bool):
            raise ValueError(f"allow_credentials must be a bool, got {self.allow_credentials!r}")
