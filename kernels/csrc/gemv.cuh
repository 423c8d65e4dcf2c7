// Weight-only GEMV for M <= 16 rows: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W int8/int4.
//
// Why tensor cores for a "GEMV": at M = 16, an int4 weight streamed at 3 TB/s feeds
// ~6e12 weights/s, i.e. ~1e14 multiply-adds/s -- more than the fp32 CUDA cores do
// (~3.3e13 FMA/s on an H100). mma.sync does them with fp32 accumulation at a fraction of
// its peak, so M = 16 costs about what M = 1 does, and the kernel stays bound by the
// weight bytes.
//
// Operand roles are swapped ("y^T = W x^T"): the weights are the 16-row A operand of
// mma.m16n8k16 (16 output channels per mma) and the activations the 8-column B operand
// (8 rows of x). M <= 8 wastes nothing on the weight side; 9 <= M <= 16 issues a second
// mma that reuses the same converted weight fragment.
//
// Work decomposition:
//   * a warp owns one n-tile (16 output channels) and streams its weights for the
//     block's K range: each lane loads 16 bytes per step, the warp 512 contiguous bytes
//     (kernels/layout.py arranges each lane's 16 bytes to be exactly its A fragments for
//     4 (int4) or 2 (int8) consecutive k16 blocks -- no shuffles, no shared memory);
//   * a block is 8 warps = 8 adjacent n-tiles sharing one K range; the activations and
//     the group scales/zeros of the current K chunk are staged in shared memory with
//     cp.async (double-buffered) and read by all 8 warps (ldmatrix for x);
//   * weights of the next chunk are prefetched into registers while the current chunk
//     is computed (8 outstanding 16-byte loads per lane);
//   * split-K over blockIdx.y gives small-N shapes enough blocks; partial sums go to an
//     fp32 workspace and the last block of each column reduces them in a fixed order
//     (deterministic), then re-arms its counter (CUDA-graph safe).
//
// Numerics: the A fragments hold the exact integers (code - zero point); each group's
// partial sums (fp32 mma accumulators) are multiplied by the group scale in fp32 and
// added to the fp32 total. The only roundings are the tensor cores' fp32 accumulation
// and the final conversion to fp16/bf16.
#pragma once

#include <cstdint>

#include "convert.cuh"
#include "mma.cuh"

namespace woq {

struct GemvParams {
  const void* x;        // [M, K] fp16/bf16, row-major
  const uint4* w;       // packed tiles, see kernels/layout.py
  const void* scales;   // [n_tiles, groups_pad, 16] (pair-interleaved rows), T
  const void* zeros;    // same layout as scales (exact integer zero points), or null
  const void* bias;     // [N] or null
  void* y;              // [M, N]
  float* workspace;     // [split_k, M, n_tiles * 16] fp32 (split_k > 1)
  int* counters;        // [gridDim.x] zero-initialised, re-armed by the kernel
  int M, N, K, K_pad;
  int n_tiles, group_size, groups_pad;
  int split_k, chunks_per_split;
};

constexpr int kGemvWarps = 8;
constexpr int kGemvSteps = 8;  // 16-byte weight loads per lane per K chunk

template <int BITS>
struct TileShape {
  static constexpr int kK = BITS == 4 ? 64 : 32;       // k covered by one 16-byte lane load
  static constexpr int kK16 = kK / 16;                 // k16 blocks per lane load
  static constexpr int kChunk = kGemvSteps * kK;       // k per staged chunk
  static constexpr int kXStride = kChunk + 8;          // +16 B per smem row: conflict-free ldmatrix
};

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Explicit conversions: torch builds define __CUDA_NO_HALF_CONVERSIONS__ and friends.
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ float2 pair_to_float2(uint32_t u);
template <>
__device__ __forceinline__ float2 pair_to_float2<__half>(uint32_t u) {
  return __half22float2(*reinterpret_cast<__half2*>(&u));
}
template <>
__device__ __forceinline__ float2 pair_to_float2<__nv_bfloat16>(uint32_t u) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u));
}

template <typename T>
__host__ __device__ constexpr float zero_point_bias(int bits) {
  return bits == 8 ? 128.f : 8.f;
}

template <typename T, int BITS>
__device__ __forceinline__ void convert_step(const uint32_t words[4], int j, const ZeroConsts<T, BITS>& z,
                                             uint32_t a[4]) {
  if constexpr (BITS == 4) {
    convert_k16(words[j], z, a);
  } else {
    convert_k16(words[2 * j], words[2 * j + 1], z, a);
  }
}

// Shared-memory bytes for one launch (x double buffer + scales/zeros double buffer).
template <typename T, int BITS, int MB>
__host__ __device__ constexpr int gemv_smem_bytes(int groups_per_chunk, bool zeros) {
  return (2 * MB * 8 * TileShape<BITS>::kXStride + 2 * kGemvWarps * groups_per_chunk * 16 * (zeros ? 2 : 1)) *
         static_cast<int>(sizeof(T));
}

