"""The engine loop: requests in, scheduler -> runner -> scheduler each step, outputs in order."""

import gc
import logging
import os
import random
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter

from tqdm.auto import tqdm

from inferlab.core.config import EngineConfig
from inferlab.core.model_runner import ModelRunner
from inferlab.core.plugins import KINDS, PluginRegistry, get_registry
from inferlab.core.sampling_params import SamplingParams
from inferlab.core.sequence import Sequence
from inferlab.core.workers import TensorParallelRunner

log = logging.getLogger("inferlab")


class RequestTooLargeError(ValueError):
    """A request needs more KV blocks than the whole cache has: no schedule could ever serve it."""


@dataclass
class EngineStats:
    """Counters over the engine's life, for users and benchmark results."""

    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    wait_seconds: float = 0.0  # blocked on the device's tokens; the rest of a step is CPU work
    num_preemptions: int = 0  # the scheduler's count: sequences evicted to be recomputed when KV ran out
    num_aborted_requests: int = 0
    num_failed_requests: int = 0  # answered with an error result (too large for the whole cache)


# What the interpreter itself keeps frozen (375 tuples on Python 3.12, none on 3.11 or 3.13): more than
# this at a generate call means its caller froze objects (a freeze made before importing inferlab
# counts as the interpreter's, and generate unfreezes it)
FROZEN_AT_IMPORT = gc.get_freeze_count()


def is_token_id_list(prompt) -> bool:
    """Whether every item is an int (not a bool). The common case, all exactly int, is one C loop."""
    types = set(map(type, prompt))
    return types <= {int} or all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


