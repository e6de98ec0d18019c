"""Structured outputs' engine and bounds (vLLM's `--structured-outputs-config`).

Guided decoding and stop regexes run on llguidance (engine/guides.py): its Earley parser and
lazy lexer come with limits of their own, and these bounds sit around it, each with a
default that no request can get past:
- a constraint's text (a schema, a regex, a grammar, a structural tag, the choices) is at
  most `max_grammar_bytes`, nested at most `max_nesting_depth` brackets deep (refused up
  front, 400);
- compiling it takes at most `compile_timeout_s` in the compile worker and grows the worker
  by at most `max_grammar_memory_mb` (else the worker is killed and restarted; 400);
- its lexer makes at most `max_lexer_states` states (llguidance's limit, ~1-2 kB each);
- a token mask takes at most `max_mask_ms` for one request in one step (the first mask is
  computed when compiling: 400; a later one past it ends that request alone with an error);
- a request has at most `max_stop_regexes` stop regexes of `max_stop_regex_bytes` together.

Why llguidance and not xgrammar (both measured on the Qwen3.5 vocabulary, CPU,
bench/results/grammar_engines_cpu.json): xgrammar masks JSON faster (a few hundredths of a
millisecond a token against a few tenths), but it has no limits to set: it took seconds to
compile the issue's lazy regex, a schema 400 levels deep and 1,000 left-recursive rules
(about 5, 9 and 2 s there), and nothing would stop one of its masks. llguidance compiled
those in milliseconds (refusing the deep schema) and ends a request at its limits while it
generates (lexer states, Earley items, lexer fuel), which is the per-request bound this
server needs; where it is slow (a counted regex's masks, 0.2-0.9 s each; a schema of 10,000
properties, which both took ~19 s to compile) the bounds above refuse the request first. Both could
only be bounded in compile time from outside, hence the worker.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

BACKENDS = ("auto", "guidance")  # auto: guidance, the one built in
OTHER_BACKENDS = ("xgrammar", "outlines", "lm-format-enforcer")  # vLLM's, not built in here


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    max_grammar_bytes: int = 65536
    max_nesting_depth: int = 64
    compile_timeout_s: float = 2.0
    max_grammar_memory_mb: int = 512
    max_lexer_states: int = 50_000
    max_mask_ms: float = 250.0
    max_stop_regexes: int = 16
    max_stop_regex_bytes: int = 4096

    def __post_init__(self) -> None:
        if self.backend in OTHER_BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend {self.backend!r} is not built into this "
                f"server; it runs llguidance: {' or '.join(map(repr, BACKENDS))}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend must be one of {', '.join(BACKENDS)}, "
                f"got {self.backend!r}"
            )
        for f in fields(self):
            if f.name == "backend":
                continue
            value = getattr(self, f.name)
            kind = float if f.type == "float" else int
            if (
                not isinstance(value, int | float)
                or isinstance(value, bool)
                or (kind is int and not isinstance(value, int))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(
                    f"structured_outputs_config.{f.name} must be a positive "
                    f"{'number' if kind is float else 'integer'}, got {value!r}"
                )

    @classmethod
    def parse(cls, text: str) -> StructuredOutputsConfig:
        """From the command line: a JSON object, or `key=value` pairs split by commas
        (`backend=guidance,max_mask_ms=100`); ValueError naming what is wrong."""
        text = text.strip()
        if text.startswith("{"):
            try:
                given: dict[str, Any] = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs_config is not valid JSON: {exc}") from None
            if not isinstance(given, dict):
                raise ValueError("structured_outputs_config must be a JSON object")
        else:
            given = {}
            for pair in filter(None, (p.strip() for p in text.split(","))):
                key, sep, value = pair.partition("=")
                if not sep:
                    raise ValueError(f"structured_outputs_config: {pair!r} is not key=value")
                given[key.strip()] = _number(value.strip())
        known = {f.name: f for f in fields(cls)}
        for key in given:
            if key not in known:
                raise ValueError(
                    f"structured_outputs_config has no field {key!r} (fields: {', '.join(known)})"
                )
        return cls(**given)


def _number(value: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


__all__ = ["BACKENDS", "StructuredOutputsConfig"]
