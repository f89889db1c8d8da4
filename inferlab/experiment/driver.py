"""The latency driver: a workload through the engine's own step loop, each request added once its
arrival time has passed on the engine's clock, and a record of every request and step.

One thread runs everything: between steps the driver adds the requests that have arrived; while
the engine is idle it waits for the next arrival through `wait_until`, the one place that blocks
(the engine's own sleeps on the host's clock; a simulated engine's moves its virtual clock). Time is
read only through `llm.clock`. Requests that arrive while the engine is busy wait in the engine's
own queue, where the scheduler policy sees them: under overload the queue grows, nothing is dropped.

`request_record` turns a finished engine Request into its RequestRecord; it serves any front end
that stamps requests on the engine's clock (the bench job here, a server's runs). A Cluster has the
engine's surface and is driven alike; its records say which replica served each request.
"""

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import numpy as np

from inferlab.cluster import Cluster
from inferlab.core.engine import RequestTooLargeError, older_objects_frozen, rarer_young_collections
from inferlab.core.protocols import SimulatedDevice
from inferlab.core.request import Request
from inferlab.core.sampling_params import SamplingParams
from inferlab.experiment.latency import RequestRecord, RunRecords, StepRecord
from inferlab.experiment.workload import WorkloadRequest

__all__ = ["request_record", "run_workload"]


def request_record(
    request: Request,
    start: float,
    request_id: int | str | None = None,
    replica_id: int | None = None,
    token_times: bool = True,
) -> RequestRecord:
    """The RequestRecord of a finished engine Request, its times relative to start (the run's t=0
    on the engine's clock); request_id replaces the engine's id (e.g. the request's place in a
    workload). Its finish is the later of the engine's finish time and its last token's time: a
    request that reaches max_tokens is finished when that token is appended, before it is read back.
    token_times False keeps only the first and last token's times (a run of a million requests)."""
    if request.finish_time is None:
        raise ValueError(f"request {request.request_id} has not finished: only a finished request has a record")
    times = request.token_times
    if not token_times and len(times) > 2:
        times = [times[0], times[-1]]
    all_token_times = len(times) == len(request.token_times)
    token_times_s = [float(t - start) for t in times]  # the float64 differences an array would give, without one
    finish = request.finish_time - start
    if token_times_s and token_times_s[-1] > finish:
        finish = token_times_s[-1]
    first_scheduled = request.first_scheduled_time
    return RequestRecord(
        request_id=request.request_id if request_id is None else request_id,
        arrival_s=request.arrival_time - start,
        first_scheduled_s=None if first_scheduled is None else first_scheduled - start,
        first_token_s=token_times_s[0] if token_times_s else None,
        token_times_s=token_times_s,
        finish_s=finish,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=len(request.token_times),  # tokens known on the host; an abort may leave one unread
        num_cached_tokens=request.num_cached_tokens,
        num_preemptions=request.num_preemptions,
        priority=request.priority,
        metadata=dict(request.metadata),
        finish_reason=request.finish_reason,
        error=request.error if request.finish_reason == "error" else None,
        replica_id=replica_id,
        all_token_times=all_token_times,
        kv_transfer_s=request.kv_transfer_s,
        kv_transfer_bytes=request.kv_transfer_bytes,
    )


