"""vLLM's structured-output request fields, of which only the choice case is honoured.

Current vLLM (vllm/entrypoints/openai/chat_completion/protocol.py, completion/protocol.py)
takes `structured_outputs`, a `StructuredOutputsParams` (vllm/sampling_params.py) with exactly
one constraint of json, regex, choice, grammar, json_object and structural_tag; vLLM 0.11 and
older took `guided_choice` (and guided_json, ...), removed in 0.12. Both spellings of the choice
are taken here (the engine's `guided_choice`); every other constraint is refused naming it (no
grammar engine), and so are the json options away from their defaults and unknown keys.
"""

from __future__ import annotations

from typing import Any

from deltaserve.http.errors import bad_request, unsupported

STRUCTURED_OUTPUT_KEYS = frozenset({"structured_outputs", "guided_choice"})
_CONSTRAINTS = ("json", "regex", "grammar", "json_object", "structural_tag")
# options of the json constraint, taken at their defaults (a client's model_dump sends them)
_OPTION_DEFAULTS = {"disable_any_whitespace": False, "disable_additional_properties": False,
                    "whitespace_pattern": None}  # fmt: skip


def parse_guided_choice(obj: dict[str, Any]) -> tuple[str, ...]:
    """The request's choices (empty: none), from `structured_outputs.choice` or `guided_choice`;
    a 400 naming the field for anything else."""
    legacy, structured = obj.get("guided_choice"), obj.get("structured_outputs")
    if structured is None:
        return () if legacy is None else _choices(legacy, "guided_choice")
    if legacy is not None:
        raise bad_request("send the choices once: structured_outputs.choice or guided_choice "
                          "(its name before vLLM 0.12), not both", "guided_choice")  # fmt: skip
    if not isinstance(structured, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    for key, value in structured.items():
        name = f"structured_outputs.{key}"
        if key in _CONSTRAINTS and value is not None:
            raise unsupported(name, "only the choice constraint is supported (no grammar engine)")
        if key in _OPTION_DEFAULTS and value is not None and value is not _OPTION_DEFAULTS[key]:
            raise unsupported(name, "options of the json constraint are not supported")
        if key not in (*_CONSTRAINTS, *_OPTION_DEFAULTS, "choice"):
            raise unsupported(name, "unknown structured outputs field")
    if structured.get("choice") is None:  # as vLLM's StructuredOutputsParams
        raise bad_request("structured_outputs needs one constraint: choice", "structured_outputs")
    return _choices(structured["choice"], "structured_outputs.choice")


def _choices(value: object, name: str) -> tuple[str, ...]:
    """A non-empty list of non-empty strings (their number is the engine's check)."""
    if not isinstance(value, list) or not value:
        raise bad_request(f"{name} must be a non-empty list of strings", name)
    for i, choice in enumerate(value):
        if not isinstance(choice, str) or not choice:
            raise bad_request(f"{name}[{i}] must be a non-empty string", name)
    return tuple(value)
