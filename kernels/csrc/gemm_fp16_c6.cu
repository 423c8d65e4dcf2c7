// Mixed-GEMM instantiations for fp16 activations, tile configuration 6 (see gemm.cuh).
#include "gemm_launch.cuh"

namespace woq {
WOQ_GEMM_INSTANTIATE(__half, 6)
}  // namespace woq
