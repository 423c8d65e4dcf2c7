// Weight-only GEMV (M <= 16) and mixed GEMM (M <= 64): y[M, N] = x[M, K] @ W[N, K]^T (+ bias),
// W int8/int4, x fp16/bf16. MB = ceil(M / 8) blocks of 8 rows share each converted weight
// fragment: the "gemv" path is MB = 1, 2; the "mixed_gemm" path MB = 4, 8.
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
//   * a warp owns one n-tile (16 output channels); each of its lanes owns 16 bytes of
//     every 512-byte weight segment, which kernels/layout.py arranged to be exactly that
//     lane's A fragments for 4 (int4) or 2 (int8) consecutive k16 blocks;
//   * a block is 8 warps = 8 adjacent n-tiles sharing one K range, cut into stages of
//     kSteps segments per warp. A stage's weights, activations and group scales/zeros are
//     fetched with cp.async into a kStages-deep shared-memory ring, so ~3 stages of
//     memory traffic stay in flight without holding registers (measured: a register
//     prefetch of one chunk left the kernel latency-bound at ~47% of the bandwidth);
//   * the group size is a template parameter: group boundaries fall at compile-time
//     positions of the unrolled k16 loop (no counters, no divisions in the hot loop);
//   * the grid is persistent and balanced "stream-K" style: the (column, stage) units
//     of the whole weight, column after column, are cut into gridDim.x equal contiguous
//     runs, one per block. Every SM gets the same number of bytes (no partial last wave)
//     and each block fills its pipeline once. A column cut between blocks leaves fp32
//     partial sums in a workspace; its last finishing contributor adds them in block
//     order (deterministic) and re-arms the column's counter (CUDA-graph safe).
//
// Numerics: the A fragments hold the exact integers (code - zero point); each group's
// partial sums (fp32 mma accumulators) are multiplied by the group scale in fp32 and
// added to the fp32 total. The only roundings are the tensor cores' fp32 accumulation
// and the final conversion to fp16/bf16.
#pragma once

#include <cstdint>
#include <type_traits>

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
  float* workspace;     // [gridDim.x, 2, M, 128] fp32 partial column sums
  int* counters;        // [columns] zero-initialised, re-armed by the kernel
  int M, N, K, K_pad;
  int n_tiles, groups_pad;
  int nstages;          // pipeline stages per column (ceil(K_pad / stage k))
  int unit_stages;      // stages per work unit: a group never straddles two blocks
};

constexpr int kGemvWarps = 8;
constexpr int kGemvMaxM = 64;   // MB = 8 blocks of 8 rows
constexpr int kGemvStages = 4;  // shared-memory ring depth
constexpr int kGemvSteps = 4;   // 512-byte weight segments per warp per stage

template <int BITS>
struct TileShape {
  static constexpr int kK = BITS == 4 ? 64 : 32;       // k covered by one 16-byte lane load
  static constexpr int kK16 = kK / 16;                 // k16 blocks per lane load
  static constexpr int kStageK = kGemvSteps * kK;      // k per pipeline stage
  static constexpr int kStageK16 = kStageK / 16;
  static constexpr int kXStride = kStageK + 8;         // +16 B per smem row: conflict-free ldmatrix
};

// Explicit conversions: torch builds define __CUDA_NO_HALF_CONVERSIONS__ and friends.
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

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

__host__ __device__ constexpr float zero_point_bias(int bits) { return bits == 8 ? 128.f : 8.f; }

template <typename T, int BITS>
__device__ __forceinline__ void convert_segment_k16(const uint4& w, int j, const ZeroConsts<T, BITS>& z,
                                                    uint32_t a[4]) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  if constexpr (BITS == 4) {
    convert_k16(words[j], z, a);
  } else {
    convert_k16(words[2 * j], words[2 * j + 1], z, a);
  }
}

