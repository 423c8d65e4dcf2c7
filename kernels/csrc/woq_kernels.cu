// Instantiations and launchers of the woq kernels (framework-free; see woq_kernels.h).
#include "dequant.cuh"
#include "gemv.cuh"
#include "woq_kernels.h"

namespace woq {
namespace {

int device_cc_major() {
  int dev = 0, major = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  return major;
}

template <typename T, int BITS, int MB, bool ZEROS>
cudaError_t gemv_launch(const GemvArgs& a, cudaStream_t stream) {
  using Shape = TileShape<BITS>;
  const PackedWeight& w = a.weight;
  GemvParams p;
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
  p.group_size = w.group_size;
  p.groups_pad = w.groups_pad;
  const int nchunks = (w.K_pad + Shape::kChunk - 1) / Shape::kChunk;
  p.split_k = a.split_k < 1 ? 1 : (a.split_k > nchunks ? nchunks : a.split_k);
  p.chunks_per_split = (nchunks + p.split_k - 1) / p.split_k;
  p.split_k = (nchunks + p.chunks_per_split - 1) / p.chunks_per_split;  // no empty splits
  const bool grouped = w.group_size < w.K_pad;
  const int gpc = grouped ? Shape::kChunk / w.group_size : 0;
  const int smem = gemv_smem_bytes<T, BITS, MB>(gpc, ZEROS);
  auto kernel = gemv_kernel<T, BITS, MB, ZEROS>;
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
  }
  dim3 grid(gemv_grid_columns(w.N), p.split_k);
  kernel<<<grid, kGemvWarps * 32, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int BITS>
cudaError_t gemv_by_m(const GemvArgs& a, cudaStream_t stream) {
  const bool z = a.weight.zeros != nullptr;
  if (a.M <= 8) return z ? gemv_launch<T, BITS, 1, true>(a, stream) : gemv_launch<T, BITS, 1, false>(a, stream);
  return z ? gemv_launch<T, BITS, 2, true>(a, stream) : gemv_launch<T, BITS, 2, false>(a, stream);
}

template <typename T>
cudaError_t gemv_by_bits(const GemvArgs& a, cudaStream_t stream) {
  return a.weight.bits == 4 ? gemv_by_m<T, 4>(a, stream) : gemv_by_m<T, 8>(a, stream);
}

template <typename T, int BITS>
cudaError_t dequant_launch(const DequantArgs& a, cudaStream_t stream) {
  const PackedWeight& w = a.weight;
  DequantParams p{static_cast<const uint4*>(w.qweight), w.scales, w.zeros, a.out, w.N, w.K, w.K_pad,
                  (w.N + 15) / 16, w.group_size, w.groups_pad};
  const size_t units = static_cast<size_t>(p.n_tiles) * (w.K_pad / TileShape<BITS>::kK) * 32;
  const unsigned blocks = static_cast<unsigned>((units + 255) / 256);
  if (w.zeros) {
    dequant_kernel<T, BITS, true><<<blocks, 256, 0, stream>>>(p);
  } else {
    dequant_kernel<T, BITS, false><<<blocks, 256, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

bool valid_weight(const PackedWeight& w, DType dtype) {
  if (w.bits != 4 && w.bits != 8) return false;
  if (w.K % 8 != 0 || w.N < 1 || w.K_pad % TileShape<8>::kK != 0) return false;
  if (w.bits == 4 && w.K_pad % TileShape<4>::kK != 0) return false;
  if (w.group_size < w.K_pad && (w.group_size < 32 || (w.group_size & (w.group_size - 1)) != 0)) return false;
  if (dtype == DType::kBFloat16 && device_cc_major() < 8) return false;  // no bf16 mma on Turing
  return true;
}

}  // namespace

int gemv_grid_columns(int N) { return ((N + 15) / 16 + kGemvWarps - 1) / kGemvWarps; }

int gemv_num_chunks(int bits, int K_pad) {
  const int kc = bits == 4 ? TileShape<4>::kChunk : TileShape<8>::kChunk;
  return (K_pad + kc - 1) / kc;
}

cudaError_t launch_gemv(const GemvArgs& a, cudaStream_t stream) {
  if (!valid_weight(a.weight, a.dtype) || a.M < 1 || a.M > 16) return cudaErrorInvalidValue;
  if (a.split_k > 1 && (a.workspace == nullptr || a.counters == nullptr)) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(a.x) % 16 != 0) return cudaErrorInvalidValue;
  return a.dtype == DType::kFloat16 ? gemv_by_bits<__half>(a, stream) : gemv_by_bits<__nv_bfloat16>(a, stream);
}

cudaError_t launch_dequant(const DequantArgs& a, cudaStream_t stream) {
  if (!valid_weight(a.weight, a.dtype)) return cudaErrorInvalidValue;
  if (a.dtype == DType::kFloat16) {
    return a.weight.bits == 4 ? dequant_launch<__half, 4>(a, stream) : dequant_launch<__half, 8>(a, stream);
  }
  return a.weight.bits == 4 ? dequant_launch<__nv_bfloat16, 4>(a, stream) : dequant_launch<__nv_bfloat16, 8>(a, stream);
}

}  // namespace woq
