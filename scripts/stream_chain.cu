// A decode layer's four GEMMs (o, gate_up, down, qkv; each one's input the previous one's output),
// `layers` times over distinct weights, in one persistent kernel whose weight stream never waits
// for the activations: measurement only, for microbench_launch.py's stream_chain part.
//
// Item 80 found that a persistent Triton kernel with grid barriers gains little over a chain of
// kernels, and that asking L2 or registers for the next weight ahead loses. Both kept every load
// of a weight behind the barrier that publishes the activations it is multiplied with. Here one
// producer warp a block copies the block's weight slabs, in the order the block will use them,
// into a ring of shared-memory stages (cp.async.bulk, completion on an mbarrier) and never takes
// part in the grid barriers: it runs ahead of the compute by as many stages as the ring holds,
// across GEMM and layer boundaries. Eight consumer warps multiply (mma.sync m16n8k16, fp32
// accumulation), reduce their K parts in a fixed order and meet the other blocks at a grid barrier
// after each GEMM. Weights do not depend on activations, so the only thing the barrier delays is
// arithmetic on data already on chip.
//
// Measured (BENCHMARKS.md, item 81): no faster than the Triton chain of kernels. Without barriers
// and activation loads the weight stream runs near its floor; what costs is each GEMM's wait for
// every block's part of the previous one and its read of all of it from L2.
//
// An item is 8 output columns (8 weight rows) over the whole of K; a stage is those rows' next
// 1,024 K elements (16 KB). Block b takes items b, b + gridDim.x, ... of each GEMM. Rows of x past
// M are zeros (M up to 16 a 16-row mma tile; up to 64 rows).
//
// Build: nvcc -O3 -arch=sm_90a -shared -Xcompiler -fPIC -o libstream_chain.so stream_chain.cu
#include <cuda_bf16.h>
#include <cstdint>

namespace {

constexpr int kChunkK = 1024;                  // K elements of a weight row in one stage
constexpr int kRows = 8;                       // output columns an item computes (mma's n)
// A stage's weight rows lie kRowPitch bytes apart: 32 bytes of padding a row put the 8 rows' reads
// of one mma step (8 bytes a thread, at 32-byte steps within a row) on distinct banks.
constexpr int kRowPitch = kChunkK * 2 + 32;
constexpr int kStageBytes = kRows * kRowPitch;
constexpr int kStageDataBytes = kRows * kChunkK * 2;
constexpr int kConsumerWarps = 8;
constexpr int kWarpK = kChunkK / kConsumerWarps;  // a consumer warp's K part of a stage
constexpr int kSteps = kWarpK / 16;              // mma k steps a warp does a stage
constexpr int kThreads = (kConsumerWarps + 1) * 32;

struct Gemm {
  const __nv_bfloat16* x;  // [M, k] with row stride x_stride
  int x_stride;
  const __nv_bfloat16* w;  // [layers, n, k]
  __nv_bfloat16* out;      // [M, n]
  int n, k;
};

struct Chain {
  Gemm g[4];  // o, gate_up, down, qkv
};

// Diagnostic modes (results are wrong under them; they show where the time goes).
constexpr int kNoBarriers = 1;  // blocks do not meet between GEMMs
constexpr int kNoXLoads = 2;    // x taken as zeros, not read from L2
constexpr int kPrivateX = 4;    // each block reads x from its own copy (scratch), not all from one
constexpr int kScratchRows = 64, kScratchStride = 6144;  // a block's copy in scratch

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// A wait that never ends is a bug in this file: trap, so the caller gets an error, not a hang.
constexpr unsigned kPatience = 1u << 22;

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  for (unsigned tries = 0;; ++tries) {
    uint32_t done;
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
    if (done) return;
    if (tries == kPatience) __trap();
  }
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// The consumer warps' own barrier (named barrier 1): the producer warp never joins it.
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumerWarps * 32) : "memory");
}

