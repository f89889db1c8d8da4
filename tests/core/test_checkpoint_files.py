"""A model directory's config.json and tokenizer, as a careless or hostile user hands them over:
no Python code from the directory ever runs (from the API or the command line, whatever stdin
answers), and a config or tokenizer that cannot work fails at load with the file and field named."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from inferlab import LLM, SamplingParams

# Python that a checkpoint ships for transformers' auto_map: importing it leaves a mark.
PAYLOAD = """
import pathlib
pathlib.Path({mark!r}).write_text("the checkpoint's code ran")
from transformers import PretrainedConfig, PreTrainedTokenizerFast
class EvilConfig(PretrainedConfig):
    model_type = "evil"
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


def copy_of(checkpoint, tmp_path, name="model"):
    target = tmp_path / name
    shutil.copytree(checkpoint("gqa2-tied"), target)
    return target


def edit_json(path, **changes):
    fields = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            fields.pop(key, None)
        else:
            fields[key] = value
    path.write_text(json.dumps(fields))


@pytest.fixture
def custom_code_model(checkpoint, tmp_path):
    """A checkpoint whose config names a model_type of its own, served by its own code (auto_map)."""
    model = copy_of(checkpoint, tmp_path)
    mark = tmp_path / "code-ran"
    (model / "evil.py").write_text(PAYLOAD.format(mark=str(mark)))
    edit_json(model / "config.json", model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig"})
    return model, mark


def test_custom_code_is_refused_from_the_api(custom_code_model):
    model, mark = custom_code_model
    with pytest.raises(ValueError) as error:
        LLM(str(model), device="cpu")
    message = str(error.value)
    assert f"{model / 'config.json'}: model_type 'evil' needs the checkpoint's own Python code" in message
    assert "auto_map {'AutoConfig': 'evil.EvilConfig'}" in message and "never runs code" in message
    assert not mark.exists()


@pytest.mark.slow
def test_custom_code_is_refused_from_the_command_line_even_when_stdin_says_yes(custom_code_model, tmp_path):
    """transformers asks "Do you wish to run the custom code? [y/N]" when trust_remote_code is left
    unset: the engine always sets it to False, so a piped "y" is never read."""
    model, mark = custom_code_model
    proc = subprocess.run(
        [sys.executable, "-m", "inferlab", f"model.path={model}", "engine.device=cpu"],
        input="y\ny\n",
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "[y/N]" not in proc.stdout + proc.stderr
    assert "needs the checkpoint's own Python code" in proc.stderr and "Traceback" not in proc.stderr
    assert not mark.exists()


def test_a_tokenizer_with_its_own_code_loads_without_running_it(checkpoint, tmp_path):
    """A known model_type whose tokenizer_config names custom code (auto_map): transformers' own
    tokenizer reads the tokenizer.json, and the directory's module is never imported."""
    model = copy_of(checkpoint, tmp_path)
    mark = tmp_path / "code-ran"
    (model / "evil.py").write_text(PAYLOAD.format(mark=str(mark)))
    edit_json(
        model / "tokenizer_config.json",
        tokenizer_class="EvilTokenizer",
        auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]},
    )
    edit_json(model / "config.json", auto_map={"AutoConfig": "evil.EvilConfig"})  # ignored beside a known model_type
    llm = LLM(str(model), device="cpu", kvcache_block_size=16, num_kvcache_blocks=8)
    assert llm.generate(["Hello"], use_tqdm=False)[0]["finish_reason"] in ("length", "stop")
    assert not mark.exists()


def test_a_model_type_transformers_does_not_know(checkpoint, tmp_path):
    model = copy_of(checkpoint, tmp_path)
    edit_json(model / "config.json", model_type="mystery")
    with pytest.raises(ValueError, match=r"config.json: model_type 'mystery' is not a model type transformers knows"):
        LLM(str(model), device="cpu")
    edit_json(model / "config.json", model_type=None)
    with pytest.raises(ValueError, match=r"config.json: model_type None is not a model type transformers knows"):
        LLM(str(model), device="cpu")


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_hidden_layers", 0),
        ("max_position_embeddings", 0),
        ("max_position_embeddings", -4),
        ("vocab_size", 0),
        ("num_attention_heads", 0),
        ("hidden_size", "64"),
    ],
)
def test_config_fields_that_cannot_work(checkpoint, tmp_path, field, value):
    model = copy_of(checkpoint, tmp_path)
    edit_json(model / "config.json", **{field: value})
    with pytest.raises(ValueError, match=rf"config.json: {field} must be a positive integer, got {value!r}"):
        LLM(str(model), device="cpu")


