// Weight-only GEMV (M <= 32): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W int8/int4,
// x fp16/bf16. MB = ceil(M / 8) blocks of 8 rows (1 to 4) share each converted weight
// fragment. M <= 16 always runs here; 17..32 runs here where the tuner measured it faster
// than the mixed GEMM for the shape (gemm.cuh reuses this file's layout and helpers).
//
// Tensor cores for a "GEMV": at M = 16 an int4 weight streamed at 3 TB/s feeds ~1e14
// multiply-adds/s, more than an H100's fp32 cores do; mma.sync does them at a fraction of
// its peak, so M = 16 costs about what M = 1 does and the kernel stays bound by weight bytes.
//
// Operand roles are swapped ("y^T = W x^T"): the weights are the 16-row A operand of
// mma.m16n8k16 (16 output channels per mma), the activations the 8-column B operand (8
// rows of x). Each further 8 rows issue one more mma on the same converted fragment.
//
// Work decomposition:
//   * each lane owns 16 bytes of every 512-byte weight segment, which kernels/layout.py
//     arranged to be exactly that lane's A fragments for 4 (int4) or 2 (int8) consecutive
//     k16 blocks of one n-tile (16 output channels);
//   * a block is 8 warps: kTiles = NT * 8 / KW adjacent n-tiles (a "column"), each warp
//     owning NT of them (gemv_tiles_per_warp), each n-tile shared by KW "k-warps" that split
//     its K range. A stage covers KW * kGemvSteps segments of every tile of the column; at
//     the column's end the k-warps' fp32 sums meet in shared memory in fixed order. KW > 1
//     is for small shapes (4096 x 4096 at KW = 1 makes only 32 columns for 132 SMs);
//   * a stage's weights, x and group scales/zeros are cp.async'd into a shared-memory ring
//     of p.stages (kGemvMaxStages where it fits, fewer on smaller GPUs), so ~3 stages of
//     traffic stay in flight without holding registers;
//   * the group size is a template parameter: group boundaries fall at compile-time
//     positions of the unrolled k16 loop;
//   * the grid is persistent, "stream-K": the (column, stage) units of the whole weight are
//     cut into gridDim.x equal contiguous runs, one per block, so every SM gets the same
//     bytes and fills its pipeline once. A column cut between blocks leaves fp32 partials
//     in the workspace; its last contributor adds them in block order (deterministic) and
//     re-arms the column's counter (CUDA-graph safe). The partition is 32-bit arithmetic
//     (a 64-bit division is a ~70-instruction subroutine).
//
// Numerics: the A fragments hold the exact integers (code - zero point); each group's fp32
// mma sums are multiplied by the group scale in fp32 and added to the fp32 total. The only
// roundings are the tensor cores' fp32 accumulation and the final conversion to T.
#pragma once

#include <cstdint>
#include <type_traits>

#include "convert.cuh"
#include "launch.cuh"
#include "mma.cuh"

