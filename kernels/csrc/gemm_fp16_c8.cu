// Mixed-GEMM instantiations for fp16 activations, tile configuration 8 (see gemm.cuh).
#include "gemm_launch.cuh"

namespace woq {
WOQ_GEMM_INSTANTIATE(__half, 8)
}  // namespace woq