// Every block's consumers have stored their part of a GEMM before any reads the next one's input
// (cooperative groups' pattern: the block meets, one thread releases and acquires for it).
__device__ __forceinline__ void grid_sync(unsigned* counter, unsigned target) {
  consumers_sync();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    unsigned seen;
    for (unsigned tries = 0;; ++tries) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
      if (seen >= target) break;
      if (tries == kPatience) __trap();
    }
  }
  consumers_sync();
}

// x's four bf16 at (row, col), col a multiple of 4, from L2: another block wrote them before the
// barrier. volatile, so the compiler keeps the load after the barrier's (__ldcg may be hoisted).
__device__ __forceinline__ uint2 load_quad(const __nv_bfloat16* x, int stride, int row, int col, int rows) {
  uint2 v = make_uint2(0u, 0u);
  if (row < rows)
    asm volatile("ld.global.cg.v2.u32 {%0, %1}, [%2];"
                 : "=r"(v.x), "=r"(v.y)
                 : "l"(x + static_cast<size_t>(row) * stride + col));
  return v;
}

__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int NSTAGES>
struct Shared {
  alignas(128) unsigned char stage[NSTAGES][kStageBytes];
  float4 partial[kConsumerWarps][4][32];  // a warp's accumulators, up to 4 row tiles
  uint64_t full[NSTAGES];
  uint64_t empty[NSTAGES];
};

