"""Tilings and launch settings of the Triton GEMMs and of the RMSNorm kernel, swept in one process
on the GPU: for each variant the projections are re-planned, the decode and sampling graphs
recaptured, and the decode graphs' device time measured (batches 1, 8, 32 and 64, replayed back to
back), with one sequence decoding 1,024 tokens after 256 and a 48-token greedy run compared with
the first variant's (random weights: any change of rounding moves its tokens).

    python3 scripts/gemm_sweep_gpu.py MODEL_DIR "base/o=32:2;down=32:2/normwarps=8" [REPLAYS]

Variants are separated by '/': 'base' (the Triton GEMMs as the code plans them, one token
included: no GEMVs), or ';'-separated settings: o=BN:S and down=BN:S (split-K partials in
BN-column blocks, K split S ways, up to 64 tokens), qkv=BN and gate_up=BN (the unsplit GEMM's
column block), warps=N and stages=N (the GEMM's launch at 16-row tiles), normwarps=N (the RMSNorm
kernel's launch); gemv (one token through the layers' GEMVs, DecoderLayer.forward_gemv, as the
model plans them) with fused=1 or 0 (the norms and SiLU*mul inside the GEMVs or in kernels of
their own; by default as the model decides), preload=0 (weights read after the PDL wait), slab=N
(a program's weight elements), rows=N (a program's weight rows, read a slab at a time along K;
0: a slab of whole rows; by default as the model plans them; orows=N, downrows=N, qkvrows=N,
gate_uprows=N for one projection), osplit=N and downsplit=N (their splits of K), gemvwarps=N; qkv=0
(decode steps through the model's q/k kernel before attention, not the attention kernel's own:
attention.decode_from_qkv=false); minsplit=N (attention.min_split_len: the fewest keys a decode
split part holds). Steps with prefill run eagerly here."""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from microbench_gpu import back_to_back_us  # noqa: E402

import inferlab.kernels.gemv as gemv  # noqa: E402
import inferlab.kernels.rms_norm as rms_norm  # noqa: E402
import inferlab.kernels.split_k_gemm as gemm  # noqa: E402
from inferlab import LLM, SamplingParams  # noqa: E402
from inferlab.plugins.models.decoder import GemvPlan  # noqa: E402

BASE_PLAN, BASE_WIDE_PLAN = gemm.plan, gemm.wide_plan
launch_settings: dict[str, int | None] = {}


class LaunchOverride:
    """Stands in for a Triton kernel: launches it with the swept num_warps / num_stages."""

    def __init__(self, kernel, kind: str):
        self.kernel, self.kind = kernel, kind

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            if self.kind in ("norm", "gemv"):
                if launch_settings.get(f"{self.kind}warps"):
                    kwargs["num_warps"] = launch_settings[f"{self.kind}warps"]
            elif kwargs.get("BLOCK_M") == 16:
                if launch_settings.get("stages"):
                    kwargs["num_stages"] = launch_settings["stages"]
                if launch_settings.get("warps"):
                    kwargs["num_warps"] = launch_settings["warps"]
            return launch(*args, **kwargs)

        return run


def plans_for(by_shape: dict):
    """plan and wide_plan with the swept tilings of the [n, k] weights in by_shape."""

    def plan(n, k, num_tokens=1):
        if num_tokens <= 64 and (n, k) in by_shape:
            block_n, split = map(int, by_shape[n, k].split(":"))
            return gemm.SplitKPlan(block_n, 128, split)
        return BASE_PLAN(n, k, num_tokens)

    def wide_plan(n, k):
        if (n, k) in by_shape:
            return gemm.SplitKPlan(int(by_shape[n, k]), 128, 1)
        return BASE_WIDE_PLAN(n, k)

    return plan, wide_plan


def rows_setting(settings: dict, name: str, planned: int | None) -> int | None:
    """A projection's GEMV rows a program: its own setting (NAMErows), else rows, else as planned;
    0 is a slab of whole rows (None). Pops the projection's own setting."""
    value = settings.pop(f"{name}rows", settings.get("rows"))
    return planned if value is None else int(value) or None


