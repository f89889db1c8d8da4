"""The engine: requests in, then each step the core scheduler decides (through the policy), the
runner computes and samples, and the core scheduler finishes what the tokens end; outputs in order."""

import gc
import logging
import math
import operator
import random
import threading
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from numbers import Integral, Real
from time import perf_counter
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from inferlab.core import interrupts
from inferlab.core.blocks import BlockPrompt
from inferlab.core.config import EngineConfig
from inferlab.core.handoff import KVHandoff
from inferlab.core.interrupts import ALLOWED, DEFERRED, INSTALLED
from inferlab.core.plugins import ENGINE_KINDS, PluginRegistry, get_registry, validated_options
from inferlab.core.protocols import (
    AdmissionCost,
    BlockAligned,
    DecodeRuns,
    KVTransfer,
    LogitsProcessingSampler,
    LogprobsSampler,
    PrefixCacheReset,
    SamplesLogits,
    StructuredOutputSampler,
    TokenConstraint,
    UnheldPrefixBlocks,
)
from inferlab.core.request import Request, RequestStatus
from inferlab.core.sampling_params import SEED_LIMIT, SamplingParams
from inferlab.core.scheduler import Scheduler, SchedulerStallError

log = logging.getLogger("inferlab")


class RequestTooLargeError(ValueError):
    """A request needs more KV blocks than the whole cache has: no schedule could ever serve it."""


class EngineClosedError(RuntimeError):
    """A call on an engine after its close(): its device memory or workers are gone."""


class EngineBusyError(RuntimeError):
    """An engine call was made from inside another call on the same engine, in the same thread (a
    signal handler or a callback): it would interleave with the call under way."""


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
    num_failed_requests: int = 0  # answered with an error result (too large for the cache, undecodable tokens)
    # prefill/decode disaggregation: KV bytes this engine sent and received, and moves that failed here
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    num_failed_kv_transfers: int = 0


# What the interpreter itself keeps frozen (375 tuples on Python 3.12, none on 3.11 or 3.13): more than
# this at a generate call means its caller froze objects (a freeze made before importing inferlab
# counts as the interpreter's, and generate unfreezes it)
FROZEN_AT_IMPORT = gc.get_freeze_count()


ACCEPTED_PROMPTS = (
    "a string or a list of token ids (a list or tuple of ints or NumPy integers, or a 1-D integer "
    "NumPy array or torch tensor)"
)


def outside_range(token_ids: list[int], stop: int) -> bool:
    """Whether any id lies outside [0, stop). A long list goes through one int64 array, whose
    minimum and maximum cost two thirds of Python's min() and max() over it (a long trace admits
    124 M ids); a short one through those, without the array's microseconds."""
    if len(token_ids) < 256:
        return min(token_ids) < 0 or max(token_ids) >= stop
    try:
        ids = np.fromiter(token_ids, np.int64, len(token_ids))
    except OverflowError:  # beyond int64, so beyond any vocabulary
        return True
    return bool(ids.min() < 0 or ids.max() >= stop)


def as_token_ids(prompt) -> list[int]:
    """A prompt given as token ids, as a list of Python ints (the prompt itself when it is one:
    the Request copies it); TypeError for anything else. The common case, a list of exactly int,
    is one C loop."""
    if isinstance(prompt, (list, tuple)):
        if operator.countOf(map(type, prompt), int) == len(prompt):
            return prompt if type(prompt) is list else list(prompt)
        if all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompt):
            return [int(t) for t in prompt]
        odd = next(t for t in prompt if not isinstance(t, Integral) or isinstance(t, bool))
        got = f"a {type(prompt).__name__} holding {type(odd).__name__} {odd!r}"
    elif isinstance(prompt, np.ndarray):
        if prompt.ndim == 1 and np.issubdtype(prompt.dtype, np.integer):
            return prompt.tolist()
        got = f"a {prompt.ndim}-D NumPy array of {prompt.dtype}"
    elif isinstance(prompt, torch.Tensor):
        if prompt.is_meta:
            raise ValueError(
                "a prompt on the meta device holds no token ids (a tensor's shape only): give one with values"
            )
        dtype = prompt.dtype
        if prompt.dim() == 1 and not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
            return prompt.tolist()
        got = f"a {prompt.dim()}-D torch tensor of {dtype}"
    else:
        got = type(prompt).__name__
    raise TypeError(f"a prompt must be {ACCEPTED_PROMPTS}; got {got}")


