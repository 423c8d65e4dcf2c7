// GEMV instantiations for M = 17..32 (MB = 3, 4), bf16 activations, 2 k-warp(s) per n-tile
// (see gemv_launch.cuh).
// The kernels compile for every architecture; below sm_80 the host refuses bf16.
#include "gemv_launch.cuh"

namespace woq {
WOQ_GEMV_WIDE_INSTANTIATE_KW(__nv_bfloat16, 2)
}  // namespace woq