namespace woq {

struct GemvParams : KernelOperands {  // workspace: [gridDim.x, 2, M, 16 * kTiles]; counters: [columns]
  int nstages;          // pipeline stages per column (ceil(K_pad / stage k))
  int unit_stages;      // stages per work unit: a group never straddles two blocks
  int units;            // columns * nstages / unit_stages; gridDim.x <= units
  int stages;           // depth of the shared-memory ring, 2..kGemvMaxStages (launch.cuh)
};

// Pipeline shape: kGemvMaxStages is the deepest ring (a launch gets it where the GPU's
// shared memory holds it -- an H100 at every M and k-warp count built -- else a shallower
// one: gemv_launch.cuh); kGemvSteps 512-byte weight segments per warp per stage.
constexpr int kGemvMaxStages = 4;
constexpr int kGemvSteps = 4;
// Resident blocks per SM the registers must allow (launch bounds): 2 at MB = 1, 2 (<= 128
// registers); 1 at MB = 3, 4, whose x rows fill most of the shared memory anyway and which
// spilled when held to 128.
constexpr int kGemvMinBlocks = 2;
constexpr int kGemvWideMinBlocks = 1;
constexpr int kGemvMaxM = kGemvMaxRows;  // 32: MB = 4 blocks of 8 rows

template <int BITS, int KW = 1>
struct TileShape {
  static constexpr int kK = BITS == 4 ? 64 : 32;        // k covered by one 16-byte lane load
  static constexpr int kK16 = kK / 16;                  // k16 blocks per lane load
  static constexpr int kWarpK = kGemvSteps * kK;        // k of one warp's share of a stage
  static constexpr int kWarpK16 = kWarpK / 16;
  static constexpr int kStageK = KW * kWarpK;           // k per pipeline stage
  static constexpr int kXStride = kStageK + 8;          // +16 B per smem row: conflict-free ldmatrix
  static constexpr int kTiles = kGemvWarps / KW;        // n-tiles per column at one n-tile per warp
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

// Two floats rounded to T each (as from_float), packed low then high.
template <typename T>
__device__ __forceinline__ uint32_t float2_to_pair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t float2_to_pair<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t float2_to_pair<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

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

// ZEROS = false: the codes are symmetric (zero point = the bias), which lets the bf16
// int8 converter skip its zero-point fma; the other converters fold z in for free.
template <typename T, int BITS, bool ZEROS = true>
__device__ __forceinline__ void convert_segment_k16(const uint4& w, int j, const ZeroConsts<T, BITS>& z,
                                                    uint32_t a[4]) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  if constexpr (BITS == 4) {
    convert_k16(words[j], z, a);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    convert_k16<ZEROS>(words[2 * j], words[2 * j + 1], z, a);
  } else {
    convert_k16(words[2 * j], words[2 * j + 1], z, a);
  }
}

// Returns the counter's old value. Release: the partial sums this block wrote (ordered
// before by the caller's __syncthreads) are visible to whoever acquires the counter;
// acquire: the last contributor then sees every other block's partials. One thread and
// one atomic per column, instead of a sequentially consistent fence in every thread.
__device__ __forceinline__ int atomic_add_acq_rel(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// The SwiGLU epilogue (GemvEpilogue::kSwiGLU). The weight's rows come interleaved in
// eights -- n-tile j is gate rows 8j..8j+7 over up rows 8j..8j+7 -- so an mma accumulator
// pair (i, i + 2), rows gid and gid + 8 of a tile, holds gate and up of one intermediate
// channel, 8j + gid: the thread finishes it alone. swiglu_column maps a gate row to it.
__host__ __device__ __forceinline__ int swiglu_column(int gate_row) { return (gate_row >> 4) * 8 + (gate_row & 7); }

// silu(gate) * up from fp32 sums, rounded where kernels/fused.py's silu_mul (and torch's
// F.silu(gate) * up) round: the projections to T, SiLU to T, then the product.
template <typename T>
__device__ __forceinline__ T swiglu(float gate, float up) {
  const float g = to_float(from_float<T>(gate)), u = to_float(from_float<T>(up));
  const float s = to_float(from_float<T>(g / (1.f + __expf(-g))));
  return from_float<T>(s * u);
}

// Row m's output for gate row n (n % 16 < 8) and its up row n + 8, from their fp32 sums
// (plus their bias, where not already in the sums): y is [M, N / 2].
template <typename T>
__device__ __forceinline__ void store_swiglu(T* y, int N, int m, int n, float gate, float up, const T* bias) {
  if (bias) {
    gate += to_float(bias[n]);
    up += to_float(bias[n + 8]);
  }
  y[static_cast<size_t>(m) * (N / 2) + swiglu_column(n)] = swiglu<T>(gate, up);
}

// Groups whose scales/zeros one stage needs per n-tile (per-channel: none, applied at the end).
template <int BITS, int KW, int GROUP>
__host__ __device__ constexpr int groups_per_stage() {
  constexpr int stage_k = TileShape<BITS, KW>::kStageK;
  return GROUP == 0 ? 0 : (stage_k >= GROUP ? stage_k / GROUP : 1);
}

// n-tiles per warp (NT). Each 8 rows of x a warp loads with ldmatrix feed NT n-tiles' mma.
// At NT = 1 and 32 rows a warp reads 8 bytes of x from shared memory per byte of int4
// weight, near an SM's shared-memory bandwidth at the weight stream's pace; NT = 2 halves
// that, so MB = 3, 4 at one k-warp take two (measured faster on H100; four lost: half the
// columns and rings of 2-3). A 1-k-warp stage of 32 rows is then ~51 KB, so GPUs with
// 99 KB of shared memory run the GEMV up to ~24 rows. Everything else keeps NT = 1, and so
// does a shape whose stage's group scales would need more than one copy per thread.
constexpr int kGemvWideTilesPerWarp = 2;
template <int BITS, int MB, int KW, int GROUP, bool ZEROS>
__host__ __device__ constexpr int gemv_tiles_per_warp() {
  constexpr int wanted = MB > 2 && KW == 1 ? kGemvWideTilesPerWarp : 1;
  constexpr int copies = wanted * TileShape<BITS, KW>::kTiles * groups_per_stage<BITS, KW, GROUP>() * 2 * (ZEROS ? 2 : 1);
  return copies <= kGemvWarps * 32 ? wanted : 1;
}

// Shared memory of one pipeline stage, in bytes (all parts 16-byte aligned): the weights,
// then M rows of x, then the group scales (and zero points). The x rows are sized by the
// launch's M, not by the 8 * MB rows an mma B operand spans: the lanes of rows >= M point
// ldmatrix at row M - 1 (their output columns are discarded). At M = 1 and 4 k-warps this
// is 2 KB of x per stage instead of 16.5 KB, which is what lets two blocks share an SM.
template <typename T, int BITS, int MB, int KW, int GROUP, bool ZEROS>
struct StageLayout {
  static constexpr int kNT = gemv_tiles_per_warp<BITS, MB, KW, GROUP, ZEROS>();
  static constexpr int kTiles = kNT * TileShape<BITS, KW>::kTiles;  // n-tiles per column
  static constexpr int kW = kGemvWarps * kNT * kGemvSteps * 32 * 16;
  static constexpr int kXRow = TileShape<BITS, KW>::kXStride * static_cast<int>(sizeof(T));  // a multiple of 16
  static constexpr int kGroups = groups_per_stage<BITS, KW, GROUP>();
  static constexpr int kS = kTiles * kGroups * 16 * static_cast<int>(sizeof(T));
  static constexpr int kZ = ZEROS ? kS : 0;
  __host__ __device__ static constexpr int x_bytes(int M) { return M * kXRow; }
  __host__ __device__ static constexpr int bytes(int M) { return kW + x_bytes(M) + kS + kZ; }
  // after the ring: the fp32 sums of k-warps 1..KW-1, for k-warp 0 to add
  static constexpr int kReduce = (KW - 1) * kTiles * 32 * MB * 4 * static_cast<int>(sizeof(float));
};

template <typename T, int BITS, int MB, int KW, int GROUP, bool ZEROS>
__host__ __device__ constexpr int gemv_smem_bytes(int M, int stages) {
  using Stage = StageLayout<T, BITS, MB, KW, GROUP, ZEROS>;
  return stages * Stage::bytes(M) + Stage::kReduce;
}

// The balanced contiguous partition of `units` work units over `blocks` blocks: the first
// `r` blocks take q + 1 units, the others q (q = units / blocks, r = units % blocks).
struct UnitPartition {
  int q, r;
  __host__ __device__ UnitPartition(int units, int blocks) : q(units / blocks), r(units % blocks) {}
  __host__ __device__ int begin(int b) const { return b * q + (b < r ? b : r); }
  __host__ __device__ int owner(int u) const {  // the block whose share holds unit u
    const int big = r * (q + 1);
    return u < big ? u / (q + 1) : r + (u - big) / q;
  }
};

// GROUP: group size in k (a power of two >= 32), or 0 for per-channel scales.
// KW: k-warps per n-tile (1, 2 or 4; 1 or 2 at MB = 3, 4).
template <typename T, int BITS, int MB, int KW, int GROUP, bool ZEROS>
__global__ void __launch_bounds__(kGemvWarps * 32, MB <= 2 ? kGemvMinBlocks : kGemvWideMinBlocks)
    gemv_kernel(const GemvParams p) {
  using Shape = TileShape<BITS, KW>;
  using Stage = StageLayout<T, BITS, MB, KW, GROUP, ZEROS>;
  constexpr int KT = Shape::kK, SK = Shape::kStageK, XS = Shape::kXStride;
  constexpr int kThreads = kGemvWarps * 32;
  constexpr int NT = Stage::kNT;           // n-tiles per warp
  constexpr int kTiles = Stage::kTiles;   // n-tiles per column
  constexpr int kCols = 16 * kTiles;      // output channels per column
  constexpr int kGroupK16 = GROUP / 16;   // k16 blocks per group
  constexpr int kGroups = Stage::kGroups;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tile0 = warp / KW * NT, kw = warp % KW;  // this warp's first n-tile in the column, its K share
  const int gid = lane >> 2, t4 = lane & 3;
  const int ktiles = p.K_pad / KT;
  const int units_per_column = p.nstages / p.unit_stages;
  const UnitPartition part_of(p.units, gridDim.x);
  // Linear stage index L = column * nstages + stage, over this block's share.
  const int L_begin = part_of.begin(blockIdx.x) * p.unit_stages;
  const int L_end = part_of.begin(blockIdx.x + 1) * p.unit_stages;
  const BlockStamps stamps(p);
  if (L_begin >= L_end) {  // (the launcher sizes the grid so that this never happens)
    wait_for_prior_grid();
    stamps.start();
    return;
  }

  extern __shared__ uint4 smem[];
  __shared__ int is_last_contributor;
  const T* x = static_cast<const T*>(p.x);
  const Scale* scales = static_cast<const Scale*>(p.scales);
  const T* zeros = static_cast<const T*>(p.zeros);
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  // The stage size follows M (x rows, see StageLayout).
  const int stage_bytes = Stage::bytes(p.M), x_bytes = Stage::x_bytes(p.M);
  auto stage_base = [&](int slot) { return reinterpret_cast<char*>(smem) + slot * stage_bytes; };

  // Every address a thread copies from or to is fixed per thread up to a per-stage /
  // per-column offset: sources advance as running pointers along the block's walk over
  // (column, stage), destinations are a slot offset, so a stage's copies are a few adds
  // (recomputing 64-bit addresses per stage cost a third of the stage's instructions).
  const uint32_t smem_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  // weights: this lane's 16 bytes of the warp's kSteps segments of each of its n-tiles
  // (in shared memory: the warp's NT runs of kSteps segments, one after the other)
  constexpr int kStageWords = KW * kGemvSteps * 32;  // uint4 of one n-tile per stage
  const uint4* w_lane = p.w + (static_cast<size_t>(tile0) * ktiles + kw * kGemvSteps) * 32 + lane;
  const size_t w_tile_stride = static_cast<size_t>(ktiles) * 32;
  const size_t w_column_stride = kTiles * w_tile_stride;
  const uint32_t w_dst = (warp * NT * kGemvSteps * 32 + lane) * 16;
  // activations: thread -> (first row, 8-element segment); further rows kRowsPerPass apart
  constexpr int kSegs = SK / 8;
  static_assert(kSegs <= kThreads && kThreads % kSegs == 0, "one segment column per thread");
  constexpr int kRowsPerPass = kThreads / kSegs;
  constexpr int kPasses = (MB * 8 + kRowsPerPass - 1) / kRowsPerPass;
  const int x_row = tid / kSegs, x_seg = tid % kSegs;
  const T* x_src = x + static_cast<size_t>(x_row) * p.K + x_seg * 8;
  const size_t x_pass_stride = static_cast<size_t>(kRowsPerPass) * p.K;
  const uint32_t x_dst = Stage::kW + (x_row * XS + x_seg * 8) * static_cast<uint32_t>(sizeof(T));
  // group scales (and zeros): one 16-byte copy per thread at most, started from the
  // block's other half of threads (the activations' copies start at thread 0, and one
  // warp issuing both would delay the whole stage)
  constexpr int kSegsS = kTiles * kGroups * 2;  // 16 values of a group of a tile = 2 copies
  static_assert(kSegsS * (ZEROS ? 2 : 1) <= kThreads, "one scale copy per thread");
  const int s_idx = (tid + kThreads / 2) % kThreads;
  const bool s_copies = kGroups > 0 && s_idx < kSegsS * (ZEROS ? 2 : 1);
  const bool s_is_zero = ZEROS && s_idx >= kSegsS;
  const int s_j = s_is_zero ? s_idx - kSegsS : s_idx;
  const int s_tile = kGroups > 0 ? s_j / (kGroups * 2) : 0, s_r = kGroups > 0 ? s_j % (kGroups * 2) : 0;
  const uint16_t* s_src = static_cast<const uint16_t*>(s_is_zero ? p.zeros : p.scales) +  // (2-byte values)
                          (static_cast<size_t>(s_tile) * p.groups_pad + s_r / 2) * 16 + (s_r % 2) * 8;
  const size_t s_column_stride = static_cast<size_t>(kTiles) * p.groups_pad * 16;
  const uint32_t s_dst = Stage::kW + x_bytes + (s_is_zero ? Stage::kS : 0) +
                         ((s_tile * kGroups) * 16 + s_r * 8) * static_cast<uint32_t>(sizeof(T));

  // The fetch walk: the (column, stage) whose copies are issued next, p.stages - 1 ahead of
  // the one computed, with this thread's weight and scale sources for it. (c_ahead,
  // st_ahead) walks the same sequence as the main loop's L without divisions.
  int c_ahead = L_begin / p.nstages, st_ahead = L_begin % p.nstages;
  const uint4* w_ahead = w_lane + c_ahead * w_column_stride + st_ahead * kStageWords;
  const uint16_t* s_ahead = s_src + c_ahead * s_column_stride;  // the column's first group
  // this warp's n-tiles that exist in the walk's column (the last column may be short)
  int w_tiles_ok = p.n_tiles - (c_ahead * kTiles + tile0);
  bool s_column_ok = c_ahead * kTiles + s_tile < p.n_tiles;
  auto advance = [&]() {
    if (++st_ahead == p.nstages) {
      st_ahead = 0;
      ++c_ahead;
      w_ahead = w_lane + c_ahead * w_column_stride;
      s_ahead += s_column_stride;
      w_tiles_ok = p.n_tiles - (c_ahead * kTiles + tile0);
      s_column_ok = c_ahead * kTiles + s_tile < p.n_tiles;
    } else {
      w_ahead += kStageWords;
    }
  };

  // The cp.async copies of the walk's stage into ring slot `slot`, in two parts: what is
  // constant while serving (weights, scales, zero points) and the activations, which the
  // previous kernel may still be writing (see the prologue below).
  auto fetch_weights = [&](int slot) {
    const uint32_t base = smem_addr + slot * stage_bytes;
    const int kt0 = (st_ahead * KW + kw) * kGemvSteps;  // this warp's first segment
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t < w_tiles_ok) {  // this lane's own weight bytes (each warp reads back only its own)
        const uint32_t dst = base + w_dst + t * kGemvSteps * 512;
        const uint4* src = w_ahead + t * w_tile_stride;
        if (kt0 + kGemvSteps <= ktiles) {
#pragma unroll
          for (int s = 0; s < kGemvSteps; ++s) copy16_async(dst + s * 512, src + s * 32, true);
        } else {  // K's last stage
#pragma unroll
          for (int s = 0; s < kGemvSteps; ++s)
            if (kt0 + s < ktiles) copy16_async(dst + s * 512, src + s * 32, true);
        }
      }
    }
    if constexpr (kGroups > 0) {  // the 16 scales (and zeros) of each group of each tile
      if (s_copies) {
        const int g0 = (st_ahead * SK) / GROUP;  // (powers of two: a shift)
        const bool valid = s_column_ok && g0 + s_r / 2 < p.groups_pad;
        copy16_async(base + s_dst, valid ? s_ahead + g0 * 16 : s_src, valid);
      }
    }
  };
  auto fetch_x = [&](int st, int slot) {
    const uint32_t base = smem_addr + slot * stage_bytes;
    // rows < M; columns past K zero-filled (padded weights are exactly 0, but
    // 0 * uninitialised memory could be NaN)
    const bool x_valid = st * SK + x_seg * 8 < p.K;
    const T* xs = x_valid ? x_src + st * SK : x;
#pragma unroll
    for (int j = 0; j < kPasses; ++j)
      if (x_row + j * kRowsPerPass < p.M)
        copy16_async(base + x_dst + j * (kRowsPerPass * XS * static_cast<int>(sizeof(T))),
                     x_valid ? xs + j * x_pass_stride : x, x_valid);
  };

