"""On a Hopper GPU: decode graphs join cuBLAS's GEMM kernels to their predecessors by programmatic
(PDL) edges, which is only exact if those kernels wait (griddepcontrol.wait) before reading their
inputs. Each case here gives a GEMM a predecessor that lets it launch at once and writes the GEMM's
input only ~20 µs later, so a GEMM that did not wait would read the stale input; a control shows
the check catches a kernel that does not wait.

Run: python -m pytest -m gpu tests/test_pdl_graphs.py"""
import logging

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                       reason="needs a CUDA GPU of compute capability 9.0 or more (PDL)"),
]

triton = pytest.importorskip("triton")
tl = triton.language
LATE_NS = 20_000


@triton.jit
def _late_copy_kernel(src_ptr, dst_ptr, n, delay_ns, BLOCK: tl.constexpr):
    """Lets its successor launch at once, then waits delay_ns before it copies src to dst."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    start = tl.extra.cuda.globaltimer()
    while tl.extra.cuda.globaltimer() - start < delay_ns:
        pass
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=offsets < n), mask=offsets < n)


@triton.jit
def _plain_copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """A kernel that does not wait on griddepcontrol: unsafe behind a programmatic edge."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=offsets < n) * 2, mask=offsets < n)


def late_copy(src, dst):
    n = src.numel()
    _late_copy_kernel[(triton.cdiv(n, 1024),)](src, dst, n, LATE_NS, BLOCK=1024, launch_pdl=True)


def captured(fn, link_prefixes=None):
    """fn captured in a CUDA graph, with edges into kernels named link_prefixes made programmatic;
    (graph, output, names of the kernels linked)."""
    from inferlab.core import pdl
    fn()  # compile and pick algorithms outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        out = fn()
    linked = pdl.link_library_kernels(graph, link_prefixes) if link_prefixes else []
    graph.instantiate()
    return graph, out, linked


# Qwen3-0.6B's qkv and gate_up above 64 tokens, Qwen3-8B's four projections at decode batch sizes
CASES = [(m, n, k) for m in (72, 128, 256) for n, k in ((4096, 1024), (6144, 1024))] + \
        [(m, n, k) for m in (8, 64, 256) for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))]


@pytest.mark.parametrize("m,n,k", CASES, ids=[f"{m}x{n}x{k}" for m, n, k in CASES])
def test_cublas_kernels_behind_a_programmatic_edge_wait_for_their_input(m, n, k):
    from inferlab.core import pdl
    torch.manual_seed(0)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    src = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros_like(src)

    def step():
        late_copy(src, x)
        return F.linear(x, weight)
    graphs = {"linked": captured(step, pdl.LIBRARY_KERNEL_PREFIXES), "plain": captured(step)}
    linked = graphs["linked"][2]
    if not linked:
        pytest.skip(f"cuBLAS ran no kernel named {pdl.LIBRARY_KERNEL_PREFIXES} for this shape")
    errors = {mode: [] for mode in graphs}
    for _ in range(5):
        src.normal_()
        expected = F.linear(src, weight).float()
        for mode, (graph, out, _) in graphs.items():
            x.fill_(1000.0)  # what a GEMM that read x before the late copy would see: far-off outputs
            graph.replay()
            torch.cuda.synchronize()
            errors[mode].append((out.float() - expected).abs().max().item())
    print(f"{m}x{n}x{k}: linked {linked}; max abs error linked {max(errors['linked']):.3g}, "
          f"plain {max(errors['plain']):.3g}")
    assert max(errors["plain"]) < 0.1, errors  # the check itself: the plain graph is right
    assert max(errors["linked"]) < 0.1, (linked, errors)


def test_the_check_catches_a_kernel_that_does_not_wait():
    src = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    x, y = torch.zeros_like(src), torch.zeros_like(src)

    def step():
        late_copy(src, x)
        _plain_copy_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        return y
    graph, out, linked = captured(step, ("_plain_copy_kernel",))
    assert linked == ["_plain_copy_kernel"]
    x.fill_(1000.0)
    graph.replay()
    torch.cuda.synchronize()
    assert (out.float() - src.float() * 2).abs().max().item() > 100  # it read x before the late copy wrote it


def test_decode_graphs_link_cublas_kernels_and_generate_the_same(tmp_path, monkeypatch, caplog):
    """Decode batches above 64 sequences run qkv and gate_up through cuBLAS inside the graphs."""
    from inferlab import LLM, SamplingParams
    from inferlab.tiny_model import make_checkpoint
    path = make_checkpoint(str(tmp_path / "model"), hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=128, tie_word_embeddings=True)
    prompts = [[(7 * i + j) % 300 + 1 for j in range(8 + i % 13)] for i in range(96)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    caplog.set_level(logging.INFO, logger="inferlab")
    outputs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("INFERLAB_PDL_LIBRARY", setting)
        llm = LLM(path, attention="triton", device="cuda", dtype="bfloat16", max_model_len=256,
                  max_num_seqs=96, max_num_batched_tokens=4096)
        try:
            outputs[setting] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            del llm
            torch.cuda.empty_cache()
    linked = [r.getMessage() for r in caplog.records if "made programmatic" in r.getMessage()]
    assert len(linked) == 1, linked  # setting 1 only: the log names a count above 0
    assert outputs["1"] == outputs["0"]
