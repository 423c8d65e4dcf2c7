// Mixed-GEMM instantiations for bf16 activations, tile configuration 4 (see gemm.cuh).
#include "gemm_launch.cuh"

namespace woq {
WOQ_GEMM_INSTANTIATE(__nv_bfloat16, 4)
}  // namespace woq
