// Mixed-GEMM instantiations for fp16 activations, tile configuration 4 (see gemm.cuh).
#include "gemm_launch.cuh"

namespace woq {
WOQ_GEMM_INSTANTIATE(__half, 4)
}  // namespace woq
