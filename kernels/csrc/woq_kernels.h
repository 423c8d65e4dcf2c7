// Host API of the woq CUDA kernels: plain C++, no framework types, so that the kernels
// build with nvcc alone (CI compiles them for sm_75..sm_90) and any binding can call them.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace woq {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };

// One quantized weight in the GPU layout (kernels/layout.py).
struct PackedWeight {
  const void* qweight;  // [n_tiles, K_pad / KT, 32 lanes, 16 bytes]
  const void* scales;   // [n_tiles, groups_pad, 16], activation dtype
  const void* zeros;    // same layout, or nullptr for symmetric weights
  int bits;             // 4 or 8
  int N, K, K_pad;      // logical output/input features, padded K
  int group_size;       // >= K_pad means per-channel
  int groups_pad;
};

// Rows the GEMV takes: up to 16 for every weight, up to 32 for per-channel, g64 and g128
// weights (the formats the mixed GEMM also takes, between which the tuner chooses).
constexpr int kGemvAnyWeightMaxRows = 16;
constexpr int kGemvMaxRows = 32;

// How the GEMV's weights reach the tensor cores: through a shared-memory ring of cp.async
// stages (gemv.cuh; any M the GEMV takes), or streamed by each warp into registers
// (gemv_stream.cuh; M <= 8). The tuner measures both per shape and M.
enum class GemvPipeline : int { kSharedRing = 0, kRegisterStream = 1 };
constexpr int kGemvStreamMaxRows = 8;

// What the GEMV writes. kSwiGLU: the weight is a SwiGLU MLP's fused gate and up
// projections with their rows interleaved in eights (gate rows 8j..8j+7, then up rows
// 8j..8j+7: kernels/format.py, interleave_gate_up), N a multiple of 16, and y is
// silu(gate) * up, [M, N / 2] -- so that gate[j] and up[j] land in the same thread's
// accumulators and the activation needs no kernel of its own.
enum class GemvEpilogue : int { kNone = 0, kSwiGLU = 1 };

// A decode step's attention, done by the first blocks of the o projection's register-stream
// GEMV (attention.cuh), whose x is then `out`. One query token per sequence.
// What its roles take: up to 8 query heads per KV head (rows 0..7 of an mma's A, the rows
// 8..15 zero), query heads x head_dim of a KV head up to 2048 (q and the new k and v in
// registers), head_dim up to 256 (a warp's p @ v accumulators).
constexpr int kAttentionMaxGroup = 8;
constexpr int kAttentionMaxGroupDims = 2048;
constexpr int kAttentionMaxHeadDim = 256;
constexpr int kAttentionMaxSplits = 16;  // shares per (sequence, KV head)
struct DecodeAttention {
  const void* qkv;            // [batch, (heads + 2 kv_heads) head_dim] the qkv projection's rows
  long long qkv_stride;       // elements between rows
  void* k_cache;              // [slots, kv_heads, positions, head_dim], rows contiguous
  void* v_cache;              // same strides as k_cache
  long long cache_slot_stride, cache_head_stride, cache_pos_stride;  // elements
  const long long* slots;     // [batch] each sequence's cache slot
  const long long* lengths;   // [batch] live positions, the new one included
  const long long* positions; // [batch] the new token's position (RoPE row, cache row)
  const float* cos;           // [max positions, head_dim] RoPE tables
  const float* sin;
  long long rope_stride;
  float* part;                // [batch, splits, heads, head_dim] partial outputs of the shares
  float* lse;                 // [batch, splits, kv_heads, kAttentionMaxGroup] their log-sum-exps (32-byte slots)
  int* merge_counters;        // [batch * kv_heads], zero, re-armed
  int* flags;                 // [2], zero, re-armed: heads written, blocks past the wait
  void* out;                  // [batch, heads * head_dim]: the attention output, the GEMV's x
  int batch, heads, kv_heads, head_dim;
  int splits;                 // shares per (sequence, KV head): at most this (part's size); the
                              // launcher takes the largest power of two the grid holds
  float scale;                // softmax scale, 1 / sqrt(head_dim)
};