def test_config_that_is_not_json(checkpoint, tmp_path):
    model = copy_of(checkpoint, tmp_path)
    (model / "config.json").write_text('{"model_type": "qwen3",')
    with pytest.raises(ValueError, match=r"config.json is not valid JSON: Expecting"):
        LLM(str(model), device="cpu")
    (model / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json must hold a JSON object, got a list"):
        LLM(str(model), device="cpu")


def test_missing_tokenizer_files(checkpoint, tmp_path):
    """Without its vocabulary transformers builds a one-token tokenizer that fails later, on the
    first prompt, with "the prompt is empty": the engine refuses the directory at load instead."""
    model = copy_of(checkpoint, tmp_path)
    os.remove(model / "tokenizer.json")
    with pytest.raises(
        FileNotFoundError, match=rf"model directory '{model}' has no tokenizer: none of \['tokenizer.json'"
    ):
        LLM(str(model), device="cpu")


@pytest.mark.parametrize("tokenizer_class", ["TokenizersBackend", "Qwen2Tokenizer", "PreTrainedTokenizerFast", None])
def test_the_tokenizer_is_the_one_auto_tokenizer_builds(checkpoint, tmp_path, tokenizer_class):
    """load_tokenizer finds the class by its name among transformers' own (without importing the
    auto classes' module) and builds the same tokenizer AutoTokenizer does; without a name it is
    AutoTokenizer's."""
    from transformers import AutoTokenizer

    from inferlab.core.checkpoint import load_tokenizer

    model = copy_of(checkpoint, tmp_path)
    edit_json(model / "tokenizer_config.json", tokenizer_class=tokenizer_class)
    ours = load_tokenizer(str(model))
    theirs = AutoTokenizer.from_pretrained(str(model), use_fast=True, trust_remote_code=False)
    assert type(ours) is type(theirs)
    text = "Hello, world: 12 tokens or so."
    assert ours.encode(text) == theirs.encode(text) and len(ours) == len(theirs)
    assert ours.eos_token_id == theirs.eos_token_id


def assert_same_config(ours, theirs):
    """Every field of ours has transformers' value, and ours has every field transformers' class
    adds to the generic config's."""
    from transformers import PretrainedConfig

    for name, value in ours.to_dict().items():
        if name != "_name_or_path":
            assert getattr(theirs, name) == value, name
    generic = set(PretrainedConfig().to_dict()) | {"transformers_version"}
    assert set(theirs.to_dict()) - generic <= set(ours.to_dict())


@pytest.mark.parametrize("name", ["gqa2-tied", "llama-gqa-llama3", "mistral-gqa4", "qwen2-bias-kv1-tied"])
def test_the_config_is_the_one_auto_config_builds(checkpoint, name):
    """The test checkpoints' configs, read without transformers' config classes, hold what
    AutoConfig's hold."""
    from transformers import AutoConfig

    from inferlab.core.checkpoint import load_checkpoint_files
    from inferlab.core.model_config import ModelConfig
    from inferlab.core.plugins import PluginRegistry

    path = checkpoint(name)
    ours, _ = load_checkpoint_files(path, PluginRegistry().model_config_defaults())
    assert isinstance(ours, ModelConfig) and ours._name_or_path == path
    assert_same_config(ours, AutoConfig.from_pretrained(path, trust_remote_code=False))


CONFIG_VARIANTS = [
    {},  # every field at its default
    {"num_key_value_heads": None, "hidden_size": 768, "num_attention_heads": 12},
    {"head_dim": None, "hidden_size": 768, "num_attention_heads": 12},
    {"rope_theta": 1000000.0, "torch_dtype": "float16", "tie_word_embeddings": True},
    {"dtype": "bfloat16", "torch_dtype": "float32", "eos_token_id": [1, 2]},
    {"rope_scaling": {"type": "linear", "factor": 2.0}},
    {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 4096},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 123.0}},
    {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1, "num_hidden_layers": 2},
    {"use_sliding_window": True, "sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"]},
    {"sliding_window": None, "attention_bias": True, "mlp_bias": True, "custom_field": "kept"},
]


BUILT_IN_NATIVE_TYPES = ["qwen3", "qwen2", "llama", "mistral"]


def test_the_model_plugins_declare_the_config_defaults():
    """The defaults config.json is read over come from the model plugins (ConfigDefaults on the
    factory), one plugin a model type, and the core names none of them."""
    import inferlab.core.model_config
    from inferlab.core.plugins import PluginRegistry
    from inferlab.core.protocols import ConfigDefaults

    registry = PluginRegistry()
    declared = {
        name: sorted(registry.get("model", name).factory.config_defaults)
        for name in registry.names("model")
        if isinstance(registry.get("model", name).factory, ConfigDefaults)
    }
    assert declared == {"llama": ["llama", "mistral"], "qwen2": ["qwen2"], "qwen3": ["qwen3"]}
    assert sorted(registry.model_config_defaults()) == sorted(BUILT_IN_NATIVE_TYPES)
    assert not hasattr(inferlab.core.model_config, "DEFAULTS")


