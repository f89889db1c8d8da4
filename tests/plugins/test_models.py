"""The Llama family (Llama 3, Mistral, Qwen2) on the shared decoder: greedy output equals
transformers' own implementation of each architecture, token for token in float32, through
prefix-cache hits, chunked prefill and preemption; the rotary tables are transformers'; and the
configs the models cannot compute are refused, saying why."""

import json
import shutil

import pytest
import torch
from transformers import AutoConfig

from inferlab import LLM, SamplingParams
from inferlab.core.plugins import PluginError, PluginRegistry
from inferlab.plugins.attention.torch_backend import TorchBackend
from inferlab.plugins.models.decoder import head_dim_of, rope_settings
from inferlab.plugins.models.layers import RotaryEmbedding
from inferlab.plugins.models.llama import LlamaForCausalLM
from inferlab.plugins.models.qwen2 import Qwen2ForCausalLM

# conftest.SHAPES: between them GQA and MHA, tied and untied, Qwen2's biases, llama3 / linear / no
# rope scaling, head_dim given or derived
FAMILY = ["llama-gqa-llama3", "llama-mha-linear-tied", "mistral-gqa4", "qwen2-bias-kv1-tied"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompts_of(lengths, start=5):
    return [[(start + 7 * i + j * 13) % 300 + 3 for j in range(n)] for i, n in enumerate(lengths)]


def test_each_architecture_is_served_by_its_plugin():
    registry = PluginRegistry()
    served = {
        architecture: name
        for name in registry.names("model")
        for architecture in registry.get("model", name).factory.architectures
    }
    assert {
        "Qwen3ForCausalLM": "qwen3",
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2",
    }.items() <= served.items()
    for name in ("llama", "qwen2"):
        assert registry.get("model", name).distribution.startswith("inferlab ")


@pytest.mark.parametrize("shape", FAMILY)
def test_greedy_matches_hf_and_again_from_the_prefix_cache(shape, checkpoint, hf_greedy):
    path = checkpoint(shape)
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=64)
    architecture = AutoConfig.from_pretrained(path).architectures[0]
    assert architecture in type(llm.runner.model).architectures
    prompts = prompts_of([1, 7, 16, 33])
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, first):
        assert out["token_ids"] == hf_greedy(path, prompt, GREEDY.max_tokens)
    hits_before = llm.kv_manager.prefix_cache_stats()[0]
    assert llm.generate(prompts, GREEDY, use_tqdm=False) == first
    # the 33-token prompt's two full blocks; each prompt's last block is recomputed
    assert llm.kv_manager.prefix_cache_stats()[0] - hits_before == 32


@pytest.mark.parametrize("shape", FAMILY)
def test_chunked_prefill_and_preemption_match_hf(shape, checkpoint, hf_greedy):
    path = checkpoint(shape)
    chunked = LLM(path, kvcache_block_size=16, num_kvcache_blocks=64, max_num_batched_tokens=24)
    prompts = prompts_of([50, 5, 70, 3])
    for prompt, out in zip(prompts, chunked.generate(prompts, GREEDY, use_tqdm=False)):
        assert out["token_ids"] == hf_greedy(path, prompt, GREEDY.max_tokens)
    # 12 blocks of 16 tokens for 8 sequences that each grow to ~30 tokens: some must be preempted
    tight = LLM(path, kvcache_block_size=16, num_kvcache_blocks=12)
    prompts = prompts_of([20, 14, 25, 9, 17, 22, 12, 18])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outputs):
        assert out["token_ids"] == hf_greedy(path, prompt, params.max_tokens)


