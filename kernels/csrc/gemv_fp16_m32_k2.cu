// GEMV instantiations for M = 17..32 (MB = 3, 4), fp16 activations, 2 k-warp(s) per n-tile
// (see gemv_launch.cuh).
#include "gemv_launch.cuh"

namespace woq {
WOQ_GEMV_WIDE_INSTANTIATE_KW(__half, 2)
}  // namespace woq