def test_a_plugin_declaring_defaults_serves_a_model_type_transformers_lacks(checkpoint, tmp_path, plugin_module):
    """A third-party model plugin that declares the defaults of its own model_type makes such a
    config.json readable without transformers, which does not know the type."""
    from inferlab.core.plugins import PluginRegistry
    from inferlab.plugins.models.qwen3 import Qwen3ForCausalLM

    class Qwen3Renamed(Qwen3ForCausalLM):
        architectures = ("RenamedForCausalLM",)
        config_defaults = {"renamed-qwen3": Qwen3ForCausalLM.config_defaults["qwen3"]}

    model = copy_of(checkpoint, tmp_path)
    edit_json(model / "config.json", model_type="renamed-qwen3", architectures=["RenamedForCausalLM"])
    with pytest.raises(ValueError, match="model_type 'renamed-qwen3' is not a model type transformers knows"):
        LLM(str(model), device="cpu")
    registry = PluginRegistry()
    registry.register(plugin_module("renamed", register_models=lambda register: register("renamed", Qwen3Renamed)))
    llm = LLM(str(model), registry=registry, device="cpu", num_kvcache_blocks=16, kvcache_block_size=16)
    assert type(llm.runner.model) is Qwen3Renamed
    assert llm.runner.hf_config.model_type == "renamed-qwen3"
    reference = LLM(checkpoint("gqa2-tied"), device="cpu", num_kvcache_blocks=16, kvcache_block_size=16)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    assert llm.generate([[5, 6, 7]], params)[0]["token_ids"] == reference.generate([[5, 6, 7]], params)[0]["token_ids"]


@pytest.mark.parametrize("model_type", BUILT_IN_NATIVE_TYPES)
@pytest.mark.parametrize("variant", range(len(CONFIG_VARIANTS)))
def test_native_configs_match_transformers_defaults_and_derivations(tmp_path, model_type, variant):
    """For each model type read without transformers' classes: defaults, and what the classes
    derive (kv heads, head_dim, layer_types, sliding_window, rope_parameters, dtype), as the
    installed transformers has them, and the engine's reading of them (rotary, window) the same."""
    from transformers import AutoConfig

    from inferlab.core.model_config import native_model_config
    from inferlab.core.plugins import PluginRegistry
    from inferlab.plugins.models.decoder import head_dim_of, rope_settings, sliding_window_of

    fields = {"model_type": model_type, "architectures": ["X"], **CONFIG_VARIANTS[variant]}
    if model_type in ("qwen3", "qwen2") and "layer_types" in fields:
        fields["num_hidden_layers"] = len(fields["layer_types"])
    elif "layer_types" in fields:
        pytest.skip(f"{model_type} has no layer_types")
    (tmp_path / "config.json").write_text(json.dumps(fields))
    try:
        theirs = AutoConfig.from_pretrained(str(tmp_path), trust_remote_code=False)
    except Exception as e:  # its strict fields: a null that Qwen3Config or MistralConfig does not allow
        pytest.skip(f"transformers refuses it (the native config derives the field): {e}")
    ours = native_model_config(fields, PluginRegistry().model_config_defaults(), str(tmp_path))
    assert_same_config(ours, theirs)
    for reading in (head_dim_of, rope_settings, sliding_window_of):
        assert reading(ours) == reading(theirs)


@pytest.mark.parametrize(
    "field, value, kind",
    [("rms_norm_eps", "small", "a number"), ("tie_word_embeddings", 1, "a boolean"), ("hidden_act", None, None)],
)
def test_config_fields_of_the_wrong_type(checkpoint, tmp_path, field, value, kind):
    """A field of the wrong type fails at load, named with the type it needs; null where the
    default is a value keeps the default's meaning only where transformers allows it."""
    model = copy_of(checkpoint, tmp_path)
    edit_json(model / "config.json", **{field: value})
    if kind is None:
        LLM(str(model), device="cpu", num_kvcache_blocks=8).close()  # a removed field takes its default
        return
    with pytest.raises(ValueError, match=rf"config.json: {field} must be {kind}, got {value!r}"):
        LLM(str(model), device="cpu")


@pytest.mark.parametrize("value", ["float99", 16, ["bfloat16"]])
def test_a_dtype_that_names_no_torch_dtype(checkpoint, tmp_path, value):
    model = copy_of(checkpoint, tmp_path)
    edit_json(model / "config.json", dtype=value)
    with pytest.raises(ValueError, match=r"config.json: dtype must name a torch dtype \(e.g. 'bfloat16'\), got"):
        LLM(str(model), device="cpu")