def main(model_dir: str, variants: list[str], replays: int) -> None:
    gemm._split_k_kernel = LaunchOverride(gemm._split_k_kernel, "gemm")
    rms_norm._rms_norm_kernel = LaunchOverride(rms_norm._rms_norm_kernel, "norm")
    gemv._gemv_kernel = LaunchOverride(gemv._gemv_kernel, "gemv")
    started = time.perf_counter()
    llm = LLM(model_dir, attention="triton", max_model_len=4096)
    print(f"start-up {time.perf_counter() - started:.1f} s", flush=True)
    runner = llm.runner
    runner.prefill_graphs = None  # only the decode graphs are recaptured for each variant
    layers = runner.model.layers
    model_gemv = layers[0].gemv  # the model's own plan: fused or not as its shapes decide
    min_split_len = runner.backend.min_split_len
    attn, mlp = layers[0].self_attn, layers[0].mlp
    projections = {"o": attn.o_proj, "down": mlp.down_proj, "qkv": attn.qkv_proj, "gate_up": mlp.gate_up_proj}
    shape_of = {name: tuple(module.weight.shape) for name, module in projections.items()}
    one = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1024)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=48)
    reference = None
    for variant in variants:
        settings = dict((*kv.split("="), "1")[:2] for kv in variant.split(";")) if variant != "base" else {}
        for key in ("warps", "stages", "normwarps", "gemvwarps"):
            launch_settings[key] = int(settings.pop(key, 0)) or None
        runner.backend.decode_from_qkv = settings.pop("qkv", "1") == "1"
        runner.backend.min_split_len = int(settings.pop("minsplit", min_split_len))
        gemv_plan = None
        if "gemv" in settings:
            settings.pop("gemv")
            slab = int(settings.pop("slab", gemv.SLAB))
            o_rows = rows_setting(settings, "o", gemv.unsplit_rows(*shape_of["o"], slab))
            down_rows = rows_setting(settings, "down", gemv.unsplit_rows(*shape_of["down"], slab))
            # qkv_proj's and gate_up_proj's GEMVs get no rows from the plan: set them by weight shape
            wide_rows = {shape_of[name]: rows_setting(settings, name, None) for name in ("qkv", "gate_up")}
            gemv_plan = GemvPlan(
                o_split=int(settings.pop("osplit", 0)) or gemv.splits_for(*shape_of["o"], slab, o_rows),
                down_split=int(settings.pop("downsplit", 0)) or gemv.splits_for(*shape_of["down"], slab, down_rows),
                o_rows=o_rows,
                down_rows=down_rows,
                fused=settings.pop("fused", "1" if model_gemv is None or model_gemv.fused else "0") == "1",
                preload=settings.pop("preload", "1") == "1",
                gemv=lambda x, w, wide_rows=wide_rows, slab=slab, rows=0, **kw: gemv.gemv(
                    x, w, slab=slab, rows=wide_rows.get(tuple(w.shape)) if rows == 0 else rows, **kw
                ),
            )
            settings.pop("rows", None)
        gemm.plan, gemm.wide_plan = plans_for({shape_of[name]: value for name, value in settings.items()})
        runner.decode_graphs = runner.sampling_graphs = None
        torch.cuda.empty_cache()
        for layer in layers:
            layer.gemv = gemv_plan
            for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
                projection.partials_tokens, projection._split_k = 0, None
                projection.return_partials(256)
        runner.decode_graphs = runner._capture_decode_graphs()
        runner.sampling_graphs = runner._capture_sampling_graphs()
        tiling = f"o {gemm.plan(*shape_of['o'], 1)} down {gemm.plan(*shape_of['down'], 1)}"
        if gemv_plan is not None:
            tiling = (
                f"gemv splits o {gemv_plan.o_split} down {gemv_plan.down_split}, "
                f"rows o {gemv_plan.o_rows} down {gemv_plan.down_rows}"
            )
        tokens = llm.generate([[(13 * i) % 10000 for i in range(256)]], greedy, use_tqdm=False)[0]["token_ids"]
        reference = reference or tokens
        same = sum(a == b for a, b in zip(tokens, reference))
        graphs = runner.decode_graphs.graphs
        times = ", ".join(f"b{b} {back_to_back_us(graphs[b].replay, replays):.1f}" for b in (1, 8, 32, 64))
        started = time.perf_counter()
        llm.generate([[(13 * i + 1) % 10000 for i in range(256)]], one, use_tqdm=False)
        rate = 1024 / (time.perf_counter() - started)
        print(
            f"{variant:36s} {tiling}; greedy same as first {same}/{len(reference)}; graph us: {times}; "
            f"one sequence {rate:.0f} tok/s",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split("/"), int(sys.argv[3]) if len(sys.argv) > 3 else 400)
