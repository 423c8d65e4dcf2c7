// What the GEMV and GEMM launchers share: the shared-memory opt-in with the occupancy
// query, and the launch itself -- "programmatic" (PDL) on sm_90+.
//
// A decode step is hundreds of short kernels; launched plainly, each waits for its
// predecessor to finish and flush, then spends a DRAM round trip filling its pipeline while
// the memory bus idles. With programmatic launch a kernel's blocks may start once every
// block of the previous kernel has executed griddepcontrol.launch_dependents. Our kernels
// then issue the copies of what does not depend on the previous kernel -- weights, scales,
// zero points, constant while serving -- and only then execute griddepcontrol.wait, which
// returns when the previous grid has completed and its writes are visible; activations,
// outputs and the split-K workspace and counters are touched only after it. Both
// instructions are no-ops in a plain launch (and compile out below sm_90), and every block
// executes the wait before it exits, so "complete" keeps meaning "its predecessors are
// complete" along a chain of such launches.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "woq_kernels.h"

namespace woq {

// In a kernel: let the next grid launch (it still waits for this one to complete).
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// In a kernel: wait until the previous grid has completed and its writes are visible.
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Scales are fp16 in the GPU layout whatever the activation dtype T: the logical format's
// fp16 scale itself, which a bf16 copy would round (8 significant bits of its 11). Zero
// points are small integers, exact in T.
using Scale = __half;

// The operands every woq kernel takes (its Params derive from this).
struct KernelOperands {
  const void* x;        // [M, K] fp16/bf16, row-major
  const uint4* w;       // packed tiles, see kernels/layout.py
  const void* scales;   // [n_tiles, groups_pad, 16] (pair-interleaved rows), Scale
  const void* zeros;    // same layout as scales, in T (exact integer zero points), or null
  const void* bias;     // [N] or null
  void* y;              // [M, N]
  float* workspace;     // fp32 partial sums (layout: the kernel's)
  int* counters;        // zero-initialised, re-armed by the kernel
  int M, N, K, K_pad;
  int n_tiles, groups_pad;
  bool swiglu;          // GEMV only: y = silu(gate) * up, [M, N / 2] (gemv.cuh, swiglu_column)
  unsigned long long* stamps;  // GEMV and GEMM: null, or [stamps_len] = [gridDim.x][2] (BlockStamps)
  int stamps_len;
};

// The GPU's global nanosecond clock, comparable between SMs (the kernel metrics' stamps).
__device__ __forceinline__ unsigned long long global_timer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

// A timed launch's %globaltimer stamps (kernels/observe.py, GemvStamps): each block writes
// when it may start computing -- after griddepcontrol.wait, once the previous kernel is done --
// and, at scope exit (every return is block-uniform), when all its threads are done. The
// call's time is the last end minus the first start: like a run of back-to-back calls, it
// leaves out the weight prefetch that overlaps the previous kernel, and it needs no event
// nodes, which would end that overlap. Plain stores to the block's own pair, no atomics. It
// reads the kernel's parameters at each use rather than holding a pointer: no register is
// kept for it across the kernel (one more spilled the register-stream GEMV).
struct BlockStamps {
  const KernelOperands& p;  // (the kernel's parameter space)
  __device__ __forceinline__ explicit BlockStamps(const KernelOperands& params) : p(params) {}
  __device__ __forceinline__ void stamp(int which) const {
    if (p.stamps != nullptr && threadIdx.x == 0 && 2 * static_cast<int>(blockIdx.x) + 1 < p.stamps_len)
      p.stamps[2 * blockIdx.x + which] = global_timer();
  }
  __device__ __forceinline__ void start() const { stamp(0); }
  __device__ __forceinline__ ~BlockStamps() {
    if (p.stamps != nullptr) {
      __syncthreads();
      stamp(1);
    }
  }
};

// Fill the shared operands from a GemvArgs or GemmArgs.
template <typename Args>
void set_operands(KernelOperands& p, const Args& a) {
  const PackedWeight& w = a.weight;
  p.x = a.x;
  p.w = static_cast<const uint4*>(w.qweight);
  p.scales = w.scales;
  p.zeros = w.zeros;
  p.bias = a.bias;
  p.y = a.y;
  p.workspace = a.workspace;
  p.counters = a.counters;
  p.M = a.M;
  p.N = w.N;
  p.K = w.K;
  p.K_pad = w.K_pad;
  p.n_tiles = (w.N + 15) / 16;
  p.groups_pad = w.groups_pad;
  p.swiglu = false;
  p.stamps = nullptr;
  p.stamps_len = 0;
}

// The kernel's static shared memory (its __shared__ variables). The CUDA runtime refuses a
// dynamic opt-in that, with these, exceeds the per-block maximum, so an opt-in of exactly
// the maximum would fail (e.g. the wide 2-k-warp GEMV asking for all of an A100's 163 KB).
template <typename Kernel>
int static_smem_bytes(Kernel kernel) {
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return static_cast<int>(attr.sharedSizeBytes);
}

// Resident blocks per SM of `kernel` at `threads` threads and `smem` bytes of dynamic
// shared memory, after opting in to up to `smem_max` (>= smem) bytes where that exceeds
// 48 KB; 0 on failure (e.g. a ring larger than this GPU's shared memory: an A100 has
// 164 KB, a T4 64 KB). A failure is also cleared from the runtime's last-error state:
// left there, launch_kernel's cudaGetLastError would report it for the next, valid launch.
// The opt-in is capped at the per-block maximum less the static bytes (the runtime's
// rule), against the budget, so that under set_shared_memory_limit a large GPU refuses
// what the emulated one would.
template <typename Kernel>
int resident_blocks(Kernel kernel, int threads, int smem, int smem_max = 0) {
  const int limit = shared_memory_budget().per_block - static_smem_bytes(kernel);  // what the runtime allows
  if (smem > limit) return 0;
  smem_max = std::min(std::max(smem_max, smem), limit);
  int resident = 0;
  if ((smem_max > 48 * 1024 &&
       cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max) != cudaSuccess) ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, threads, smem) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return resident;
}

