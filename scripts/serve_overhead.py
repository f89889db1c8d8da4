"""Where a streamed completion's time goes in the OpenAI server, against the same stream in
process, in one process on one engine: one stream of --tokens tokens after a --prompt-token
prompt (fresh ids each run, so no run reuses another's prefix cache),
  1. in process: engine.add_request, then engine.step() until it finishes;
  2. over HTTP: the InferenceServer on this engine, the stream sent from a client process of its
     own (the HTTP bench's, on a new connection or a kept one), the server's steps and hand-overs
     timed here on the same clock (perf_counter is CLOCK_MONOTONIC on Linux).
Prints, per run, TTFT and TPOT as the client saw them, the server's path of the first token
(client send, handler, the engine thread's add, the first steps, the hand-overs to the event loop,
the chunk's send) and the engine's step intervals, so that the server's added latency is split
into its parts. With --streams N, a burst of N streams instead (tok/s, the engine's step
intervals, each server thread's CPU). With --emulate PROFILE, no checkpoint: the simulated engine
of that profile in real time (executor.real_time) stands in for the GPU. A SETTING (engine
keyword arguments) is KEY=VALUE, each VALUE read as JSON.

    python3 scripts/serve_overhead.py MODEL_DIR [--runs 3] [SETTING...]   # e.g. attention='"triton"'
    python3 scripts/serve_overhead.py --emulate h200-qwen3-0.6b-triton --streams 256 --prompt 256 --tokens 256
"""

import argparse
import json
import re
import socket
import statistics
import subprocess
import sys
import time
from time import perf_counter

TOKEN_IDS = re.compile(rb'"token_ids":\[([^\]]*)\]')


