"""Qwen2ForCausalLM (also Qwen2.5): Llama's architecture with a bias on the q, k and v projections
(none on o_proj or the MLP)."""

from inferlab.core.hookspecs import hookimpl
from inferlab.plugins.models.decoder import Biases, DecoderForCausalLM, DecoderOptions

# Qwen2Config's defaults (transformers 5.x) for the fields a causal LM reads; Qwen3Config's add two.
QWEN2_CONFIG_DEFAULTS = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=22016,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    hidden_act="silu",
    max_position_embeddings=32768,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    use_cache=True,
    tie_word_embeddings=False,
    rope_parameters=None,
    use_sliding_window=False,
    sliding_window=4096,
    max_window_layers=28,
    layer_types=None,
    attention_dropout=0.0,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)


class Qwen2ForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen2ForCausalLM",)
    config_defaults = {"qwen2": QWEN2_CONFIG_DEFAULTS}

    @classmethod
    def biases(cls, config) -> Biases:
        return Biases(qkv=True, o=False, mlp=False)


@hookimpl
def register_models(register):
    register("qwen2", Qwen2ForCausalLM, options=DecoderOptions)
