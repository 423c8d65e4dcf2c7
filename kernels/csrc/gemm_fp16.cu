// Mixed-GEMM instantiations (M <= 64) for fp16 activations: the GEMV kernel with 4 or 8
// row blocks of x per converted weight fragment (see gemv.cuh, gemv_launch.cuh).
#include "gemv_launch.cuh"

namespace woq {
WOQ_GEMM_INSTANTIATE(__half)
}  // namespace woq
