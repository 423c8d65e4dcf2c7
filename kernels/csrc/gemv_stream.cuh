// Register-streaming GEMV for decode (M <= 8): y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// The same packed weights, converters and mma as gemv.cuh, with the weights' way to the
// tensor cores shortened. In the ring every lane cp.asyncs its own 16 bytes of each
// 512-byte segment, the block meets at a barrier per stage, and each lane reads back
// exactly what it copied: shared memory is only a deep asynchronous buffer, and its
// barrier and MIO stalls add to the loads' own. Here each warp streams its weights straight
// into registers -- 16-byte ld.global.nc loads, a whole chunk of segments in flight while
// the previous chunk is converted and multiplied -- so no warp waits for another. Only x
// (M rows of the block's K range) sits in shared memory, loaded once per block.
//
// Work decomposition (one block = 8 warps, no persistent loop):
//   * a block owns a "column" of TPB adjacent n-tiles and one of `splits` equal runs of K;
//     each tile's run is split again among KW = 8 / TPB warps;
//   * a warp's share is a run of whole chunks (stream_chunk segments of one n-tile), loaded
//     into a double-buffered register array: chunk c + 1's loads are issued before chunk c
//     is converted;
//   * a chunk's group scales and zero points ride along in registers (a chunk holds at most
//     4 groups); group boundaries fall at compile-time positions of the unrolled chunk;
//   * the KW warps of a tile add their fp32 sums in shared memory (fixed order); with
//     splits > 1 the blocks of a column leave partials in the workspace and the last to
//     finish adds them in split order (deterministic) and re-arms the counter.
// Under a programmatic launch (launch.cuh) each warp's first two chunks and the
// per-channel scales are in flight before griddepcontrol.wait (at 4096 x 4096 with 8
// k-warps, a warp's whole share).
//
// M <= 8 (one 8-row B operand): the tuner measures this pipeline against the ring per
// shape and M and keeps the faster.
#pragma once

#include <cstdint>

#include "gemv.cuh"

namespace woq {

// Segments (16-byte lane loads) per chunk.
constexpr int kStreamChunk = 8;

// A chunk's segments: kStreamChunk, fewer where the chunk would hold more than 4 groups
// (int4 g32: 2, g64: 4; int8 g32: 4) -- their scales and zeros are registers.
template <int BITS, int GROUP>
__host__ __device__ constexpr int stream_chunk() {
  constexpr int kK = TileShape<BITS>::kK;
  constexpr int most = GROUP == 0 ? kStreamChunk : 4 * GROUP / kK;
  return most < 1 ? 1 : most < kStreamChunk ? most : kStreamChunk;
}

struct GemvStreamParams : KernelOperands {  // workspace: [gridDim.x, M, 16 * TPB]; counters: [columns]
  int ktiles;       // segments per n-tile along K (K_pad / kK)
  int chunks;       // chunks per n-tile, the last one possibly partial
  int warp_chunks;  // chunks per warp share
  int splits;       // blocks per column (runs of K)
  // Padding: ptxas allocates this kernel's registers differently below this parameter size
  // (up to 10 more registers for some instantiations); sized so that the whole parameter
  // block keeps the size the allocation was measured at.
  char reserved_[48];
};

// Shared memory: M rows of the block's x range (+16 bytes per row: conflict-free
// ldmatrix), then the fp32 sums of k-warps 1..KW-1.
template <typename T, int BITS, int TPB, int GROUP>
struct StreamSmem {
  static constexpr int kKW = kGemvWarps / TPB;
  __host__ __device__ static constexpr int x_row(int warp_chunks) {
    return kKW * warp_chunks * stream_chunk<BITS, GROUP>() * TileShape<BITS>::kK + 8;
  }
  static constexpr int kReduce = (kKW - 1) * TPB * 4 * 32 * static_cast<int>(sizeof(float));
  __host__ __device__ static constexpr int bytes(int M, int warp_chunks) {
    return M * x_row(warp_chunks) * static_cast<int>(sizeof(T)) + kReduce;
  }
};

// TPB: n-tiles per block (1, 2, 4, 8), i.e. 8, 4, 2, 1 k-warps per tile.
// GROUP: group size in k, or 0 for per-channel scales.
template <typename T, int BITS, int TPB, int GROUP, bool ZEROS>
__global__ void __launch_bounds__(kGemvWarps * 32, 2) gemv_stream_kernel(const GemvStreamParams p) {
  using Smem = StreamSmem<T, BITS, TPB, GROUP>;
  constexpr int KW = Smem::kKW;
  constexpr int KT = TileShape<BITS>::kK;      // k per segment
  constexpr int K16 = TileShape<BITS>::kK16;   // k16 blocks per segment
  constexpr int CH = stream_chunk<BITS, GROUP>();
  constexpr int kChunkK = CH * KT;
  constexpr int kGroups = GROUP == 0 ? 1 : kChunkK / GROUP;  // groups per chunk (>= 1: kChunkK >= GROUP)
  constexpr int kGroupK16 = GROUP == 0 ? 1 : GROUP / 16;  // k16 blocks per group
  constexpr int kThreads = kGemvWarps * 32;
  static_assert(kChunkK % (GROUP == 0 ? 1 : GROUP) == 0, "a chunk holds whole groups");

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, t4 = lane & 3;
  const int column = blockIdx.x / p.splits, split = blockIdx.x % p.splits;
  const int tb = warp / KW, kw = warp % KW;  // this warp's tile in the column, its K share
  const int tile = column * TPB + tb;
  const bool tile_ok = tile < p.n_tiles;
  // this warp's chunks [c_begin, c_end) of the tile, and the block's first k
  const int block_c0 = split * KW * p.warp_chunks;
  const int c_begin = block_c0 + kw * p.warp_chunks;
  const int c_end = tile_ok ? min(c_begin + p.warp_chunks, p.chunks) : c_begin;
  const int block_k0 = block_c0 * kChunkK;

  extern __shared__ uint4 smem[];
  __shared__ int is_last_contributor;
  T* xs = reinterpret_cast<T*>(smem);
  const int XR = Smem::x_row(p.warp_chunks);  // elements per x row in shared memory
  const T* x = static_cast<const T*>(p.x);
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  const uint32_t* scales = static_cast<const uint32_t*>(p.scales);  // pairs (rows gid, gid + 8)
  const uint32_t* zeros = static_cast<const uint32_t*>(p.zeros);
  const uint4* w_lane = p.w + static_cast<size_t>(tile) * p.ktiles * 32 + lane;
  const size_t s_tile = static_cast<size_t>(tile) * p.groups_pad * 8 + gid;  // u32 index of group 0's pair

  // One chunk's weights, and its groups' scale and zero pairs (constant while serving).
  struct Chunk {
    uint4 w[CH];
    uint32_t s[kGroups], z[kGroups];
  };
  auto load = [&](int c, Chunk& b) {
    const int seg0 = c * CH;
#pragma unroll
    for (int i = 0; i < CH; ++i)
      if (seg0 + i < p.ktiles) b.w[i] = load_stream(w_lane + static_cast<size_t>(seg0 + i) * 32);
    if constexpr (GROUP != 0) {
      const int g0 = c * kGroups;
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        if (g0 + g < p.groups_pad) {
          b.s[g] = __ldg(scales + s_tile + (g0 + g) * 8);
          if constexpr (ZEROS) b.z[g] = __ldg(zeros + s_tile + (g0 + g) * 8);
        }
      }
    }
  };

