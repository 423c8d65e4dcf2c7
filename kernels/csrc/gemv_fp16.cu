// GEMV instantiations for fp16 activations (see gemv_launch.cuh).
#include "gemv_launch.cuh"

namespace woq {
WOQ_GEMV_INSTANTIATE(__half)
}  // namespace woq
