// Host side of the tensor copies (TMA) the mixed GEMM's wgmma configurations load their
// stages with: CUtensorMap descriptors, encoded by the driver. The driver's encoder is
// reached through the runtime (cudaGetDriverEntryPointByVersion), so nothing links
// against libcuda; only cuda.h's types are used.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace woq {

// A 2-byte or 4-byte tensor of `rank` (2 or 3) dimensions, innermost first: dims[i]
// elements, strides[i] the bytes between consecutive indices of dimension i + 1 (each a
// multiple of 16), boxes of box[i] elements. 128-byte swizzle or none. False where the
// driver refuses the description (the caller then copies with cp.async).
inline bool encode_tensor_map(CUtensorMap* map, const void* base, bool four_bytes, int rank, const cuuint64_t* dims,
                              const cuuint64_t* strides, const cuuint32_t* box, bool swizzle_128b) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  const cuuint32_t element_strides[3] = {1, 1, 1};
  return encode(map, four_bytes ? CU_TENSOR_MAP_DATA_TYPE_UINT32 : CU_TENSOR_MAP_DATA_TYPE_UINT16,
                static_cast<cuuint32_t>(rank), const_cast<void*>(base), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle_128b ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace woq
