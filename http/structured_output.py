"""vLLM's structured-output request fields, as the engine's guided_* sampling parameters.

Current vLLM (vllm/entrypoints/openai/chat_completion/protocol.py, completion/protocol.py)
takes `structured_outputs`, a `StructuredOutputsParams` (vllm/sampling_params.py) with exactly
one constraint of json, regex, choice, grammar, json_object and structural_tag, and maps
`response_format` (json_object, json_schema; both endpoints) onto it; vLLM 0.11 and older took
`guided_json`, `guided_regex`, `guided_choice` (removed in 0.12). A forced tool_choice
("required" or a named function) is guided JSON too (tool_protocol.py). All become one `Guided`;
a grammar is GBNF or Lark (engine/grammar.py), a structural tag its structures and triggers
(engine/structural_tag.py); anything unknown is refused.

One constraint per request: vLLM refuses two in `structured_outputs`; where two fields would
each give one (response_format with structured_outputs, a forced tool with either), vLLM
overrides one with the other, and which wins has changed between its versions: refused here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from deltaserve.engine.sampling_params import GUIDED_FIELDS
from deltaserve.http.errors import ApiError, bad_request, unsupported
from deltaserve.http.tool_protocol import ToolFields, forced_tool_schema

STRUCTURED_OUTPUT_KEYS = frozenset(
    {
        "structured_outputs",
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_whitespace_pattern",
        "guided_decoding_backend",
    }
)
_KINDS = (
    "json",
    "regex",
    "choice",
    "json_object",
    "grammar",
    "structural_tag",
)  # the constraints the engine has
# options of the json constraint (vLLM's defaults: False, False, None)
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


@dataclass(frozen=True, slots=True)
class Guided:
    """A request's constraint in the engine's terms (SamplingParams' guided_* fields): at most
    one of `choice`, `regex`, `json` (a JSON Schema as JSON text) and `json_object`, with
    `whitespace` (a regex of the blanks between JSON tokens; None: the engine's default) for
    the last two. `param` and `whitespace_param`: the request fields they came from, which
    errors name; `param` None: no constraint."""

    choice: tuple[str, ...] = ()
    regex: str | None = None
    json: str | None = None
    json_object: bool = False
    grammar: str | None = None  # GBNF or Lark (engine/grammar.py)
    # JSON text: {structures, triggers} (engine/structural_tag.py)
    structural_tag: str | None = None
    whitespace: str | None = None
    param: str | None = None
    whitespace_param: str | None = None

    def params(self) -> dict[str, Any]:
        """The SamplingParams fields it sets (those left at their defaults are not passed)."""
        fields = {
            "guided_choice": self.choice,
            "guided_regex": self.regex,
            "guided_json": self.json,
            "guided_json_object": self.json_object,
            "guided_grammar": self.grammar,
            "guided_structural_tag": self.structural_tag,
            "guided_whitespace": self.whitespace,
        }
        return {name: value for name, value in fields.items() if value not in ((), None, False)}

    def param_names(self) -> dict[str, str]:
        """The request field each of the engine's guided_* fields came from, which the
        engine's refusals of them name (`errors.refused_param`)."""
        if self.param is None:
            return {}
        names = {name: self.param for name, _ in GUIDED_FIELDS}
        names["guided_whitespace"] = self.whitespace_param or self.param
        return names


def parse_guided(obj: dict[str, Any], tools: ToolFields | None = None) -> Guided:
    """The request's constraint, from whichever field gives one (`tools`: a chat's, whose
    forced tool_choice is one); a 400 naming the field for two, or for anything refused."""
    given = [
        g
        for g in (_structured(obj), _legacy(obj), _response_format(obj), _forced(tools))
        if g.param
    ]
    if len(given) > 1:
        first, second = given[0].param, given[1].param
        if "tool_choice" in (first, second):  # vLLM's words
            raise bad_request(
                "You can only either use constraints for structured outputs or tools, not "
                f"both: {first} and {second} are set",
                second,
            )
        raise bad_request(
            f"You can only use one kind of structured outputs constraint: {first} and "
            f"{second} are both set; send one, not both",
            second,
        )
    return given[0] if given else Guided()


def refuse_in_reasoning(guided: Guided) -> ApiError:
    """A constraint on a chat that opens a think block would constrain the reasoning."""
    return unsupported(
        guided.param or "structured_outputs",
        "structured outputs would constrain the model's "
        "reasoning, which comes first in this chat; turn thinking off "
        '(chat_template_kwargs {"enable_thinking": false})',
    )


def _structured(obj: dict[str, Any]) -> Guided:
    """`structured_outputs`: exactly one constraint, as vLLM's StructuredOutputsParams."""
    spec = obj.get("structured_outputs")
    if spec is None:
        return Guided()
    if not isinstance(spec, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    for key in spec:
        if key not in (*_KINDS, *_OPTIONS):
            raise unsupported(f"structured_outputs.{key}", "unknown structured outputs field")
    for key in ("disable_any_whitespace", "disable_additional_properties", "json_object"):
        if spec.get(key) is not None and not isinstance(spec[key], bool):
            raise bad_request(
                f"structured_outputs.{key} must be a boolean", f"structured_outputs.{key}"
            )
    # disable_additional_properties: the schemas here allow no properties they do not list,
    # with it or without (engine/json_schema.py); xgrammar's only with it
    whitespace, option = (
        _string(spec, "whitespace_pattern", "structured_outputs."),
        "whitespace_pattern",
    )
    if spec.get("disable_any_whitespace"):  # xgrammar's: no blanks at all
        if whitespace is not None:
            raise bad_request(
                "structured_outputs.disable_any_whitespace and whitespace_pattern both set the "
                "blanks between JSON tokens; send one",
                "structured_outputs.whitespace_pattern",
            )
        whitespace, option = "", "disable_any_whitespace"
    guided = _one(spec, "structured_outputs.", whitespace, f"structured_outputs.{option}")
    if guided.param is None:  # as vLLM's StructuredOutputsParams
        raise bad_request(
            "structured_outputs needs one constraint: json, regex, choice, json_object, grammar "
            "or structural_tag",
            "structured_outputs",
        )
    return guided


def _legacy(obj: dict[str, Any]) -> Guided:
    """vLLM 0.11's fields. guided_decoding_backend is refused: this server has one engine, and
    vLLM's V1 engine refuses a request's backend other than its own too."""
    if obj.get("guided_decoding_backend") is not None:
        raise unsupported(
            "guided_decoding_backend",
            "a request cannot choose the structured outputs engine (vLLM's V1 refuses it too)",
        )
    values = {kind: obj.get(f"guided_{kind}") for kind in ("json", "regex", "choice", "grammar")}
    whitespace = _string(obj, "guided_whitespace_pattern")
    return _one(values, "guided_", whitespace, "guided_whitespace_pattern")


def _one(
    values: dict[str, Any], prefix: str, whitespace: str | None, whitespace_param: str
) -> Guided:
    """The constraint of `values` (kind -> value; null or false: not given), its field
    `prefix + kind`; `whitespace`, for a json one, from `whitespace_param`."""
    given = [kind for kind in _KINDS if values.get(kind) not in (None, False)]
    if len(given) > 1:  # vLLM's words
        raise bad_request(
            "You can only use one kind of structured outputs constraint but multiple are "
            f"specified: {', '.join(prefix + k for k in given)}",
            prefix + given[1],
        )
    if not given:
        if whitespace is not None:
            raise bad_request(f"{whitespace_param} needs a json constraint", whitespace_param)
        return Guided()
    kind, param = given[0], prefix + given[0]
    value = values[kind]
    if whitespace is not None and kind not in ("json", "json_object"):
        raise unsupported(
            whitespace_param, "it applies to the json and json_object constraints only"
        )
    if kind == "choice":
        return Guided(choice=_choices(value, param), param=param)
    if kind in ("regex", "grammar"):
        if not isinstance(value, str):
            raise bad_request(f"{param} must be a string", param)
        return (
            Guided(regex=value, param=param)
            if kind == "regex"
            else Guided(grammar=value, param=param)
        )
    if kind == "structural_tag":  # vLLM's is JSON text; an object is taken too
        if not isinstance(value, str | dict):
            raise bad_request(f"{param} must be JSON text of {{structures, triggers}}", param)
        return Guided(
            structural_tag=value if isinstance(value, str) else json.dumps(value), param=param
        )
    if kind == "json_object":
        return Guided(
            json_object=True, whitespace=whitespace, param=param, whitespace_param=whitespace_param
        )
    return Guided(
        json=_schema_text(value, param),
        whitespace=whitespace,
        param=param,
        whitespace_param=whitespace_param,
    )


def _response_format(obj: dict[str, Any]) -> Guided:
    """OpenAI's response_format, as vLLM maps it: json_object, json_schema's `schema`."""
    spec = obj.get("response_format")
    if spec is None:
        return Guided()
    if not isinstance(spec, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = spec.get("type")
    if kind == "structural_tag":  # its structures and triggers beside the type (vLLM's legacy form)
        return Guided(structural_tag=json.dumps(spec), param="response_format")
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_request(
            "response_format.type must be 'text', 'json_object', 'json_schema' or "
            f"'structural_tag', got {kind!r}",
            "response_format",
        )
    for key in spec:
        if key != "type" and (kind != "json_schema" or key != "json_schema"):
            raise unsupported(
                f"response_format.{key}",
                f"a {kind} response_format carries only its type"
                + (" and json_schema" if kind == "json_schema" else ""),
            )
    if kind == "text":
        return Guided()
    if kind == "json_object":
        return Guided(json_object=True, param="response_format")
    return Guided(json=_json_schema_format(spec.get("json_schema")), param="response_format")


def _json_schema_format(spec: object) -> str:
    """response_format.json_schema: {name, schema, description, strict} as OpenAI's (the name
    is required, as there and in vLLM); strict is taken either way: the output follows the
    schema."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f"{where} must be an object with name and schema", "response_format")
    for key in spec:
        if key not in ("name", "schema", "description", "strict"):
            raise unsupported(
                f"{where}.{key}", "it carries only name, schema, description and strict"
            )
    if not isinstance(spec.get("name"), str):
        raise bad_request(f"{where}.name is required: a string", "response_format")
    for key, kind in (("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise bad_request(f"{where}.{key} must be a {kind.__name__}", "response_format")
    if "schema" not in spec:
        raise bad_request(f"{where}.schema is required", "response_format")
    return _schema_text(spec["schema"], "response_format")


def _forced(tools: ToolFields | None) -> Guided:
    schema = None if tools is None else forced_tool_schema(tools)
    return Guided() if schema is None else Guided(json=json.dumps(schema), param="tool_choice")


def _schema_text(value: object, param: str) -> str:
    """A JSON Schema given as an object (or true/false), or as its JSON text (vLLM takes
    both), as JSON text; its keywords are the engine's check."""
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param) from None
        return value
    if not isinstance(value, dict | bool):
        raise bad_request(f"{param} must be a JSON Schema: an object, or its JSON text", param)
    return json.dumps(value)


def _string(obj: dict[str, Any], name: str, prefix: str = "") -> str | None:
    value = obj.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"{prefix}{name} must be a string", prefix + name)
    return value


def _choices(value: object, name: str) -> tuple[str, ...]:
    """A non-empty list of non-empty strings (their number is the engine's check)."""
    if not isinstance(value, list) or not value:
        raise bad_request(f"{name} must be a non-empty list of strings", name)
    for i, choice in enumerate(value):
        if not isinstance(choice, str) or not choice:
            raise bad_request(f"{name}[{i}] must be a non-empty string", name)
    return tuple(value)
