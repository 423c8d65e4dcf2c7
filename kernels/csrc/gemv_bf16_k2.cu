// GEMV instantiations for bf16 activations, 2 k-warp(s) per n-tile (see gemv_launch.cuh).
// The kernels compile for every architecture; below sm_80 the host refuses bf16 (no bf16
// tensor cores).
#include "gemv_launch.cuh"

namespace woq {
WOQ_GEMV_INSTANTIATE(__nv_bfloat16, 2)
}  // namespace woq