@pytest.mark.parametrize("shape", ["llama-gqa-llama3", "llama-mha-linear-tied", "mistral-gqa4"])
def test_rotary_table_is_transformers(shape, checkpoint):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = AutoConfig.from_pretrained(checkpoint(shape))
    positions = torch.arange(0, config.max_position_embeddings, 37)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions[None])
    theta, scaling = rope_settings(config)
    head_dim = head_dim_of(config)
    ours = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling=scaling).cos_sin[positions]
    half = head_dim // 2
    torch.testing.assert_close(ours[:, :half], cos[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours[:, half:], sin[0, :, :half], rtol=0, atol=1e-6)


def test_rope_settings_of_hub_configs_and_of_transformers_4(tmp_path):
    """Llama 3.1's config.json on the hub, as the installed transformers presents it, and
    transformers 4's attributes (rope_theta beside rope_scaling, whose older spelling is `type`)."""
    llama31 = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(llama31))
    theta, scaling = rope_settings(AutoConfig.from_pretrained(tmp_path))
    assert theta == 500000.0
    assert {k: scaling[k] for k in llama31["rope_scaling"]} == llama31["rope_scaling"]

    class Transformers4Config:
        rope_theta = 20000.0
        rope_scaling = {"type": "linear", "factor": 2.0}

    assert rope_settings(Transformers4Config()) == (20000.0, {"rope_type": "linear", "factor": 2.0})

    class PlainConfig:
        rope_theta = 1000.0
        rope_scaling = None

    assert rope_settings(PlainConfig()) == (1000.0, None)


def config_of(checkpoint, shape, **changes):
    config = AutoConfig.from_pretrained(checkpoint(shape))
    for name, value in changes.items():
        setattr(config, name, value)
    return config


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_other_rope_scaling_is_refused_naming_its_type(rope_type, checkpoint):
    config = config_of(checkpoint, "llama-gqa-llama3")
    config.rope_parameters = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 4.0}
    message = rf"rope_type '{rope_type}' is not supported; supported: \['default', 'linear', 'llama3'\]"
    with pytest.raises(ValueError, match=message):
        LlamaForCausalLM(config, backend=TorchBackend())


def test_rope_scaling_without_its_fields_is_refused(checkpoint):
    config = config_of(checkpoint, "llama-gqa-llama3")
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    with pytest.raises(
        ValueError,
        match=r"'llama3' needs \['low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'\]",
    ):
        LlamaForCausalLM(config, backend=TorchBackend())


def test_other_activations_and_partial_rotary_are_refused(checkpoint):
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported; supported: 'silu'"):
        LlamaForCausalLM(config_of(checkpoint, "llama-gqa-llama3", hidden_act="gelu"), backend=TorchBackend())
    config = config_of(checkpoint, "mistral-gqa4")
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported"):
        LlamaForCausalLM(config, backend=TorchBackend())


def test_mistral_sliding_window_shorter_than_max_model_len_is_refused(checkpoint, hf_greedy, tmp_path):
    """No sliding-window attention yet: a window shorter than the sequences the engine may run is
    an error, not full attention in its place; max_model_len within the window is exact."""
    path = str(tmp_path / "windowed")
    shutil.copytree(checkpoint("mistral-gqa4"), path)
    config = json.loads(open(f"{path}/config.json").read())
    (tmp_path / "windowed" / "config.json").write_text(json.dumps({**config, "sliding_window": 64}))
    with pytest.raises(
        PluginError, match=r"sliding window of 64 tokens .* shorter than max_model_len=4096; .* set max_model_len <= 64"
    ):
        LLM(path, kvcache_block_size=16, num_kvcache_blocks=16)
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=64)
    prompt = prompts_of([40])[0]
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(path, prompt, 10)
    # no window, or one as long as the sequences: fine
    LlamaForCausalLM(config_of(checkpoint, "mistral-gqa4", sliding_window=None), backend=TorchBackend())
    LlamaForCausalLM(config_of(checkpoint, "mistral-gqa4", sliding_window=64), backend=TorchBackend(), max_model_len=64)


def test_qwen2_sliding_window_counts_only_where_layers_use_it(checkpoint):
    """Qwen2 slides only with use_sliding_window, and only from layer max_window_layers on."""
    from transformers import Qwen2Config

    base = AutoConfig.from_pretrained(checkpoint("qwen2-bias-kv1-tied")).to_dict()
    for key in ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types"):
        base.pop(key, None)

    def qwen2(**window):
        return Qwen2ForCausalLM(Qwen2Config(**{**base, **window}), backend=TorchBackend(), max_model_len=4096)

    with pytest.raises(ValueError, match="sliding window of 64 tokens"):
        qwen2(use_sliding_window=True, sliding_window=64, max_window_layers=1)
    qwen2(use_sliding_window=False, sliding_window=64)  # Qwen2's hub configs: the window is off
    qwen2(use_sliding_window=True, sliding_window=64, max_window_layers=2)  # no layer from 2 on