template <int MT, int NSTAGES>
__global__ void __launch_bounds__(kThreads, 1)
    stream_chain_kernel(Chain chain, int rows, int layers, unsigned* counter, int mode,
                        const __nv_bfloat16* scratch) {
  extern __shared__ __align__(128) unsigned char raw[];
  auto& sh = *reinterpret_cast<Shared<NSTAGES>*>(raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < NSTAGES; ++s) {
      mbar_init(&sh.full[s], 1);                // the producer's expect_tx arrival
      mbar_init(&sh.empty[s], kConsumerWarps);  // one arrival a consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == kConsumerWarps) {  // the producer: the block's weight slabs, in order of use
    if (lane != 0) return;
    uint32_t it = 0;
    for (int layer = 0; layer < layers; ++layer) {
      for (int p = 0; p < 4; ++p) {
        const Gemm& g = chain.g[p];
        const __nv_bfloat16* w = g.w + static_cast<size_t>(layer) * g.n * g.k;
        for (int item = blockIdx.x; item < g.n / kRows; item += gridDim.x) {
          for (int c = 0; c < g.k / kChunkK; ++c, ++it) {
            const int s = it % NSTAGES;
            mbar_wait(&sh.empty[s], ((it / NSTAGES) & 1) ^ 1);
            // The consumers read the stage with ordinary loads (the generic proxy); the refill is
            // the async proxy's. Without this fence a refill could land before their reads: 4 and 5
            // runs in 150 at 32 rows and 4 stages gave a few wrong weight columns (item 81).
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            mbar_expect_bytes(&sh.full[s], kStageDataBytes);
            for (int r = 0; r < kRows; ++r)
              bulk_copy(sh.stage[s] + r * kRowPitch,
                        w + static_cast<size_t>(item * kRows + r) * g.k + c * kChunkK, kChunkK * 2,
                        &sh.full[s]);
          }
        }
      }
    }
    return;
  }

  // The consumers. mma fragment coordinates: group g = lane / 4 (a row of A, a column of B and
  // D), quad q = lane % 4. K is permuted inside each 16-wide mma step, the same way for x and the
  // weight (a dot product does not care): the mma's K elements 2q, 2q+1 are the step's 4q, 4q+1 and
  // its 2q+8, 2q+9 are 4q+2, 4q+3, so a thread's A pair registers and B registers are each one
  // 8-byte load.
  const int g = lane / 4, q = lane % 4;
  uint32_t it = 0;
  unsigned barriers = 0;
  // x at rows g and g + 8 of each 16-row tile over the warp's K part of a stage, for up to kHeld
  // stages: with one row tile all of a GEMM's x (K up to 3 stages) is loaded at once after the
  // barrier, so its L2 latency is paid once a GEMM, not once a stage.
  constexpr int kHeld = MT == 1 ? 3 : 1;
  uint2 a[kHeld][kSteps][MT][2];
  for (int layer = 0; layer < layers; ++layer) {
    for (int p = 0; p < 4; ++p) {
      const Gemm& gm = chain.g[p];
      const int chunks = gm.k / kChunkK;
      const bool private_x = mode & kPrivateX;
      const __nv_bfloat16* x =
          private_x ? scratch + static_cast<size_t>(blockIdx.x) * kScratchRows * kScratchStride : gm.x;
      const int x_stride = private_x ? kScratchStride : gm.x_stride;
      auto load_x = [&](int c, uint2 (&dst)[kSteps][MT][2]) {
        const int k0 = c * kChunkK + warp * kWarpK + q * 4;
#pragma unroll
        for (int ks = 0; ks < kSteps; ++ks)
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            if (mode & kNoXLoads) {
              dst[ks][mt][0] = dst[ks][mt][1] = make_uint2(0u, 0u);
            } else {
              dst[ks][mt][0] = load_quad(x, x_stride, mt * 16 + g, k0 + ks * 16, rows);
              dst[ks][mt][1] = load_quad(x, x_stride, mt * 16 + g + 8, k0 + ks * 16, rows);
            }
          }
      };
      // The next stage of the ring times src into acc, then the stage goes back to the producer.
      auto take_stage = [&](const uint2 (&src)[kSteps][MT][2], float (&acc)[MT][4]) {
        const int s = it % NSTAGES;
        mbar_wait(&sh.full[s], (it / NSTAGES) & 1);
        const unsigned char* wrow = sh.stage[s] + g * kRowPitch + (warp * kWarpK + q * 4) * 2;
#pragma unroll
        for (int ks = 0; ks < kSteps; ++ks) {
          const uint2 b = *reinterpret_cast<const uint2*>(wrow + ks * 32);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const uint32_t frag[4] = {src[ks][mt][0].x, src[ks][mt][1].x, src[ks][mt][0].y, src[ks][mt][1].y};
            mma(acc[mt], frag, b.x, b.y);
          }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&sh.empty[s]);
        ++it;
      };
      const bool held = chunks <= kHeld;  // then every item of this GEMM reuses the loaded x
      if (held) {
#pragma unroll
        for (int c = 0; c < kHeld; ++c)
          if (c < chunks) load_x(c, a[c]);
      }
      for (int item = blockIdx.x; item < gm.n / kRows; item += gridDim.x) {
        float acc[MT][4] = {};
        if (held) {
#pragma unroll
          for (int c = 0; c < kHeld; ++c)
            if (c < chunks) take_stage(a[c], acc);
        } else {
          for (int c = 0; c < chunks; ++c) {
            load_x(c, a[0]);
            take_stage(a[0], acc);
          }
        }
        // The warps' K parts summed in warp order, so the result does not depend on timing.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          sh.partial[warp][mt][lane] = make_float4(acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]);
        consumers_sync();
        if (threadIdx.x < MT * 32) {
          const int mt = threadIdx.x / 32, l = threadIdx.x % 32;
          float4 sum = sh.partial[0][mt][l];
          for (int w = 1; w < kConsumerWarps; ++w) {
            const float4 v = sh.partial[w][mt][l];
            sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
          }
          const int row = mt * 16 + l / 4, col = item * kRows + (l % 4) * 2;
          if (row < rows)
            *reinterpret_cast<__nv_bfloat162*>(gm.out + static_cast<size_t>(row) * gm.n + col) =
                __floats2bfloat162_rn(sum.x, sum.y);
          if (row + 8 < rows)
            *reinterpret_cast<__nv_bfloat162*>(gm.out + static_cast<size_t>(row + 8) * gm.n + col) =
                __floats2bfloat162_rn(sum.z, sum.w);
        }
        consumers_sync();
      }
      if (!(mode & kNoBarriers)) grid_sync(counter, ++barriers * gridDim.x);
    }
  }
}

