"""`deltaserve serve`'s flags for who may call what: the keys (also from the environment, so
that they need not show in `ps`), the opt-in admin routes, the hosts and origins served, and
where new weights may come from. docs/API.md ("Security") maps them to vLLM's and SGLang's.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import Any

# the environment variables a key is taken from when its flag is not given, first set wins
API_KEY_ENV = ("DELTASERVE_API_KEY", "VLLM_API_KEY")
ADMIN_API_KEY_ENV = ("DELTASERVE_ADMIN_API_KEY",)
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM's switch for its admin routes: "1" routes ours


def _json_list(text: str) -> list[str]:
    """A JSON list of strings, as vLLM reads --allowed-origins and its siblings."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        example = '["http://localhost:3000"]'
        raise argparse.ArgumentTypeError(
            f"must be a JSON list of strings such as '{example}', got {text!r}"
        )
    return value


def add_access_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but "
        f"/health, /ping, /version and /metrics; default: ${API_KEY_ENV[0]}, else "
        f"${API_KEY_ENV[1]} (the environment keeps it out of `ps`)",
    )
    group.add_argument(
        "--admin-api-key",
        default=None,
        help="the admin routes' key (as SGLang's flag), in place of --api-key there; "
        f"default: ${ADMIN_API_KEY_ENV[0]}",
    )
    group.add_argument(
        "--enable-admin-routes",
        action="store_true",
        help="route what changes the engine: /update_weights_from_disk, /pause, /resume, "
        "/is_paused, /pause_generation, /continue_generation, /flush_cache, "
        f"/reset_prefix_cache (vLLM routes its own under {DEV_MODE_ENV}=1, which sets this too)",
    )
    group.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="route sleep mode: /sleep, /wake_up, /is_sleeping, /release_memory_occupation, "
        "/resume_memory_occupation (as vLLM's flag)",
    )
    group.add_argument(
        "--allowed-hosts",
        type=_json_list,
        default=None,
        metavar="JSON",
        help='the Host names served, e.g. \'["api.example.com", "*.internal"]\'; "*": any. '
        "Default: on loopback connections an IP address, localhost or this machine's name "
        "(against DNS rebinding), anything on others",
    )
    group.add_argument(
        "--allowed-weights-root",
        default=None,
        metavar="DIR",
        help="/update_weights_from_disk loads only checkpoint folders under DIR (symbolic "
        "links followed); default: any folder",
    )
    # CORS, as vLLM's flags (JSON lists; a str default goes through `type` too)
    group.add_argument(
        "--allowed-origins",
        type=_json_list,
        default="[]",
        metavar="JSON",
        help='CORS: the origins browser pages may call from; "*": any. Default: none '
        '(vLLM\'s is "*"): requests from other sites are refused',
    )
    group.add_argument(
        "--allowed-methods",
        type=_json_list,
        default='["*"]',
        metavar="JSON",
        help='CORS: the methods they may use; "*": any',
    )
    group.add_argument(
        "--allowed-headers",
        type=_json_list,
        default='["*"]',
        metavar="JSON",
        help='CORS: the request headers they may send; "*": any',
    )
    group.add_argument(
        "--allow-credentials",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="CORS: browsers may send cookies and credentials (the Origin is then "
        'echoed, never "*"), as vLLM\'s flag',
    )


def _from_env(names: tuple[str, ...], env: Mapping[str, str]) -> str | None:
    return next((env[name] for name in names if env.get(name)), None)


def access_config(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """ServerConfig's fields from these flags, a key's environment variable standing in for
    a flag not given."""
    return {
        "api_key": args.api_key if args.api_key is not None else _from_env(API_KEY_ENV, env),
        "admin_api_key": args.admin_api_key
        if args.admin_api_key is not None
        else _from_env(ADMIN_API_KEY_ENV, env),
        "enable_admin_routes": args.enable_admin_routes or env.get(DEV_MODE_ENV) == "1",
        "enable_sleep_mode": args.enable_sleep_mode,
        "allowed_hosts": args.allowed_hosts,
        "allowed_weights_root": args.allowed_weights_root,
        "allowed_origins": args.allowed_origins,
        "allowed_methods": args.allowed_methods,
        "allowed_headers": args.allowed_headers,
        "allow_credentials": args.allow_credentials,
    }
