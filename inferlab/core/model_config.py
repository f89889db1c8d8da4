"""A checkpoint's config.json as the config object the models read, built without transformers'
config classes for the model types whose defaults a model plugin declares (ConfigDefaults).

Loading any of those classes is slow: in transformers 5.x the docstring decorator on each config
class imports the model auto-classes, most of the config-and-tokenizer phase of start-up. The
object built here holds every field of config.json, the default transformers' class gives each
field the file leaves out (the plugin's config_defaults), and what that class derives from them
(num_key_value_heads, head_dim, layer_types, rope_parameters, dtype, sliding_window); tests compare
it with the installed transformers' config for every model type a built-in plugin declares. Other
model types go through transformers (checkpoint.transformers_config)."""

from __future__ import annotations

import torch

# Rotary types whose scaling is relative to the length the model was trained at.
_ROPE_TYPES_WITH_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")


class ModelConfig:
    """A model's settings as attributes, as transformers' config object presents them."""

    def __init__(self, fields: dict):
        self.__dict__.update(fields)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def __eq__(self, other) -> bool:
        return isinstance(other, ModelConfig) and self.__dict__ == other.__dict__

    def __repr__(self) -> str:
        return f"ModelConfig({self.__dict__!r})"


def native_model_config(
    fields: dict, config_defaults: dict[str, dict], path: str = "", source: str = "config.json"
) -> ModelConfig | None:
    """The config of a config.json's fields, or None where its model_type is not one of
    config_defaults (model_type -> the defaults of transformers' config class: what the model
    plugins declare, see ConfigDefaults). Raises ValueError, naming source, for a field whose type
    is not the one its default has."""
    defaults = config_defaults.get(fields.get("model_type"))
    if defaults is None:
        return None
    check_field_types(fields, defaults, source)
    values = {**defaults, **fields, "_name_or_path": path}
    dtype = values.pop("torch_dtype", None)
    values["dtype"] = values.get("dtype") or dtype
    if values["dtype"] is not None:
        if not isinstance(values["dtype"], str) or not isinstance(getattr(torch, values["dtype"], None), torch.dtype):
            raise ValueError(f"{source}: dtype must name a torch dtype (e.g. 'bfloat16'), got {values['dtype']!r}")
        values["dtype"] = getattr(torch, values["dtype"])
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if "head_dim" in defaults and values["head_dim"] is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if "use_sliding_window" in defaults:
        if not values["use_sliding_window"]:
            values["sliding_window"] = None
        if values["layer_types"] is None:
            values["layer_types"] = [
                "sliding_attention"
                if values["sliding_window"] is not None and i >= values["max_window_layers"]
                else "full_attention"
                for i in range(values["num_hidden_layers"])
            ]
    values["rope_parameters"] = _rope_parameters(values)
    values.pop("rope_scaling", None)
    values.pop("rope_theta", None)
    return ModelConfig(values)


def _rope_parameters(values: dict) -> dict:
    """transformers 5's rope_parameters: the rotary scaling (config.json's rope_scaling, or its
    rope_parameters), with the rotary base and type filled in."""
    given = values.get("rope_scaling") or values.get("rope_parameters")
    params = dict(given) if isinstance(given, dict) else {}
    params.setdefault("rope_theta", values.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    if values.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", values["partial_rotary_factor"])
    if params["rope_type"] in _ROPE_TYPES_WITH_ORIGINAL_LENGTH:
        original = values.get("original_max_position_embeddings", values["max_position_embeddings"])
        params.setdefault("original_max_position_embeddings", original)
    return params


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}


def check_field_types(fields: dict, defaults: dict, source: str) -> None:
    """Each field the models read whose default is an integer, number, boolean or string must hold
    one (null where transformers' class allows it is left to the reader)."""
    for name, default in defaults.items():
        value = fields.get(name)
        kind = type(default)
        if value is None or kind not in _TYPE_NAMES or name.endswith("_token_id"):
            continue
        if kind is float:
            fits = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            fits = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not fits:
            raise ValueError(f"{source}: {name} must be {_TYPE_NAMES[kind]}, got {value!r}")