template <typename T, int BITS, int MB, bool ZEROS>
__global__ void __launch_bounds__(kGemvWarps * 32, 2) gemv_kernel(const GemvParams p) {
  using Shape = TileShape<BITS>;
  constexpr int KT = Shape::kK, KC = Shape::kChunk, XS = Shape::kXStride, MP = MB * 8;
  constexpr int kThreads = kGemvWarps * 32;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, t4 = lane & 3;
  const int nt = blockIdx.x * kGemvWarps + warp;
  const bool active = nt < p.n_tiles;
  const int ktiles = p.K_pad / KT;
  const int nchunks = (p.K_pad + KC - 1) / KC;
  const int c_begin = blockIdx.y * p.chunks_per_split;
  const int c_end = min(c_begin + p.chunks_per_split, nchunks);
  const bool grouped = p.group_size < p.K_pad;
  const int k16_per_group = p.group_size / 16;
  const int gpc = grouped ? KC / p.group_size : 0;  // groups per chunk (KC is a multiple of G)

  extern __shared__ uint4 smem_raw[];
  T* xs = reinterpret_cast<T*>(smem_raw);             // [2][MP][XS]
  T* ss = xs + 2 * MP * XS;                           // [2][warps][gpc][16]
  T* zs = ss + 2 * kGemvWarps * gpc * 16;             // [2][warps][gpc][16] (ZEROS)
  __shared__ int is_last_block;

  const T* x = static_cast<const T*>(p.x);
  const T* scales = static_cast<const T*>(p.scales);
  const T* zeros = static_cast<const T*>(p.zeros);

  // Stage chunk c's activations (rows < M; columns past K zero-filled, since padded
  // weights are 0 but 0 * garbage could be NaN) and its group scales/zeros.
  auto stage = [&](int c, int buf) {
    const int k0 = c * KC;
    constexpr int kSegs = KC / 8;  // 16-byte segments per row
    T* xb = xs + buf * MP * XS;
    for (int i = tid; i < p.M * kSegs; i += kThreads) {
      const int m = i / kSegs, s = i % kSegs, k = k0 + s * 8;
      const bool valid = k < p.K;
      copy16_async(xb + m * XS + s * 8, x + static_cast<size_t>(m) * p.K + (valid ? k : 0), valid);
    }
    if (grouped) {
      const int g0 = k0 / p.group_size;
      const int segs = kGemvWarps * gpc * 2;  // 16 elements = 2 segments per (tile, group)
      for (int i = tid; i < segs * (ZEROS ? 2 : 1); i += kThreads) {
        const bool is_zero = ZEROS && i >= segs;
        const int j = is_zero ? i - segs : i;
        const int wt = j / (gpc * 2), r = j % (gpc * 2);
        const int tile = blockIdx.x * kGemvWarps + wt, g = g0 + r / 2;
        const bool valid = tile < p.n_tiles && g < p.groups_pad;
        const T* src = (is_zero ? zeros : scales) + (static_cast<size_t>(valid ? tile : 0) * p.groups_pad + (valid ? g : 0)) * 16 + (r % 2) * 8;
        T* dst = (is_zero ? zs : ss) + ((buf * kGemvWarps + wt) * gpc) * 16 + r * 8;
        copy16_async(dst, src, valid);
      }
    }
  };

  const uint4* wbase = p.w + (static_cast<size_t>(active ? nt : 0) * ktiles) * 32 + lane;
  uint4 wr[kGemvSteps];
  auto load_weights = [&](int c) {
#pragma unroll
    for (int s = 0; s < kGemvSteps; ++s) {
      const int kt = c * kGemvSteps + s;
      if (active && kt < ktiles) wr[s] = load_stream(wbase + static_cast<size_t>(kt) * 32);
    }
  };

  // Zero-point constants: per-channel weights need them once; grouped ones per group.
  const float bias_z = zero_point_bias<T>(BITS);
  ZeroConsts<T, BITS> zc(bias_z, bias_z);
  if (ZEROS && !grouped && active) {
    const uint32_t zp = reinterpret_cast<const uint32_t*>(zeros + static_cast<size_t>(nt) * p.groups_pad * 16)[gid];
    const float2 z = pair_to_float2<T>(zp);
    zc = ZeroConsts<T, BITS>(z.x, z.y);
  }

  float acc[MB][4], part[MB][4];
#pragma unroll
  for (int h = 0; h < MB; ++h)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[h][i] = part[h][i] = 0.f;
  float s_lo = 0.f, s_hi = 0.f;
  int k16_in_group = 0, group_in_chunk = 0;

  load_weights(c_begin);
  stage(c_begin, 0);
  cp_async_commit();

  for (int c = c_begin; c < c_end; ++c) {
    const int buf = (c - c_begin) & 1;
    if (c + 1 < c_end) stage(c + 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (active) {
      const T* xb = xs + buf * MP * XS;
      const int steps = min(kGemvSteps, ktiles - c * kGemvSteps);
      const bool prefetch = c + 1 < c_end;
      group_in_chunk = 0;
#pragma unroll
      for (int s = 0; s < kGemvSteps; ++s) {
        if (s < steps) {
          const uint4 wv = wr[s];
          const int kt_next = (c + 1) * kGemvSteps + s;
          if (prefetch && kt_next < ktiles) wr[s] = load_stream(wbase + static_cast<size_t>(kt_next) * 32);
          const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
          uint32_t bx[MB][4];
#pragma unroll
          for (int j = 0; j < Shape::kK16; ++j) {
            const int kk = s * KT + j * 16;
            if (j % 2 == 0) {  // one ldmatrix.x4 per 8 rows of x covers two k16 blocks
#pragma unroll
              for (int h = 0; h < MB; ++h) ldmatrix_x4(bx[h], xb + (h * 8 + (lane & 7)) * XS + kk + 8 * (lane >> 3));
            }
            if (grouped && k16_in_group == 0) {  // a new group starts: its scales and zeros
              const int off = ((buf * kGemvWarps + warp) * gpc + group_in_chunk) * 16;
              const float2 sc = pair_to_float2<T>(reinterpret_cast<const uint32_t*>(ss + off)[gid]);
              s_lo = sc.x;
              s_hi = sc.y;
              if (ZEROS) {
                const float2 z = pair_to_float2<T>(reinterpret_cast<const uint32_t*>(zs + off)[gid]);
                zc = ZeroConsts<T, BITS>(z.x, z.y);
              }
            }
            uint32_t a[4];
            convert_step<T, BITS>(words, j, zc, a);
#pragma unroll
            for (int h = 0; h < MB; ++h) {
              const uint32_t b[2] = {bx[h][(j % 2) * 2], bx[h][(j % 2) * 2 + 1]};
              mma_16816<T>(part[h], a, b);
            }
            if (grouped && ++k16_in_group == k16_per_group) {  // group done: scale into the total
#pragma unroll
              for (int h = 0; h < MB; ++h) {
                acc[h][0] += s_lo * part[h][0];
                acc[h][1] += s_lo * part[h][1];
                acc[h][2] += s_hi * part[h][2];
                acc[h][3] += s_hi * part[h][3];
#pragma unroll
                for (int i = 0; i < 4; ++i) part[h][i] = 0.f;
              }
              k16_in_group = 0;
              ++group_in_chunk;
            }
          }
        }
      }
    }
    __syncthreads();
  }

  if (!grouped && active) {  // per-channel: one scale per output row, applied once
    const float2 sc = pair_to_float2<T>(reinterpret_cast<const uint32_t*>(scales + static_cast<size_t>(nt) * p.groups_pad * 16)[gid]);
#pragma unroll
    for (int h = 0; h < MB; ++h) {
      acc[h][0] = sc.x * part[h][0];
      acc[h][1] = sc.x * part[h][1];
      acc[h][2] = sc.y * part[h][2];
      acc[h][3] = sc.y * part[h][3];
    }
  }

  // Accumulator (h, i) holds y[m][n] with m = 8h + 2*t4 + (i & 1), n = 16*nt + gid + 8*(i >> 1).
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  if (p.split_k == 1) {
    if (!active) return;
#pragma unroll
    for (int h = 0; h < MB; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = 8 * h + 2 * t4 + (i & 1), n = 16 * nt + gid + 8 * (i >> 1);
        if (m < p.M && n < p.N) {
          const float b = bias ? to_float(bias[n]) : 0.f;
          y[static_cast<size_t>(m) * p.N + n] = from_float<T>(acc[h][i] + b);
        }
      }
    return;
  }

  const int n_pad = p.n_tiles * 16;
  if (active) {
    float* ws = p.workspace + static_cast<size_t>(blockIdx.y) * p.M * n_pad;
#pragma unroll
    for (int h = 0; h < MB; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = 8 * h + 2 * t4 + (i & 1), n = 16 * nt + gid + 8 * (i >> 1);
        if (m < p.M) ws[static_cast<size_t>(m) * n_pad + n] = acc[h][i];
      }
  }
  __threadfence();  // partials visible device-wide before this block is counted
  __syncthreads();
  if (tid == 0) is_last_block = atomicAdd(&p.counters[blockIdx.x], 1) == p.split_k - 1;
  __syncthreads();
  if (!is_last_block) return;
  __threadfence();
  constexpr int kCols = kGemvWarps * 16;
  const int n0 = blockIdx.x * kCols;
  for (int i = tid; i < p.M * kCols; i += kThreads) {
    const int m = i / kCols, n = n0 + i % kCols;
    if (n >= p.N) continue;
    float sum = bias ? to_float(bias[n]) : 0.f;
    for (int k = 0; k < p.split_k; ++k) sum += __ldcg(p.workspace + (static_cast<size_t>(k) * p.M + m) * n_pad + n);
    y[static_cast<size_t>(m) * p.N + n] = from_float<T>(sum);
  }
  if (tid == 0) p.counters[blockIdx.x] = 0;  // re-arm for the next launch / graph replay
}

}  // namespace woq
