// GEMV instantiations for fp16 activations, 4 k-warp(s) per n-tile (see gemv_launch.cuh).
#include "gemv_launch.cuh"

namespace woq {
WOQ_GEMV_INSTANTIATE(__half, 4)
}  // namespace woq