def burst_client(url: str, bodies: list[dict]) -> dict:
    """Every body sent at once as a streamed completion, each on a socket of its own, read as
    the chunks come (counting token ids without decoding the JSON, so the client stays light):
    the send time, and per stream its first token's time, its end and its token and chunk counts."""
    import selectors

    host, port = url.removeprefix("http://").rsplit(":", 1)
    selector = selectors.DefaultSelector()
    streams = []
    for body in bodies:
        payload = json.dumps(body).encode()
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        streams.append({"sock": sock, "request": (head + f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload,
                        "buffer": b"", "first": None, "end": None, "tokens": 0, "chunks": 0})  # fmt: skip
    sent = perf_counter()
    for stream in streams:
        stream["sock"].sendall(stream.pop("request"))
        selector.register(stream["sock"], selectors.EVENT_READ, stream)
    open_streams = len(streams)
    while open_streams:
        for key, _ in selector.select():
            stream = key.data
            data = key.fileobj.recv(1 << 16)
            now = perf_counter()
            buffer = stream["buffer"] + data
            cut = buffer.rfind(b"\n\n") + 2
            complete, stream["buffer"] = buffer[:cut], buffer[cut:]
            counts = [ids.count(b",") + 1 for ids in TOKEN_IDS.findall(complete) if ids]
            if counts:
                stream["first"] = stream["first"] or now
                stream["tokens"] += sum(counts)
                stream["chunks"] += len(counts)
            if not data or b"data: [DONE]" in complete:
                stream["end"] = now
                selector.unregister(key.fileobj)
                key.fileobj.close()
                open_streams -= 1
    return {"sent": sent, "streams": [{k: s[k] for k in ("first", "end", "tokens", "chunks")} for s in streams]}


def stream_client(url: str, body: dict, kept: bool) -> dict:
    """One streamed completion through the HTTP bench's client (inferlab.experiment.sse_client): on a
    new connection (its connect timed with the send), or, when kept, on one a short request
    opened first, as the bench's warm-up does. The times of the send, of the response's headers
    and of every chunk with token ids (perf_counter), and each chunk's token count."""
    import asyncio

    from inferlab.experiment.sse_client import SSEClient

    async def stream(client: SSEClient, body: dict) -> tuple[float, float, list]:
        sent = perf_counter()
        response = await client.post("/v1/completions", json.dumps(body).encode())
        headers, chunks = perf_counter(), []
        async for arrived, data in response.events():
            if data != b"[DONE]":
                count = sum(len(c.get("token_ids") or ()) for c in json.loads(data)["choices"])
                if count:
                    chunks.append((arrived, count))
        response.close()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")
        return sent, headers, chunks

    async def run() -> dict:
        client = SSEClient(url)
        if kept:
            await stream(client, {**body, "prompt": body["prompt"][:8], "max_tokens": 4})
        sent, headers, chunks = await stream(client, body)
        await client.aclose()
        return {"sent": sent, "headers": headers, "chunks": chunks}

    return asyncio.run(run())


class Timeline:
    """The server's moments, on this process's clock: (name, time, detail)."""

    def __init__(self):
        self.events: list[tuple[str, float, object]] = []

    def wrap(self, owner, name: str, label: str, after: bool = False, detail=None) -> None:
        original = getattr(owner, name)
        events = self.events

        def wrapper(*args, **kwargs):
            if not after:
                events.append((label, perf_counter(), detail(*args) if detail else None))
            result = original(*args, **kwargs)
            if after:
                events.append((label, perf_counter(), detail(*args) if detail else None))
            return result

        setattr(owner, name, wrapper)

    def between(self, start: float, end: float) -> list[tuple[str, float, object]]:
        return [e for e in self.events if start <= e[1] <= end]

    def times(self, label: str, start: float, end: float) -> list[float]:
        return [t for name, t, _ in self.between(start, end) if name == label]


def instrument(timeline: Timeline, engine) -> None:
    """Times the server's path: the handler (body parsed), the engine thread's add and steps, its
    posts to the event loop and their delivery, and each message the response sends."""
    import starlette.applications

    import inferlab.server.app as app
    from inferlab.server.engine_loop import ACCEPTED, EngineLoop

    for module in ("h11_impl", "httptools_impl"):  # whichever uvicorn runs
        try:
            protocols = __import__(f"uvicorn.protocols.http.{module}", fromlist=["x"])
        except ImportError:
            continue
        owner = getattr(protocols, "H11Protocol" if module == "h11_impl" else "HttpToolsProtocol")
        timeline.wrap(owner, "data_received", "bytes in")
    original_call = starlette.applications.Starlette.__call__

    async def call(self, scope, receive, send):
        if scope["type"] == "http":
            timeline.events.append(("app", perf_counter(), None))
        await original_call(self, scope, receive, send)

    starlette.applications.Starlette.__call__ = call
    timeline.wrap(app, "parse_body", "handler")
    timeline.wrap(EngineLoop, "_add", "added", after=True)
    timeline.wrap(engine, "step", "step start")
    timeline.wrap(engine, "step", "step end", after=True)  # wraps the wrapper: its end
    kinds = lambda self, updates: {"accepted" if u is ACCEPTED else "tokens" for _, u in updates}  # noqa: E731
    timeline.wrap(EngineLoop, "_post", "post", detail=kinds)
    timeline.wrap(EngineLoop, "_deliver", "deliver")
    original = app.EventStream.stream_response
    events = timeline.events

    async def stream_response(self, send):
        async def timed(message):
            await send(message)
            events.append(("sent " + message["type"].split(".")[-1], perf_counter(), len(message.get("body", b""))))

        await original(self, timed)

    app.EventStream.stream_response = stream_response


def figures(first: float, token_times: list[float]) -> tuple[float, float]:
    """TTFT from `first` and the mean time between tokens, in ms."""
    ttft = (token_times[0] - first) * 1000
    tpot = (token_times[-1] - token_times[0]) / max(1, len(token_times) - 1) * 1000
    return ttft, tpot


def ms(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{(b - a) * 1000:7.3f}"


def first_of(events, name: str, after: float = 0.0, detail=None):
    """The time of the first event `name` at or after `after` (whose detail holds `detail`)."""
    for label, t, d in events:
        if label == name and t >= after and (detail is None or detail in d):
            return t
    return None


def intervals_us(times: list[float]) -> str:
    gaps = [(b - a) * 1e6 for a, b in zip(times, times[1:])]
    if not gaps:
        return "-"
    q = statistics.quantiles(gaps, n=10)
    return f"p10 {q[0]:.0f}, p50 {statistics.median(gaps):.0f}, p90 {q[-1]:.0f} us ({len(gaps)} gaps)"


def thread_cpu_s(server) -> tuple[float, float]:
    """CPU seconds so far of the server's engine thread and of its event loop's thread."""
    threads = (server.engine_loop.thread, server.thread)
    return tuple(time.clock_gettime(time.pthread_getcpuclockid(t.ident)) for t in threads)


def durations_us(starts: list[float], ends: list[float]) -> str:
    spans = sorted((b - a) * 1e6 for a, b in zip(starts, ends))
    return f"p10 {spans[len(spans) // 10]:.0f}, p50 {statistics.median(spans):.0f}, p90 {spans[9 * len(spans) // 10]:.0f} us"


def start_server(engine, args, **settings):
    """The InferenceServer over engine with the script's options, serving on a thread."""
    import inferlab.server.app as app
    from inferlab.conf import ServeConfig
    from inferlab.server.server import InferenceServer

    if args.gil_switch_interval is not ...:
        settings["gil_switch_interval_s"] = args.gil_switch_interval
    if args.chunk_per_step:
        app.per_choice = lambda updates: updates
    server = InferenceServer(engine, ServeConfig(port=0, log_level="warning", **settings))
    if args.uvicorn:
        server.uvicorn.config.http, server.uvicorn.config.loop = args.uvicorn.split(",")
    return server.start()


def burst(engine, args, prompt, params, timeline: "Timeline") -> None:
    """args.streams streams at once, in process and then over HTTP (from one light client process):
    output tok/s, the engine's step intervals and its thread's CPU, the event loop's CPU a token."""
    n, total = args.streams, args.streams * args.tokens
    print(f"{n} streams at once, {args.tokens} tokens after {args.prompt} each:")
    for run in range(args.runs + 1):
        cpu, begin = time.thread_time(), perf_counter()
        for _ in range(n):
            engine.add_request(prompt(), params)
        while not engine.is_finished():
            engine.step()
        wall, cpu = perf_counter() - begin, time.thread_time() - cpu
        starts = timeline.times("step start", begin, begin + wall)
        if run:
            print(f"  in process: {total / wall:.0f} tok/s; step starts {intervals_us(starts)}; "
                  f"the engine thread's CPU {cpu / len(starts) * 1e6:.0f} us a step")  # fmt: skip
    server = start_server(engine, args, max_queued_requests=None)
    protocol, loop = server.uvicorn.config.http_protocol_class.__name__, type(server.engine_loop.event_loop).__name__
    print(f"  uvicorn: {protocol}, {loop}, GIL switch interval {sys.getswitchinterval()} s")
    try:
        for run in range(args.runs + 1):
            bodies = [{"prompt": prompt(), "max_tokens": args.tokens, "temperature": 0.6, "ignore_eos": True,
                       "stream": True, "return_token_ids": True} for _ in range(n)]  # fmt: skip
            cpu_before = thread_cpu_s(server)
            out = subprocess.run(
                [sys.executable, __file__, "x", "--client", f"burst,{server.url}"],
                input=json.dumps(bodies), capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            engine_cpu, loop_cpu = (b - a for a, b in zip(cpu_before, thread_cpu_s(server)))
            client = json.loads(out)
            if not run:
                continue
            streams = client["streams"]
            wall = max(s["end"] for s in streams) - client["sent"]
            tokens = sum(s["tokens"] for s in streams)
            chunks = sum(s["chunks"] for s in streams)
            ttft = statistics.median(s["first"] - client["sent"] for s in streams) * 1000
            sent = client["sent"]
            starts, adds = (timeline.times(label, sent, sent + wall) for label in ("step start", "added"))
            print(f"  over HTTP, ms from the first send: the first and last adds {(adds[0] - sent) * 1e3:.1f}, "
                  f"{(adds[-1] - sent) * 1e3:.1f}; the first and last steps {(starts[0] - sent) * 1e3:.1f}, "
                  f"{(starts[-1] - sent) * 1e3:.1f}; the first and last streams' ends "
                  f"{(min(s['end'] for s in streams) - sent) * 1e3:.1f}, {wall * 1e3:.1f}")  # fmt: skip
            print(f"  over HTTP: {tokens / wall:.0f} tok/s ({tokens} of {total} tokens in {chunks} chunks), "
                  f"TTFT p50 {ttft:.1f} ms; step starts {intervals_us(starts)}; the engine thread's CPU "
                  f"{engine_cpu / max(1, len(starts)) * 1e6:.0f} us a step, the event loop's {loop_cpu / tokens * 1e6:.1f} us a token "
                  f"({loop_cpu / chunks * 1e6:.1f} a chunk)", flush=True)  # fmt: skip
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?", help="a checkpoint directory (none with --emulate)")
    parser.add_argument("settings", nargs="*")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument(
        "--emulate", metavar="PROFILE", help="a simulated engine of this profile in real time (executor.real_time)"
    )
    parser.add_argument("--streams", type=int, default=1, help="above 1: a burst of this many streams instead")
    parser.add_argument(
        "--gil-switch-interval", type=json.loads, default=..., help="serve.gil_switch_interval_s (JSON: 0.005, null)"
    )
    parser.add_argument("--uvicorn", metavar="HTTP,LOOP", help="uvicorn's http and loop settings (default auto,auto)")
    parser.add_argument("--chunk-per-step", action="store_true", help="a chunk per step's update, as before per_choice")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # internal: run one client, print its times
    args = parser.parse_args()
    if args.client:
        kind, url = args.client.split(",", 1)
        body = json.loads(sys.stdin.read())
        if kind == "burst":
            print(json.dumps(burst_client(url, body)))
        else:
            print(json.dumps(stream_client(url, body, kept=kind == "kept")))
        return

    from inferlab import LLM, SamplingParams

    settings = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.settings)}
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.tokens)
    seed = [0]

    if args.emulate:  # the simulated engine on this host's clock, standing in for the profiled GPU
        settings.update(executor="simulated", executor_options={"profile": args.emulate, "real_time": True})
    with LLM(None if args.emulate else args.model_dir, **settings) as engine:
        vocab = min(10000, engine.hf_config.vocab_size)

        def prompt() -> list[int]:
            seed[0] += 1
            return [(7919 * seed[0] + 104729 * j) % vocab for j in range(args.prompt)]

        timeline = Timeline()
        instrument(timeline, engine)
        if args.streams > 1:
            burst(engine, args, prompt, params, timeline)
            return
        print(f"in process ({settings}), {args.tokens} tokens after {args.prompt}:", flush=True)
        for run in range(args.runs + 1):  # the first is a warm-up
            begin = perf_counter()
            request_id = engine.add_request(prompt(), params)
            request = engine.requests[request_id]
            cpu = time.thread_time()
            while not engine.is_finished():
                engine.step()
            cpu = (time.thread_time() - cpu) / args.tokens * 1e6
            step_times, step_ends = (
                timeline.times(label, begin, perf_counter()) for label in ("step start", "step end")
            )
            if run:
                ttft, tpot = figures(request.arrival_time, request.token_times)
                print(f"  TTFT {ttft:.3f} ms, TPOT {tpot:.4f} ms; step starts {intervals_us(step_times)}")
                print(f"    CPU a token: the engine's thread {cpu:.0f} us")
                print(f"    step() calls {durations_us(step_times, step_ends)}")

        server = start_server(engine, args)
        protocol = server.uvicorn.config.http_protocol_class.__name__
        loop = type(server.engine_loop.event_loop).__name__
        print(f"uvicorn: {protocol}, {loop}, GIL switch interval {sys.getswitchinterval()} s")
        try:
            for kind in ("new", "kept"):
                print(f"over HTTP, a client in a process of its own, on a {kind} connection:", flush=True)
                for run in range(args.runs + 1):
                    body = {"model": server.model.name, "prompt": prompt(), "max_tokens": args.tokens,
                            "temperature": 0.6, "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
                    cpu_before = thread_cpu_s(server)
                    out = subprocess.run(
                        [sys.executable, __file__, "x", "--client", f"{kind},{server.url}"],
                        input=json.dumps(body), capture_output=True, text=True, check=True,
                    ).stdout  # fmt: skip
                    cpu = [(b - a) / args.tokens * 1e6 for a, b in zip(cpu_before, thread_cpu_s(server))]
                    client = json.loads(out)
                    if not run:
                        continue
                    times = [t for t, n in client["chunks"] for _ in range(n)]
                    ttft, tpot = figures(client["sent"], times)
                    events = timeline.between(client["sent"], times[-1])
                    sent = client["sent"]
                    bytes_in = first_of(events, "bytes in", sent)
                    app_at = first_of(events, "app", sent)
                    handler = first_of(events, "handler", sent)
                    added = first_of(events, "added", sent)
                    step1 = first_of(events, "step start", sent)
                    step1_end = first_of(events, "step end", sent)
                    accepted = first_of(events, "post", sent, "accepted")
                    delivered1 = first_of(events, "deliver", accepted or sent)
                    headers = first_of(events, "sent start", sent)
                    posted = first_of(events, "post", sent, "tokens")
                    delivered = first_of(events, "deliver", posted or sent)
                    first_chunk = first_of(events, "sent body", (headers or sent) + 1e-9)
                    server_tokens = [t for label, t, d in events if label == "post" and "tokens" in d]
                    steps = [t for label, t, _ in events if label == "step start"]
                    print(
                        f"  TTFT {ttft:.3f} ms, TPOT {tpot:.4f} ms, {len(times)} tokens in {len(client['chunks'])} chunks"
                    )
                    print(
                        "    ms from the client's send: bytes in " + ms(sent, bytes_in) + ", app " + ms(sent, app_at)
                        + ", handler " + ms(sent, handler)
                        + ", added " + ms(sent, added) + ", step 1 " + ms(sent, step1) + "-" + ms(sent, step1_end)
                        + ", ACCEPTED posted " + ms(sent, accepted) + ", delivered " + ms(sent, delivered1)
                        + ", headers sent " + ms(sent, headers) + ", at the client " + ms(sent, client["headers"])
                    )  # fmt: skip
                    print(
                        "    first token posted " + ms(sent, posted) + ", delivered " + ms(sent, delivered)
                        + ", its chunk sent " + ms(sent, first_chunk) + ", at the client " + ms(sent, times[0])
                        + "; in-process TTFT (added to posted) " + ms(added, posted)
                    )  # fmt: skip
                    print(f"    engine step starts {intervals_us(steps)}")
                    ends = [t for label, t, _ in events if label == "step end"]
                    print(f"    step() calls {durations_us(steps[: len(ends)], ends)}")
                    print(f"    token posts {intervals_us(server_tokens)}")
                    print(f"    at the client {intervals_us([t for t, _ in client['chunks']])}")
                    print(
                        f"    CPU a token: the engine's thread {cpu[0]:.0f} us, the event loop's {cpu[1]:.0f} us",
                        flush=True,
                    )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