@contextmanager
def older_objects_frozen():
    """Freezes every object the garbage collector tracks for the length of the block, unfreezing
    them after. A full collection walks every tracked object (torch, Triton, compiled graphs: about
    250 ms on the bench's host) while the GPU idles; one came every few bench runs (BENCHMARKS.md
    item 85). Inside the block, collections walk only what the block creates. Unfrozen after, so
    cyclic garbage older than the block waits for its end, no longer. A caller's own freeze is
    theirs to manage."""
    if gc.get_freeze_count() > FROZEN_AT_IMPORT:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class LLMEngine:
    """LLM(model_path, **settings): nano-vllm's settings, plus device, dtype and plugin names
    (scheduler, kv_cache, attention, model, sampler). Without a path, the embedded tiny model."""

    def __init__(self, model_path: str | None = None, /, *, registry: PluginRegistry | None = None, **kwargs):
        config = EngineConfig.from_kwargs(model_path, kwargs)
        self.registry = registry or get_registry()
        for kind in KINDS:  # fail on a misspelled plugin before loading anything heavy
            name = getattr(config, kind)
            if name != "auto":
                self.registry.get(kind, name)
        if model_path is None:
            from inferlab.tiny_model import default_model_path

            model_path = default_model_path()
        self.model_path = model_path = os.fspath(model_path)
        hf_config, self.tokenizer = load_checkpoint_files(model_path)
        self.config = config
        self.hf_config = hf_config
        config.max_model_len = min(config.max_model_len, hf_config.max_position_embeddings)
        if config.tensor_parallel_size > 1:  # rank 0 runs here, ranks 1..N-1 in worker processes
            self.runner = TensorParallelRunner(config, hf_config, model_path, self.registry)
        else:
            self.runner = ModelRunner(config, hf_config, model_path, self.registry)
        try:
            self.kv_cache = self.registry.create(
                "kv_cache", config.kv_cache, config, self.runner.num_kv_blocks, **config.kv_cache_options
            )
            self.scheduler = self.registry.create(
                "scheduler", config.scheduler, config, self.kv_cache, **config.scheduler_options
            )
        except BaseException:
            self.close()
            raise
        self.eos_token_id = self.tokenizer.eos_token_id
        self.seed_rng = random.Random(config.seed)
        self.requests: dict[int, Sequence] = {}
        self.stats = EngineStats()
        overlap = config.overlap_scheduling
        self.overlap = self.runner.device.type == "cuda" if overlap is None else bool(overlap)
        self.pending = None  # (batch, StepHandle) launched but not yet resolved, under overlap

    # -- requests -----------------------------------------------------------------------------

    def make_sequence(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Tokenizes and validates one request; of the engine's state it touches only the seed
        generator (a request without a seed draws one)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and is_token_id_list(prompt):
            token_ids = list(prompt)
        else:
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.hf_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:  # C loops: the bench's prompts are 143k ids
            bad = [t for t in token_ids if not 0 <= t < vocab]
            raise ValueError(f"token ids {bad[:10]} are outside the vocabulary: ids must be in [0, {vocab})")
        max_len = self.config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len={max_len}")
        # Drawn before the cache check, so other requests' seeds do not depend on the cache size.
        seed = params.seed if params.seed is not None else self.seed_rng.getrandbits(63)
        self.check_fits_cache(len(token_ids), params)
        return Sequence(token_ids, params, self.eos_token_id, max_len, seed)

    def check_fits_cache(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raises RequestTooLargeError when the request alone would need more blocks than the cache
        has. Exact: the last token is sampled, never computed, so at most prompt + max_tokens - 1
        tokens (and max_model_len - 1) ever hold K/V, and the oldest running request always fits."""
        bs, num_blocks = self.kv_cache.block_size, self.kv_cache.num_blocks
        most_tokens = max(num_prompt_tokens, min(num_prompt_tokens + params.max_tokens, self.config.max_model_len) - 1)
        needed = -(-most_tokens // bs)
        if needed > num_blocks:
            raise RequestTooLargeError(
                f"the request needs up to {needed} KV blocks of {bs} tokens ({num_prompt_tokens} prompt + "
                f"{params.max_tokens} max_tokens) but the whole cache has {num_blocks}: it could never be served; "
                f"lower prompt + max_tokens to at most {num_blocks * bs + 1} tokens, or give the cache more memory"
            )

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> int:
        """Queues one request; returns its id for abort() and for matching outputs."""
        return self._add(self.make_sequence(prompt, params or SamplingParams()))

    def _add(self, seq: Sequence) -> int:
        self.requests[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def abort(self, request_id: int) -> bool:
        """Stops a request (waiting, mid-prefill or decoding) and frees everything it holds; its
        finish_reason becomes "abort". True if it was still pending."""
        if self.requests.pop(request_id, None) is None or self.scheduler.abort(request_id) is None:
            return False
        self.stats.num_aborted_requests += 1
        return True

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self.pending is None

    def reset_prefix_cache(self) -> None:
        """Drops the prefix cache's unreferenced blocks, where the KV manager supports it."""
        reset = getattr(self.kv_cache, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> tuple[list[Sequence], int, int]:
        """One round: schedule, launch the forward pass, postprocess. Returns the requests that
        finished (with every token resolved) and the prefill and decode tokens launched.

        With overlap scheduling the step's samples stay on the device as placeholders: the next
        step is scheduled and launched before they are read, and they are filled in (and stop
        conditions checked) right after that launch, so the CPU works while the GPU computes."""
        batch = self.scheduler.schedule()
        self.stats.num_preemptions = getattr(self.scheduler, "num_preemptions", 0)
        if not batch.seqs and self.pending is None:
            if self.scheduler.is_finished():
                return [], 0, 0
            raise RuntimeError(
                "the scheduler has pending requests but scheduled nothing: the KV cache "
                "cannot hold any of them (this is a scheduler bug or a cache too small)"
            )
        start = perf_counter()
        decode_tokens = batch.num_decode_tokens
        prefill_tokens = batch.total_tokens - decode_tokens
        handle = self.runner.launch(batch) if batch.seqs else None
        finished = []
        if self.pending is not None:  # the previous step's tokens, while this one runs
            finished = self._resolve(*self.pending)
            self.pending = None
        if handle is not None:
            if self.overlap:
                # Reported when resolved, so that callers never see a placeholder.
                self.scheduler.postprocess(batch, handle.placeholders())
                self.pending = (batch, handle)
            else:
                tokens = self._wait(handle)
                finished += self.scheduler.postprocess(batch, tokens)
                finished += self._check_stop_strings(batch, tokens)
        elapsed = perf_counter() - start
        stats = self.stats
        stats.num_steps += 1
        stats.num_prefill_tokens += prefill_tokens
        stats.num_decode_tokens += decode_tokens
        if prefill_tokens:
            stats.prefill_seconds += elapsed
        else:
            stats.decode_seconds += elapsed
        for seq in finished:
            self.requests.pop(seq.seq_id, None)
        return finished, prefill_tokens, decode_tokens

    def _resolve(self, batch, handle) -> list[Sequence]:
        """Fills in a launched step's placeholders and applies the stop conditions they trigger."""
        finished = []
        tokens = self._wait(handle)
        for seq, token in zip(batch.seqs, tokens):
            if token is None or not seq.token_ids or seq.token_ids[-1] >= 0:
                continue  # no sample, or the sequence ended before its placeholder was appended
            seq.token_ids[-1] = token
            if seq.hits_stop_token(token):
                if seq.finish_reason == "length":
                    seq.finish_reason = "stop"  # the token decides, as without overlap
                else:
                    self.scheduler.finish(seq, "stop")
            if seq.is_finished:
                finished.append(seq)
        return finished + self._check_stop_strings(batch, tokens)

    def _wait(self, handle) -> list[int | None]:
        start = perf_counter()
        tokens = handle.tokens()
        self.stats.wait_seconds += perf_counter() - start
        return tokens

    def _check_stop_strings(self, batch, tokens) -> list[Sequence]:
        finished = []
        for seq, token in zip(batch.seqs, tokens):
            if token is not None and seq.params.stop and not seq.is_finished and self._hits_stop_string(seq):
                self.scheduler.finish(seq, "stop")
                finished.append(seq)
        return finished

    def _hits_stop_string(self, seq: Sequence) -> bool:
        # A stop string of m characters spans at most m tokens; look a few more back for safety.
        longest = max(len(s) for s in seq.params.stop)
        tail = self.tokenizer.decode(seq.completion_token_ids[-(longest + 4) :])
        return any(s in tail for s in seq.params.stop)

    def output(self, seq: Sequence) -> dict:
        text = self.tokenizer.decode(seq.completion_token_ids)
        if seq.params.stop:
            cuts = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
            if cuts:
                text = text[: min(cuts)]
        return {
            "text": text,
            "token_ids": seq.completion_token_ids,
            "finish_reason": seq.finish_reason,
            "num_preemptions": seq.num_preemptions,
        }

    @staticmethod
    def error_output(message: str) -> dict:
        """The result of a request that could not be served: no tokens, and why."""
        return {"text": "", "token_ids": [], "finish_reason": "error", "error": message, "num_preemptions": 0}

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        raise_on_error: bool = False,
    ) -> list[dict]:
        """Generates for every prompt; returns [{"text", "token_ids", "finish_reason", "num_preemptions"}]
        in input order. Invalid input raises before anything is queued. A request too large for the
        whole KV cache gets {"finish_reason": "error", "error": why} and no tokens while the others
        run, unless raise_on_error, which raises for it too. Objects older than the call are frozen
        from the garbage collector while it runs (older_objects_frozen; a loop over step() can take
        the same context)."""
        with older_objects_frozen():
            return self._generate(prompts, sampling_params, use_tqdm, raise_on_error)

    def _generate(self, prompts, sampling_params, use_tqdm: bool, raise_on_error: bool) -> list[dict]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"got {len(sampling_params)} sampling params for {len(prompts)} prompts; "
                    "give one for all or one per prompt"
                )
        else:
            sampling_params = [sampling_params] * len(prompts)
        # Validate everything before queueing anything, so a bad prompt leaves the engine as it was.
        results: list[Sequence | str] = []  # a sequence, or why its request cannot be served
        seed_state = self.seed_rng.getstate()
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            try:
                results.append(self.make_sequence(prompt, params))
            except (ValueError, TypeError) as e:
                if isinstance(e, RequestTooLargeError) and not raise_on_error:
                    results.append(str(e))  # answered with an error result; the others still run
                    continue
                self.seed_rng.setstate(seed_state)
                raise type(e)(f"prompt {i}: {e}") from None
        seqs = [r for r in results if isinstance(r, Sequence)]
        self.stats.num_failed_requests += len(results) - len(seqs)
        for seq in seqs:
            self._add(seq)
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_rate = decode_rate = 0.0
        # A request's output (its text decoded) is built when it finishes, while the device still
        # computes the others' tokens, not all at the end with the device idle.
        outputs: dict[int, dict] = {}
        mine = {seq.seq_id for seq in seqs}
        try:
            while any(not s.is_finished or s.token_ids[-1] < 0 for s in seqs):
                start = perf_counter()
                finished, prefill_tokens, decode_tokens = self.step()
                elapsed = perf_counter() - start
                if prefill_tokens:
                    prefill_rate = prefill_tokens / elapsed
                else:
                    decode_rate = decode_tokens / elapsed
                finished = [seq for seq in finished if seq.seq_id in mine]
                for seq in finished:
                    outputs[seq.seq_id] = self.output(seq)
                if use_tqdm:
                    bar.set_postfix({"Prefill": f"{int(prefill_rate)}tok/s", "Decode": f"{int(decode_rate)}tok/s"})
                    bar.update(len(finished))
        except BaseException:
            for seq in seqs:  # leave the engine usable: drop what this call queued
                if not self.abort(seq.seq_id):
                    self.requests.pop(seq.seq_id, None)  # finished in the interrupted step
            raise
        finally:
            bar.close()
        return [
            self.error_output(r) if not isinstance(r, Sequence) else outputs.get(r.seq_id) or self.output(r)
            for r in results
        ]

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Releases the engine's resources (worker processes under tensor parallelism)."""
        close = getattr(getattr(self, "runner", None), "close", None)
        if close is not None:
            close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load_checkpoint_files(path: str):
    """The HF config and tokenizer of a model directory, with errors that name what is missing."""
    from transformers import AutoConfig, AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"model directory {path!r} has no config.json ({config_file!r})")
    hf_config = AutoConfig.from_pretrained(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, use_fast=True)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"no usable tokenizer in {path!r}: {e}") from e
    return hf_config, tokenizer
