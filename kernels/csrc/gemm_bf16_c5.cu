// Mixed-GEMM instantiations for bf16 activations, tile configuration 5 (see gemm.cuh).
#include "gemm_launch.cuh"

namespace woq {
WOQ_GEMM_INSTANTIATE(__nv_bfloat16, 5)
}  // namespace woq
