// Mixed-GEMM instantiations for bf16 activations, tile configuration 7 (see gemm.cuh).
#include "gemm_launch.cuh"

namespace woq {
WOQ_GEMM_INSTANTIATE(__nv_bfloat16, 7)
}  // namespace woq