def run_workload(
    llm,
    requests: Sequence[WorkloadRequest],
    params: Sequence[SamplingParams],
    wait_until: Callable[[float], None] | None = None,
    record_steps: bool = True,
    record_token_times: bool = True,
) -> RunRecords:
    """Runs requests (in arrival order, params one per request) through llm's step loop (an engine,
    or a Cluster: the same surface). The run's t=0 is llm.clock() at the call; request i is added
    with arrival_time = t=0 + its arrival_s once the clock has passed that, so its TTFT counts from
    its nominal arrival. wait_until(t) blocks until llm.clock() reaches t (default: llm.wait_until,
    which sleeps on the host's clock or moves a simulation's virtual clock).

    Returns one RequestRecord per request, in the workload's order with request_id its index (each
    built when its request finishes, so that a long run holds records, not requests); one
    StepRecord per engine step (per replica step, for a cluster) unless record_steps is False; and
    the wall time from t=0 to the end of the run. A request too large for the whole KV cache is
    refused when it arrives and recorded with finish_reason "error" and the reason; one aborted
    meanwhile (from another thread) is recorded with "abort"."""
    if len(params) != len(requests):
        raise ValueError(f"got {len(params)} sampling params for {len(requests)} requests; give one per request")
    if not requests:
        raise ValueError("the workload has no requests")
    arrivals = np.asarray([r.arrival_s for r in requests], dtype=np.float64)
    # NaN fails every comparison, so the checks are written to pass only good values: a NaN arrival
    # was never due and hung the run
    if not (np.isfinite(arrivals).all() and arrivals[0] >= 0 and np.all(np.diff(arrivals) >= 0)):
        raise ValueError("requests must be in arrival order, with finite arrival_s >= 0")
    clock = llm.clock
    if wait_until is None:
        wait_until = llm.wait_until
    cluster = isinstance(llm, Cluster)
    replica_of = llm.replica_of if cluster else lambda request_id: None
    simulated = llm.simulated if cluster else isinstance(llm.runner, SimulatedDevice)
    num_requests = len(requests)
    records: list[RequestRecord | None] = [None] * num_requests
    in_flight: dict[int, tuple[int, Request]] = {}  # engine request id -> (workload index, request)
    steps: list[StepRecord] = []
    step, is_finished, pending = llm.step, llm.is_finished, llm.requests
    # a simulation allocates what lives on (records, requests, block books) and little else: its
    # young objects are collected rarely, and what survives is frozen out of later collections
    young = rarer_young_collections(1_000_000) if simulated else nullcontext()
    with older_objects_frozen(refreeze=simulated), young:
        start = clock()
        due = (arrivals + start).tolist()  # arrivals on the engine's clock
        next_index = 0

        def record(request: Request, index: int) -> None:
            records[index] = request_record(
                request,
                start,
                request_id=index,
                replica_id=replica_of(request.request_id),
                token_times=record_token_times,
            )

        try:
            while True:
                if next_index < num_requests:
                    now = clock()
                    while next_index < num_requests and due[next_index] <= now:
                        request = requests[next_index]
                        try:
                            request_id = llm.add_request(
                                request.prompt_token_ids,
                                params[next_index],
                                priority=request.priority,
                                metadata=request.metadata,
                                arrival_time=due[next_index],
                            )
                            in_flight[request_id] = (next_index, pending[request_id])
                        except RequestTooLargeError as e:
                            records[next_index] = _refused_record(next_index, request, due[next_index] - start, e)
                        next_index += 1
                if is_finished():
                    if next_index == num_requests:
                        break
                    wait_until(due[next_index])  # idle until the next arrival
                    continue
                step_start = clock()
                # a cluster is told when the next request arrives: a simulated one runs what
                # nothing before it can change at once
                output = step(due[next_index] if next_index < num_requests else math.inf) if cluster else step()
                step_end = clock()
                for request in output.finished:
                    index, _ = in_flight.pop(request.request_id, (None, None))
                    if index is not None:
                        record(request, index)
                if not record_steps:
                    continue
                if cluster:
                    for replica_id, replica_start, replica_end, replica_step in output.replica_steps:
                        steps.append(_step_record(replica_step, replica_start - start, replica_end - start, replica_id))
                else:
                    steps.append(_step_record(output, step_start - start, step_end - start))
            wall_time = clock() - start
        except BaseException:
            for _, request in in_flight.values():  # leave the engine usable: drop what this run queued
                if not request.is_finished:
                    llm.abort(request.request_id)
            raise
    for index, request in in_flight.values():  # aborted from another thread: never reported by a step
        record(request, index)
    return RunRecords(records, steps, wall_time)


def _step_record(output, start_s: float, end_s: float, replica_id: int | None = None) -> StepRecord:
    return StepRecord(
        start_s, end_s, output.num_prefill_tokens, output.num_decode_tokens, output.num_requests, replica_id
    )


def _refused_record(index: int, request: WorkloadRequest, arrival_s: float, error: Exception) -> RequestRecord:
    return RequestRecord(
        request_id=index,
        arrival_s=arrival_s,
        first_scheduled_s=None,
        first_token_s=None,
        token_times_s=[],
        finish_s=arrival_s,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_output_tokens=0,
        priority=request.priority,
        metadata=dict(request.metadata),
        finish_reason="error",
        error=str(error),
    )
