// Dequantize the packed GPU layout back to a dense [N, K] fp16/bf16 weight, for the
// dequant + cuBLAS path (large M, where a dense GEMM's reuse wins over reading int4).
// Same converters as the GEMV; each thread expands one 16-byte lane load.
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

template <typename T, int BITS, bool ZEROS>
__global__ void __launch_bounds__(256) dequant_kernel(const DequantParams p) {
  using Shape = TileShape<BITS>;
  using T2 = typename std::conditional<std::is_same<T, __half>::value, __half2, __nv_bfloat162>::type;
  const int ktiles = p.K_pad / Shape::kK;
  const size_t unit = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // one lane load
  const size_t tile = unit / 32;
  if (tile >= static_cast<size_t>(p.n_tiles) * ktiles) return;
  const int lane = static_cast<int>(unit % 32), gid = lane >> 2, t4 = lane & 3;
  const int nt = static_cast<int>(tile / ktiles), kt = static_cast<int>(tile % ktiles);
  const uint4 wv = p.w[unit];
  const T* scales = static_cast<const T*>(p.scales);
  const T* zeros = static_cast<const T*>(p.zeros);
  T* out = static_cast<T*>(p.out);
  const float bias_z = zero_point_bias(BITS);
#pragma unroll
  for (int j = 0; j < Shape::kK16; ++j) {
    const int k = kt * Shape::kK + j * 16 + 2 * t4;
    const int g = min(k / p.group_size, p.groups_pad - 1);
    const size_t off = (static_cast<size_t>(nt) * p.groups_pad + g) * 16;
    const float2 s = pair_to_float2<T>(reinterpret_cast<const uint32_t*>(scales + off)[gid]);
    float2 z = make_float2(bias_z, bias_z);
    if (ZEROS) z = pair_to_float2<T>(reinterpret_cast<const uint32_t*>(zeros + off)[gid]);
    uint32_t a[4];
    convert_segment_k16<T, BITS>(wv, j, ZeroConsts<T, BITS>(z.x, z.y), a);
    // a[r] holds rows (gid | gid+8) x columns (k | k+8), two consecutive k each
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int n = nt * 16 + gid + 8 * (r & 1), kk = k + 8 * (r >> 1);
      if (n >= p.N || kk >= p.K) continue;
      const float2 v = pair_to_float2<T>(a[r]);
      const float sc = (r & 1) ? s.y : s.x;
      T2 o;
      o.x = from_float<T>(v.x * sc);
      o.y = from_float<T>(v.y * sc);
      *reinterpret_cast<T2*>(out + static_cast<size_t>(n) * p.K + kk) = o;  // K % 8 == 0: kk + 1 < K
    }
  }
}

}  // namespace woq
