"""An OpenAI-compatible HTTP server over the engine: `inferlab job=serve` (docs/serving.md).

engine_loop   the thread that owns the engine: requests in through a queue, tokens out per step
text          incremental detokenization and stop strings across chunks
protocol      the request bodies, their checks, OpenAI's error JSON
tokenization  vLLM's /tokenize and /detokenize
app           the FastAPI endpoints and the server-sent events
metrics       the Prometheus metrics of one server
server        InferenceServer (uvicorn, signals, orderly shutdown) and the job's entry point
load          the latency bench's workload sent over HTTP (bench.url)
"""

try:
    import fastapi  # noqa: F401
    import httpx  # noqa: F401
    import prometheus_client  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:  # an optional extra: say which
    raise ImportError(f"the server and bench.url need the serve extra: pip install 'inferlab[serve]' ({e})") from e

from inferlab.server.server import InferenceServer, run_serve  # noqa: E402

__all__ = ["InferenceServer", "run_serve"]