// The dynamic shared memory a launch asks for: at least 116 KB, so that two blocks never share a
// multiprocessor while another has none.
template <int NSTAGES>
constexpr int shared_bytes() {
  return sizeof(Shared<NSTAGES>) > 116 * 1024 ? sizeof(Shared<NSTAGES>) : 116 * 1024;
}

template <int MT, int NSTAGES>
int launch(const Chain& chain, int rows, int layers, unsigned* counter, int blocks, int mode,
           const __nv_bfloat16* scratch, cudaStream_t stream) {
  const int bytes = shared_bytes<NSTAGES>();
  auto kernel = stream_chain_kernel<MT, NSTAGES>;
  static bool configured = false;  // once, before any graph capture (the first call is never captured)
  if (!configured) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured = true;
  }
  kernel<<<blocks, kThreads, bytes, stream>>>(chain, rows, layers, counter, mode, scratch);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" {

// The shared memory a launch at `stages` stages asks for a block (for the caller's report).
int stream_chain_shared_bytes(int stages) {
  switch (stages) {
    case 4: return shared_bytes<4>();
    case 8: return shared_bytes<8>();
    case 12: return shared_bytes<12>();
  }
  return -1;
}

// qkv [rows, n_qkv] is the chain's input and its output; o's input is its first k_o columns.
// Returns a cudaError_t (0 on success); -1 for rows or stages it was not built for. mode: 0, or
// the diagnostics kNoBarriers | kNoXLoads | kPrivateX (scratch: blocks x 64 x 6144 bf16, read
// under kPrivateX). Every block must be resident at once (blocks at most the multiprocessor
// count): the grid barrier waits for all.
int stream_chain_launch(const void* w_o, const void* w_gu, const void* w_d, const void* w_qkv, void* qkv,
                        void* h1, void* gu, void* h2, unsigned* counter, int rows, int layers, int n_qkv,
                        int k_o, int hidden, int n_gu, int k_d, int blocks, int stages, int mode,
                        const void* scratch, void* stream) {
  using bf = __nv_bfloat16;
  Chain chain;
  chain.g[0] = {static_cast<const bf*>(qkv), n_qkv, static_cast<const bf*>(w_o), static_cast<bf*>(h1), hidden, k_o};
  chain.g[1] = {static_cast<const bf*>(h1), hidden, static_cast<const bf*>(w_gu), static_cast<bf*>(gu), n_gu, hidden};
  chain.g[2] = {static_cast<const bf*>(gu), n_gu, static_cast<const bf*>(w_d), static_cast<bf*>(h2), hidden, k_d};
  chain.g[3] = {static_cast<const bf*>(h2), hidden, static_cast<const bf*>(w_qkv), static_cast<bf*>(qkv), n_qkv, hidden};
  for (const Gemm& g : chain.g)
    if (g.k % kChunkK != 0 || g.n % kRows != 0) return -1;
  auto s = static_cast<cudaStream_t>(stream);
  const int mt = (rows + 15) / 16;
#define STREAM_CHAIN_CASE(MT_, ST_) \
  if (mt == MT_ && stages == ST_) return launch<MT_, ST_>(chain, rows, layers, counter, blocks, mode, static_cast<const bf*>(scratch), s);
  STREAM_CHAIN_CASE(1, 4) STREAM_CHAIN_CASE(1, 8) STREAM_CHAIN_CASE(1, 12)
  STREAM_CHAIN_CASE(2, 4) STREAM_CHAIN_CASE(2, 8) STREAM_CHAIN_CASE(2, 12)
  STREAM_CHAIN_CASE(4, 4) STREAM_CHAIN_CASE(4, 8) STREAM_CHAIN_CASE(4, 12)
#undef STREAM_CHAIN_CASE
  return -1;
}

}  // extern "C"