  // ldmatrix row addresses (elements past a stage's x): lane l reads row l % 8 of each
  // 8-row block, k-segment l / 8; rows >= M read row M - 1 (see StageLayout).
  int x_lane[MB];
#pragma unroll
  for (int h = 0; h < MB; ++h) x_lane[h] = min(8 * h + (lane & 7), p.M - 1) * XS + 8 * (lane >> 3) + kw * Shape::kWarpK;

  const float bz = zero_point_bias(BITS);
  ZeroConsts<T, BITS> zc[NT];  // symmetric: fixed; otherwise set per group / column
#pragma unroll
  for (int t = 0; t < NT; ++t) zc[t] = ZeroConsts<T, BITS>(bz, bz);
  float acc[NT][MB][4], part[NT][MB][4];
  auto reset = [&]() {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int h = 0; h < MB; ++h)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[t][h][i] = part[t][h][i] = 0.f;
  };
  reset();

  // This warp's share of one stage: convert, mma, and at each group's end (or the share's
  // end, when a group is longer) scale the partial sums into acc.
  auto compute = [&](int st, int slot, auto full_tag) {
    constexpr bool kFull = decltype(full_tag)::value;
    const char* base = stage_base(slot);
    const uint4* wsm = reinterpret_cast<const uint4*>(base) + warp * NT * kGemvSteps * 32 + lane;
    const T* xsm = reinterpret_cast<const T*>(base + Stage::kW);
    const uint32_t* ssm = reinterpret_cast<const uint32_t*>(base + Stage::kW + x_bytes) + tile0 * kGroups * 8 + gid;
    [[maybe_unused]] const uint32_t* zsm = ssm + Stage::kS / 4;
    const int steps = kFull ? kGemvSteps : ktiles - (st * KW + kw) * kGemvSteps;
    [[maybe_unused]] float s_lo[NT], s_hi[NT];
#pragma unroll
    for (int s = 0; s < kGemvSteps; ++s) {
      if (!kFull && s >= steps) break;
      uint4 wv[NT];
#pragma unroll
      for (int t = 0; t < NT; ++t) wv[t] = wsm[(t * kGemvSteps + s) * 32];
      uint32_t bx[MB][4];
#pragma unroll
      for (int j = 0; j < Shape::kK16; ++j) {
        const int i = s * Shape::kK16 + j;  // k16 index within the warp's share (compile-time)
        if (j % 2 == 0) {  // one ldmatrix.x4 per 8 rows of x covers two k16 blocks
#pragma unroll
          for (int h = 0; h < MB; ++h) ldmatrix_x4(bx[h], xsm + x_lane[h] + i * 16);
        }
        if constexpr (GROUP != 0) {
          if (i % kGroupK16 == 0 || i == 0) {  // a group starts (or the share starts inside one)
            // the group's index among the stage's groups (one per stage when groups are longer)
            const int g = GROUP <= SK ? (kw * Shape::kWarpK + i * 16) / GROUP : 0;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
              const float2 sc = pair_to_float2<Scale>(ssm[(t * kGroups + g) * 8]);
              s_lo[t] = sc.x;
              s_hi[t] = sc.y;
              if constexpr (ZEROS) {
                zc[t] = zero_consts<T, BITS>(zsm[(t * kGroups + g) * 8]);
              }
            }
          }
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          uint32_t a[4];
          convert_segment_k16<T, BITS, ZEROS>(wv[t], j, zc[t], a);
#pragma unroll
          for (int h = 0; h < MB; ++h) {
            const uint32_t b[2] = {bx[h][(j % 2) * 2], bx[h][(j % 2) * 2 + 1]};
            mma_16816<T>(part[t][h], a, b);
          }
        }
        if constexpr (GROUP != 0) {
          // A share never ends mid-segment inside a group: K_pad is a multiple of the group
          // size, so a partial share (K's last) ends at a group end.
          if ((i + 1) % kGroupK16 == 0 || i == Shape::kWarpK16 - 1) {
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
              for (int h = 0; h < MB; ++h) {
                acc[t][h][0] += s_lo[t] * part[t][h][0];
                acc[t][h][1] += s_lo[t] * part[t][h][1];
                acc[t][h][2] += s_hi[t] * part[t][h][2];
                acc[t][h][3] += s_hi[t] * part[t][h][3];
#pragma unroll
                for (int q = 0; q < 4; ++q) part[t][h][q] = 0.f;
              }
          }
        }
      }
    }
  };

  // A column segment ends: add the k-warps' sums, then write them, directly when this
  // block computed the whole column, else as a partial that the column's last
  // contributor reduces. Called by every thread of the block.
  auto finish_column = [&](int c, bool whole, bool first_segment) {
    if constexpr (GROUP == 0) {  // per-channel: one scale per output row, applied once
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const int nt = c * kTiles + tile0 + t;
        if (nt < p.n_tiles) {
          const float2 sc = pair_to_float2<Scale>(reinterpret_cast<const uint32_t*>(scales + static_cast<size_t>(nt) * 16)[gid]);
#pragma unroll
          for (int h = 0; h < MB; ++h) {
            acc[t][h][0] = sc.x * part[t][h][0];
            acc[t][h][1] = sc.x * part[t][h][1];
            acc[t][h][2] = sc.y * part[t][h][2];
            acc[t][h][3] = sc.y * part[t][h][3];
          }
        }
      }
    }
    if constexpr (KW > 1) {  // k-warps 1..KW-1 hand their sums to k-warp 0, lane for lane
      float* red = reinterpret_cast<float*>(reinterpret_cast<char*>(smem) + p.stages * stage_bytes);
      auto slot = [&](int k, int t, int h, int i) {
        return red + (((k - 1) * kTiles + tile0 + t) * MB * 4 + h * 4 + i) * 32 + lane;
      };
      if (kw > 0) {
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int h = 0; h < MB; ++h)
#pragma unroll
            for (int i = 0; i < 4; ++i) *slot(kw, t, h, i) = acc[t][h][i];
      }
      __syncthreads();  // (the next column's writes come after the main loop's next barrier)
      if (kw == 0) {
        for (int k = 1; k < KW; ++k)
#pragma unroll
          for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int h = 0; h < MB; ++h)
