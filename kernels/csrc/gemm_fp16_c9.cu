// Mixed-GEMM instantiations for fp16 activations, tile configuration 9 (see gemm.cuh).
#include "gemm_launch.cuh"

namespace woq {
WOQ_GEMM_INSTANTIATE(__half, 9)
}  // namespace woq