// Groups whose scales/zeros one stage needs per n-tile (per-channel: none, applied at the end).
template <int BITS, int GROUP>
__host__ __device__ constexpr int groups_per_stage() {
  return GROUP == 0 ? 0 : (TileShape<BITS>::kStageK >= GROUP ? TileShape<BITS>::kStageK / GROUP : 1);
}

// Shared memory of one pipeline stage, in bytes (all parts 16-byte aligned).
template <typename T, int BITS, int MB, int GROUP, bool ZEROS>
struct StageLayout {
  static constexpr int kW = kGemvWarps * kGemvSteps * 32 * 16;
  static constexpr int kX = MB * 8 * TileShape<BITS>::kXStride * static_cast<int>(sizeof(T));
  static constexpr int kGroups = groups_per_stage<BITS, GROUP>();
  static constexpr int kS = kGemvWarps * kGroups * 16 * static_cast<int>(sizeof(T));
  static constexpr int kZ = ZEROS ? kS : 0;
  static constexpr int kBytes = kW + kX + kS + kZ;
};

template <typename T, int BITS, int MB, int GROUP, bool ZEROS>
__host__ __device__ constexpr int gemv_smem_bytes() {
  return kGemvStages * StageLayout<T, BITS, MB, GROUP, ZEROS>::kBytes;
}

// Block b's share of the work: units [unit_begin(b), unit_begin(b + 1)).
__host__ __device__ __forceinline__ long long unit_begin(long long b, long long units, long long blocks) {
  return b * units / blocks;
}

// The block whose share holds unit u (shares are contiguous and non-decreasing).
__device__ __forceinline__ int unit_owner(long long u, long long units, int blocks) {
  int b = static_cast<int>(u * blocks / units);
  while (b + 1 < blocks && unit_begin(b + 1, units, blocks) <= u) ++b;
  while (b > 0 && unit_begin(b, units, blocks) > u) --b;
  return b;
}

