"""nano-vllm's bench.py workload on a random-weight checkpoint with Qwen3-0.6B's shapes (--shape:
Qwen3-8B's or Llama-3.1-8B's instead), for several (attention backend, CUDA graphs) combinations,
each in a fresh process (a CUDA fault in one cannot poison the next, and each sizes its KV cache
from the whole GPU). Prints output tokens/s per combination as a table and writes the results as
JSON.

    python scripts/bench_gpu.py flash_attn:graphs flash_attn:eager triton:graphs triton:eager \\
        torch:graphs torch:eager --out bench.json

Workload (nano-vllm bench.py, as `inferlab job=bench` draws it): random.seed(0); 256 sequences;
prompt lengths randint(100, 1024) of ids randint(0, 10000); max_tokens randint(100, 1024);
temperature 0.6; ignore_eos; max_model_len 4096; a warm-up generate first, then --warmup-runs
untimed passes over the whole workload (1 by default). Output tokens/s = sum(max_tokens) /
generate time, the median of --repeats.
"""

import argparse
import gc
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

SHAPE_FIELDS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
    "tie_word_embeddings"
).split()
QWEN3_0_6B = dict(zip(SHAPE_FIELDS, (151936, 1024, 3072, 28, 16, 8, 128, True)))
QWEN3_8B = dict(zip(SHAPE_FIELDS, (151936, 4096, 12288, 36, 32, 8, 128, False)))
# Llama-3.1-8B: no q/k norms (the rotary-only kernel), llama3 rope scaling, a 128k vocabulary
LLAMA_3_1_8B = {
    **dict(zip(SHAPE_FIELDS, (128256, 4096, 14336, 32, 32, 8, 128, False))),
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    "rms_norm_eps": 1e-5,
}
SHAPES = {"0.6b": QWEN3_0_6B, "8b": QWEN3_8B, "llama-8b": LLAMA_3_1_8B}
ALL_COMBOS = ["flash_attn:graphs", "flash_attn:eager", "triton:graphs", "triton:eager", "torch:graphs", "torch:eager"]
# Qwen3's config fields beyond its shapes (the other presets name their architecture and rope settings)
QWEN3_CONFIG = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    attention_dropout=0.0,
    use_cache=True,
    rope_scaling=None,
    use_sliding_window=False,
    sliding_window=None,
)