// The persistent batch-1 decode step (decode_step.cuh): every decoder layer of a
// Llama-family model in one kernel. What it reads of each layer, built once per model and
// KV cache (a device array of StepLayer, whose pointers must outlive it):
struct StepWeight {
  const void* qweight;     // PackedWeight's qweight: [n_tiles][ktiles][32][16 bytes]
  const void* scales;      // [n_tiles][groups_pad][16], activation dtype
  const void* zeros;       // same, or nullptr
  int n_tiles, ktiles, groups_pad, pad_;
};
constexpr int kStepLinears = 4;  // qkv, o, gate/up (rows interleaved for SwiGLU), down
struct StepLayer {
  StepWeight linear[kStepLinears];
  const void* norm[2];             // input and post-attention RMSNorm weights [hidden]
  DecodeAttention attention;       // the layer's cache, the shared qkv/part/lse/out buffers;
                                   // slots, lengths, positions and flags are set per launch
};
struct DecodeStepArgs {
  const StepLayer* layers;  // device array [n_layers]
  int n_layers;
  int n_tiles[kStepLinears];  // of each linear, the same in every layer (as StepWeight's)
  int ktiles[kStepLinears];
  int groups_pad[kStepLinears];
  void* h;                  // [hidden] residual stream: the embedding in, the last layer's sum out
  void* qkv;                // [(heads + 2 kv_heads) head_dim] = the layers' attention.qkv
  void* attn;               // [hidden] = the layers' attention.out
  void* act;                // [inter] silu(gate) * up
  const long long* slots;   // [1] the sequence's slot, live length (its new token included), position
  const long long* lengths;
  const long long* positions;
  int* counters;            // >= decode_step_counters(n_layers) int32 zeros, left zero
  int hidden, inter;
  int bits, group_size;
  bool zeros;
  int roles;                // attention roles: kv_heads * the layers' attention.splits
  int kv_heads;             // attention outputs (KV heads) o waits for, a layer
  int cache_hints = 0;      // decode_step.cuh's kHint*: the weight stream evict_first in L2, small data prefetched
  int max_slots = 0;        // shared-memory ring slots, at most (0: as many as fit)
  float eps;
  DType dtype;
  int skip = 0;             // measurement only: parts left out (decode_step.cuh, kSkip*); results wrong
  unsigned long long* trace = nullptr;  // measurement only: the step's timeline (decode_step.cuh, TraceEvent)
};
int decode_step_counters(int n_layers);
int decode_step_trace_events();  // words per (block, layer) of DecodeStepArgs::trace
// cudaErrorNotSupported: not an sm_90 device, or a weight format without an instantiation
// (int4 g128 for now); cudaErrorInvalidConfiguration: the ring does not fit the shared
// memory; cudaErrorCooperativeLaunchTooLarge: not one block per SM, or more roles than blocks.
cudaError_t launch_decode_step(const DecodeStepArgs& args, cudaStream_t stream);

struct GemvArgs {
  PackedWeight weight;
  const void* x;     // [M, K], row-major, K % 8 == 0, 16-byte aligned
  const void* bias;  // [N] or nullptr
  void* y;           // [M, N] ([M, N / 2] with the SwiGLU epilogue)
  int M;                   // 1..32 (17..32: per-channel, g64 and g128 weights only; register stream: 1..8)
  int max_blocks;          // grid size; 0 = one resident wave (ring) / about 2 blocks per SM (stream)
  int k_warps;             // warps splitting each n-tile's K: ring 1, 2, 4 (M > 16: 1, 2); stream 1, 2, 4, 8; 0 = by shape
  GemvPipeline pipeline;
  float* workspace;        // partial column sums: ring 2 * M * (column channels: 128, or 256 at M > 16 and 1 k-warp)
                           // floats per block; stream M * 128 / k_warps per block
  long long workspace_floats;
  int* counters;           // >= gemv_grid_columns(N) ints, zero-initialised
  DType dtype;
  GemvEpilogue epilogue;   // kSwiGLU: y is [M, N / 2]
  // Register stream only: the attention whose output is x, done by the grid's first blocks
  // (M = batch). The launch fails with cudaErrorCooperativeLaunchTooLarge where the grid is
  // more than one resident wave or holds fewer blocks than batch * kv_heads.
  const DecodeAttention* attention = nullptr;
};

