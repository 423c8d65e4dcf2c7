// Dequantize the packed GPU layout back to a dense [N, K] fp16/bf16 weight, for the
// dequant + cuBLAS path (large M, where a dense GEMM's reuse wins over reading int4).
//
// The write dominates (2 bytes out per 0.5 or 1 byte in), so it must be coalesced. A warp
// converts one 16-row x 128-k tile with the GEMV's converters (its lanes hold fragment
// pairs scattered over 16 rows), parks it in shared memory, and writes it back as 16
// full 256-byte row segments, 16 bytes per lane per store.
#pragma once

#include <type_traits>

#include "gemv.cuh"

namespace woq {

struct DequantParams {
  const uint4* w;
  const void* scales;
  const void* zeros;
  void* out;  // [N, K] row-major
  int N, K, K_pad, n_tiles, group_size, groups_pad;
};

constexpr int kDequantK = 128;             // k per warp tile
constexpr int kDequantStride = kDequantK + 8;  // +16 B per smem row: conflict-free stores
constexpr int kDequantWarps = 8;

template <typename T, int BITS, bool ZEROS>
__global__ void __launch_bounds__(kDequantWarps * 32) dequant_kernel(const DequantParams p) {
  using Shape = TileShape<BITS>;
  using T2 = typename std::conditional<std::is_same<T, __half>::value, __half2, __nv_bfloat162>::type;
  constexpr int kLoads = kDequantK / Shape::kK;  // lane loads per tile: 2 (int4) or 4 (int8)
  __shared__ __align__(16) T tile_smem[kDequantWarps][16 * kDequantStride];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, t4 = lane & 3;
  const int ktiles = p.K_pad / Shape::kK;
  const int kchunks = (p.K_pad + kDequantK - 1) / kDequantK;
  const long long task = static_cast<long long>(blockIdx.x) * kDequantWarps + warp;  // (n-tile, k-chunk)
  if (task >= static_cast<long long>(p.n_tiles) * kchunks) return;
  const int nt = static_cast<int>(task / kchunks), kc = static_cast<int>(task % kchunks);
  const Scale* scales = static_cast<const Scale*>(p.scales);
  const T* zeros = static_cast<const T*>(p.zeros);
  T* tile = tile_smem[warp];
  const float bz = zero_point_bias(BITS);

#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    const int kt = kc * kLoads + l;
    if (kt >= ktiles) break;
    const uint4 wv = p.w[(static_cast<size_t>(nt) * ktiles + kt) * 32 + lane];
#pragma unroll
    for (int j = 0; j < Shape::kK16; ++j) {
      const int k16 = kt * Shape::kK + j * 16;  // first k of this k16 block
      const int g = min(k16 / p.group_size, p.groups_pad - 1);
      const size_t off = (static_cast<size_t>(nt) * p.groups_pad + g) * 16;
      const float2 s = pair_to_float2<Scale>(reinterpret_cast<const uint32_t*>(scales + off)[gid]);
      const float2 z = ZEROS ? pair_to_float2<T>(reinterpret_cast<const uint32_t*>(zeros + off)[gid]) : make_float2(bz, bz);
      uint32_t a[4];
      convert_segment_k16<T, BITS, ZEROS>(wv, j, ZeroConsts<T, BITS>(z.x, z.y), a);
      // a[r]: row gid (+8 if r odd), columns 2*t4, 2*t4 + 1 (+8 if r >= 2) of the k16 block
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float2 v = pair_to_float2<T>(a[r]);
        const float sc = (r & 1) ? s.y : s.x;
        T2 o;
        o.x = from_float<T>(v.x * sc);
        o.y = from_float<T>(v.y * sc);
        const int row = gid + 8 * (r & 1), col = (l * Shape::kK + j * 16) + 2 * t4 + 8 * (r >> 1);
        *reinterpret_cast<T2*>(tile + row * kDequantStride + col) = o;
      }
    }
  }
  __syncwarp();
  // 16 rows x 128 columns = 256 segments of 16 bytes; 16 lanes write one row's 256 bytes.
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int seg = i * 32 + lane, row = seg / 16, col = (seg % 16) * 8;
    const int n = nt * 16 + row, k = kc * kDequantK + col;
    if (n < p.N && k < p.K) {  // K % 8 == 0: a segment is wholly inside or outside
      *reinterpret_cast<uint4*>(out + static_cast<size_t>(n) * p.K + k) =
          *reinterpret_cast<const uint4*>(tile + row * kDequantStride + col);
    }
  }
}

}  // namespace woq
