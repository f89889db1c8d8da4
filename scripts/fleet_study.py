"""The figure and table of docs/cluster.md's router study: TTFT p90 and output throughput against the
offered request rate, one line per router, from a sweep's results (inferlab-report reads the same
runs; its latency figure shows p50 and p99).

    python scripts/fleet_study.py sweeps/fleet_study docs/img/fleet_study_8b_sim.png
"""

import argparse

import matplotlib

from inferlab.experiment.report import figure, load_results

matplotlib.use("Agg")  # files only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", help="the sweep's directory")
    parser.add_argument("out", help="the figure to write (.png)")
    args = parser.parse_args()
    lines: dict[str, list[tuple]] = {}
    for _, result in load_results(args.sweep):
        choices = result["choices"]
        label = choices["router"]
        if "router.overlap_weight" in choices:
            label += f" (overlap_weight={choices['router.overlap_weight']:g})"
        lines.setdefault(label, []).append(
            (
                choices["bench.request_rate"],
                figure(result, "ttft_s.p90"),
                figure(result, "output_tokens_per_s"),
                figure(result, "prefix_cache_hit_rate"),
                figure(result, "load_imbalance"),
            )
        )
    print(f"{'router':<30}{'rate':>6}{'TTFT p90 s':>12}{'output tok/s':>14}{'prefix hit':>12}{'imbalance':>11}")
    for router, points in lines.items():
        points.sort()
        for rate, ttft, tokens, hit, imbalance in points:
            print(f"{router:<30}{rate:>6g}{ttft:>12.3f}{tokens:>14.0f}{hit:>12.3f}{imbalance:>11.3f}")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for router, points in lines.items():
        rates = [p[0] for p in points]
        left.plot(rates, [p[1] for p in points], marker="o", label=router)
        right.plot(rates, [p[2] for p in points], marker="o", label=router)
    left.set_yscale("log")
    left.set_ylabel("TTFT p90 (s)")
    right.set_ylabel("output tokens/s")
    for axis in (left, right):
        axis.set_xlabel("offered request rate (requests/s)")
        axis.grid(True, alpha=0.3)
    left.legend()
    fig.suptitle("8 simulated Qwen3-8B replicas (H200 profile): 256 tenants, 6,144-token system prompts")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