// The mixed GEMM (any M; per-channel, g64 and g128 weights; sm_80+).
struct GemmArgs {
  PackedWeight weight;
  const void* x;     // [M, K], row-major, K % 8 == 0, 16-byte aligned
  const void* bias;  // [N] or nullptr
  void* y;           // [M, N]
  int M;
  int config;        // tile configuration 0..9 (gemm.cuh; 5..9 where wgmma_available); -1 = by M
  int splits;        // blocks per output tile (split-K); 0 = one resident wave (stream-K)
  float* workspace;  // partial tiles: 2 * BM * BN floats per block (the grid is capped to fit)
  long long workspace_floats;
  int* counters;     // one per output tile, zero-initialised (fewer: one block per tile)
  long long counters_len;
  DType dtype;
};

struct DequantArgs {
  PackedWeight weight;
  void* out;  // [N, K] row-major
  DType dtype;
};

// The dense (unquantized) GEMV (dense_gemv.cuh): y = x w^T (+ bias), x [M, K], w [N, K]
// row-major, y [M, N], all of `dtype` (y float32 with float_out, its values rounded to
// `dtype` first), 16-byte aligned, K a multiple of 8. It holds x as fp32 in shared memory:
// M <= kDenseGemvMaxRows and M K 4 bytes <= kDenseGemvMaxXBytes.
constexpr int kDenseGemvMaxRows = 4;
constexpr int kDenseGemvMaxXBytes = 64 * 1024;
struct DenseGemvArgs {
  const void* x;
  const void* w;
  const void* bias;  // [N] or nullptr
  void* y;
  int M, N, K;
  DType dtype;
  bool float_out = false;
};
// cudaErrorInvalidValue: arguments outside the above.
cudaError_t launch_dense_gemv(const DenseGemvArgs& args, cudaStream_t stream);

// Columns of the narrowest kind (one n-tile of 16 output channels: the register stream at 8
// k-warps): the number of counters the GEMV needs.
int gemv_grid_columns(int N);
// Multiprocessors of the current device (cached).
int gemv_sm_count();
// Compute capability major of the current device.
int device_cc_major();
// Whether the mixed GEMM's wgmma configurations (5..9) run here: this library holds sm_90a
// code (built with -DWOQ_BUILT_SM90A and an sm_90a target: kernels/ops.py, setup.py) and
// the current device is compute capability 9.0 (H100, H200).
bool wgmma_available();

// Shared memory the launchers plan their rings with, in bytes: the current device's
// per-block opt-in maximum and per-SM capacity (an H100 227 / 228 KB, an A100 163 / 164,
// an RTX 30/40 or L4 99 / 100, a T4 64 / 64), each capped by set_shared_memory_limit.
// The cap (0: none) lets a GPU test on a large GPU run the shallower rings a small one gets.
struct SharedMemoryBudget {
  int per_block, per_sm, reserved_per_block;
};
SharedMemoryBudget shared_memory_budget();
void set_shared_memory_limit(int bytes);
// Changes with every set_shared_memory_limit: the launchers' cached plans expire.
int shared_memory_generation();

// Programmatic dependent launch of the GEMV and GEMM on sm_90+ (launch.cuh): on by
// default; off makes every launch a plain one (for measuring what it brings).
void set_programmatic_launch(bool enabled);
bool programmatic_launch();

// Where the GEMV blocks of a WOQ_TRACE build write their timeline (trace.cuh): `data`
// holds a record count, then `capacity` records; null stops tracing. False (and nothing
// set) in a build without WOQ_TRACE.
constexpr int kTraceWordsPerRecord = 8;
bool set_trace_buffer(unsigned long long* data, long long capacity);

// Launch on `stream`. Returns cudaErrorInvalidValue for unsupported arguments (bits,
// M, alignment, bf16 below sm_80), else the launch status.
cudaError_t launch_gemv(const GemvArgs& args, cudaStream_t stream);
cudaError_t launch_gemm(const GemmArgs& args, cudaStream_t stream);
cudaError_t launch_dequant(const DequantArgs& args, cudaStream_t stream);

}  // namespace woq