def as_prompt_list(prompts) -> list:
    """generate's prompts: one prompt (a string, or token ids) or a list of them."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (np.ndarray, torch.Tensor)):
        if prompts.ndim == 1:
            return [prompts]
        raise TypeError(
            f"prompts as a {prompts.ndim}-D array are ambiguous (padding would become prompt tokens): give one "
            f"prompt as a 1-D array, or several as a list of 1-D arrays"
        )
    if isinstance(prompts, (list, tuple)):
        if prompts and isinstance(prompts[0], Integral) and not isinstance(prompts[0], bool):
            return [prompts]  # a single prompt of token ids
        return list(prompts)
    raise TypeError(
        f"prompts must be one prompt or a list of prompts, each {ACCEPTED_PROMPTS}; got {type(prompts).__name__}"
    )


@contextmanager
def rarer_young_collections(threshold: int = 100_000):
    """The collector's youngest generation collected every `threshold` net new objects instead of
    Python's 700, for the length of the block: for code that allocates containers which live on
    (a workload's prompts, a simulated run's requests and block records), which frequent young
    collections only walk again; on the whole Mooncake trace they took a fifth of a simulated run.
    The engine's GPU runs keep Python's default until a measurement says otherwise."""
    old = gc.get_threshold()
    gc.set_threshold(threshold, *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


@contextmanager
def older_objects_frozen(refreeze: bool = False):
    """Freezes every object the garbage collector tracks for the length of the block, unfreezing
    them after. A full collection walks every tracked object (torch, Triton, compiled graphs), a
    pause long against a step, while the GPU idles, and one came every few bench runs. Inside the
    block, collections walk only what the block creates. Unfrozen after, so cyclic garbage older
    than the block waits for its end, no longer. A caller's own freeze is theirs to manage.

    refreeze: also freeze what survives each collection of the middle generation, for a block whose
    objects mostly live on (a simulated run's records, requests and KV books), which full
    collections would otherwise walk again and again as they grow; its cyclic garbage waits for the
    block's end too."""
    if gc.get_freeze_count() > FROZEN_AT_IMPORT:
        yield
        return

    def freeze_survivors(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 1:
            gc.freeze()

    try:  # frozen inside the try: an interrupt just after the freeze still unfreezes
        gc.freeze()
        if refreeze:
            gc.callbacks.append(freeze_survivors)
        yield
    finally:
        if freeze_survivors in gc.callbacks:
            gc.callbacks.remove(freeze_survivors)
        gc.unfreeze()


@dataclass(slots=True)
class StepOutput:
    """What one engine step did: the requests that finished in it (every token known) and the
    tokens it launched."""

    finished: list[Request]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_requests: int  # in the launched batch


def check_request_arguments(params, priority, metadata, arrival_time) -> None:
    """The checks of make_request's arguments that need no engine (a Ray cluster's driver makes
    them before it sends a request): TypeError naming the argument."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"priority must be an integer (lower is served first), got {priority!r}")
    if metadata is not None and type(metadata) is not dict and not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict (or None), got {type(metadata).__name__}")
    # policies compare arrival times every step: one that is not a number would fail them all
    if arrival_time is not None and (
        (type(arrival_time) is not float and (not isinstance(arrival_time, Real) or isinstance(arrival_time, bool)))
        or not math.isfinite(arrival_time)
    ):
        raise TypeError(f"arrival_time must be a finite number of seconds on the engine's clock, got {arrival_time!r}")


def draw_seed(params: SamplingParams, rng: random.Random) -> int:
    """A request's seed: its own, or the next draw of the engine's stream (a Ray cluster's driver
    draws from one such stream for every replica)."""
    return params.seed if params.seed is not None else rng.getrandbits(32)


class LLMEngine:
    """LLM(model_path, **settings): nano-vllm's settings, plus device, dtype and plugin names
    (scheduler, kv_cache, attention, model, sampler) with their `<kind>_options`. Without a path,
    the embedded tiny model."""

    def __init__(self, model_path: str | None = None, /, *, registry: PluginRegistry | None = None, **kwargs):
        # One call at a time: generate holds it for its whole run, step, add_request and abort for theirs;
        # other threads wait their turn, and a call from inside a call in the same thread is refused.
        # Made first, with `closed`, so that close() serves a constructor that fails halfway.
        self.lock = threading.RLock()
        self.closed = False
        started = perf_counter()
        config = EngineConfig.from_kwargs(model_path, kwargs)
        self.registry = registry or get_registry()
        for kind in ENGINE_KINDS:  # a misspelled plugin or option fails before anything heavy loads
            name = getattr(config, kind)
            if name != "auto":
                validated_options(self.registry.get(kind, name), getattr(config, f"{kind}_options"))
        # The executor opens the checkpoint and builds whatever runs the steps (inferlab.core.protocols.Runner).
        # Its errors (a missing checkpoint, a rank that failed to start) are the engine's own, raised as they are.
        self.runner = runner = self.registry.create(
            "executor",
            config.executor,
            config,
            model_path,
            self.registry,
            options=config.executor_options,
            wrap_errors=False,
        )
        checkpoint = runner.checkpoint
        self.model_path, self.hf_config, self.tokenizer = checkpoint.path, checkpoint.hf_config, checkpoint.tokenizer
        self.config = config
        # The time requests and steps are stamped with: the host's, or a simulation's virtual one.
        self.clock = runner.clock
        self.admission_cost = runner.admit if isinstance(runner, AdmissionCost) else None
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
        self.overlap = runner.runs_ahead if overlap is None else bool(overlap)
        self.pending = None  # (tokens advance appended, StepHandle) of the step launched last, under overlap
        self.unreported: list[Request] = []  # finished, for the next step to report (a step that raised could not)
        # Leaders of n > 1 choices whose prompt is not computed yet: their other choices wait here, out
        # of the scheduler, so that they reuse its prefill through the prefix cache.
        self.held: list[Request] = []
        # Pending requests with a TokenConstraint: while there are any, each step's tokens are read
        # before the next is scheduled (the next mask needs them), so steps do not overlap.
        self.constrained: set[int] = set()
        # the sampler whose capabilities decide what requests may ask beyond plain sampling (None: the
        # runner computes no logits)
        samples = isinstance(runner, SamplesLogits)
        self.sampler = runner.sampler if samples else None
        self.reads_logprobs = samples  # its handles are LogprobsStepHandles
        kv = self.kv_manager
        # Runs of decode steps at once (run_decodes): a simulation's, over block-aligned books
        self.decode_runs = isinstance(runner, DecodeRuns) and isinstance(kv, BlockAligned) and kv.block_aligned
        # a waiting request's cached blocks that nobody holds, which admitting it takes from the free ones
        self.unheld_prefix_blocks = kv.num_unheld_prefix_blocks if isinstance(kv, UnheldPrefixBlocks) else None
        self.handoff: KVHandoff | None = None  # prefill/decode disaggregation, once connect_kv_transfer ran
        log.info("engine ready in %.1f s", perf_counter() - started)

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
        check_request_arguments(params, priority, metadata, arrival_time)
        if metadata:
            self.scheduler.check_metadata(metadata)  # the fields the policy declares it reads, and their types
        if isinstance(prompt, str):
            try:
                token_ids = self.tokenizer.encode(prompt)
            except Exception as e:  # the tokenizer's own error type (a Rust panic, say) would name no prompt
                raise ValueError(f"the tokenizer could not encode the prompt: {type(e).__name__}: {e}") from e
        elif isinstance(prompt, BlockPrompt):
            token_ids = prompt  # the Request keeps its blocks' keys, not its ids
        else:
            token_ids = as_token_ids(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.hf_config.vocab_size
        if isinstance(token_ids, BlockPrompt):
            if token_ids.id_bound > vocab:
                raise ValueError(
                    f"the prompt's blocks hold token ids up to {token_ids.id_bound - 1}, outside the vocabulary: "
                    f"ids must be in [0, {vocab})"
                )
        elif outside_range(token_ids, vocab):
            bad = [t for t in token_ids if not 0 <= t < vocab]
            raise ValueError(f"token ids {bad[:10]} are outside the vocabulary: ids must be in [0, {vocab})")
        max_len = self.config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len={max_len}")
        # Drawn before the cache check, so other requests' seeds do not depend on the cache size.
        seed = draw_seed(params, self.seed_rng)
        self.check_fits_cache(len(token_ids), params)
        new_constraint = self.constraint_factory(params)
        arrival_time = self.clock() if arrival_time is None else arrival_time
        choices = []
        for index in range(params.n):
            request = Request(
                self.next_request_id + index,
                token_ids,
                params,
                arrival_time=arrival_time,
                priority=priority,
                metadata=metadata,
                eos_token_id=self.eos_token_id,
                max_model_len=max_len,
                seed=(seed + index) % SEED_LIMIT,
            )
            request.index = index
            if params.logprobs is not None:
                request.logprobs = []
            if new_constraint is not None:
                request.constraint = new_constraint()
            choices.append(request)
        self.next_request_id += params.n
        leader = choices[0]
        if params.prompt_logprobs is not None:  # the first choice's: the others take its prefill from the cache
            leader.prompt_logprobs = [None]
        if params.n > 1:
            leader.choices = choices
            for choice in choices[1:]:
                choice.leader = leader
        return leader

    def constraint_factory(self, params: SamplingParams):
        """Checks that the sampler can do what params ask beyond plain sampling (ValueError naming
        what it lacks), and returns the factory of each choice's TokenConstraint, or None."""
        sampler, name = self.sampler, self.config.sampler
        wants_logprobs = params.logprobs is not None or params.prompt_logprobs is not None
        if sampler is None and (wants_logprobs or params.penalized or params.constrained):
            raise ValueError(
                f"executor {self.config.executor!r} computes no logits: logprobs, penalties, logit_bias, min_tokens "
                f"and constraints are not available with it"
            )
        lacking = None
        if params.logprobs is not None and not isinstance(sampler, LogprobsSampler):
            lacking = "logprobs (it does not implement LogprobsSampler)"
        elif (params.penalized or params.constrained) and not isinstance(sampler, LogitsProcessingSampler):
            lacking = (
                "penalties, logit_bias, min_tokens and constraints (it does not implement LogitsProcessingSampler)"
            )
        elif params.structured_outputs is not None and not isinstance(sampler, StructuredOutputSampler):
            lacking = "structured_outputs (it does not implement StructuredOutputSampler)"
        if lacking is not None:
            raise ValueError(f"sampler {name!r} does not support {lacking}")
        vocab = self.hf_config.vocab_size
        if params.logit_bias is not None and max(params.logit_bias) >= vocab:
            bad = sorted(t for t in params.logit_bias if t >= vocab)[:10]
            raise ValueError(f"logit_bias: token ids {bad} are outside the vocabulary: ids must be in [0, {vocab})")
        if params.structured_outputs is not None:
            return sampler.compile_constraint(params.structured_outputs, self.tokenizer, vocab)
        if params.constraint is not None:
            made = params.constraint
            return lambda: checked_constraint(made())
        return None

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
        self.refuse_reentry("add_request")
        with self.lock:
            interrupts.install()
            with DEFERRED:
                request = self.make_request(prompt, params or SamplingParams(), priority, metadata, arrival_time)
                self._add(request)
        return request.request_id

    def queue(self, request: Request) -> None:
        """Queues a request that make_request built: this engine's, or another's with the same
        settings (a cluster makes each request once, with an id unique in the cluster, and queues
        it on the replica its router chose). RequestTooLargeError if this engine's cache could
        never hold it; ValueError if a request with its id is pending here.

        Under disaggregation (connect_kv_transfer) request.kv_send has this engine prefill it and
        hand it off after its first token (reported finished with finish_reason "handoff", its
        blocks held until sent), and request.kv_receive has it take over such a request, its
        prompt's K/V received rather than computed."""
        self.refuse_reentry("queue")
        with self.lock:
            interrupts.install()
            with DEFERRED:
                if request.request_id in self.requests:
                    raise ValueError(f"request id {request.request_id} is already pending on this engine")
                if request.kv_send is not None or request.kv_receive is not None:
                    if self.handoff is None:
                        raise ValueError(
                            f"request {request.request_id} moves its K/V between replicas, but this engine has no "
                            f"KV transfer: call connect_kv_transfer first"
                        )
                    self.handoff.check(request)
                self.check_fits_cache(request.num_prompt_tokens, request.params)
                self._add(request)

    def connect_kv_transfer(self, transfer: KVTransfer, endpoint: int) -> None:
        """Makes this engine replica `endpoint` of a disaggregated cluster: requests queued with
        kv_send or kv_receive move their K/V through `transfer` (a kv_transfer plugin serving
        every engine of this process). Once, before any such request."""
        if not isinstance(transfer, KVTransfer):
            raise TypeError(f"transfer must be a kv_transfer plugin (KVTransfer), got {type(transfer).__name__}")
        if not isinstance(endpoint, int) or isinstance(endpoint, bool) or endpoint < 0:
            raise ValueError(f"endpoint must be a replica id, an integer >= 0; got {endpoint!r}")
        self.refuse_reentry("connect_kv_transfer")
        with self.lock:
            if self.handoff is not None:
                raise ValueError(f"this engine is replica {self.handoff.endpoint} of a KV transfer already")
            transfer.attach(endpoint, self.runner, self.kv_manager.block_size)
            self.handoff = KVHandoff(transfer, endpoint, self.scheduler, self.kv_manager, lambda: self.stats)

    def poll_kv_transfer(self) -> None:
        """Applies what the KV transfer reports (each step does): blocks of sends that ended are
        freed, receives that ended decode on, failed ones end with an error (reported by the next
        step). For a replica that is not stepping, such as an idle prefill replica holding blocks."""
        self.refuse_reentry("poll_kv_transfer")
        with self.lock, DEFERRED:
            if self.handoff is not None:
                try:
                    self.handoff.poll()
                finally:  # failed receives: the next step reports them
                    self.unreported, self.scheduler.ended = self.unreported + self.scheduler.ended, []

    def _add(self, request: Request) -> None:
        """Queues a request made by make_request: its first choice, while the others wait for its
        prefill (held). Never half added: after an exception none of its choices is pending (the
        caller got no id for it)."""
        choices = request.choices or (request,)
        try:
            for choice in choices:
                self.requests[choice.request_id] = choice
                if choice.constraint is not None:
                    self.constrained.add(choice.request_id)
            self.scheduler.add(request)
            if self.admission_cost is not None:
                self.admission_cost(request)
            if request.choices:
                self.held.append(request)
        except BaseException:
            for choice in choices:
                self.requests.pop(choice.request_id, None)
                self.constrained.discard(choice.request_id)
            if self.scheduler.abort(request):
                self.scheduler.ended.remove(request)
            self.held = [leader for leader in self.held if leader is not request]
            raise

    def _release_choices(self) -> None:
        """Queues, in front, the other choices of leaders whose prompt is computed (their full
        blocks are in the prefix cache now) or that finished."""
        held = []
        for leader in self.held:
            if leader.num_computed_tokens < leader.num_prompt_tokens and not leader.is_finished:
                held.append(leader)
                continue
            for choice in reversed(leader.choices[1:]):
                if not choice.is_finished:  # an aborted one was never queued
                    self.scheduler.add(choice, front=True)
                    if self.admission_cost is not None:
                        self.admission_cost(choice)
        self.held = held

    def abort(self, request_id: int) -> bool:
        """Stops a request (waiting, mid-prefill or decoding) and frees everything it holds; its
        finish_reason becomes "abort". True if it was still pending."""
        self.refuse_reentry("abort")
        with self.lock, DEFERRED:
            return self._abort(request_id)

    def _abort(self, request_id: int) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.constrained.discard(request_id)
        if request.view is None and request.leader is not None:  # a choice still held back: never queued
            if request.is_finished:
                return False
            request.finish_reason, request.finish_time = "abort", self.clock()
            ended = [*self.scheduler.ended, request]  # the next step reports it
            request.status, request.reported, self.scheduler.ended = RequestStatus.FINISHED, True, ended
        else:
            if self.handoff is not None:
                self.handoff.cancel(request)  # a receive in flight stops writing into its blocks
            if not self.scheduler.abort(request):  # the next step reports it
                return False
        self.stats.num_aborted_requests += 1
        return True

    def wait_until(self, t: float) -> None:
        """Blocks until the engine's clock reads t: the host sleeps; a simulation's virtual clock
        moves there at once. For drivers that feed requests at their arrival times."""
        self.runner.wait_until(t)

    def is_finished(self) -> bool:
        self.refuse_closed("is_finished")
        return not self.unreported and self._idle()

    def _idle(self) -> bool:
        """Nothing pending but requests finished and not yet reported."""
        scheduler = self.scheduler
        return not scheduler.has_unfinished() and self.pending is None and not scheduler.ended and not self.held

    def reset_prefix_cache(self) -> None:
        """Drops the prefix cache's unreferenced blocks, where the KV manager can."""
        self.refuse_reentry("reset_prefix_cache")
        with self.lock, DEFERRED:
            if isinstance(self.kv_manager, PrefixCacheReset):
                self.kv_manager.reset_prefix_cache()

    def refuse_closed(self, call: str) -> None:
        """Raises EngineClosedError once close() has run. Calls the engine makes of itself while
        it holds its lock (is_finished, output) check only this, not refuse_reentry."""
        if self.closed:
            raise EngineClosedError(f"{call}() on a closed engine: close() released its resources; build a new LLM")

    def refuse_reentry(self, call: str) -> None:
        """Raises EngineBusyError when this thread is inside a call on this engine already: the
        new call would run in the middle of the other's step (other threads wait for the lock)."""
        self.refuse_closed(call)
        if self.lock._is_owned():  # RLock's own record of whether this thread holds it
            raise EngineBusyError(
                f"{call}() was called while this engine is inside another call in the same thread (from a signal "
                f"handler or a callback during generate or step); the engine serves one call at a time: make it "
                f"after that call returns"
            )

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """One round: schedule, launch the forward pass, then finish what the sampled tokens end.

        With overlap scheduling a step's samples stay on the device as placeholders: the next
        step is scheduled and launched before they are read, and they are filled in (and stop
        conditions checked) right after that launch, so the CPU works while the GPU computes.

        A Ctrl-C during the step's bookkeeping takes effect when it ends, one during the forward
        pass at once (see inferlab.core.interrupts); either way the engine stays usable."""
        self.refuse_reentry("step")
        with self.lock:
            interrupts.install()
            with DEFERRED:
                output = self._step()
                # whether it went idle, before the output is taken: a fault here leaves the output for
                # the next step to report (no try block: on Python 3.11 an exception that a trace
                # function raises at a `try:` line skips the enclosing with blocks' exits)
                idle = self._idle()
                output.finished = self._take_finished()
                if interrupts.held_back():  # raised on the way out, losing the output: the next step reports these
                    self.unreported[:0] = output.finished
            if idle:
                interrupts.restore()
        return output

    def run_decodes(self, until: float) -> list[tuple[float, float]]:
        """A simulation's shortcut: runs at once the decode steps that step() would run next and
        that start before `until` on the clock, as long as nothing can change them, and returns
        each one's (start, end) on the clock; [] where the next step is not such a step (step()
        then runs it). The requests, the KV books, the counters and the clock end as those steps
        one at a time would leave them, the step after the run reading the last one's tokens.

        Nothing can change a step when: the runner times decode runs (DecodeRuns) on a virtual
        clock and the KV manager is BlockAligned; the steps overlap and the step launched last
        computed the running requests' last tokens, in order (and those of requests it finished at
        their length, which the run's first step reads and reports: take_finished); no step could
        admit a waiting request (none waits; or every sequence slot is taken, or the decodes take
        the whole token budget; or the policy is a PureAdmissionOrder and not a PreemptivePolicy,
        and no waiting request fits in the free blocks, see _admits_nothing); nothing is
        left to report or free, and no K/V moves to or from it (disaggregated); the policy is asked
        nothing else each step (no BudgetPolicy, ObservingPolicy);
        no request reads logprobs, has a constraint, stop strings or stop ids, or could sample EOS
        without ignoring it; and none reaches max_tokens or max_model_len, nor needs more blocks
        than are free, within the run. The caller promises that no request is queued before
        `until` (a cluster's next arrival)."""
        self.refuse_reentry("run_decodes")
        with self.lock:
            if not self.decode_runs:
                return []
            num_steps = self._decode_run_length()
            if num_steps <= 0:
                return []
            interrupts.install()
            with DEFERRED:
                return self._run_decodes(until, num_steps)

    def _decode_run_length(self) -> int:
        """How many decode steps of the running requests nothing can change (0: not such a step)."""
        scheduler, pending = self.scheduler, self.pending
        waiting = scheduler.waiting
        if (
            pending is None
            or not self.overlap
            or scheduler.receiving  # a move that ends mid-run would change the running requests
            or scheduler.sending
            or scheduler.to_free
            or scheduler.ended
            or self.unreported
            or self.held
            or self.constrained
            or scheduler.budgeted
            or scheduler.observing
            or self.reads_logprobs
        ):
            return 0
        running, (appended, _) = scheduler.running, pending
        num_running = len(running)
        if not running or num_running > scheduler.max_num_batched_tokens or len(appended) < num_running:
            return 0
        # whether each step of the run would ask the policy to admit a waiting request (as schedule
        # does: room left in the token budget, and a free sequence slot or a policy that preempts)
        asks = (
            waiting
            and num_running < scheduler.max_num_batched_tokens
            and (num_running < scheduler.max_num_seqs or scheduler.preemptive)
        )
        if asks and (scheduler.preemptive or not scheduler.pure_admission_order or not self._admits_nothing()):
            return 0
        sampled = self.runner.sampled_token_ids
        kv = self.kv_manager
        bs, free, block_table = kv.block_size, kv.num_free_blocks, kv.block_table
        steps = math.inf
        firsts = []  # of each request, the first step whose token lies past the blocks it holds
        # The pending step's tokens: one for each running request, in order, and one for each
        # request that step finished at its length (the run's first step reports those).
        row = 0
        for i, entry in enumerate(appended):
            request = entry[0]
            num_tokens = len(request.token_ids)
            params = request.params
            if (
                entry[1] != i
                or entry[2] != num_tokens - 1
                or request.error is not None
                or params.stop
                or params.stop_token_ids
                or (not params.ignore_eos and request.eos_token_id in sampled)
            ):
                return 0
            if row < num_running and request is running[row]:
                if request.status is not RequestStatus.RUNNING or request.num_computed_tokens != num_tokens - 1:
                    return 0
                row += 1
            elif (
                request.status is RequestStatus.FINISHED
                and request.finish_reason == "length"
                and not request.reported
                and len(request.token_times) == num_tokens - 1 - request.num_prompt_tokens
            ):
                continue
            else:
                return 0
            # step n appends the request's (num_tokens + n)th token; the step that reaches a limit
            # finishes it, and ends the run (the next step reports it)
            limit = params.max_tokens - (num_tokens - request.num_prompt_tokens)
            if limit < steps:
                steps = limit
            if request.max_model_len is not None and request.max_model_len - num_tokens < steps:
                steps = request.max_model_len - num_tokens
            # step n computes token c + n - 1, in block (c + n - 1) // bs: past the held ones from
            # n = held * bs - c + 1 on, and into a further one every bs steps after
            firsts.append(len(block_table(request)) * bs - request.num_computed_tokens + 1)
        if steps <= 0 or row != num_running:
            return 0
        return steps_in_free_blocks(firsts, steps, bs, free)

    def _admits_nothing(self) -> bool:
        """Whether no step of a run of decode steps starting now could admit a waiting request,
        whatever order a PureAdmissionOrder policy gives them in (with a FixedAdmissionOrder, the
        order it gives now: the core stops at the first request that does not fit).

        A waiting request holds no blocks; admitted with c tokens cached (a multiple of the block
        size), it takes at least the free blocks past c that its first chunk fills (at most the
        budget the decodes leave; kv_receive: its whole prompt), which are fewer the more is
        cached. Through the run the free blocks only dwindle (nothing finishes before its last
        step), and the blocks the decodes take can only evict a cached prefix. A block a decode
        commits may lengthen a cached prefix, by one block (BlockAligned), but the request that
        filled it takes a free block for its next token in the step after, before anything is
        admitted: so a request that does not fit now fits in no step of the run.

        With UnheldPrefixBlocks, the cached blocks that nobody holds count too (admitting takes them
        from the free ones). A decode's take that evicts one costs a free block and ends the cached
        prefix there, and the request computes into at least as many blocks more as it revives
        fewer; where its first chunk is cut by the budget, the blocks past its cache do not depend
        on how much is cached, and the pass without the cache found they do not fit."""
        scheduler, kv = self.scheduler, self.kv_manager
        bs, free = kv.block_size, kv.num_free_blocks
        budget = scheduler.max_num_batched_tokens - len(scheduler.running)
        waiting = scheduler.waiting
        if scheduler.fixed_admission_order:  # the same order each step: only its first can be admitted
            try:
                first = scheduler.first_to_admit()
            except Exception:
                return False  # a step asks again, and deals with the fault
            waiting = () if first is None else (first,)

        def blocks_past(request: Request, cached: int) -> int:
            """The free blocks the request takes at least, admitted with `cached` tokens cached."""
            end = (
                request.num_prompt_tokens
                if request.kv_receive is not None
                else min(len(request.token_ids), cached + budget)
            )
            return -(-end // bs) - cached // bs

        # first without asking the cache: a request that fits with nothing cached fits with anything
        if any(blocks_past(request, 0) <= free for request in waiting):
            return False
        unheld = self.unheld_prefix_blocks
        for request in waiting:
            # prompt logprobs need every prompt token's logits: nothing comes from the cache
            cached = kv.num_cached_prefix_tokens(request) if request.prompt_logprobs is None else 0
            if cached and blocks_past(request, cached) + (unheld(request, cached) if unheld else 0) <= free:
                return False  # (uncached: the pass above)
        return True

    def _run_decodes(self, until: float, max_steps: int) -> list[tuple[float, float]]:
        scheduler, kv = self.scheduler, self.kv_manager
        running = list(scheduler.running)
        run = self.runner.launch_decodes(running, self.pending[1], until, max_steps)
        starts, times = run.starts, run.ends
        num_steps = len(starts)
        if not num_steps:
            return []
        read, bs, block_table = run.read_tokens, kv.block_size, kv.block_table
        # The KV books at the steps that touch them, in the order stepping would: each step
        # allocates (scheduling) before it commits (advancing), request by request. Everything up
        # to c was committed by the step before (BlockAligned: a commit that fills no block changes
        # nothing), so a request commits where its steps fill a block.
        events = []  # (step, commit, row, tokens computed before the run)
        finishing = []  # rows that reach max_tokens or max_model_len in the last step
        pending = []  # the last step's entries, as advance appends them
        first, rest, end = read[0], read[1:], num_steps + 1
        for row, request in enumerate(running):
            c = request.num_computed_tokens
            token_ids = request.token_ids
            num_tokens = len(token_ids) + num_steps
            if num_tokens - request.num_prompt_tokens >= request.params.max_tokens or (
                request.max_model_len is not None and num_tokens >= request.max_model_len
            ):
                finishing.append(row)
            n = len(block_table(request)) * bs - c + 1
            while n < end:
                events.append((n, 0, row, c))
                n += bs
            n = bs - c % bs
            while n < end:
                events.append((n, 1, row, c))
                n += bs
            token_ids[-1] = first  # the pending step's placeholder
            token_ids += rest
            token_ids.append(-(row + 1))  # the last step's placeholder, as advance appends it
            request.token_times += times
            request.num_computed_tokens = c + num_steps  # the events below set theirs on the way
            pending.append((request, row, num_tokens - 1))
        if len(self.pending[0]) != len(
            running
        ):  # the pending step finished some: the first step resolves and reports them
            ended = [entry[0] for entry in self.pending[0] if entry[0].status is RequestStatus.FINISHED]
            for request in ended:
                request.token_ids[-1] = first
                request.reported = True
                request.token_times.append(times[0])
            self.unreported = ended
        if events:
            events.sort()
            if finishing:  # they finish in the last step's advance, before it commits
                last = set(finishing)
                events = [e for e in events if not (e[1] and e[0] == num_steps and e[2] in last)]
            for n, commit, row, c in events:
                request = running[row]
                if commit:
                    request.num_computed_tokens = c + n
                    kv.commit(request)
                else:
                    request.num_computed_tokens = c + n - 1
                    if not kv.allocate(request, 1):
                        raise RuntimeError(f"request {request.request_id}: a decode run found no free block")
            for _, _, row, c in events:
                running[row].num_computed_tokens = c + num_steps
        if finishing:  # as advance finishes them: out of the running queue, their blocks freed
            for row in finishing:
                scheduler._finish(running[row], "length")
            scheduler.release()
        self.pending = (pending, run.handle)
        scheduler.num_steps += num_steps
        stats = self.stats
        stats.num_steps += num_steps
        stats.num_decode_tokens += num_steps * len(running)
        for start, end in zip(starts, times):
            stats.decode_seconds += end - start
        return list(zip(starts, times))

    def _step(self) -> StepOutput:
        scheduler, handoff = self.scheduler, self.handoff
        if self.constrained and self.pending is not None:
            self.constrained &= self.requests.keys()  # some may have left without being reported
            if self.constrained:
                self._resolve_pending()  # a constraint takes the previous token before the next step's mask
        if self.held:
            self._release_choices()
        try:
            if handoff is not None:
                handoff.start_sends()  # those a step that raised left
                handoff.poll()
            batch = scheduler.schedule()
            if handoff is not None and scheduler.receiving:
                handoff.start_receives()
        finally:  # requests the scheduler ended (a policy's fault pinned on them, an abort, a failed move): this step reports them
            self.unreported, scheduler.ended = self.unreported + scheduler.ended, []
        self.stats.num_preemptions = scheduler.num_preemptions
        if not batch.requests and self.pending is None:
            if not scheduler.has_unfinished():
                return StepOutput([], 0, 0, 0)
            if (scheduler.receiving or scheduler.sending) and not scheduler.running:
                # nothing to compute until K/V arrives, or a send ends and frees the blocks it holds
                handoff.wait()
                return StepOutput([], 0, 0, 0)
            raise SchedulerStallError(
                f"scheduler {self.config.scheduler!r} scheduled nothing while {len(scheduler.waiting)} requests "
                f"wait and {len(scheduler.running)} run, with {self.kv_manager.num_free_blocks} of "
                f"{self.kv_manager.num_blocks} KV blocks free: its admission_order declined every waiting request "
                f"with nothing running"
            )
        start = self.clock()  # the step's time on the engine's clock: a simulation's steps take virtual time
        decode_tokens = batch.num_decode_tokens
        prefill_tokens = batch.total_tokens - decode_tokens
        pending = self.pending
        appended: list = []  # filled by advance as it goes: what an exception leaves is still resolved
        tokens = None
        try:
            with ALLOWED:  # the forward pass and the waits change no books: a Ctrl-C may stop them at once
                handle = self.runner.launch(batch) if batch.requests else None
                # the tokens to read now: under overlap the previous step's (while this one runs), else this one's
                waited = (pending and pending[1]) if self.overlap else handle
                tokens = self._wait(waited) if waited is not None else None
            if pending is not None:
                self._resolve(pending[0], tokens, pending[1])  # what it finishes is in scheduler.ended
                self.pending = None
            if handle is not None:
                if self.overlap:
                    self.pending = (appended, handle)
                    scheduler.advance(batch, handle.placeholders(), appended)
                else:
                    scheduler.advance(batch, tokens, appended)
                    self._resolve(appended, tokens, handle)
        except BaseException:
            # This launch may have replaced the samples that the pending step's placeholders stand
            # for: read that step's tokens now, so that no placeholder outlives the step. What was
            # resolved already is skipped.
            try:
                self._resolve_pending()
                if not self.overlap and appended:
                    self._resolve(appended, tokens, handle)
            except Exception:
                self.pending = None  # the runner failed: its samples are lost with it
            raise
        finally:
            self.unreported, scheduler.ended = self.unreported + scheduler.ended, []
        if handoff is not None and scheduler.handed_off:
            handoff.start_sends()  # before the step reports them handed off
        elapsed = self.clock() - start
        stats = self.stats
        stats.num_steps += 1
        stats.num_prefill_tokens += prefill_tokens
        stats.num_decode_tokens += decode_tokens
        if prefill_tokens:
            stats.prefill_seconds += elapsed
        else:
            stats.decode_seconds += elapsed
        return StepOutput([], prefill_tokens, decode_tokens, len(batch))  # the caller takes the finished requests

    def _resolve_pending(self) -> None:
        """Waits for the pending step's tokens and finishes what they end (under overlap)."""
        if self.pending is not None:
            appended, handle = self.pending
            self._resolve(appended, self._wait(handle), handle)
            self.pending = None

    def _resolve(self, appended: list, tokens: list[int | None], handle) -> None:
        """scheduler.resolve (what it finishes is listed in scheduler.ended, which the step
        reports), then the step's logprobs recorded and its new tokens given to the constraints (a
        constraint that completes ends its sequence with "stop"). Entries a resolve cut short had
        resolved already are not given to the constraints again."""
        fresh = [entry for entry in appended if unresolved(entry)] if self.constrained else ()
        self.scheduler.resolve(appended, tokens)
        step_logprobs = handle.logprobs() if self.reads_logprobs else None
        if step_logprobs is not None:
            record_logprobs(appended, step_logprobs)
        for request, _, position in fresh:
            constraint = request.constraint
            if constraint is None or request.finish_reason in ("abort", "error"):
                continue
            done = advance_constraint(request, request.token_ids[position])
            if done is None:
                continue
            if not request.is_finished:
                self.scheduler.finish(request, done)
            elif done == "error" or request.finish_reason == "length":
                request.finish_reason = done  # finished at max_tokens by the token that completes it

    def take_finished(self) -> list[Request]:
        """The requests finished since a step last reported them: those whose last token the first
        step of a run_decodes read (a step would have reported them)."""
        with self.lock:
            return self._take_finished()

    def _take_finished(self) -> list[Request]:
        """The requests finished since they were last reported, which stop being pending; those
        that failed are counted."""
        finished = self.unreported
        for request in finished:
            self.requests.pop(request.request_id, None)
            self.constrained.discard(request.request_id)
        self.stats.num_failed_requests += sum(request.finish_reason == "error" for request in finished)
        self.unreported = []
        return finished

    def _wait(self, handle) -> list[int | None]:
        start = perf_counter()
        tokens = handle.tokens()
        self.stats.wait_seconds += perf_counter() - start
        return tokens

    def output(self, request: Request) -> dict:
        """A finished request's result: its text, token ids, finish_reason and preemptions, and
        "error" (why) when finish_reason is "error"."""
        if not isinstance(request, Request):
            raise TypeError(
                f"output() takes a finished Request (an item of step().finished), got {type(request).__name__}"
            )
        self.refuse_closed("output")
        text = ""
        if request.finish_reason != "error":
            try:
                text = self.tokenizer.decode(request.output_token_ids)
            except Exception as e:  # one request's tokens the tokenizer cannot decode fail that request alone
                request.finish_reason = "error"
                request.error = f"decoding its output tokens failed: {type(e).__name__}: {e}"
                self.stats.num_failed_requests += 1
        if request.params.stop:
            cuts = [i for i in (text.find(s) for s in request.params.stop) if i >= 0]
            if cuts:
                text = text[: min(cuts)]
        output = {
            "text": text,
            "token_ids": request.output_token_ids,
            "finish_reason": request.finish_reason,
            "num_preemptions": request.num_preemptions,
        }
        if request.finish_reason == "error":
            output["error"] = request.error
        if request.logprobs is not None:
            output["logprobs"] = [by_token_id(request.token_ids[request.num_prompt_tokens + i], entry)
                                  for i, entry in enumerate(request.logprobs)]  # fmt: skip
        scored = request if request.leader is None else request.leader  # the first choice computed the prompt's
        if scored.prompt_logprobs is not None:
            prompt = request.token_ids[: request.num_prompt_tokens]
            output["prompt_logprobs"] = [
                None if entry is None else by_token_id(prompt[i], entry)
                for i, entry in enumerate(scored.prompt_logprobs)
            ]
        return output

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
        can take the same context).

        One call at a time: a generate from another thread waits until this one returns; one from
        inside it in the same thread (a signal handler) raises EngineBusyError. A Ctrl-C ends the
        call at the next forward pass (see inferlab.core.interrupts), aborting what it queued."""
        self.refuse_reentry("generate")
        with self.lock, INSTALLED, DEFERRED, older_objects_frozen():
            return self._generate(prompts, sampling_params, use_tqdm, raise_on_error, priority, metadata)

    def _generate(self, prompts, sampling_params, use_tqdm, raise_on_error, priority, metadata) -> list[dict]:
        prompts = as_prompt_list(prompts)
        sampling_params = per_prompt("sampling params", sampling_params or SamplingParams(), SamplingParams, prompts)
        priorities = per_prompt("priorities", priority, int, prompts)
        metadatas = per_prompt("metadata", metadata, (Mapping, type(None)), prompts)
        # Validate everything before queueing anything, so a bad prompt leaves the engine as it was.
        seed_state, next_id = self.seed_rng.getstate(), self.next_request_id
        try:
            with ALLOWED:  # tokenizing may take a while, and what it changes is put back below
                results = [  # a request, or why it cannot be served
                    self._request_or_error(i, args, raise_on_error)
                    for i, args in enumerate(zip(prompts, sampling_params, priorities, metadatas))
                ]
        except BaseException:
            self.seed_rng.setstate(seed_state)
            self.next_request_id = next_id
            raise
        requests = [r for r in results if isinstance(r, Request)]
        self.stats.num_failed_requests += len(results) - len(requests)
        choices = [choice for r in requests for choice in (r.choices or (r,))]
        bar = tqdm(total=len(choices), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_rate = decode_rate = 0.0
        # A request's output (its text decoded) is built when it finishes, while the device still
        # computes the others' tokens, not all at the end with the device idle.
        outputs: dict[int, dict] = {}
        mine = {r.request_id for r in choices}
        unreported = set(mine)
        others: list[Request] = []  # queued through add_request: the next step() reports them
        try:
            for request in requests:
                self._add(request)
            while unreported and not self.is_finished():
                start = perf_counter()
                step = self._step()
                elapsed = perf_counter() - start
                if step.num_prefill_tokens:
                    prefill_rate = step.num_prefill_tokens / elapsed
                else:
                    decode_rate = step.num_decode_tokens / elapsed
                finished = []
                for request in self._take_finished():
                    (finished if request.request_id in mine else others).append(request)
                for request in finished:
                    outputs[request.request_id] = self.output(request)
                    unreported.discard(request.request_id)
                if use_tqdm:
                    bar.set_postfix({"Prefill": f"{int(prefill_rate)}tok/s", "Decode": f"{int(decode_rate)}tok/s"})
                    bar.update(len(finished))
        except BaseException:
            scheduler = self.scheduler
            for request in choices:  # leave the engine usable: drop what this call queued
                try:
                    self._abort(request.request_id)
                except Exception:  # the KV manager failed to free it: the next step frees it (Scheduler.to_free)
                    pass
                self.requests.pop(request.request_id, None)
            self.unreported, scheduler.ended = (
                [r for r in (*self.unreported, *scheduler.ended) if r.request_id not in mine],
                [],
            )
            self.held = [leader for leader in self.held if leader.request_id not in mine]
            raise
        finally:
            self.unreported[:0] = others
            bar.close()
        for request in choices:
            if request.request_id not in outputs:
                outputs[request.request_id] = self.output(request)
        for request in requests:
            if request.choices:  # n > 1: the first choice's fields, and every choice's
                outputs[request.request_id] = {
                    **outputs[request.request_id],
                    "choices": [outputs[c.request_id] for c in request.choices],
                }
        return [self.error_output(r) if not isinstance(r, Request) else outputs[r.request_id] for r in results]

    def _request_or_error(self, index: int, args: tuple, raise_on_error: bool) -> Request | str:
        """make_request, with the prompt's index in its error; a request too large for the whole
        cache becomes the reason it cannot be served (an error result) unless raise_on_error."""
        try:
            return self.make_request(*args)
        except (ValueError, TypeError) as e:
            if isinstance(e, RequestTooLargeError) and not raise_on_error:
                return str(e)
            kind = RequestTooLargeError if isinstance(e, RequestTooLargeError) else type(e).__mro__[0]
            if kind not in (RequestTooLargeError, ValueError, TypeError):
                kind = ValueError if isinstance(e, ValueError) else TypeError
            raise kind(f"prompt {index}: {e}") from None

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Releases the engine's resources: its GPU memory (weights, KV cache, CUDA graphs), or
        its worker processes under tensor parallelism. Requests still unfinished are dropped;
        later calls raise EngineClosedError. Safe to call twice."""
        if self.closed:
            return
        self.refuse_reentry("close")
        with self.lock:
            self.closed = True
            self.pending = None  # its placeholders point at samples that are about to be freed
            runner = getattr(self, "runner", None)  # absent when start-up failed before the executor was built
            if runner is not None:
                runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def steps_in_free_blocks(firsts: list[int], steps: int, block_size: int, free: int) -> int:
    """The longest run of decode steps, at most `steps`, whose blocks are free (no step preempts):
    each request takes a block at step firsts[i] (its first token past the blocks it holds) and
    every block_size steps after, so the run ends before the step that would take one block more
    than are free. One pass over the steps that take blocks, not a search over run lengths."""
    needs = [n for first in firsts for n in range(first, steps + 1, block_size)]
    if len(needs) <= free:
        return steps
    needs.sort()
    return max(needs[free] - 1, 0)


def record_logprobs(appended: list, step_logprobs) -> None:
    """Appends a step's logprobs to its requests: each new output token's (those appended at
    `position`), and the prompt tokens' scored in it that the request does not hold yet (a
    preempted request computes its prompt again)."""
    by_row = step_logprobs.sampled()
    for request, row, position in appended:
        entry = by_row.get(row)
        held = request.logprobs
        if entry is not None and held is not None and len(held) == position - request.num_prompt_tokens:
            k = request.params.logprobs
            held.append((entry[0], entry[1][:k], entry[2][:k]))
    for request, first, entries in step_logprobs.prompt():
        held = request.prompt_logprobs
        skip = -1 if held is None else len(held) - first
        if 0 <= skip < len(entries):
            k = request.params.prompt_logprobs
            held.extend((value, ids[:k], values[:k]) for value, ids, values in entries[skip:])


def unresolved(entry: tuple[Request, int, int]) -> bool:
    """Whether an entry of a step's appended tokens is still to be resolved (Scheduler.resolve)."""
    request, _, position = entry
    return position < len(request.token_ids) and len(request.token_times) <= position - request.num_prompt_tokens


def advance_constraint(request: Request, token: int) -> str | None:
    """Tells request's constraint the token drawn: "stop" when that completes it, "error" (with
    request.error saying why) when it refuses the token, raises or failed to fill its mask (a
    fault of one constraint fails its own request alone), else None."""
    if request.error is None:
        try:
            if not request.constraint.accept_token(token):
                request.error = f"its constraint refused token {token}"
            elif request.constraint.is_terminated():
                return "stop"
        except Exception as e:
            request.error = f"its constraint raised {type(e).__name__}: {e}"
    return None if request.error is None else "error"


def by_token_id(token_id: int, entry: tuple[float, list[int], list[float]]) -> dict[int, float]:
    """One token's logprobs as the library returns them (vLLM's layout): {token id: logprob} of the
    token itself, then of the top ones in order."""
    value, top_ids, top_values = entry
    return {token_id: value, **{i: v for i, v in zip(top_ids, top_values) if i != token_id}}


def checked_constraint(constraint) -> TokenConstraint:
    """What a SamplingParams.constraint factory returned, checked to be a TokenConstraint."""
    if not isinstance(constraint, TokenConstraint):
        raise TypeError(
            f"SamplingParams.constraint returned {type(constraint).__name__}, which is not a TokenConstraint "
            f"(fill_bitmask, accept_token, is_terminated: see inferlab.core.protocols)"
        )
    return constraint


def per_prompt(what: str, value, kind, prompts) -> list:
    """One value for each prompt: a list given per prompt, or one value for all."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(prompts):
            raise ValueError(f"got {len(value)} {what} for {len(prompts)} prompts; give one for all or one per prompt")
        return list(value)
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise TypeError(
            f"{what} must be one {names} for all prompts or a list of them, one per prompt; got {type(value).__name__}"
        )
    return [value] * len(prompts)