#pragma unroll
              for (int i = 0; i < 4; ++i) acc[t][h][i] += *slot(k, t, h, i);
      }
    }
    // Accumulator (t, h, i) holds y[m][n], m = 8h + 2*t4 + (i & 1), n = 16*nt + gid + 8*(i >> 1)
    // with nt the warp's t-th n-tile.
    if (whole) {
      if (kw != 0) return;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const int nt = c * kTiles + tile0 + t;
        if (nt >= p.n_tiles) break;
#pragma unroll
        for (int h = 0; h < MB; ++h) {
          if (p.swiglu) {  // (i, i + 2): gate and up of channel 8 nt + gid (swiglu_column)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const int m = 8 * h + 2 * t4 + i;
              if (m < p.M) store_swiglu(y, p.N, m, 16 * nt + gid, acc[t][h][i], acc[t][h][i + 2], bias);
            }
            continue;
          }
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int m = 8 * h + 2 * t4 + (i & 1), n = 16 * nt + gid + 8 * (i >> 1);
            if (m < p.M && n < p.N) {
              const float b = bias ? to_float(bias[n]) : 0.f;
              y[static_cast<size_t>(m) * p.N + n] = from_float<T>(acc[t][h][i] + b);
            }
          }
        }
      }
      return;
    }
    float* ws = p.workspace + (static_cast<size_t>(blockIdx.x) * 2 + (first_segment ? 0 : 1)) * p.M * kCols;
    if (kw == 0) {
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (c * kTiles + tile0 + t >= p.n_tiles) break;
#pragma unroll
        for (int h = 0; h < MB; ++h)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int m = 8 * h + 2 * t4 + (i & 1), n = 16 * (tile0 + t) + gid + 8 * (i >> 1);
            if (m < p.M) ws[m * kCols + n] = acc[t][h][i];
          }
      }
    }
    const int cu0 = c * units_per_column;
    const int b_first = part_of.owner(cu0);
    const int b_last = part_of.owner(cu0 + units_per_column - 1);
    __syncthreads();  // every partial written before thread 0 releases them
    if (tid == 0) is_last_contributor = atomic_add_acq_rel(&p.counters[c], 1) == b_last - b_first;
    __syncthreads();
    if (!is_last_contributor) return;
    // Four adjacent channels per thread and pass (16-byte loads: a column's 32 rows of 256
    // channels are 8 passes instead of 32 of dependent scalar loads, and this block's own
    // next column waits for them).
    static_assert(kCols % 16 == 0, "whole float4 of a row, whole n-tiles (SwiGLU pairs quads 8 apart)");
    // The fixed-order sum of one float4 of partials (quad i4 of the column's M x kCols).
    auto column_sum = [&](int i4, int n0, float (&sum)[4]) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sum[e] = bias && n0 + e < p.N ? to_float(bias[n0 + e]) : 0.f;
      for (int b = b_first; b <= b_last; ++b) {  // fixed order: deterministic
        const bool b_starts_here = part_of.begin(b) >= cu0;
        const float4 v = __ldcg(reinterpret_cast<const float4*>(
                                    p.workspace + (static_cast<size_t>(b) * 2 + (b_starts_here ? 0 : 1)) * p.M * kCols) + i4);
        sum[0] += v.x;
        sum[1] += v.y;
        sum[2] += v.z;
        sum[3] += v.w;
      }
    };
    for (int i4 = tid; i4 < p.M * (kCols / 4); i4 += kThreads) {
      const int m = i4 / (kCols / 4), n0 = c * kCols + (i4 % (kCols / 4)) * 4;
      if (n0 >= p.N) continue;
      float sum[4];
      if (p.swiglu) {  // a gate quad (first half of its n-tile) with its up quad, 8 rows on
        if (n0 & 8) continue;
        float up[4];
        column_sum(i4, n0, sum);
        column_sum(i4 + 2, n0 + 8, up);
#pragma unroll
        for (int e = 0; e < 4; ++e) store_swiglu<T>(y, p.N, m, n0 + e, sum[e], up[e], nullptr);  // (bias in the sums)
        continue;
      }
      column_sum(i4, n0, sum);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (n0 + e < p.N) y[static_cast<size_t>(m) * p.N + n0 + e] = from_float<T>(sum[e]);
    }
    if (tid == 0) p.counters[c] = 0;  // re-arm for the next launch / graph replay
  };

  // Per-channel zero points: once per column.
  auto load_channel_zeros = [&](int c) {
    if constexpr (ZEROS && GROUP == 0) {
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const int nt = c * kTiles + tile0 + t;
        if (nt < p.n_tiles) {
          const float2 z = pair_to_float2<T>(reinterpret_cast<const uint32_t*>(zeros + static_cast<size_t>(nt) * 16)[gid]);
          zc[t] = ZeroConsts<T, BITS>(z.x, z.y);
        }
      }
    }
  };

  // Pipeline over this block's stages, p.stages - 1 in flight ahead of the one computed.
  // Prologue: under a programmatic launch (launch.cuh) the first stages' weights stream in
  // while the previous kernel finishes; x, the outputs and the workspace wait for it. Each
  // stage's weights are a commit group of their own, and x, readable only after the wait,
  // comes by plain loads (L2 hits) rather than cp.async: a copy issued after the wait would
  // join a group behind every weight group, and the first stage would wait for all of them.
  // x keeps the copies at 17..32 rows (measured faster there) and where the plain loads in
  // flight would exceed 12 16-byte values per thread (9..16 rows at 4 k-warps: spilled).
  constexpr bool kXByLoads = MB <= 2 && (kGemvMaxStages - 1) * kPasses <= 12;
  allow_dependent_launch();
  int st_prologue[kGemvMaxStages - 1];
