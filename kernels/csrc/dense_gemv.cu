// Launcher of the dense GEMV (dense_gemv.cuh).
#include <algorithm>
#include <atomic>

#include "dense_gemv.cuh"
#include "woq_kernels.h"

namespace woq {

namespace {

// Grid: every resident block of the instantiation (x is read once a block), or fewer
// where the rows run out: 8 rows a block at least.
template <typename T, int M, int U>
cudaError_t launch(const DenseGemvArgs& a, cudaStream_t stream) {
  auto kernel = dense_gemv_kernel<T, M, U>;
  const int smem = dense_gemv_smem_bytes(M, a.K);
  // (the occupancy query and opt-in are host time: once per shared-memory size and budget)
  static std::atomic<unsigned long long> cached{0};  // generation + 1 << 40 | smem << 8 | resident
  const unsigned long long tag = static_cast<unsigned long long>(shared_memory_generation()) + 1;
  unsigned long long c = cached.load(std::memory_order_relaxed);
  if ((c >> 40) != tag || ((c >> 8) & 0xffffffffull) != static_cast<unsigned long long>(smem)) {
    const int resident = std::min(resident_blocks(kernel, kDenseGemvThreads, smem), 255);
    c = (tag << 40) | (static_cast<unsigned long long>(smem) << 8) | static_cast<unsigned long long>(resident);
    cached.store(c, std::memory_order_relaxed);
  }
  const int resident = static_cast<int>(c & 255);
  if (resident < 1) return cudaErrorInvalidConfiguration;
  const int blocks = std::min((a.N + kDenseGemvWarps - 1) / kDenseGemvWarps, resident * gemv_sm_count());
  const DenseGemvParams p{a.x, static_cast<const uint4*>(a.w), a.bias, a.y, a.N, a.K, a.float_out};
  return launch_kernel(kernel, static_cast<unsigned>(blocks), kDenseGemvThreads, smem, stream, p);
}

// U, a lane's loads a pass: a row in as few passes as the registers allow (16 loads: 64
// of them), fewer for short rows, whose lanes would load nothing past K.
template <typename T, int M>
cudaError_t by_unroll(const DenseGemvArgs& a, cudaStream_t stream) {
  const int vecs = a.K / 8;
  if (vecs > 256) return launch<T, M, 16>(a, stream);
  if (vecs > 128) return launch<T, M, 8>(a, stream);
  return launch<T, M, 4>(a, stream);
}

template <typename T>
cudaError_t by_rows(const DenseGemvArgs& a, cudaStream_t stream) {
  switch (a.M) {
    case 1: return by_unroll<T, 1>(a, stream);
    case 2: return by_unroll<T, 2>(a, stream);
    case 3: return by_unroll<T, 3>(a, stream);
    case 4: return by_unroll<T, 4>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_dense_gemv(const DenseGemvArgs& a, cudaStream_t stream) {
  if (a.M < 1 || a.M > kDenseGemvMaxRows || a.N < 1 || a.K < 8 || a.K % 8 != 0 ||
      dense_gemv_smem_bytes(a.M, a.K) > kDenseGemvMaxXBytes)
    return cudaErrorInvalidValue;
  return a.dtype == DType::kFloat16 ? by_rows<__half>(a, stream) : by_rows<__nv_bfloat16>(a, stream);
}

}  // namespace woq