// The deepest shared-memory ring of 2..max_stages stages of `stage_bytes` (plus
// `extra_bytes` after it) with which `blocks_per_sm` blocks fit in one SM of budget `b`;
// 0 if not even two stages fit. The rings are sized for an H100, where every
// configuration gets its full depth; smaller GPUs get shallower rings (fewer bytes in
// flight, but the kernel runs): e.g. the GEMV's int4 M = 1 stage of ~18 KB takes 3 deep
// in a T4's 64 KB, its M = 16 stage of ~26 KB 3 deep in an RTX 30/40's 99 KB.
inline int ring_stages(const SharedMemoryBudget& b, int stage_bytes, int extra_bytes, int max_stages,
                       int blocks_per_sm) {
  const int per_block = std::min(b.per_block, b.per_sm / blocks_per_sm - b.reserved_per_block);
  for (int s = max_stages; s >= 2; --s)
    if (s * stage_bytes + extra_bytes <= per_block) return s;
  return 0;
}

// A launch's ring depth and resident blocks per SM (0: it does not fit this GPU).
struct LaunchPlan {
  int stages, resident;
};

// A 32-bit value worked out from the shared-memory budget, on first use and again after
// the budget changes (woq_kernels.h). Tagged with the budget's generation in one atomic
// word: launches may come from several host threads, and the value is cheap to recompute
// if two of them race.
class BudgetCached {
 public:
  template <typename Compute>
  uint32_t get(Compute compute) {
    const unsigned long long tag = static_cast<unsigned long long>(shared_memory_generation()) + 1;
    const unsigned long long w = word_.load(std::memory_order_relaxed);
    if ((w >> 32) == tag) return static_cast<uint32_t>(w);
    const uint32_t v = compute();
    word_.store((tag << 32) | v, std::memory_order_relaxed);
    return v;
  }

 private:
  std::atomic<unsigned long long> word_{0};
};

// One cached LaunchPlan (stages and resident blocks, 16 bits each).
class PlanCache {
 public:
  template <typename Plan>
  LaunchPlan get(Plan plan) {
    const uint32_t w = cache_.get([&] {
      const LaunchPlan p = plan();
      return (static_cast<uint32_t>(p.stages) << 16) | static_cast<uint32_t>(p.resident);
    });
    return {static_cast<int>(w >> 16), static_cast<int>(w & 0xffff)};
  }

 private:
  BudgetCached cache_;
};

// Launch `kernel<<<blocks, threads, smem, stream>>>(params)`, programmatically dependent
// on the stream's previous kernel where enabled and the device supports it (sm_90+).
template <typename Params>
cudaError_t launch_kernel(void (*kernel)(Params), unsigned blocks, int threads, int smem, cudaStream_t stream,
                          const Params& params) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  if (programmatic_launch() && device_cc_major() >= 9) {
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  const cudaError_t e = cudaLaunchKernelEx(&config, kernel, params);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace woq
