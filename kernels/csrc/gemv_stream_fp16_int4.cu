// Register-streaming GEMV instantiations (M <= 8) for fp16 activations, int4 weights: every
// tile count and group size (see gemv_stream_launch.cuh).
#include "gemv_stream_launch.cuh"

namespace woq {
WOQ_STREAM_INSTANTIATE(__half, 4)
}  // namespace woq