  allow_dependent_launch();
  // Before the wait: what does not depend on the previous kernel.
  const float bz = zero_point_bias(BITS);
  ZeroConsts<T, BITS> zc(bz, bz);  // symmetric: fixed; else per group or per channel
  [[maybe_unused]] float2 channel_scale = make_float2(0.f, 0.f);
  if constexpr (GROUP == 0) {
    if (tile_ok) {
      channel_scale = pair_to_float2<Scale>(__ldg(scales + s_tile));
      if constexpr (ZEROS) {
        const float2 z = pair_to_float2<T>(__ldg(zeros + s_tile));
        zc = ZeroConsts<T, BITS>(z.x, z.y);
      }
    }
  }
  Chunk buf[2];
  if (c_begin < c_end) load(c_begin, buf[0]);
  if (c_begin + 1 < c_end) load(c_begin + 1, buf[1]);  // (two chunks in flight across the wait)
  const BlockStamps stamps(p);
  wait_for_prior_grid();
  stamps.start();

  // x: the block's K range of every row, columns past K zero (the padded weights there
  // are zero, but 0 * uninitialised shared memory could be NaN). Loads before stores,
  // four at a time: one L2 round trip per four 16-byte units.
  {
    const int units = (XR - 8) / 8, total = p.M * units;
    for (int u0 = tid; u0 < total; u0 += 4 * kThreads) {
      uint4 v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int u = u0 + j * kThreads, m = u / units, k = block_k0 + (u % units) * 8;
        v[j] = u < total && k < p.K ? __ldcg(reinterpret_cast<const uint4*>(x + static_cast<size_t>(m) * p.K + k))
                                    : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int u = u0 + j * kThreads;
        if (u < total) reinterpret_cast<uint4*>(xs + (u / units) * XR)[u % units] = v[j];
      }
    }
  }
  __syncthreads();

  // ldmatrix row addresses: lane l reads row l % 8 (rows >= M read row M - 1: their
  // output columns are discarded), k-segment l / 8.
  const T* x_lane = xs + min(lane & 7, p.M - 1) * XR + 8 * (lane >> 3);
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, part[4] = {0.f, 0.f, 0.f, 0.f};

  // Convert and multiply one chunk; at each group's end, scale its sums into acc.
  auto compute = [&](int c, const Chunk& b) {
    const int seg0 = c * CH;
    const T* xc = x_lane + (seg0 * KT - block_k0);
    [[maybe_unused]] float2 sc = make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < CH; ++i) {
      if (seg0 + i >= p.ktiles) break;  // K's last chunk (it ends on a group end: K_pad % GROUP == 0)
      uint32_t bx[4];
#pragma unroll
      for (int j = 0; j < K16; ++j) {
        const int k16 = i * K16 + j;  // within the chunk (compile-time)
        if (j % 2 == 0) ldmatrix_x4(bx, xc + k16 * 16);  // two k16 blocks of x
        if constexpr (GROUP != 0) {
          if (k16 % kGroupK16 == 0) {
            sc = pair_to_float2<Scale>(b.s[k16 / kGroupK16]);
            if constexpr (ZEROS) zc = zero_consts<T, BITS>(b.z[k16 / kGroupK16]);
          }
        }
        uint32_t a[4];
        convert_segment_k16<T, BITS, ZEROS>(b.w[i], j, zc, a);
        const uint32_t bb[2] = {bx[(j % 2) * 2], bx[(j % 2) * 2 + 1]};
        mma_16816<T>(part, a, bb);
        if constexpr (GROUP != 0) {
          if ((k16 + 1) % kGroupK16 == 0) {
            acc[0] += sc.x * part[0];
            acc[1] += sc.x * part[1];
            acc[2] += sc.y * part[2];
            acc[3] += sc.y * part[3];
#pragma unroll
            for (int q = 0; q < 4; ++q) part[q] = 0.f;
          }
        }
      }
    }
  };

  // The pipeline, unrolled by two so that the buffers keep compile-time names.
  for (int c = c_begin; c < c_end; c += 2) {
    if (c + 1 < c_end && c != c_begin) load(c + 1, buf[1]);  // (the first pair: before the wait)
    compute(c, buf[0]);
    if (c + 1 >= c_end) break;
    if (c + 2 < c_end) load(c + 2, buf[0]);
    compute(c + 1, buf[1]);
  }
  if constexpr (GROUP == 0) {  // per-channel: one scale per output row, applied once
    acc[0] = channel_scale.x * part[0];
    acc[1] = channel_scale.x * part[1];
    acc[2] = channel_scale.y * part[2];
    acc[3] = channel_scale.y * part[3];
  }

  // k-warps 1..KW-1 hand their sums to k-warp 0, lane for lane (fixed order).
  if constexpr (KW > 1) {
    float* red = reinterpret_cast<float*>(reinterpret_cast<char*>(smem) + p.M * XR * static_cast<int>(sizeof(T)));
    auto slot = [&](int k, int i) { return red + (((k - 1) * TPB + tb) * 4 + i) * 32 + lane; };
    if (kw > 0) {
#pragma unroll
      for (int i = 0; i < 4; ++i) *slot(kw, i) = acc[i];
    }
    __syncthreads();
    if (kw == 0) {
      for (int k = 1; k < KW; ++k)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] += *slot(k, i);
    }
  }

  // Accumulator i holds y[m][n], m = 2 * t4 + (i & 1), n = 16 * tile + gid + 8 * (i >> 1).
  constexpr int kCols = 16 * TPB;
  if (p.splits == 1) {
    if (kw == 0 && tile_ok && p.swiglu) {  // (i, i + 2): gate and up of channel 8 tile + gid (swiglu_column)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int m = 2 * t4 + i;
        if (m < p.M) store_swiglu(y, p.N, m, 16 * tile + gid, acc[i], acc[i + 2], bias);
      }
    } else if (kw == 0 && tile_ok) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = 2 * t4 + (i & 1), n = 16 * tile + gid + 8 * (i >> 1);
        if (m < p.M && n < p.N) {
          const float bv = bias ? to_float(bias[n]) : 0.f;
          y[static_cast<size_t>(m) * p.N + n] = from_float<T>(acc[i] + bv);
        }
      }
    }
    return;
  }
  float* ws = p.workspace + static_cast<size_t>(blockIdx.x) * p.M * kCols;
  if (kw == 0 && tile_ok) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int m = 2 * t4 + (i & 1);
      if (m < p.M) ws[m * kCols + 16 * tb + gid + 8 * (i >> 1)] = acc[i];
    }
  }
  __syncthreads();  // every partial written before thread 0 releases them
  if (tid == 0) is_last_contributor = atomic_add_acq_rel(&p.counters[column], 1) == p.splits - 1;
  __syncthreads();
  if (!is_last_contributor) return;
  const float* first = p.workspace + static_cast<size_t>(column) * p.splits * p.M * kCols;
  auto column_sum = [&](int o, int n) {
    float sum = bias ? to_float(bias[n]) : 0.f;
    for (int s = 0; s < p.splits; ++s) sum += __ldcg(first + static_cast<size_t>(s) * p.M * kCols + o);  // fixed order
    return sum;
  };
  for (int o = tid; o < p.M * kCols; o += kThreads) {
    const int m = o / kCols, n = column * kCols + o % kCols;
    if (n >= p.N) continue;
    if (p.swiglu) {  // a gate row (first half of its n-tile) with its up row, 8 on
      if (n & 8) continue;
      store_swiglu<T>(y, p.N, m, n, column_sum(o, n), column_sum(o + 8, n + 8), nullptr);  // (bias in the sums)
      continue;
    }
    y[static_cast<size_t>(m) * p.N + n] = from_float<T>(column_sum(o, n));
  }
  if (tid == 0) p.counters[column] = 0;  // re-arm for the next launch / graph replay
}

}  // namespace woq
