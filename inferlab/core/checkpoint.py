"""A checkpoint directory's config and tokenizer, read with errors that name the file and what is
wrong; no code from the directory ever runs. The real executors read their checkpoint here; the
simulated one reads only a config and a tokenizer."""

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Real
from time import perf_counter
from typing import Any

from inferlab.core.model_config import native_model_config
from inferlab.tiny_model import default_model_path

log = logging.getLogger("inferlab")


@dataclass(frozen=True)
class Checkpoint:
    """The model an engine serves: its HF config and tokenizer, and where they came from."""

    path: str  # the checkpoint directory, or what a simulated engine's model shape came from
    hf_config: Any
    tokenizer: Any  # None in tensor-parallel worker processes, which never tokenize


def open_checkpoint(config, model_path: str | None, registry) -> Checkpoint:
    """The checkpoint at model_path (the embedded tiny model when None), with the engine's
    max_model_len cut to what the model's positions allow. registry (a PluginRegistry) gives the
    model plugins' config defaults (ConfigDefaults)."""
    path = os.fspath(default_model_path() if model_path is None else model_path)
    reading = perf_counter()
    hf_config, tokenizer = load_checkpoint_files(path, registry.model_config_defaults())
    log.info("read the model's config and tokenizer in %.1f s", perf_counter() - reading)
    fit_model_len(config, hf_config)
    return Checkpoint(path, hf_config, tokenizer)


def fit_model_len(config, hf_config) -> None:
    """Cuts config.max_model_len to the model's max_position_embeddings, before anything is sized
    from it."""
    config.max_model_len = min(config.max_model_len, hf_config.max_position_embeddings)


# Files that hold a tokenizer's vocabulary, in the formats transformers reads without a checkpoint's own code.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
# Config fields the engine divides by or sizes tensors with: each must be a positive integer where present.
POSITIVE_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)


def load_checkpoint_files(path: str, config_defaults: dict[str, dict]):
    """The HF config and tokenizer of a model directory, with errors that name the file and what
    is wrong. No code from the directory ever runs (trust_remote_code is always False), and
    nothing asks on stdin: a checkpoint that needs its own code is refused. config_defaults
    (model_type -> the defaults of transformers' config class, PluginRegistry.model_config_defaults)
    lists the model types read without transformers' config classes."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"model directory {path!r} has no config.json ({config_file!r})")
    try:
        with open(config_file, encoding="utf-8") as f:
            fields = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{config_file} must hold a JSON object, got a {type(fields).__name__}")
    check_model_type(fields, config_file, config_defaults)
    check_positive_fields(fields, config_file)
    hf_config = native_model_config(fields, config_defaults, path, config_file)
    if hf_config is None:
        try:
            hf_config = transformers_config(path, fields["model_type"])
        except Exception as e:  # transformers' own validation errors are of several kinds
            raise ValueError(f"{config_file} could not be read as a transformers config: {e}") from e
    check_positive_fields({name: getattr(hf_config, name, None) for name in POSITIVE_CONFIG_FIELDS}, config_file)
    check_norm_and_rotary_fields(hf_config, config_file)
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"model directory {path!r} has no tokenizer: none of {list(TOKENIZER_FILES)}")
    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"no usable tokenizer in {path!r}: {e}") from e
    if len(tokenizer) < 2:
        raise ValueError(f"the tokenizer in {path!r} has {len(tokenizer)} token(s): its vocabulary files are missing")
    return hf_config, tokenizer


def transformers_config(path: str, model_type: str):
    """The config AutoConfig would build, for the model types no plugin declares defaults for: the config class transformers maps the model_type to, found by its name without
    importing the auto classes (see load_tokenizer); AutoConfig where the name is not in that table."""
    import transformers

    name = transformers_config_names().get(model_type)
    cls = getattr(transformers, name, None) if name else None
    if isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig):
        return cls.from_pretrained(path, name_or_path=path)  # AutoConfig records the path too
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=False)


def transformers_config_names() -> dict[str, str]:
    """model_type -> config class name, as transformers' own table lists them (a module of names
    only: cheap to import); empty where this transformers has no such module."""
    try:
        from transformers.models.auto.auto_mappings import CONFIG_MAPPING_NAMES
    except ImportError:
        return {}
    return CONFIG_MAPPING_NAMES


def load_tokenizer(path: str):
    """The tokenizer AutoTokenizer would build (fast where there is one), found by the class name
    tokenizer_config.json gives, among transformers' own classes: the auto classes' modules import
    transformers' model machinery, which in some versions is most of the start-up's config and
    tokenizer phase (BENCHMARKS.md, "Start-up and the first pass"). Anything else (no name, a name transformers
    lacks, such as custom code's) goes through AutoTokenizer, which never runs a directory's code."""
    import transformers
    from transformers import PreTrainedTokenizerBase

    name = None
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        pass
    if isinstance(name, str) and name.isidentifier():
        for candidate in [name] if name.endswith("Fast") else [f"{name}Fast", name]:
            try:
                cls = getattr(transformers, candidate)
            except (AttributeError, ImportError):
                continue
            if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase):
                try:
                    return cls.from_pretrained(path)
                except ImportError:  # a class whose backend is not installed: AutoTokenizer may find another
                    break
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, use_fast=True, trust_remote_code=False)


def check_norm_and_rotary_fields(hf_config, config_file: str) -> None:
    """rms_norm_eps must be a finite number >= 0 and every rope_theta a finite number > 0: a
    negative epsilon or a zero base loads, then turns every hidden state into NaN (token 0 for ever)."""

    def finite(value) -> bool:
        return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)

    eps = getattr(hf_config, "rms_norm_eps", None)
    if eps is not None and not (finite(eps) and eps >= 0):
        raise ValueError(f"{config_file}: rms_norm_eps must be a finite number >= 0, got {eps!r}")
    found = [getattr(hf_config, "rope_theta", None)]
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(hf_config, name, None)
        if isinstance(params, Mapping):  # one dict, or one per layer type
            found += [params.get("rope_theta")] + [
                p.get("rope_theta") for p in params.values() if isinstance(p, Mapping)
            ]
    for theta in found:
        if theta is not None and not (finite(theta) and theta > 0):
            raise ValueError(f"{config_file}: rope_theta must be a finite number > 0, got {theta!r}")


def check_positive_fields(fields: dict, config_file: str) -> None:
    for name in POSITIVE_CONFIG_FIELDS:
        value = fields.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{config_file}: {name} must be a positive integer, got {value!r}")


def check_model_type(fields: dict, config_file: str, config_defaults: dict[str, dict]) -> None:
    """A config.json must name a model_type that a model plugin declares defaults for or that
    transformers implements itself: any other would need Python code from the checkpoint (its
    auto_map), which inferlab never runs."""
    model_type = fields.get("model_type")
    if model_type in config_defaults:
        return  # read without transformers' classes (an auto_map beside it is ignored)
    if isinstance(model_type, str) and model_type in transformers_config_names():
        return  # transformers' own classes serve it (an auto_map beside it is ignored)
    from transformers import CONFIG_MAPPING  # the full table (its module imports the auto classes)

    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return
    if fields.get("auto_map"):
        raise ValueError(
            f"{config_file}: model_type {model_type!r} needs the checkpoint's own Python code (auto_map "
            f"{fields['auto_map']}); inferlab never runs code from a model directory (trust_remote_code is off). "
            f"Use a checkpoint whose model_type transformers knows"
        )
    raise ValueError(f"{config_file}: model_type {model_type!r} is not a model type transformers knows")
