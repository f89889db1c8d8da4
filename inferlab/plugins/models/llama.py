"""Llama (2, 3, 3.1 with its rope scaling) and Mistral: the shared decoder as it is, q/k without a
norm (the fused kernel is kernels/qk_norm_rope.py's rotary), biases where the config's
attention_bias and mlp_bias ask for them. Mistral's architecture is Llama's with a sliding
attention window, which the shared decoder refuses where it is shorter than max_model_len."""

from inferlab.core.hookspecs import hookimpl
from inferlab.plugins.models.decoder import DecoderForCausalLM, DecoderOptions


class LlamaForCausalLM(DecoderForCausalLM):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM")


@hookimpl
def register_models(register):
    register("llama", LlamaForCausalLM, options=DecoderOptions)
