"""The embedded default model: a tiny random-weight Qwen3 checkpoint with a byte-level BPE
tokenizer trained here on a built-in text, so that the engine runs with no download. Tests use
make_checkpoint to build checkpoints of other shapes with the same tokenizer."""

import json
import logging
import os
import shutil
import tempfile

log = logging.getLogger("inferlab")

CACHE_DIR = os.environ.get("INFERLAB_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "inferlab"))
VERSION = 3  # bump when the recipe changes, so stale caches are not reused

CORPUS = """\
The quick brown fox jumps over the lazy dog. A paged cache keeps keys and values in blocks.
Once upon a time, a small engine learned to schedule requests first come, first served.
Prefix caching lets two prompts that start alike share the blocks of their common start.
Numbers: zero one two three four five six seven eight nine ten eleven twelve 0 1 2 3 4 5 6 7 8 9.
Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.
Readability counts. Errors should never pass silently. In the face of ambiguity, refuse to guess.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris.
def main(): print("hello") # code, too: for i in range(10): total += i * i
Large language models predict the next token from the tokens before it, one step at a time.
"""
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen's chat models use it, so that /v1/chat/completions runs on the embedded model.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

DEFAULT_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
)


def build_tokenizer(path: str) -> int:
    """Trains the byte-level BPE tokenizer deterministically and saves it in path; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return len(fast)


# the architectures make_checkpoint builds, with their transformers model_type
MODEL_TYPES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


def make_checkpoint(
    path: str, seed: int = 0, max_shard_size: str | None = None, architecture: str = "Qwen3ForCausalLM", **shape
) -> str:
    """Writes a random-weight model of the given architecture (one of MODEL_TYPES; HF format,
    safetensors) plus the tokenizer to path. shape: config fields over DEFAULT_SHAPE's."""
    import torch
    import transformers
    from transformers import AutoConfig

    if architecture not in MODEL_TYPES:
        raise ValueError(f"make_checkpoint builds {sorted(MODEL_TYPES)}, not {architecture!r}")
    os.makedirs(path, exist_ok=True)
    vocab_size = build_tokenizer(path)
    # a field given as None is left out of the config (e.g. head_dim, then hidden_size / heads)
    settings = {key: value for key, value in {**DEFAULT_SHAPE, **shape}.items() if value is not None}
    defaults = dict(
        max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0
    )
    config = AutoConfig.for_model(MODEL_TYPES[architecture], vocab_size=vocab_size, **{**defaults, **settings})
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():  # HF's init is tiny; wider weights give varied, tie-free logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:  # biases (Qwen2's q/k/v) large enough that slicing them wrong would show
                param.normal_(0, 0.5 / param.shape[-1] ** 0.5 if param.dim() > 1 else 0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


_announced = False  # the embedded model is announced once a process


def default_model_path(announce: bool = True) -> str:
    """The embedded model's directory, created on first use (atomically, so concurrent first
    runs cannot see half a checkpoint). Says once a process, as a warning, that its text is
    gibberish: whoever forgot the model path should not take it for the engine's output.
    `announce=False` is for callers that only borrow its tokenizer."""
    global _announced
    if announce and not _announced:
        _announced = True
        log.warning(
            "no model path given: running inferlab's embedded tiny model, whose weights are random, "
            "so its text is gibberish; give a checkpoint directory (LLM(path), or model.path=PATH "
            "on the command line)"
        )
    path = os.path.join(CACHE_DIR, f"tiny-qwen3-v{VERSION}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(CACHE_DIR, exist_ok=True)
    scratch = tempfile.mkdtemp(dir=CACHE_DIR, prefix=".tiny-qwen3-")
    try:
        make_checkpoint(scratch)
        with open(os.path.join(scratch, "inferlab.json"), "w") as f:
            json.dump({"recipe": VERSION, "shape": DEFAULT_SHAPE}, f)
        try:
            os.rename(scratch, path)
        except OSError:  # another process won the race; use its copy
            pass
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path
