"""Names of the implementations a linear layer can run through (see ``models/dispatch.py``)."""

DENSE = "dense"  # unquantized layer: F.linear
DENSE_GEMV = "dense_gemv"  # unquantized layer, CUDA, M <= 2 (decode): the in-repo dense GEMV kernel
CPU_REFERENCE = "cpu_reference"  # quantized, off CUDA (or no compiled kernels): torch reference
GEMV = "gemv"  # CUDA, M <= 16 (8 to 32 as measured per shape): weight-only GEMV kernel
MIXED_GEMM = "mixed_gemm"  # CUDA, mid M: tensor-core GEMM with fused dequantization
DEQUANT_CUBLAS = "dequant_cublas"  # CUDA, large M: dequantize to a scratch buffer + cuBLAS
# CUDA decode step, o projection: the register-stream GEMV whose grid computes the step's
# attention first (kernels/csrc/attention.cuh); its time includes the attention's
ATTENTION_GEMV = "attention_gemv"
# CUDA batch-1 decode step: every decoder layer (their linears, norms and attention) in one
# persistent kernel (kernels/csrc/decode_step.cuh), one call a step
DECODE_STEP = "decode_step"
PATHS = (DENSE, DENSE_GEMV, CPU_REFERENCE, GEMV, MIXED_GEMM, DEQUANT_CUBLAS, ATTENTION_GEMV, DECODE_STEP)

GEMV_MAX_M = 16  # rows the GEMV path takes, any weight (row blocks MB = 1, 2), unless the
# tuner gives 9..16 to the mixed GEMM (GpuWeight.gemv_max_m = 8; tuning._gemv_reach).
# Rows it can take for per-channel, g64 and g128 weights (MB = 3, 4): between 17 and 32
# the tuner measures it against the mixed GEMM per shape (GpuWeight.gemv_max_m).
GEMV_WIDE_MAX_M = 32
