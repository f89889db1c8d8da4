"""A load tester's latencies beside the server's own: guidellm's JSON report against the growth of
the server's Prometheus histograms over the run (docs/serving.md, "Checked with a load tester").

    curl -s http://127.0.0.1:8765/metrics > before.prom
    guidellm run --backend kind=openai_http,target=http://127.0.0.1:8765 ... --output kind=json,path=guidellm.json
    python scripts/guidellm_vs_metrics.py http://127.0.0.1:8765 guidellm.json before.prom

prints, for TTFT, ITL and e2e, the server's mean (histogram sum / count over the run), guidellm's
mean over its successful requests, and their difference.
"""

import argparse
import json
import re
import urllib.request

# (the server's histogram, guidellm's metric, guidellm's unit in seconds)
PAIRS = (
    ("time_to_first_token_seconds", "time_to_first_token_ms", 1e-3),
    ("inter_token_latency_seconds", "inter_token_latency_ms", 1e-3),
    ("e2e_request_latency_seconds", "request_latency", 1.0),
)


def sums_and_counts(text: str) -> dict[tuple[str, str], float]:
    """(histogram, "sum" or "count") -> value, from a Prometheus text exposition."""
    found = re.findall(r"^inferlab:([a-z0-9_]+?)_(sum|count)\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return {(name, kind): float(value) for name, kind, value in found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:8765")
    parser.add_argument("report", help="guidellm's JSON report (--output kind=json,path=...)")
    parser.add_argument("before", nargs="?", help="the server's /metrics saved before the run")
    args = parser.parse_args()
    with urllib.request.urlopen(f"{args.url.rstrip('/')}/metrics") as response:
        after = sums_and_counts(response.read().decode())
    before = sums_and_counts(open(args.before).read()) if args.before else {}
    metrics = json.load(open(args.report))["benchmarks"][0]["metrics"]
    for histogram, theirs, unit in PAIRS:
        count = after[histogram, "count"] - before.get((histogram, "count"), 0.0)
        server_s = (after[histogram, "sum"] - before.get((histogram, "sum"), 0.0)) / count
        successful = metrics[theirs]["successful"]
        client_s = successful["mean"] * unit
        print(
            f"{histogram:30s} server {server_s * 1e3:9.3f} ms (n={count:.0f})   guidellm {client_s * 1e3:9.3f} ms "
            f"(n={successful['count']})   {100 * (client_s / server_s - 1):+.1f}%"
        )


if __name__ == "__main__":
    main()
