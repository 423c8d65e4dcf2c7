// Instantiations and launchers of the woq kernels (framework-free; see woq_kernels.h).
#include <algorithm>
#include <atomic>

#include "dequant.cuh"
#include "woq_kernels.h"

namespace woq {

// Defined in gemv_launch.cuh, instantiated in gemv_{fp16,bf16}_k{1,2,4}.cu (M <= 16) and
// gemv_{fp16,bf16}_m32_k{1,2}.cu (M = 17..32).
template <typename T, int BITS, int MB, int KW, int GROUP, bool ZEROS>
cudaError_t gemv_launch(const GemvArgs& a, cudaStream_t stream);
// Defined in gemv_stream_launch.cuh, instantiated in gemv_stream_{fp16,bf16}_int{4,8}.cu.
template <typename T, int BITS, int TPB, int GROUP, bool ZEROS>
cudaError_t gemv_stream_launch(const GemvArgs& a, cudaStream_t stream);
// Defined in gemm_launch.cuh, instantiated in gemm_{fp16,bf16}_c{0..9}.cu.
template <typename T, int BITS, int CFG, int GROUP, bool ZEROS>
cudaError_t gemm_launch(const GemmArgs& a, cudaStream_t stream);

namespace {

template <typename T, int BITS, int MB, int KW>
cudaError_t gemv_by_group(const GemvArgs& a, cudaStream_t stream) {
  const bool z = a.weight.zeros != nullptr;
  const int group = a.weight.group_size >= a.weight.K_pad ? 0 : a.weight.group_size;
#define WOQ_CASE(G) \
  case G: return z ? gemv_launch<T, BITS, MB, KW, G, true>(a, stream) : gemv_launch<T, BITS, MB, KW, G, false>(a, stream);
  if constexpr (MB > 2) {  // M > 16: the wide instantiations (gemv_launch.cuh)
    switch (group) {
      WOQ_CASE(0)
      WOQ_CASE(64)
      WOQ_CASE(128)
      default: return cudaErrorInvalidValue;
    }
  } else {
    switch (group) {
      WOQ_CASE(0)
      WOQ_CASE(32)
      WOQ_CASE(64)
      WOQ_CASE(128)
      WOQ_CASE(256)
      default: return cudaErrorInvalidValue;
    }
  }
#undef WOQ_CASE
}

// k-warps per n-tile when the caller leaves it to us: the fewest that make at least one
// column per SM (small shapes need the split to fill the GPU; large ones do not).
int default_k_warps(int N) {
  const int n_tiles = (N + 15) / 16;
  for (int kw = 1; kw < kGemvMaxKWarps; kw *= 2)
    if ((n_tiles + kGemvWarps / kw - 1) / (kGemvWarps / kw) >= gemv_sm_count()) return kw;
  return kGemvMaxKWarps;
}

template <typename T, int BITS, int MB>
cudaError_t gemv_with_k_warps(const GemvArgs& a, int k_warps, cudaStream_t stream) {
  switch (k_warps) {
    case 1: return gemv_by_group<T, BITS, MB, 1>(a, stream);
    case 2: return gemv_by_group<T, BITS, MB, 2>(a, stream);
    case 4:
      if constexpr (MB <= 2) return gemv_by_group<T, BITS, MB, 4>(a, stream);
      return cudaErrorInvalidValue;  // at most 2 k-warps above 16 rows (gemv_launch.cuh)
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, int BITS, int MB>
cudaError_t gemv_by_k_warps(const GemvArgs& a, cudaStream_t stream) {
  if (a.k_warps > 0) return gemv_with_k_warps<T, BITS, MB>(a, a.k_warps, stream);
  // Our choice: the shape's default, halved while not even a 2-stage ring fits this GPU's
  // shared memory (a stage grows with the k-warps and with M: a T4's 64 KB hold 1 k-warp's
  // int4 stages up to M = 16, an RTX 30/40's 99 KB 2 k-warps' up to 16; an H100 holds all).
  int k_warps = std::min(default_k_warps(a.weight.N), MB > 2 ? kGemvWideMaxKWarps : kGemvMaxKWarps);
  cudaError_t err = gemv_with_k_warps<T, BITS, MB>(a, k_warps, stream);
  while (err == cudaErrorInvalidConfiguration && k_warps > 1) {
    k_warps /= 2;
    err = gemv_with_k_warps<T, BITS, MB>(a, k_warps, stream);
  }
  return err;
}

template <typename T, int BITS>
cudaError_t gemv_by_m(const GemvArgs& a, cudaStream_t stream) {
  switch ((a.M + 7) / 8) {  // blocks of 8 rows
    case 1: return gemv_by_k_warps<T, BITS, 1>(a, stream);
    case 2: return gemv_by_k_warps<T, BITS, 2>(a, stream);
    case 3: return gemv_by_k_warps<T, BITS, 3>(a, stream);
    default: return gemv_by_k_warps<T, BITS, 4>(a, stream);
  }
}

template <typename T, int BITS, int TPB>
cudaError_t gemv_stream_by_group(const GemvArgs& a, cudaStream_t stream) {
  const bool z = a.weight.zeros != nullptr;
  const int group = a.weight.group_size >= a.weight.K_pad ? 0 : a.weight.group_size;
#define WOQ_CASE(G) \
  case G: return z ? gemv_stream_launch<T, BITS, TPB, G, true>(a, stream) : gemv_stream_launch<T, BITS, TPB, G, false>(a, stream);
  switch (group) {
    WOQ_CASE(0)
    WOQ_CASE(32)
    WOQ_CASE(64)
    WOQ_CASE(128)
    WOQ_CASE(256)
#undef WOQ_CASE
    default: return cudaErrorInvalidValue;
  }
}

// The register stream's k-warps when the caller leaves them to us: the fewest whose
// columns (8 / k_warps n-tiles each) give two blocks per SM without splitting K.
template <typename T, int BITS>
cudaError_t gemv_stream_by_k_warps(const GemvArgs& a, cudaStream_t stream) {
  int k_warps = a.k_warps;
  if (k_warps == 0) {
    const int n_tiles = (a.weight.N + 15) / 16;
    k_warps = kGemvWarps;
    for (int kw = 1; kw < kGemvWarps; kw *= 2)
      if (k_warps == kGemvWarps && (n_tiles + kGemvWarps / kw - 1) / (kGemvWarps / kw) >= 2 * gemv_sm_count()) k_warps = kw;
  }
  switch (k_warps) {
    case 1: return gemv_stream_by_group<T, BITS, 8>(a, stream);
    case 2: return gemv_stream_by_group<T, BITS, 4>(a, stream);
    case 4: return gemv_stream_by_group<T, BITS, 2>(a, stream);
    case 8: return gemv_stream_by_group<T, BITS, 1>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, int BITS, int CFG>
cudaError_t gemm_by_group(const GemmArgs& a, cudaStream_t stream) {
  const bool z = a.weight.zeros != nullptr;
  switch (a.weight.group_size >= a.weight.K_pad ? 0 : a.weight.group_size) {
#define WOQ_CASE(G) \
  case G: return z ? gemm_launch<T, BITS, CFG, G, true>(a, stream) : gemm_launch<T, BITS, CFG, G, false>(a, stream);
    WOQ_CASE(0)
    WOQ_CASE(64)
    WOQ_CASE(128)
#undef WOQ_CASE
    default: return cudaErrorInvalidValue;
  }
}

// The tile configuration when the caller leaves it to us: block rows just above M
// (no tile computes mostly padding), 128-row tiles beyond.
int default_gemm_config(int M) { return M <= 32 ? 0 : M <= 64 ? 1 : 2; }

template <typename T, int BITS>
cudaError_t gemm_with_config(const GemmArgs& a, int config, cudaStream_t stream) {
  switch (config) {
    case 0: return gemm_by_group<T, BITS, 0>(a, stream);
    case 1: return gemm_by_group<T, BITS, 1>(a, stream);
    case 2: return gemm_by_group<T, BITS, 2>(a, stream);
    case 3: return gemm_by_group<T, BITS, 3>(a, stream);
    case 4: return gemm_by_group<T, BITS, 4>(a, stream);
    case 5: return gemm_by_group<T, BITS, 5>(a, stream);
    case 6: return gemm_by_group<T, BITS, 6>(a, stream);
    case 7: return gemm_by_group<T, BITS, 7>(a, stream);
    case 8: return gemm_by_group<T, BITS, 8>(a, stream);
    case 9: return gemm_by_group<T, BITS, 9>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

// The caller's configuration, or ours: by M, then the smallest tile (config 4) where this
// GPU's shared memory holds no 2-stage ring of the larger one (an RTX 30/40's 99 KB and
// the int8 tiles of configs 1 and 2).
template <typename T, int BITS>
cudaError_t gemm_by_config(const GemmArgs& a, cudaStream_t stream) {
  if (a.config >= 0) return gemm_with_config<T, BITS>(a, a.config, stream);
  const cudaError_t err = gemm_with_config<T, BITS>(a, default_gemm_config(a.M), stream);
  return err == cudaErrorInvalidConfiguration ? gemm_with_config<T, BITS>(a, 4, stream) : err;
}

template <typename T>
cudaError_t gemv_by_bits(const GemvArgs& a, cudaStream_t stream) {
  if (a.pipeline == GemvPipeline::kRegisterStream)
    return a.weight.bits == 4 ? gemv_stream_by_k_warps<T, 4>(a, stream) : gemv_stream_by_k_warps<T, 8>(a, stream);
  return a.weight.bits == 4 ? gemv_by_m<T, 4>(a, stream) : gemv_by_m<T, 8>(a, stream);
}

template <typename T, int BITS>
cudaError_t dequant_launch(const DequantArgs& a, cudaStream_t stream) {
  const PackedWeight& w = a.weight;
  DequantParams p{static_cast<const uint4*>(w.qweight), w.scales, w.zeros, a.out, w.N, w.K, w.K_pad,
                  (w.N + 15) / 16, w.group_size, w.groups_pad};
  const long long tasks = static_cast<long long>(p.n_tiles) * ((w.K_pad + kDequantK - 1) / kDequantK);
  const unsigned blocks = static_cast<unsigned>((tasks + kDequantWarps - 1) / kDequantWarps);
  if (w.zeros) {
    dequant_kernel<T, BITS, true><<<blocks, kDequantWarps * 32, 0, stream>>>(p);
  } else {
    dequant_kernel<T, BITS, false><<<blocks, kDequantWarps * 32, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

bool valid_weight(const PackedWeight& w, DType dtype) {
  // K_pad is a multiple of the lane-load k (64 for int4, 32 for int8), so a dequantize
  // tile of 128 k holds whole lane loads.
  if (w.bits != 4 && w.bits != 8) return false;
  if (w.K % 8 != 0 || w.N < 1 || w.K_pad % TileShape<8, 1>::kK != 0) return false;
  if (w.bits == 4 && w.K_pad % TileShape<4, 1>::kK != 0) return false;
  if (w.group_size < w.K_pad && w.group_size != 32 && w.group_size != 64 && w.group_size != 128 && w.group_size != 256)
    return false;
  if (w.group_size < w.K_pad && w.K_pad % w.group_size != 0) return false;
  if (dtype == DType::kBFloat16 && device_cc_major() < 8) return false;  // no bf16 mma on Turing
  return true;
}

}  // namespace

int gemv_grid_columns(int N) { return (N + 15) / 16; }

ScratchSizes scratch_sizes(int N, int sms, int max_gemm_m) {
  // Workspace. The ring GEMV (gemv_launch.cuh) caps its grid at workspace_floats /
  // (2 M 16 kTiles): two partial columns per block; this holds them for up to 4 resident
  // blocks per SM at 32 rows of 128-channel columns (the 256-channel columns above 16
  // rows run one block per SM). The register stream (gemv_stream_launch.cuh) caps its
  // splits alike, M x 16 TPB floats per block, about two blocks per SM. The mixed GEMM
  // (gemm_launch.cuh) caps its grid at workspace_floats / (2 BM BN): two partial tiles per
  // block, one resident wave of its largest tiles.
  long long tile_floats = 0;
  for (const GemmTileConfig& c : kGemmTileConfigs)
    tile_floats = std::max(tile_floats, static_cast<long long>(c.bm()) * c.bn());
  const long long gemv_floats = 4LL * sms * 2 * kGemvMaxRows * kGemvWarps * 16;
  const long long floats = std::max(gemv_floats, 2LL * sms * tile_floats);
  // Counters. The GEMV: one per column, the narrowest being one n-tile (the register stream
  // at kGemvWarps k-warps: gemv_grid_columns). The mixed GEMM: one per output tile of its
  // smallest tile at max_gemm_m rows (with fewer, it runs one block per tile and needs none).
  long long counters = std::max<long long>(gemv_grid_columns(N), 2LL * sms);
  for (const GemmTileConfig& c : kGemmTileConfigs)
    counters = std::max(counters, static_cast<long long>((max_gemm_m + c.bm() - 1) / c.bm()) * ((N + c.bn() - 1) / c.bn()));
  return {floats, counters};
}

int device_cc_major() {
  int dev = 0, major = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  return major;
}

bool wgmma_available() {
#if defined(WOQ_BUILT_SM90A)
  int dev = 0, major = 0, minor = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

namespace {
bool programmatic_launch_enabled = true;
}  // namespace

void set_programmatic_launch(bool enabled) { programmatic_launch_enabled = enabled; }
bool programmatic_launch() { return programmatic_launch_enabled; }

namespace {
std::atomic<int> shared_memory_limit{0};
std::atomic<int> shared_memory_generation_{0};
}  // namespace

void set_shared_memory_limit(int bytes) {
  shared_memory_limit.store(bytes > 0 ? bytes : 0);
  shared_memory_generation_.fetch_add(1);
}

SharedMemoryBudget shared_memory_budget() {
  int dev = 0, per_block = 0, per_sm = 0, reserved = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
  cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev);
  const int limit = shared_memory_limit.load();
  if (limit > 0) {
    per_block = std::min(per_block, limit);
    per_sm = std::min(per_sm, limit);
  }
  return {per_block, per_sm, reserved};
}

int shared_memory_generation() { return shared_memory_generation_.load(std::memory_order_relaxed); }

int gemv_sm_count() {
  static int count = 0;
  if (count == 0) {
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev);
  }
  return count;
}

cudaError_t launch_gemv(const GemvArgs& a, cudaStream_t stream) {
  if (!valid_weight(a.weight, a.dtype) || a.M < 1 || a.M > kGemvMaxM) return cudaErrorInvalidValue;
  if (a.pipeline == GemvPipeline::kRegisterStream && a.M > kGemvStreamMaxRows) return cudaErrorInvalidValue;
  if (a.workspace == nullptr || a.counters == nullptr) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(a.x) % 16 != 0) return cudaErrorInvalidValue;
  if (a.epilogue == GemvEpilogue::kSwiGLU && a.weight.N % 16 != 0) return cudaErrorInvalidValue;  // whole n-tiles
  return a.dtype == DType::kFloat16 ? gemv_by_bits<__half>(a, stream) : gemv_by_bits<__nv_bfloat16>(a, stream);
}

cudaError_t launch_gemm(const GemmArgs& a, cudaStream_t stream) {
  // sm_80+ (cp.async, bf16 mma); a T4's mid-M layers run dequantize + cuBLAS.
  if (!valid_weight(a.weight, a.dtype) || a.M < 1 || device_cc_major() < 8) return cudaErrorInvalidValue;
  if (a.workspace == nullptr || a.counters == nullptr) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(a.x) % 16 != 0) return cudaErrorInvalidValue;
  if (a.dtype == DType::kFloat16)
    return a.weight.bits == 4 ? gemm_by_config<__half, 4>(a, stream) : gemm_by_config<__half, 8>(a, stream);
  return a.weight.bits == 4 ? gemm_by_config<__nv_bfloat16, 4>(a, stream) : gemm_by_config<__nv_bfloat16, 8>(a, stream);
}

cudaError_t launch_dequant(const DequantArgs& a, cudaStream_t stream) {
  if (!valid_weight(a.weight, a.dtype)) return cudaErrorInvalidValue;
  if (a.dtype == DType::kFloat16) {
    return a.weight.bits == 4 ? dequant_launch<__half, 4>(a, stream) : dequant_launch<__half, 8>(a, stream);
  }
  return a.weight.bits == 4 ? dequant_launch<__nv_bfloat16, 4>(a, stream) : dequant_launch<__nv_bfloat16, 8>(a, stream);
}

}  // namespace woq
