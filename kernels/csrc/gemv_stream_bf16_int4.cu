// Register-streaming GEMV instantiations (M <= 8) for bf16 activations, int4 weights: every
// tile count and group size (see gemv_stream_launch.cuh).
// The kernels compile for every architecture; below sm_80 the host refuses bf16.
#include "gemv_stream_launch.cuh"

namespace woq {
WOQ_STREAM_INSTANTIATE(__nv_bfloat16, 4)
}  // namespace woq
