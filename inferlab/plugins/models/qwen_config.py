"""transformers' Qwen2 config defaults, which Qwen3's extend: shared by the qwen2 and qwen3 model
plugins, neither of which imports the other."""

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