// GROUP: group size in k (a power of two >= 32), or 0 for per-channel scales.
template <typename T, int BITS, int MB, int GROUP, bool ZEROS>
__global__ void __launch_bounds__(kGemvWarps * 32) gemv_kernel(const GemvParams p) {
  using Shape = TileShape<BITS>;
  using Stage = StageLayout<T, BITS, MB, GROUP, ZEROS>;
  constexpr int KT = Shape::kK, SK = Shape::kStageK, XS = Shape::kXStride;
  constexpr int kThreads = kGemvWarps * 32;
  constexpr int kCols = kGemvWarps * 16;  // output channels per column (8 n-tiles)
  constexpr int kGroupK16 = GROUP / 16;   // k16 blocks per group
  constexpr int kGroups = Stage::kGroups;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, t4 = lane & 3;
  const int ktiles = p.K_pad / KT;
  const int columns = (p.n_tiles + kGemvWarps - 1) / kGemvWarps;
  const int units_per_column = p.nstages / p.unit_stages;
  const long long units = static_cast<long long>(columns) * units_per_column;
  const long long u_begin = unit_begin(blockIdx.x, units, gridDim.x);
  const long long u_end = unit_begin(blockIdx.x + 1, units, gridDim.x);
  // Linear stage index L = column * nstages + stage, over this block's share.
  const long long L_begin = u_begin * p.unit_stages, L_end = u_end * p.unit_stages;
  if (L_begin >= L_end) return;

  extern __shared__ uint4 smem[];
  __shared__ int is_last_contributor;
  const T* x = static_cast<const T*>(p.x);
  const T* scales = static_cast<const T*>(p.scales);
  const T* zeros = static_cast<const T*>(p.zeros);
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  auto stage_base = [&](int slot) { return reinterpret_cast<char*>(smem) + slot * Stage::kBytes; };

  // Issue the cp.async copies of stage `st` of column `c` into ring slot `slot`.
  auto fetch = [&](int c, int st, int slot) {
    char* base = stage_base(slot);
    const int nt = c * kGemvWarps + warp;
    const int kt0 = st * kGemvSteps;
    if (nt < p.n_tiles) {  // this lane's own weight bytes (each warp reads back only its own)
      const uint4* src = p.w + (static_cast<size_t>(nt) * ktiles + kt0) * 32 + lane;
      uint4* dst = reinterpret_cast<uint4*>(base) + warp * kGemvSteps * 32 + lane;
#pragma unroll
      for (int s = 0; s < kGemvSteps; ++s)
        if (kt0 + s < ktiles) copy16_async(dst + s * 32, src + s * 32, true);
    }
    // activations: rows < M; columns past K zero-filled (padded weights are exactly 0,
    // but 0 * uninitialised memory could be NaN)
    T* xdst = reinterpret_cast<T*>(base + Stage::kW);
    constexpr int kSegs = SK / 8;
    const int k0 = st * SK;
    for (int i = tid; i < p.M * kSegs; i += kThreads) {
      const int m = i / kSegs, sg = i % kSegs, k = k0 + sg * 8;
      const bool valid = k < p.K;
      copy16_async(xdst + m * XS + sg * 8, x + static_cast<size_t>(m) * p.K + (valid ? k : 0), valid);
    }
    if constexpr (kGroups > 0) {  // the 16 scales (and zeros) of each group of each tile
      const int g0 = (st * SK) / GROUP;
      constexpr int kSegsS = kGemvWarps * kGroups * 2;  // 16 values = two 16-byte segments
      for (int i = tid; i < kSegsS * (ZEROS ? 2 : 1); i += kThreads) {
        const bool is_zero = ZEROS && i >= kSegsS;
        const int j = is_zero ? i - kSegsS : i;
        const int wt = j / (kGroups * 2), r = j % (kGroups * 2);
        const int tile = c * kGemvWarps + wt, g = g0 + r / 2;
        const bool valid = tile < p.n_tiles && g < p.groups_pad;
        const T* src = (is_zero ? zeros : scales) +
                       (static_cast<size_t>(valid ? tile : 0) * p.groups_pad + (valid ? g : 0)) * 16 + (r % 2) * 8;
        T* dst = reinterpret_cast<T*>(base + Stage::kW + Stage::kX + (is_zero ? Stage::kS : 0)) + (wt * kGroups) * 16 + r * 8;
        copy16_async(dst, src, valid);
      }
    }
  };

  const float bz = zero_point_bias(BITS);
  ZeroConsts<T, BITS> zc(bz, bz);  // symmetric: fixed; otherwise set per group / column
  float acc[MB][4], part[MB][4];
  auto reset = [&]() {
#pragma unroll
    for (int h = 0; h < MB; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[h][i] = part[h][i] = 0.f;
  };
  reset();

  // The k16 blocks of one stage: convert, mma, and at each group's end scale into acc.
  auto compute = [&](int st, int slot, auto full_tag) {
    constexpr bool kFull = decltype(full_tag)::value;
    const char* base = stage_base(slot);
    const uint4* wsm = reinterpret_cast<const uint4*>(base) + warp * kGemvSteps * 32 + lane;
    const T* xsm = reinterpret_cast<const T*>(base + Stage::kW) + (lane & 7) * XS + 8 * (lane >> 3);
    const uint32_t* ssm = reinterpret_cast<const uint32_t*>(base + Stage::kW + Stage::kX) + warp * kGroups * 8 + gid;
    [[maybe_unused]] const uint32_t* zsm = ssm + Stage::kS / 4;
    const int steps = kFull ? kGemvSteps : ktiles - st * kGemvSteps;
    [[maybe_unused]] float s_lo = 0.f, s_hi = 0.f;
#pragma unroll
    for (int s = 0; s < kGemvSteps; ++s) {
      if (!kFull && s >= steps) break;
      const uint4 wv = wsm[s * 32];
      uint32_t bx[MB][4];
#pragma unroll
      for (int j = 0; j < Shape::kK16; ++j) {
        const int i = s * Shape::kK16 + j;  // k16 index within the stage (compile-time)
        if (j % 2 == 0) {  // one ldmatrix.x4 per 8 rows of x covers two k16 blocks
#pragma unroll
          for (int h = 0; h < MB; ++h) ldmatrix_x4(bx[h], xsm + h * 8 * XS + i * 16);
        }
        if constexpr (GROUP != 0) {
          if (i % kGroupK16 == 0 || i == 0) {  // a group starts (or continues from the last stage)
            const int g = kGroupK16 >= Shape::kStageK16 ? 0 : i / kGroupK16;
            const float2 sc = pair_to_float2<T>(ssm[g * 8]);
            s_lo = sc.x;
            s_hi = sc.y;
            if constexpr (ZEROS) {
              const float2 z = pair_to_float2<T>(zsm[g * 8]);
              zc = ZeroConsts<T, BITS>(z.x, z.y);
            }
          }
        }
        uint32_t a[4];
        convert_segment_k16<T, BITS>(wv, j, zc, a);
#pragma unroll
        for (int h = 0; h < MB; ++h) {
          const uint32_t b[2] = {bx[h][(j % 2) * 2], bx[h][(j % 2) * 2 + 1]};
          mma_16816<T>(part[h], a, b);
        }
        if constexpr (GROUP != 0) {
          // group end: compile-time when groups fit in a stage, else at the stage end of
          // every (group / stage)-th stage
          const bool end = kGroupK16 <= Shape::kStageK16
                               ? (i + 1) % kGroupK16 == 0
                               : (i == Shape::kStageK16 - 1 && ((st + 1) * Shape::kStageK16) % kGroupK16 == 0);
          if (end) {
#pragma unroll
            for (int h = 0; h < MB; ++h) {
              acc[h][0] += s_lo * part[h][0];
              acc[h][1] += s_lo * part[h][1];
              acc[h][2] += s_hi * part[h][2];
              acc[h][3] += s_hi * part[h][3];
#pragma unroll
              for (int q = 0; q < 4; ++q) part[h][q] = 0.f;
            }
          }
        }
      }
    }
  };

  // A column segment ends: write its sums, directly when this block computed the whole
  // column, else as a partial that the column's last contributor reduces.
  auto finish_column = [&](int c, bool whole, bool first_segment) {
    const int nt = c * kGemvWarps + warp;
    const bool active = nt < p.n_tiles;
    if constexpr (GROUP == 0) {  // per-channel: one scale per output row, applied once
      if (active) {
        const float2 sc = pair_to_float2<T>(reinterpret_cast<const uint32_t*>(scales + static_cast<size_t>(nt) * 16)[gid]);
#pragma unroll
        for (int h = 0; h < MB; ++h) {
          acc[h][0] = sc.x * part[h][0];
          acc[h][1] = sc.x * part[h][1];
          acc[h][2] = sc.y * part[h][2];
          acc[h][3] = sc.y * part[h][3];
        }
      }
    }
    // Accumulator (h, i) holds y[m][n], m = 8h + 2*t4 + (i & 1), n = 16*nt + gid + 8*(i >> 1).
    if (whole) {
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
    float* ws = p.workspace + (static_cast<size_t>(blockIdx.x) * 2 + (first_segment ? 0 : 1)) * p.M * kCols;
    if (active) {
#pragma unroll
      for (int h = 0; h < MB; ++h)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int m = 8 * h + 2 * t4 + (i & 1), n = 16 * warp + gid + 8 * (i >> 1);
          if (m < p.M) ws[m * kCols + n] = acc[h][i];
        }
    }
    const long long cu0 = static_cast<long long>(c) * units_per_column;
    const int b_first = unit_owner(cu0, units, gridDim.x);
    const int b_last = unit_owner(cu0 + units_per_column - 1, units, gridDim.x);
    __threadfence();  // partials visible device-wide before this block is counted
    __syncthreads();
    if (tid == 0) is_last_contributor = atomicAdd(&p.counters[c], 1) == b_last - b_first;
    __syncthreads();
    if (!is_last_contributor) return;
    __threadfence();
    for (int i = tid; i < p.M * kCols; i += kThreads) {
      const int m = i / kCols, n = c * kCols + i % kCols;
      if (n >= p.N) continue;
      float sum = bias ? to_float(bias[n]) : 0.f;
      for (int b = b_first; b <= b_last; ++b) {  // fixed order: deterministic
        const bool b_starts_here = unit_begin(b, units, gridDim.x) >= cu0;
        sum += __ldcg(p.workspace + (static_cast<size_t>(b) * 2 + (b_starts_here ? 0 : 1)) * p.M * kCols + i);
      }
      y[static_cast<size_t>(m) * p.N + n] = from_float<T>(sum);
    }
    if (tid == 0) p.counters[c] = 0;  // re-arm for the next launch / graph replay
  };

  // Pipeline over this block's stages: kStages - 1 in flight ahead of the one computed.
  // (c_ahead, st_ahead) walks the same sequence as L, without 64-bit divisions.
  int c_ahead = static_cast<int>(L_begin / p.nstages), st_ahead = static_cast<int>(L_begin % p.nstages);
  auto advance = [&]() {
    if (++st_ahead == p.nstages) {
      st_ahead = 0;
      ++c_ahead;
    }
  };
#pragma unroll
  for (int q = 0; q < kGemvStages - 1; ++q) {
    if (L_begin + q < L_end) {
      fetch(c_ahead, st_ahead, q);
      advance();
    }
    cp_async_commit();
  }
  long long segment_start = L_begin;  // first stage of the current column segment
  int c = static_cast<int>(L_begin / p.nstages);
  if constexpr (ZEROS && GROUP == 0) {  // per-channel zero points: once per column
    const int nt = c * kGemvWarps + warp;
    if (nt < p.n_tiles) {
      const float2 z = pair_to_float2<T>(reinterpret_cast<const uint32_t*>(zeros + static_cast<size_t>(nt) * 16)[gid]);
      zc = ZeroConsts<T, BITS>(z.x, z.y);
    }
  }
  for (long long L = L_begin; L < L_end; ++L) {
    cp_async_wait<kGemvStages - 2>();
    __syncthreads();  // stage L visible to all; the slot of stage L - 1 free to overwrite
    const long long ahead = L + kGemvStages - 1;
    if (ahead < L_end) {
      fetch(c_ahead, st_ahead, static_cast<int>((ahead - L_begin) % kGemvStages));
      advance();
    }
    cp_async_commit();
    const int st = static_cast<int>(L - static_cast<long long>(c) * p.nstages);
    if (c * kGemvWarps + warp < p.n_tiles) {
      const int slot = static_cast<int>((L - L_begin) % kGemvStages);
      if ((st + 1) * kGemvSteps <= ktiles) {
        compute(st, slot, std::true_type{});
      } else {
        compute(st, slot, std::false_type{});
      }
    }
    if (st == p.nstages - 1 || L == L_end - 1) {
      const long long col_start = static_cast<long long>(c) * p.nstages;
      finish_column(c, segment_start == col_start && st == p.nstages - 1, segment_start == L_begin);
      reset();
      segment_start = L + 1;
      ++c;
      if constexpr (ZEROS && GROUP == 0) {
        const int nt = c * kGemvWarps + warp;
        if (L + 1 < L_end && nt < p.n_tiles) {
          const float2 z = pair_to_float2<T>(reinterpret_cast<const uint32_t*>(zeros + static_cast<size_t>(nt) * 16)[gid]);
          zc = ZeroConsts<T, BITS>(z.x, z.y);
        }
      }
    }
  }
}

}  // namespace woq
