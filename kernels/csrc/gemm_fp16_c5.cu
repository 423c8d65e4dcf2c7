// Mixed-GEMM instantiations for fp16 activations, tile configuration 5 (see gemm.cuh).
#include "gemm_launch.cuh"

namespace woq {
WOQ_GEMM_INSTANTIATE(__half, 5)
}  // namespace woq
