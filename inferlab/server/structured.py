"""A body's structured-output fields as one StructuredOutputs: OpenAI's response_format
(json_object, json_schema), vLLM's guided_json, guided_regex, guided_choice and guided_grammar, and
its newer structured_outputs object. At most one may constrain a request; a malformed one is a
400 naming the field. The grammar library checks the grammar itself when the engine takes the
request (a schema it rejects is a 400 that says why)."""

from inferlab.core.sampling_params import StructuredOutputs

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


class FieldError(ValueError):
    """A malformed structured-output field: the message, and the field (the error's param)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def structured_outputs(body) -> StructuredOutputs | None:
    """The constraint body asks for, or None. FieldError for one that is malformed or for two."""
    found: list[tuple[str, dict]] = []
    response_format = body.response_format
    if response_format is not None:
        kind = response_format.get("type")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            schema = response_format.get("json_schema")
            if not isinstance(schema, dict) or not isinstance(schema.get("schema"), (dict, bool)):
                raise FieldError(
                    'response_format: a json_schema response_format needs {"json_schema": {"name": ..., "schema": {...}}}',
                    "response_format",
                )
            found.append(("response_format", {"json": schema["schema"] if schema["schema"] is not True else {}}))
        elif kind != "text":
            raise FieldError(
                f"response_format: type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                "response_format",
            )
    for name, key in GUIDED_FIELDS.items():
        value = getattr(body, name)
        if value is not None:
            found.append((name, {key: value}))
    if body.structured_outputs is not None:
        given = {k: v for k, v in body.structured_outputs.items() if k in STRUCTURED_KEYS and v not in (None, False)}
        if given:
            found.append(("structured_outputs", given))
    if not found:
        return None
    if len(found) > 1:
        names = [name for name, _ in found]
        raise FieldError(f"{names[0]}: give one structured output constraint, got {names}", names[1])
    name, settings = found[0]
    try:
        return StructuredOutputs(**settings)
    except (ValueError, TypeError) as e:
        raise FieldError(f"{name}: {e}", name) from None
