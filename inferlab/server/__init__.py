"""An OpenAI-compatible HTTP server over the engine: `inferlab job=serve` (docs/serving.md).

engine_loop   the thread that owns the engine: requests in through a queue, tokens out per step
text          incremental detokenization and stop strings across chunks
protocol      the request bodies, their checks, OpenAI's error JSON
app           the FastAPI endpoints and the server-sent events
metrics       the Prometheus metrics of one server
server        InferenceServer (uvicorn, signals, orderly shutdown) and the job's entry point
load          the latency bench's workload sent over HTTP (bench.url)
"""

from inferlab.server.server import InferenceServer, run_serve

__all__ = ["InferenceServer", "run_serve"]
