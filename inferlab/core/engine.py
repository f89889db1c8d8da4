"""The engine: requests in, then each step the core scheduler decides (through the policy), the
runner computes and samples, and the core scheduler finishes what the tokens end; outputs in order."""

import gc
import logging
import os
import random
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from tqdm.auto import tqdm

from inferlab.core.config import EngineConfig
from inferlab.core.model_runner import ModelRunner
from inferlab.core.plugins import KINDS, PluginRegistry, get_registry, validated_options
from inferlab.core.protocols import PrefixCacheReset
from inferlab.core.request import Request
from inferlab.core.sampling_params import SamplingParams
from inferlab.core.scheduler import Scheduler, SchedulerStallError
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
    num_preemptions: int = 0  # the core scheduler's count: requests evicted to be recomputed
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
    250 ms on the bench's host) while the GPU idles, and one came every few bench runs. Inside the block, collections walk only what the block creates. Unfrozen after, so
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


@dataclass(slots=True)
class StepOutput:
    """What one engine step did: the requests that finished in it (every token known) and the
    tokens it launched."""

    finished: list[Request]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_requests: int  # in the launched batch


class LLMEngine:
    """LLM(model_path, **settings): nano-vllm's settings, plus device, dtype and plugin names
    (scheduler, kv_cache, attention, model, sampler) with their `<kind>_options`. Without a path,
    the embedded tiny model."""

    def __init__(self, model_path: str | None = None, /, *, registry: PluginRegistry | None = None, **kwargs):
        config = EngineConfig.from_kwargs(model_path, kwargs)
        self.registry = registry or get_registry()
        for kind in KINDS:  # a misspelled plugin or option fails before anything heavy loads
            name = getattr(config, kind)
            if name != "auto":
                validated_options(self.registry.get(kind, name), getattr(config, f"{kind}_options"))
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
        self.clock = perf_counter  # the time requests and steps are stamped with
        try:
            self.kv_manager = self.registry.create(
                "kv_cache", config.kv_cache, config, self.runner.num_kv_blocks, options=config.kv_cache_options
            )
            policy = self.registry.create("scheduler", config.scheduler, options=config.scheduler_options)
        except BaseException:
            self.close()
            raise
        self.scheduler = Scheduler(
            config,
            self.kv_manager,
            policy,
            policy_name=config.scheduler,
            clock=lambda: self.clock(),
            decode=self.tokenizer.decode,
        )
        self.eos_token_id = self.tokenizer.eos_token_id
        self.seed_rng = random.Random(config.seed)
        self.requests: dict[int, Request] = {}  # pending requests by id
        self.next_request_id = 0
        self.stats = EngineStats()
        overlap = config.overlap_scheduling
        self.overlap = self.runner.device.type == "cuda" if overlap is None else bool(overlap)
        self.pending = None  # (tokens advance appended, StepHandle) of the step launched last, under overlap

    # -- requests -----------------------------------------------------------------------------

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        metadata: Mapping[str, Any] | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Tokenizes and validates one request; of the engine's state it touches only the seed
        generator (a request without a seed draws one) and the request id counter."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an integer (lower is served first), got {priority!r}")
        if metadata is not None and not isinstance(metadata, Mapping):
            raise TypeError(f"metadata must be a dict (or None), got {type(metadata).__name__}")
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
        seed = params.seed if params.seed is not None else self.seed_rng.getrandbits(32)
        self.check_fits_cache(len(token_ids), params)
        request_id = self.next_request_id
        self.next_request_id += 1
        return Request(
            request_id,
            token_ids,
            params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            priority=priority,
            metadata=metadata,
            eos_token_id=self.eos_token_id,
            max_model_len=max_len,
            seed=seed,
        )

    def check_fits_cache(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raises RequestTooLargeError when the request alone would need more KV than the whole
        cache holds. Exact: the last token is sampled, never computed, so at most prompt +
        max_tokens - 1 tokens (and max_model_len - 1) ever hold K/V."""
        most_tokens = max(num_prompt_tokens, min(num_prompt_tokens + params.max_tokens, self.config.max_model_len) - 1)
        kv = self.kv_manager
        if not kv.could_ever_fit(most_tokens):
            bs, needed = kv.block_size, -(-most_tokens // kv.block_size)
            raise RequestTooLargeError(
                f"the request needs up to {needed} KV blocks of {bs} tokens ({num_prompt_tokens} prompt + "
                f"{params.max_tokens} max_tokens) but the whole cache has {kv.num_blocks}: it could never be served; "
                f"lower prompt + max_tokens to at most {kv.num_blocks * bs + 1} tokens, or give the cache more memory"
            )

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        metadata: Mapping[str, Any] | None = None,
        arrival_time: float | None = None,
    ) -> int:
        """Queues one request; returns its id (for abort() and for matching outputs). priority:
        lower is served first by policies that use it; metadata: a free-form dict the scheduler
        policy sees (tenant, deadline, ...); arrival_time: on the engine's clock, now if None."""
        request = self.make_request(prompt, params or SamplingParams(), priority, metadata, arrival_time)
        self._add(request)
        return request.request_id

    def _add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: int) -> bool:
        """Stops a request (waiting, mid-prefill or decoding) and frees everything it holds; its
        finish_reason becomes "abort". True if it was still pending."""
        request = self.requests.pop(request_id, None)
        if request is None or not self.scheduler.abort(request):
            return False
        self.stats.num_aborted_requests += 1
        return True

    def is_finished(self) -> bool:
        return not self.scheduler.has_unfinished() and self.pending is None

    def reset_prefix_cache(self) -> None:
        """Drops the prefix cache's unreferenced blocks, where the KV manager can."""
        if isinstance(self.kv_manager, PrefixCacheReset):
            self.kv_manager.reset_prefix_cache()

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """One round: schedule, launch the forward pass, then finish what the sampled tokens end.

        With overlap scheduling a step's samples stay on the device as placeholders: the next
        step is scheduled and launched before they are read, and they are filled in (and stop
        conditions checked) right after that launch, so the CPU works while the GPU computes."""
        scheduler = self.scheduler
        batch = scheduler.schedule()
        self.stats.num_preemptions = scheduler.num_preemptions
        if not batch.requests and self.pending is None:
            if not scheduler.has_unfinished():
                return StepOutput([], 0, 0, 0)
            raise SchedulerStallError(
                f"scheduler {self.config.scheduler!r} scheduled nothing while {len(scheduler.waiting)} requests "
                f"wait and {len(scheduler.running)} run, with {self.kv_manager.num_free_blocks} of "
                f"{self.kv_manager.num_blocks} KV blocks free: its admission_order declined every waiting request "
                f"with nothing running"
            )
        start = perf_counter()
        decode_tokens = batch.num_decode_tokens
        prefill_tokens = batch.total_tokens - decode_tokens
        handle = self.runner.launch(batch) if batch.requests else None
        finished = []
        if self.pending is not None:  # the previous step's tokens, while this one runs
            appended, previous = self.pending
            self.pending = None
            finished = scheduler.resolve(appended, self._wait(previous))
        if handle is not None:
            if self.overlap:
                self.pending = (scheduler.advance(batch, handle.placeholders()), handle)
            else:
                tokens = self._wait(handle)
                finished += scheduler.resolve(scheduler.advance(batch, tokens), tokens)
        elapsed = perf_counter() - start
        stats = self.stats
        stats.num_steps += 1
        stats.num_prefill_tokens += prefill_tokens
        stats.num_decode_tokens += decode_tokens
        if prefill_tokens:
            stats.prefill_seconds += elapsed
        else:
            stats.decode_seconds += elapsed
        for request in finished:
            self.requests.pop(request.request_id, None)
        return StepOutput(finished, prefill_tokens, decode_tokens, len(batch))

    def _wait(self, handle) -> list[int | None]:
        start = perf_counter()
        tokens = handle.tokens()
        self.stats.wait_seconds += perf_counter() - start
        return tokens

    def output(self, request: Request) -> dict:
        text = self.tokenizer.decode(request.output_token_ids)
        if request.params.stop:
            cuts = [i for i in (text.find(s) for s in request.params.stop) if i >= 0]
            if cuts:
                text = text[: min(cuts)]
        return {
            "text": text,
            "token_ids": request.output_token_ids,
            "finish_reason": request.finish_reason,
            "num_preemptions": request.num_preemptions,
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
        priority: int | list[int] = 0,
        metadata: Mapping[str, Any] | list[Mapping[str, Any] | None] | None = None,
    ) -> list[dict]:
        """Generates for every prompt; returns [{"text", "token_ids", "finish_reason", "num_preemptions"}]
        in input order. sampling_params, priority and metadata are one for all prompts or a list
        with one per prompt. Invalid input raises before anything is queued. A request too large
        for the whole KV cache gets {"finish_reason": "error", "error": why} and no tokens while the
        others run, unless raise_on_error, which raises for it too. Objects older than the call are
        frozen from the garbage collector while it runs (older_objects_frozen; a loop over step()
        can take the same context)."""
        with older_objects_frozen():
            return self._generate(prompts, sampling_params, use_tqdm, raise_on_error, priority, metadata)

    def _generate(self, prompts, sampling_params, use_tqdm, raise_on_error, priority, metadata) -> list[dict]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        sampling_params = per_prompt("sampling params", sampling_params or SamplingParams(), SamplingParams, prompts)
        priorities = per_prompt("priorities", priority, int, prompts)
        metadatas = per_prompt("metadata", metadata, (Mapping, type(None)), prompts)
        # Validate everything before queueing anything, so a bad prompt leaves the engine as it was.
        results: list[Request | str] = []  # a request, or why it cannot be served
        seed_state, next_id = self.seed_rng.getstate(), self.next_request_id
        for i, args in enumerate(zip(prompts, sampling_params, priorities, metadatas)):
            try:
                results.append(self.make_request(*args))
            except (ValueError, TypeError) as e:
                if isinstance(e, RequestTooLargeError) and not raise_on_error:
                    results.append(str(e))  # answered with an error result; the others still run
                    continue
                self.seed_rng.setstate(seed_state)
                self.next_request_id = next_id
                raise type(e)(f"prompt {i}: {e}") from None
        requests = [r for r in results if isinstance(r, Request)]
        self.stats.num_failed_requests += len(results) - len(requests)
        for request in requests:
            self._add(request)
        bar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_rate = decode_rate = 0.0
        # A request's output (its text decoded) is built when it finishes, while the device still
        # computes the others' tokens, not all at the end with the device idle.
        outputs: dict[int, dict] = {}
        unreported = {r.request_id for r in requests}
        try:
            while unreported and not self.is_finished():
                start = perf_counter()
                step = self.step()
                elapsed = perf_counter() - start
                if step.num_prefill_tokens:
                    prefill_rate = step.num_prefill_tokens / elapsed
                else:
                    decode_rate = step.num_decode_tokens / elapsed
                finished = [r for r in step.finished if r.request_id in unreported]
                for request in finished:
                    outputs[request.request_id] = self.output(request)
                    unreported.discard(request.request_id)
                if use_tqdm:
                    bar.set_postfix({"Prefill": f"{int(prefill_rate)}tok/s", "Decode": f"{int(decode_rate)}tok/s"})
                    bar.update(len(finished))
        except BaseException:
            for request in requests:  # leave the engine usable: drop what this call queued
                if not self.abort(request.request_id):
                    self.requests.pop(request.request_id, None)  # finished in the interrupted step
            raise
        finally:
            bar.close()
        # What is still unreported was aborted from outside the loop (another thread, a handler).
        return [
            self.error_output(r) if not isinstance(r, Request) else outputs.get(r.request_id) or self.output(r)
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


def per_prompt(what: str, value, kind, prompts) -> list:
    """One value for each prompt: a list given per prompt, or one value for all."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(prompts):
            raise ValueError(f"got {len(value)} {what} for {len(prompts)} prompts; give one for all or one per prompt")
        return list(value)
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise TypeError(f"{what} must be a {names} or a list of them, one per prompt; got {type(value).__name__}")
    return [value] * len(prompts)


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