def build_checkpoint(path: str, num_layers: int, base: dict = QWEN3_0_6B) -> str:
    """config.json, random bf16 safetensors with the shapes of base (a SHAPES preset) and the tiny
    tokenizer (its vocabulary is smaller than the model's; the bench feeds token ids, all < 10000).
    Weights are drawn on the GPU when there is one (seconds, where the CPU takes a minute)."""
    import torch
    from safetensors.torch import save_file

    from inferlab.tiny_model import build_tokenizer

    shape = {**base, "num_hidden_layers": num_layers}
    marker = os.path.join(path, "bench-shape.json")
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == shape:
                return path
    os.makedirs(path, exist_ok=True)
    qwen3 = "model_type" not in shape
    extra = {**QWEN3_CONFIG, "max_window_layers": num_layers} if qwen3 else {"mlp_bias": False}
    common = dict(torch_dtype="bfloat16", hidden_act="silu", attention_bias=False, bos_token_id=0, eos_token_id=0)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**shape, **common, **extra}, f, indent=1)
    build_tokenizer(path)
    hidden, inter, head_dim = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q_size, kv_size = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)

    def weight(*size):  # small normal weights keep activations finite through all layers
        return torch.empty(size, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=generator).cpu()

    projections = {
        "self_attn.q_proj": (q_size, hidden),
        "self_attn.k_proj": (kv_size, hidden),
        "self_attn.v_proj": (kv_size, hidden),
        "self_attn.o_proj": (hidden, q_size),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    norms = {"input_layernorm": hidden, "post_attention_layernorm": hidden}
    if qwen3:
        norms.update({"self_attn.q_norm": head_dim, "self_attn.k_norm": head_dim})
    tensors = {
        "model.embed_tokens.weight": weight(shape["vocab_size"], hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    if not shape["tie_word_embeddings"]:
        tensors["lm_head.weight"] = weight(shape["vocab_size"], hidden)
    for i in range(num_layers):
        tensors.update({f"model.layers.{i}.{name}.weight": weight(*size) for name, size in projections.items()})
        tensors.update(
            {f"model.layers.{i}.{name}.weight": torch.ones(n, dtype=torch.bfloat16) for name, n in norms.items()}
        )
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(marker, "w") as f:
        json.dump(shape, f)
    return path


class GcPauses:
    """The garbage collector's collections and pause time, by generation, since the last reset."""

    def __init__(self):
        self.reset()
        gc.callbacks.append(self._callback)

    def reset(self):
        self.collections, self.seconds, self._start = [0, 0, 0], [0.0, 0.0, 0.0], None

    def summary(self) -> dict:
        return {"gc_collections": list(self.collections), "gc_pause_ms": [round(s * 1e3, 1) for s in self.seconds]}

    def _callback(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.collections[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start


class GpuSampler:
    """nvidia-smi's SM clock, power, temperature and throttle reasons every 50 ms, in a thread;
    summary(t0, t1) describes those taken between two perf_counter times. Empty without nvidia-smi."""

    FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"

    def __init__(self, device_index: int = 0):
        self.rows, self.process = [], None
        # nvidia-smi counts every GPU, torch only the visible ones (CUDA_VISIBLE_DEVICES: indices or UUIDs)
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        gpu = visible[device_index] if device_index < len(visible) else str(device_index)
        query = ["nvidia-smi", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits", "-lms", "50", "-i", gpu]
        try:
            self.process = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.rows.append((time.perf_counter(), float(parts[0]), float(parts[1]), float(parts[2]), parts[3]))
            except (ValueError, IndexError):  # a field this driver does not report
                continue

    def summary(self, t0, t1) -> dict:
        """Mean and lowest SM clock, mean power, hottest temperature and the throttle reasons seen."""
        rows = [r for r in self.rows if t0 <= r[0] <= t1]
        if not rows:
            return {}
        clocks = [r[1] for r in rows]
        return {
            "sm_clock_mhz_mean": sum(clocks) / len(clocks),
            "sm_clock_mhz_min": min(clocks),
            "power_w_mean": sum(r[2] for r in rows) / len(rows),
            "temperature_c_max": max(r[3] for r in rows),
            "throttle_reasons": sorted({r[4] for r in rows}),
        }

    def close(self):
        if self.process is not None:
            self.process.terminate()


def describe_conditions(c: dict) -> str:
    """GcPauses.summary and GpuSampler.summary as one line."""
    line = f"GC collections {c['gc_collections']}, pauses {c['gc_pause_ms']} ms"
    if "sm_clock_mhz_mean" in c:
        line += (
            f"; SM clock mean {c['sm_clock_mhz_mean']:.0f} MHz (lowest {c['sm_clock_mhz_min']:.0f}), "
            f"power mean {c['power_w_mean']:.0f} W, temperature {c['temperature_c_max']:.0f} C max, "
            f"throttle reasons {c['throttle_reasons']}"
        )
    return line


# the engine's counters a run moves (result key: EngineStats field)
STATS = {"steps": "num_steps", "prefill_tokens": "num_prefill_tokens", "decode_tokens": "num_decode_tokens"}
STATS.update({name: name for name in ("prefill_seconds", "decode_seconds", "wait_seconds")})


def engine_stats(llm) -> dict:
    return {key: getattr(llm.stats, name) for key, name in STATS.items()}


def run_one(combo: str, args) -> dict:
    """One combination in this process: build the engine, warm up, time the workload."""
    import logging

    import torch

    from inferlab import LLM
    from inferlab.conf import BenchConfig
    from inferlab.core.model_cost import model_cost
    from inferlab.experiment.bench import warm_up
    from inferlab.experiment.floor import device_rates, workload_floor
    from inferlab.experiment.workload import bench_workload

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    attention, graphs, overlap, compile_, options = parse_combo(combo)
    start = time.perf_counter()
    llm = LLM(
        args.model_dir,
        attention=attention,
        enforce_eager=graphs == "eager",
        max_model_len=4096,
        device=args.device,
        overlap_scheduling=overlap == "overlap",
        model_options={"torch_compile": compile_ == "compile", **options["model"]},
        attention_options=options["attention"],
        **options["engine"],
        **({"dtype": "bfloat16"} if args.device != "cpu" else {}),
    )
    init_seconds = time.perf_counter() - start
    bench = BenchConfig(num_seqs=args.num_seqs, max_len=args.max_input_len, max_output_len=args.max_output_len)
    prompts, params = bench_workload(bench, llm.hf_config.vocab_size, llm.config.max_model_len)
    output_tokens = sum(p.max_tokens for p in params)
    warm_up(llm)
    for _ in range(args.warmup_runs):
        # The first pass over the workload pays one-time costs the later ones do not: Triton and
        # torch.compile specializations of new prefill shapes, cuBLAS plan selection.
        llm.reset_prefix_cache()
        llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    first = engine_stats(llm)
    runs, compiles, conditions = [], [], []
    # what each run ran under, so a slow run's cause shows (a full garbage collection, a power-capped
    # clock): the engine's step and wait times, the garbage collector's pauses, the GPU's clocks and throttle reasons
    gc_pauses = GcPauses()
    sampler = GpuSampler(torch.cuda.current_device()) if torch.cuda.is_available() else None
    for _ in range(args.repeats):
        llm.reset_prefix_cache()  # every run prefills its prompts, as the first did
        variants, before = compiled_variants(), engine_stats(llm)
        gc_pauses.reset()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        end = time.perf_counter()
        runs.append(end - start)
        after, now = compiled_variants(), engine_stats(llm)
        compiles.append({name: n - variants.get(name, 0) for name, n in after.items() if n != variants.get(name, 0)})
        c = {
            f"{kind}_step_seconds": now[f"{kind}_seconds"] - before[f"{kind}_seconds"] for kind in ("prefill", "decode")
        }
        c["wait_seconds"] = now["wait_seconds"] - before["wait_seconds"]
        conditions.append({**c, **gc_pauses.summary(), **(sampler.summary(start, end) if sampler else {})})
        print(
            f"run {len(runs)}: {output_tokens / runs[-1]:.0f} output tok/s; steps: prefill "
            f"{c['prefill_step_seconds']:.3f} s, decode {c['decode_step_seconds']:.3f} s, waiting on the GPU "
            f"{c['wait_seconds']:.3f} s; {describe_conditions(conditions[-1])}"
            + (f"; compiled during the run: {compiles[-1]}" if compiles[-1] else ""),
            flush=True,
        )
    if sampler:
        sampler.close()
    seconds = statistics.median(runs)
    generated = sum(len(o["token_ids"]) for o in outputs)
    if generated != output_tokens:
        raise RuntimeError(f"generated {generated} tokens, the workload asked for {output_tokens}")
    runner, last = llm.runner, engine_stats(llm)
    floor = workload_floor(
        [len(p) for p in prompts],
        [p.max_tokens for p in params],
        model_cost(llm.hf_config, runner.dtype, runner.kv_cache_dtype, llm.config.tensor_parallel_size),
        device_rates(runner.device, runner.dtype),
    )
    return {
        "attention": runner.backend.name,
        "cuda_graphs": runner.decode_graphs is not None,
        "kv_cache_dtype": str(runner.kv_cache_dtype).replace("torch.", ""),
        "overlap": llm.overlap,
        "torch_compile": compile_ == "compile",
        "tensor_parallel_size": llm.config.tensor_parallel_size,
        "runs_seconds": runs,
        # kernel variants (Triton specializations, torch.compile graphs) first built inside a timed run
        "compiled_during_runs": compiles,
        "run_conditions": conditions,
        "output_tokens": output_tokens,
        "prompt_tokens": sum(len(p) for p in prompts),
        "seconds": seconds,
        "output_tok_per_s": output_tokens / seconds,
        "init_seconds": init_seconds,
        **floor,
        "percent_of_floor": 100 * floor["floor_seconds"] / seconds,
        "num_kv_blocks": runner.num_kv_blocks,
        "block_size": runner.block_size,
        # summed over all runs; wait_seconds (blocked on the GPU's tokens) near zero means the CPU bounds the run
        **{key: last[key] - first[key] for key in STATS},
        "wall_seconds_all_runs": sum(runs),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "flash_attn": _version("flash_attn"),
    }


def compiled_variants() -> dict[str, int]:
    """How many variants of each of inferlab's Triton kernels are compiled so far, and how many
    graphs torch.compile has built: a count that grows inside a timed run means the run paid for a
    compilation that its warm-up did not cover."""
    counts = {}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("inferlab.") or module is None:
            continue
        for name, value in vars(module).items():
            caches = getattr(value, "device_caches", None)  # a triton JITFunction
            if isinstance(caches, dict):
                counts[f"{module_name.rsplit('.', 1)[-1]}.{name}"] = sum(len(c[0]) for c in caches.values())
    try:
        from torch._dynamo.utils import counters

        counts["torch.compile graphs"] = int(counters["stats"]["unique_graphs"])
    except Exception:  # torch.compile not in use or its counters moved: the Triton counts still stand
        pass
    return counts


def _version(module: str) -> str | None:
    loaded = sys.modules.get(module)  # flash-attn may be importable without package metadata
    if hasattr(loaded, "__version__"):
        return loaded.__version__
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_in_subprocess(combo: str, args) -> dict:
    """Runs one combination in a child process, echoing its output; returns its result or error."""
    attention, graphs, overlap, compile_, options = parse_combo(combo)
    record = {
        "combo": combo,
        "attention": attention,
        "cuda_graphs": graphs == "graphs",
        "overlap": overlap == "overlap",
        "torch_compile": compile_ == "compile",
        "options": options,
    }
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_file = f.name
    command = [sys.executable, os.path.abspath(__file__), "--worker", combo, "--result-file", result_file]
    for name in ("model_dir", "device", "num_seqs", "max_input_len", "max_output_len", "repeats", "warmup_runs"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    tail = deque(maxlen=40)
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    timer = threading.Timer(args.timeout, child.kill)
    timer.start()
    try:
        for line in child.stdout:
            tail.append(line.rstrip())
            print(f"[{combo}] {line}", end="", flush=True)
        returncode = child.wait()
    finally:
        timer.cancel()
    record["wall_seconds"] = time.perf_counter() - start
    try:
        with open(result_file) as f:
            result = json.load(f)
    except (OSError, ValueError):
        result = None
    finally:
        os.unlink(result_file)
    if returncode == 0 and result and "error" not in result:
        record.update(result, ok=True)
        return record
    if result and "error" in result:
        error = result["error"]
    elif returncode < 0 and record["wall_seconds"] >= args.timeout:
        error = f"killed after the {args.timeout} s timeout"
    else:
        error = f"exited with code {returncode}"
    record.update(ok=False, error=error, log_tail=list(tail))
    print(f"[{combo}] FAILED: {error}", flush=True)
    return record


COMBO_FORM = (
    "ATTENTION:graphs|eager[:overlap|sync][:compile|nocompile][:m.OPTION=VALUE][:a.OPTION=VALUE][:e.SETTING=VALUE]"
)


def parse_combo(combo: str) -> tuple[str, str, str, str, dict]:
    """COMBO_FORM: overlap and compile by default; m.* and a.* set model and attention options, e.*
    engine settings (e.kv_cache_dtype=fp8); VALUE is read as JSON when it parses, e.g. 128 or false,
    else as a string."""
    parts = combo.split(":")
    attention, graphs = parts[0], parts[1] if len(parts) > 1 else "graphs"
    flags = [p for p in parts[2:] if "=" not in p]
    overlap = next((p for p in flags if p in ("overlap", "sync")), "overlap")
    compile_ = next((p for p in flags if p in ("compile", "nocompile")), "compile")
    unknown = [p for p in flags if p not in ("overlap", "sync", "compile", "nocompile")]
    options = {"model": {}, "attention": {}, "engine": {}}
    for part in (p for p in parts[2:] if "=" in p):
        key, value = part.split("=", 1)
        kind = {"m": "model", "a": "attention", "e": "engine"}.get(key.split(".", 1)[0])
        if kind is None or "." not in key:
            unknown.append(part)
            continue
        try:
            value = json.loads(value)
        except ValueError:
            pass
        options[kind][key.split(".", 1)[1]] = value
    if not attention or graphs not in ("graphs", "eager") or unknown:
        raise ValueError(f"combination {combo!r} must be {COMBO_FORM}")
    return attention, graphs, overlap, compile_, options


def print_table(records: list[dict]) -> None:
    header = (
        f"{'attention':<11} {'graphs':<6} {'overlap':<7} {'compile':<7} {'output tok/s':>12} {'% floor':>7} "
        f"{'time s':>7} {'init s':>6} {'KV blocks':>9}  status"
    )
    print(header)
    print("-" * len(header))
    for r in records:
        on = {True: "on", False: "off"}
        flags = f"{on[r['cuda_graphs']]:<6} {on[r['overlap']]:<7} {on[r['torch_compile']]:<7}"
        options = r.get("options") or {}
        extra = " ".join(f"{kind[0]}.{k}={v}" for kind in options for k, v in options[kind].items())
        if r["ok"]:
            figures = (
                f"{r['output_tok_per_s']:>12.0f} {r['percent_of_floor']:>7.1f} {r['seconds']:>7.2f} "
                f"{r['init_seconds']:>6.1f} {r['num_kv_blocks']:>9}  ok {extra}"
            )
        else:
            figures = f"{'-':>12} {'-':>7} {'-':>7} {'-':>6} {'-':>9}  FAILED {extra}: {r['error'][:200]}"
        print(f"{r['attention']:<11} {flags} {figures}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "combos",
        nargs="*",
        default=ALL_COMBOS,
        help=f"{COMBO_FORM}, e.g. flash_attn:graphs triton:eager:sync triton:graphs:a.decode_block_n=128 "
        "(default: the six attention x graphs pairs, overlap and compile on)",
    )
    parser.add_argument("--out", default="bench_gpu.json", help="where to write the JSON results")
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "inferlab-bench-qwen3-0.6b-random"))
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="0.6b",
        help="model shapes to bench: Qwen3-0.6B (0.6b), Qwen3-8B (8b), Llama-3.1-8B (llama-8b)",
    )
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers for a quick smoke run")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one combination may take")
    parser.add_argument("--commit", default=None, help="recorded in the JSON (default: the checkout's HEAD)")
    parser.add_argument("--build-only", action="store_true", help="only write the checkpoint to --model-dir")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per combination; the median is reported")
    parser.add_argument(
        "--warmup-runs",
        type=int,
        default=1,
        help="untimed runs of the whole workload first (nano-vllm's bench warms up with one short prompt)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one combination, in this process
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    base = SHAPES[args.shape]
    args.num_layers = args.num_layers or base["num_hidden_layers"]
    if args.shape != "0.6b" and args.model_dir == parser.get_default("model_dir"):
        model_name = args.shape if "model_type" in base else f"qwen3-{args.shape}"
        args.model_dir = args.model_dir.replace("qwen3-0.6b", model_name)

    if args.build_only:
        build_checkpoint(args.model_dir, args.num_layers, base)
        return
    if args.worker:
        try:
            result = run_one(args.worker, args)
        except BaseException as e:  # reported to the parent, which carries on with the next combination
            import traceback

            traceback.print_exc()
            result = {"error": f"{type(e).__name__}: {e}"}
        with open(args.result_file, "w") as f:
            json.dump(result, f)
        sys.exit(0 if "error" not in result else 1)

    for combo in args.combos:
        try:
            parse_combo(combo)
        except ValueError as e:
            parser.error(str(e))
    start = time.perf_counter()
    # in a child, so that this process never holds a CUDA context while the combinations run
    build = ["--build-only", "--model-dir", args.model_dir, "--num-layers", str(args.num_layers), "--shape", args.shape]
    subprocess.run([sys.executable, os.path.abspath(__file__), *build], check=True)
    print(f"checkpoint ready in {args.model_dir} ({time.perf_counter() - start:.1f} s)", flush=True)
    records = []
    for combo in args.combos:
        records.append(run_in_subprocess(combo, args))
        print_table(records)  # so far, in case a later combination takes the machine down
    from inferlab.experiment.records import git_state

    report = {
        "commit": args.commit or (git_state()["git_commit"] or "unknown")[:7],
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "model": {**base, "num_hidden_layers": args.num_layers, "dtype": "bfloat16", "weights": "random"},
        "workload": {
            "num_seqs": args.num_seqs,
            "prompt_len": [100, args.max_input_len],
            "output_len": [100, args.max_output_len],
            "temperature": 0.6,
            "ignore_eos": True,
            "max_model_len": 4096,
            "seed": 0,
        },
        "results": records,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\ncommit {report['commit']}: {report['command']}")
    print_table(records)
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
