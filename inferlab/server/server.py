"""Serving an engine: the engine loop, the FastAPI app and uvicorn, started together and stopped
in order.

On SIGINT or SIGTERM (or stop()): the listening socket closes, new requests (on connections
already open too) get 503, in-flight streams run until shortly before serve.shutdown_timeout_s
and are then aborted (each still gets a final event and [DONE]); once no stream is left, uvicorn
closes the connections, giving what it still sends SEND_GRACE_S, then cancels what is left (a
client still sending its body, say), the engine loop stops, and the caller closes the engine (its
tensor-parallel workers). `inferlab job=serve` then exits 0. A second signal stops at once.
"""

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time

import anyio.lowlevel
import uvicorn
from omegaconf import OmegaConf

import inferlab
from inferlab.cluster import Cluster
from inferlab.conf import ServeConfig, cluster_arguments, engine_arguments
from inferlab.experiment.records import num_kvcache_blocks, resolved_plugins
from inferlab.server.app import build_app
from inferlab.server.connections import ConnectionLimits, limited_protocol
from inferlab.server.engine_loop import ClusterLoop, EngineLoop
from inferlab.server.metrics import ServerMetrics
from inferlab.server.protocol import ServedModel, longest_token_chars

log = logging.getLogger("inferlab")

API_KEY_ENV = "INFERLAB_API_KEY"  # the bearer token, when serve.api_key is not set
# Of serve.shutdown_timeout_s, what the last events of aborted streams get to reach their clients
# (half the timeout when that is shorter); past it uvicorn cancels what is left.
SEND_GRACE_S = 1.0
# Per token of the engine's context, the request body a prompt may need (JSON-escaped text or token ids)...
BODY_BYTES_PER_TOKEN = 64
BODY_BYTES_OTHER = 64 * 1024  # ...plus the other fields
MAX_HEADER_BYTES = 64 * 1024  # h11's limit on a request's headers (httptools has its own)
POSITIVE_SETTINGS = ("shutdown_timeout_s", "header_timeout_s", "body_timeout_s", "keep_alive_timeout_s")


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, but a signal starts inferlab's drain and is not raised again once the
    server has stopped (uvicorn re-raises it, which would kill the process instead of exiting 0)."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        """The first signal starts the drain, which ends the server once the streams are done; a
        second one stops it at once."""
        if self.on_exit():
            super().handle_exit(sig, frame)
            self.should_exit = self.force_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (port 0: any free one), made as socket.create_server makes
    one but with TCP's protocol number instead of 0: asyncio turns Nagle's algorithm off only on
    the connections of such a socket, and with it on a stream's first chunk after the headers
    waited for the client's delayed ACK."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            if os.name not in ("nt", "cygwin"):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPV6_V6ONLY"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(2048)
        except BaseException:
            sock.close()
            raise
        return sock
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port} (serve.host, serve.port): {e}") from None


class InferenceServer:
    """An OpenAI-compatible server over an engine it does not own (close the engine after).

        with LLM(path) as engine:
            InferenceServer(engine, ServeConfig(port=8000)).serve()   # blocks until SIGINT/SIGTERM

    start() runs it on a background thread instead (tests, notebooks); stop() ends it."""

    def __init__(self, engine, config: ServeConfig | None = None):
        config = config or ServeConfig()
        interval = config.gil_switch_interval_s
        if interval is not None and not (type(interval) in (int, float) and interval > 0):
            raise ValueError(
                f"serve.gil_switch_interval_s must be a positive number of seconds or null, got {interval!r}"
            )
        for name in POSITIVE_SETTINGS:
            value = getattr(config, name)
            if type(value) not in (int, float) or not value > 0:
                raise ValueError(f"serve.{name} must be a positive number of seconds, got {value!r}")
        for name in ("max_body_bytes", "max_connections"):
            value = getattr(config, name)
            if (value is not None or name == "max_connections") and (type(value) is not int or value < 1):
                raise ValueError(
                    f"serve.{name} must be a positive integer{' or null' if name != 'max_connections' else ''}, got {value!r}"
                )
        self.config = config
        self.api_key = config.api_key or os.environ.get(API_KEY_ENV) or None
        name = config.model_name or os.path.basename(os.path.normpath(engine.model_path))
        self.model = ServedModel(
            name,
            engine.config.max_model_len,
            engine.hf_config.vocab_size,
            engine.tokenizer,
            num_kvcache_blocks(engine) * engine.config.kvcache_block_size,
            resolved_plugins(engine),
            config.max_n,
            longest_token_chars(engine.tokenizer),
        )
        self.engine_loop = ClusterLoop(engine) if isinstance(engine, Cluster) else EngineLoop(engine)
        cache_config = {  # a cluster's: each replica's
            "block_size": str(engine.config.kvcache_block_size),
            "num_gpu_blocks": str(num_kvcache_blocks(engine)),
            "cache_dtype": str(engine.config.kv_cache_dtype),
        }
        self.metrics = ServerMetrics(lambda: self.engine_loop.snapshot, name, self.model.max_model_len, cache_config)
        self.engine_loop.metrics = self.metrics
        self.draining = False
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.max_body_bytes = (
            config.max_body_bytes or BODY_BYTES_PER_TOKEN * engine.config.max_model_len + BODY_BYTES_OTHER
        )
        self.app = build_app(
            self.engine_loop,
            self.model,
            self.metrics,
            api_key=self.api_key,
            max_queued_requests=config.max_queued_requests,
            max_body_bytes=self.max_body_bytes,
            draining=lambda: self.draining,
            lifespan=self.lifespan,
        )
        self.socket = listening_socket(config.host, config.port)
        self.send_grace_s = min(SEND_GRACE_S, config.shutdown_timeout_s / 2)
        limits = ConnectionLimits(config.max_connections, config.header_timeout_s, config.body_timeout_s)
        uvicorn_config = uvicorn.Config(
            self.app,
            http=limited_protocol(limits),
            log_config=None,  # the application's logging (Hydra's, under `inferlab`) applies
            log_level=config.log_level,
            access_log=False,  # /metrics counts requests; a line per request costs the loop time
            timeout_keep_alive=config.keep_alive_timeout_s,
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
            timeout_graceful_shutdown=self.send_grace_s,
        )
        self.uvicorn = _Uvicorn(uvicorn_config, on_exit=self.begin_shutdown)
        self.thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.socket.getsockname()[1]

    @property
    def url(self) -> str:
        host = self.socket.getsockname()[0]
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        # anyio loads its asyncio backend on first use, which would otherwise delay a fresh server's
        # first streamed response
        await anyio.lowlevel.checkpoint()
        self.event_loop = asyncio.get_running_loop()
        self.engine_loop.start(self.event_loop)
        try:
            yield
        finally:
            self.engine_loop.stop()

    def begin_shutdown(self) -> bool:
        """Stops taking new work (503 for new requests, the listening socket closed); streams in
        flight may run until shortly before serve.shutdown_timeout_s, then are aborted with a
        final event, and uvicorn ends once none is left. Called again (a second signal): aborts
        them now and returns True, for uvicorn to stop at once."""
        if self.draining:
            self.engine_loop.drain(0.0)
            return True
        self.draining = True
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        self.engine_loop.drain(self.config.shutdown_timeout_s - self.send_grace_s)
        if self.event_loop is None:  # not serving yet
            self.uvicorn.should_exit = True
        else:
            self.event_loop.call_soon_threadsafe(lambda: self.event_loop.create_task(self._drain(deadline)))
        return False

    async def _drain(self, deadline: float) -> None:
        """On the event loop: stops accepting connections, then ends uvicorn once no stream is in
        flight (their last events sent) or the deadline less the send grace has come."""
        for server in self.uvicorn.servers:
            server.close()
        while self.engine_loop.num_in_flight() and time.monotonic() < deadline - self.send_grace_s:
            await asyncio.sleep(0.02)
        self.uvicorn.should_exit = True

    def serve(self) -> None:
        """Serves until SIGINT or SIGTERM (on the main thread) or stop(), then returns. While it
        serves, the process's GIL switch interval is serve.gil_switch_interval_s."""
        previous = sys.getswitchinterval()
        if self.config.gil_switch_interval_s is not None:
            # The engine's thread and the event loop share the GIL. Python makes a thread that
            # wants it wait a whole interval before the holder must let go, and a busy event loop
            # rarely lets go sooner: at 5 ms, a step's launch could wait longer than the step.
            sys.setswitchinterval(self.config.gil_switch_interval_s)
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            sys.setswitchinterval(previous)

    def start(self, timeout_s: float = 60.0) -> "InferenceServer":
        """Serves on a background thread; returns once requests are accepted."""
        self.thread = threading.Thread(target=self.serve, name="inferlab-server", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.uvicorn.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """Shuts down as a signal would and waits for the server thread to end."""
        self.begin_shutdown()
        if self.thread is not None:
            self.thread.join(timeout_s)

    def __enter__(self) -> "InferenceServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_serve(cfg) -> None:
    """`inferlab job=serve`: builds the engine (or the cluster, with cluster.replicas > 1 or
    cluster.backend=ray) cfg describes and serves it until SIGINT/SIGTERM."""
    config = OmegaConf.to_object(cfg.serve)
    model_path, settings = engine_arguments(cfg)
    cluster = cluster_arguments(cfg)
    engine = inferlab.Cluster(model_path, **cluster, **settings) if cluster else inferlab.LLM(model_path, **settings)
    with engine:
        server = InferenceServer(engine, config)
        auth = "a bearer token required" if server.api_key else "no API key"
        print(
            f"inferlab: serving {server.model.name!r} at {server.url} ({auth}); Ctrl+C or SIGTERM stops it", flush=True
        )
        server.serve()
    print("inferlab: server stopped", flush=True)
