// A GEMV for unquantized fp16/bf16 weights at a few rows: y[m, n] = sum_k x[m, k] w[n, k]
// (+ b[n]) for M <= kDenseGemvMaxRows, fp32 sums, y rounded to T (as cuBLAS rounds its
// fp32 accumulators). It serves layers left unquantized, above all an LM head: Llama-3-8B's
// is 128256 x 4096 fp16, 1.05 GB -- a fifth of what a batch-1 int4 decode step reads.
//
// Why not cuBLAS: a GEMV at M = 1 is one pass over w with almost no arithmetic per byte,
// so it can run at the read bandwidth if enough bytes are in flight, and this kernel keeps
// more in flight than cuBLAS's (which also needs a memset before it, so it cannot launch
// programmatically behind the norm).
//
// How.
//   * A warp takes one row of w at a time -- rows warp, warp + warps, ... of the grid, so
//     neighbouring warps read neighbouring rows -- in passes of 32 lanes x U 16-byte loads,
//     all U loads of a lane issued before any is used (U = 16: a 4096-wide fp16 row in one
//     pass, 8 KB a warp in flight). A block of 8 warps holds x in shared memory; at two
//     blocks an SM (~100-127 registers a thread at U = 16) that is up to 128 KB in flight
//     an SM, several times what DRAM's latency needs at full bandwidth, so the warps'
//     gaps between rows do not starve it; and a warp issues its next row's loads before
//     it reduces the current row's sums.
//   * The loads bypass L1 (ld.global.nc.L1::no_allocate: nothing is read twice) and ask L2
//     for 256-byte lines (.L2::256B: whole DRAM bursts for a sequential stream).
//   * x is kept as fp32 in two planes, elements 8v..8v+3 and 8v+4..8v+7 of each 16-byte
//     vector v: a lane's two 16-byte shared loads for its weight vector then sit side by
//     side with its neighbours' (conflict-free), and x is converted once, not per row.
//   * Two fp32 accumulators per row of x (even and odd elements) halve the FMA chain; the
//     lanes' sums meet by shuffles.
//   * float_out: the rounded outputs stored as float32 (an LM head's logits, which the
//     model wants in float32: no conversion kernel after this one).
//   * Programmatic launch: a block issues its first row's loads before
//     griddepcontrol.wait -- the weights do not depend on the previous kernel -- and reads
//     x only after it (launch.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "gemv.cuh"
#include "launch.cuh"
#include "woq_kernels.h"

namespace woq {

constexpr int kDenseGemvWarps = 8;
constexpr int kDenseGemvThreads = 32 * kDenseGemvWarps;

struct DenseGemvParams {
  const void* x;     // [M, K] row-major
  const uint4* w;    // [N, K] row-major, K % 8 == 0, 16-byte aligned
  const void* bias;  // [N] or null
  void* y;           // [M, N] of T, or float32 (float_out: the logits, still rounded to T)
  int N, K;
  bool float_out;
};

// 16 bytes of a stream read once: no L1 line (as mma.cuh's load_stream), 256-byte L2 requests.
__device__ __forceinline__ uint4 load_stream_256(const uint4* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#else
  return load_stream(p);  // (the L2 prefetch size is sm_80+)
#endif
}

// Shared memory of a block: x as fp32, M rows of K.
__host__ __device__ constexpr int dense_gemv_smem_bytes(int M, int K) { return M * K * 4; }

template <typename T, int M, int U>
__global__ void __launch_bounds__(kDenseGemvThreads) dense_gemv_kernel(const DenseGemvParams p) {
  extern __shared__ float4 dense_x[];  // plane 0 [M][K / 8], then plane 1 (see above)
  const int lane = threadIdx.x & 31;
  const int vecs = p.K / 8;                  // 16-byte vectors a row of w (or x)
  constexpr int kPassVecs = 32 * U;
  const int passes = (vecs + kPassVecs - 1) / kPassVecs;
  const int stride = gridDim.x * kDenseGemvWarps;
  int row = blockIdx.x * kDenseGemvWarps + (threadIdx.x >> 5);

  uint4 wv[U];
  auto load = [&](int r, int pass) {
    const uint4* src = p.w + static_cast<long long>(r) * vecs;
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int v = pass * kPassVecs + i * 32 + lane;
      wv[i] = v < vecs ? load_stream_256(src + v) : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  if (row < p.N) load(row, 0);  // (before the wait: the weights are constant)
  wait_for_prior_grid();

  float4* plane0 = dense_x;
  float4* plane1 = dense_x + M * vecs;
  const uint4* x8 = static_cast<const uint4*>(p.x);
  for (int e = threadIdx.x; e < M * vecs; e += kDenseGemvThreads) {
    const uint4 u = x8[e];
    const float2 a = pair_to_float2<T>(u.x), b = pair_to_float2<T>(u.y);
    const float2 c = pair_to_float2<T>(u.z), d = pair_to_float2<T>(u.w);
    plane0[e] = make_float4(a.x, a.y, b.x, b.y);
    plane1[e] = make_float4(c.x, c.y, d.x, d.y);
  }
  __syncthreads();

  for (; row < p.N; row += stride) {
    float acc[M][2] = {};
    for (int pass = 0; pass < passes; ++pass) {
      if (pass > 0) load(row, pass);
#pragma unroll
      for (int i = 0; i < U; ++i) {
        const int v = pass * kPassVecs + i * 32 + lane;
        if (v >= vecs) break;  // (the rest of the pass is past K too)
        const float2 w0 = pair_to_float2<T>(wv[i].x), w1 = pair_to_float2<T>(wv[i].y);
        const float2 w2 = pair_to_float2<T>(wv[i].z), w3 = pair_to_float2<T>(wv[i].w);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const float4 lo = plane0[m * vecs + v], hi = plane1[m * vecs + v];
          acc[m][0] = fmaf(w0.x, lo.x, acc[m][0]);
          acc[m][1] = fmaf(w0.y, lo.y, acc[m][1]);
          acc[m][0] = fmaf(w1.x, lo.z, acc[m][0]);
          acc[m][1] = fmaf(w1.y, lo.w, acc[m][1]);
          acc[m][0] = fmaf(w2.x, hi.x, acc[m][0]);
          acc[m][1] = fmaf(w2.y, hi.y, acc[m][1]);
          acc[m][0] = fmaf(w3.x, hi.z, acc[m][0]);
          acc[m][1] = fmaf(w3.y, hi.w, acc[m][1]);
        }
      }
    }
    const int next = row + stride;
    if (next < p.N) load(next, 0);  // (the next row's loads fly during the reduction)
    const float b = p.bias != nullptr ? to_float(static_cast<const T*>(p.bias)[row]) : 0.f;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float s = acc[m][0] + acc[m][1];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == m) {
        const long long o = static_cast<long long>(m) * p.N + row;
        const T v = from_float<T>(s + b);
        if (p.float_out)
          static_cast<float*>(p.y)[o] = to_float(v);
        else
          static_cast<T*>(p.y)[o] = v;
      }
    }
  }
}

}  // namespace woq