#pragma unroll
  for (int q = 0; q < kGemvMaxStages - 1; ++q) {
    st_prologue[q] = st_ahead;
    if (q < p.stages - 1 && L_begin + q < L_end) {
      fetch_weights(q);
      advance();
    }
    if (kXByLoads && q < p.stages - 1) cp_async_commit();  // (empty groups keep the count)
  }
  wait_for_prior_grid();
  stamps.start();
  if constexpr (kXByLoads) {  // every load issued before the first store: one L2 round trip
    uint4 xv[kGemvMaxStages - 1][kPasses];
#pragma unroll
    for (int q = 0; q < kGemvMaxStages - 1; ++q) {
      const int st_q = st_prologue[q];
      const bool x_valid = q < p.stages - 1 && L_begin + q < L_end && st_q * SK + x_seg * 8 < p.K;
#pragma unroll
      for (int j = 0; j < kPasses; ++j)
        xv[q][j] = x_valid && x_row + j * kRowsPerPass < p.M
                       ? __ldcg(reinterpret_cast<const uint4*>(x_src + st_q * SK + j * x_pass_stride))
                       : make_uint4(0, 0, 0, 0);  // columns past K: zero, as fetch_x fills them
    }
#pragma unroll
    for (int q = 0; q < kGemvMaxStages - 1; ++q)
      if (q < p.stages - 1 && L_begin + q < L_end)
#pragma unroll
        for (int j = 0; j < kPasses; ++j)
          if (x_row + j * kRowsPerPass < p.M)
            store16_shared(smem_addr + q * stage_bytes + x_dst + j * (kRowsPerPass * XS * static_cast<int>(sizeof(T))),
                           xv[q][j]);
  } else {  // one commit group per stage (the first also holds the other stages' weights)
#pragma unroll
    for (int q = 0; q < kGemvMaxStages - 1; ++q) {
      if (q < p.stages - 1) {
        if (L_begin + q < L_end) fetch_x(st_prologue[q], q);
        cp_async_commit();
      }
    }
  }
  int segment_start = L_begin;  // first stage of the current column segment
  int c = L_begin / p.nstages, st = L_begin % p.nstages;
  load_channel_zeros(c);
  int slot = 0;
  for (int L = L_begin; L < L_end; ++L) {
    cp_async_wait_dynamic<kGemvMaxStages - 2>(p.stages - 2);
    __syncthreads();  // stage L visible to all; the slot of stage L - 1 free to overwrite
    if (L + p.stages - 1 < L_end) {
      const int ahead_slot = slot == 0 ? p.stages - 1 : slot - 1;
      fetch_weights(ahead_slot);
      fetch_x(st_ahead, ahead_slot);
      advance();
    }
    cp_async_commit();
    if (c * kTiles + tile0 < p.n_tiles) {  // (n-tiles past N compute on stale shared memory, never written)
      const int share_end = ((st * KW + kw) + 1) * kGemvSteps;  // this warp's last segment + 1
      if (share_end <= ktiles) {
        compute(st, slot, std::true_type{});
      } else if (share_end - kGemvSteps < ktiles) {
        compute(st, slot, std::false_type{});
      }
    }
    slot = slot == p.stages - 1 ? 0 : slot + 1;
    if (st == p.nstages - 1 || L == L_end - 1) {
      finish_column(c, segment_start == c * p.nstages && st == p.nstages - 1, segment_start == L_begin);
      reset();
      segment_start = L + 1;
      ++c;
      st = 0;
      if (L + 1 < L_end) load_channel_zeros(c);
    } else {
      ++st;
    }
  }
}

}  // namespace woq
