"""Serving an engine: the engine loop, the FastAPI app and uvicorn, started together and stopped
in order.

On SIGINT or SIGTERM (or stop()): the listening socket closes, new requests get 503, in-flight
streams run for serve.shutdown_timeout_s more and are then aborted (each still gets a final event
and [DONE]), uvicorn waits for the responses to end, the engine loop stops, and the caller
closes the engine (its tensor-parallel workers). `inferlab job=serve` then exits 0.
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
from inferlab.conf import ServeConfig, engine_arguments
from inferlab.experiment.records import resolved_plugins
from inferlab.server.app import build_app
from inferlab.server.engine_loop import EngineLoop
from inferlab.server.metrics import ServerMetrics
from inferlab.server.protocol import ServedModel

log = logging.getLogger("inferlab")

API_KEY_ENV = "INFERLAB_API_KEY"  # the bearer token, when serve.api_key is not set
# uvicorn gives up on responses this long after the streams' own deadline (a client that stopped reading).
GRACE_AFTER_ABORT_S = 10.0


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, but a signal starts inferlab's drain and is not raised again once the
    server has stopped (uvicorn re-raises it, which would kill the process instead of exiting 0)."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self.on_exit()
        super().handle_exit(sig, frame)

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
        self.config = config
        self.api_key = config.api_key or os.environ.get(API_KEY_ENV) or None
        name = config.model_name or os.path.basename(os.path.normpath(engine.model_path))
        kv = engine.kv_manager
        self.model = ServedModel(
            name,
            engine.config.max_model_len,
            engine.hf_config.vocab_size,
            engine.tokenizer,
            kv.num_blocks * kv.block_size,
            resolved_plugins(engine),
            config.max_n,
        )
        self.engine_loop = EngineLoop(engine)
        cache_config = {
            "block_size": str(kv.block_size),
            "num_gpu_blocks": str(kv.num_blocks),
            "cache_dtype": str(engine.config.kv_cache_dtype),
        }
        self.metrics = ServerMetrics(lambda: self.engine_loop.snapshot, name, self.model.max_model_len, cache_config)
        self.engine_loop.metrics = self.metrics
        self.draining = False
        self.app = build_app(
            self.engine_loop,
            self.model,
            self.metrics,
            api_key=self.api_key,
            max_queued_requests=config.max_queued_requests,
            draining=lambda: self.draining,
            lifespan=self.lifespan,
        )
        self.socket = listening_socket(config.host, config.port)
        uvicorn_config = uvicorn.Config(
            self.app,
            log_config=None,  # the application's logging (Hydra's, under `inferlab`) applies
            log_level=config.log_level,
            access_log=False,  # /metrics counts requests; a line per request costs the loop time
            timeout_graceful_shutdown=config.shutdown_timeout_s + GRACE_AFTER_ABORT_S,
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
        self.engine_loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            self.engine_loop.stop()

    def begin_shutdown(self) -> None:
        """Stops taking new work; streams in flight get serve.shutdown_timeout_s to finish, then
        are aborted with a final event."""
        if not self.draining:
            self.draining = True
            self.engine_loop.drain(self.config.shutdown_timeout_s)

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
        self.uvicorn.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout_s)

    def __enter__(self) -> "InferenceServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_serve(cfg) -> None:
    """`inferlab job=serve`: builds the engine cfg describes and serves it until SIGINT/SIGTERM."""
    config = OmegaConf.to_object(cfg.serve)
    model_path, settings = engine_arguments(cfg)
    with inferlab.LLM(model_path, **settings) as engine:
        server = InferenceServer(engine, config)
        auth = "a bearer token required" if server.api_key else "no API key"
        print(
            f"inferlab: serving {server.model.name!r} at {server.url} ({auth}); Ctrl+C or SIGTERM stops it", flush=True
        )
        server.serve()
    print("inferlab: server stopped", flush=True)
