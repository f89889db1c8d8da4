"""Llama (2, 3, 3.1 with its rope scaling) and Mistral: the shared decoder as it is, q/k without a
norm (the fused kernel is kernels/qk_norm_rope.py's rotary), biases where the config's
attention_bias and mlp_bias ask for them. Mistral's architecture is Llama's with a sliding
attention window, which the shared decoder refuses where it is shorter than max_model_len."""

from inferlab.core.hookspecs import hookimpl
from inferlab.plugins.models.decoder import DecoderForCausalLM, DecoderOptions

# The defaults LlamaConfig and MistralConfig (transformers 5.x) share, for the fields a causal LM reads.
_LLAMA_LIKE = dict(
    vocab_size=32000,
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    head_dim=None,
    hidden_act="silu",
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    use_cache=True,
    pad_token_id=None,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    rope_parameters=None,
    attention_dropout=0.0,
)


class LlamaForCausalLM(DecoderForCausalLM):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM")
    config_defaults = {
        "llama": {
            **_LLAMA_LIKE,
            "intermediate_size": 11008,
            "num_key_value_heads": None,
            "max_position_embeddings": 2048,
            "pretraining_tp": 1,
            "attention_bias": False,
            "mlp_bias": False,
        },
        "mistral": {
            **_LLAMA_LIKE,
            "intermediate_size": 14336,
            "num_key_value_heads": 8,
            "max_position_embeddings": 131072,
            "sliding_window": 4096,
        },
    }


@hookimpl
def register_models(register):
    register("llama", LlamaForCausalLM, options=DecoderOptions)
