// Mixed-GEMM instantiations for bf16 activations, tile configuration 9 (see gemm.cuh).
#include "gemm_launch.cuh"

namespace woq {
WOQ_GEMM_INSTANTIATE(__nv_bfloat16, 9)
}  // namespace woq
