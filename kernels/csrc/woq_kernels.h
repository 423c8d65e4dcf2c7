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

// Bump when a kernel's launch space (tile configs, k-warp counts, instantiated formats) or
// its numerics change: the tuner's tables (kernels/tuned/) are keyed on it.
constexpr int kTuningVersion = 1;

// GEMV. A block is kGemvWarps warps. Rows: up to kGemvAnyWeightMaxRows (row blocks MB = 1, 2)
// for every weight; up to kGemvMaxRows (MB = 3, 4) for per-channel, g64 and g128 weights,
// the formats the mixed GEMM also takes, between which the tuner chooses.
constexpr int kGemvWarps = 8;
constexpr int kGemvAnyWeightMaxRows = 16;
constexpr int kGemvMaxRows = 32;
// k-warps (warps splitting one n-tile's K) built for the shared-memory ring: 1, 2, 4 up to
// 16 rows, 1, 2 above (at 4, a 32-row int4 stage is ~82 KB: an H100 would hold 2). The register
// stream takes 1, 2, 4 and kGemvWarps.
constexpr int kGemvMaxKWarps = 4;
constexpr int kGemvWideMaxKWarps = 2;

// How the GEMV's weights reach the tensor cores: through a shared-memory ring of cp.async
// stages (gemv.cuh; any M the GEMV takes), or streamed by each warp into registers
// (gemv_stream.cuh; M <= kGemvStreamMaxRows). The tuner measures both per shape and M.
enum class GemvPipeline : int { kSharedRing = 0, kRegisterStream = 1 };
constexpr int kGemvStreamMaxRows = 8;

// What the GEMV writes. kSwiGLU: the weight is a SwiGLU MLP's fused gate and up
// projections with their rows interleaved in eights (gate rows 8j..8j+7, then up rows
// 8j..8j+7: kernels/format.py, interleave_gate_up), N a multiple of 16, and y is
// silu(gate) * up, [M, N / 2] -- so that gate[j] and up[j] land in the same thread's
// accumulators and the activation needs no kernel of its own.
enum class GemvEpilogue : int { kNone = 0, kSwiGLU = 1 };

// Mixed GEMM tile configurations (gemm.cuh): a block of kGemmWarps warps as WM x (8 / WM)
// warp tiles of MBW row blocks (8 rows) x NTW n-tiles (16 channels; wgmma: 64-channel
// slices). BM = WM * MBW * 8 rows, BN = (8 / WM) * NTW * 16 channels (wgmma: 2 * NTW * 64).
// min_blocks: resident blocks per SM the registers are capped for. stage_k4: k per stage
// with int4 weights (int8: kGemmStageK). Configs 5..9 use wgmma (sm_90a).
constexpr int kGemmWarps = 8;
constexpr int kGemmStageK = 128;
struct GemmTileConfig {
  int wm, mbw, ntw, min_blocks, stage_k4;
  bool wgmma;
  constexpr int bm() const { return wm * mbw * 8; }
  constexpr int bn() const { return kGemmWarps / wm * ntw * 16; }
};
constexpr int kGemmConfigs = 10;
constexpr GemmTileConfig kGemmTileConfigs[kGemmConfigs] = {
    {1, 4, 2, 1, kGemmStageK, false},   // 0:  32 x 256
    {2, 4, 4, 1, kGemmStageK, false},   // 1:  64 x 256
    {2, 8, 2, 1, kGemmStageK, false},   // 2: 128 x 128
    {2, 4, 2, 2, kGemmStageK, false},   // 3:  64 x 128
    {1, 4, 1, 2, kGemmStageK, false},   // 4:  32 x 128
    {1, 4, 2, 1, 256, true},            // 5:  32 x 256
    {1, 8, 2, 1, kGemmStageK, true},    // 6:  64 x 256
    {1, 16, 1, 1, kGemmStageK, true},   // 7: 128 x 128
    {1, 16, 2, 1, kGemmStageK, true},   // 8: 128 x 256
    {1, 2, 2, 1, 256, true},            // 9:  16 x 256
};
// Group sizes the mixed GEMM is instantiated for, besides per-channel (gemm_launch.cuh's
// WOQ_GEMM_INSTANTIATE_BITS and woq_kernels.cu's gemm_by_group list the same).
constexpr int kGemmGroupSizes[] = {64, 128};
constexpr int kGemmGroupCount = 2;

// A decode attention over a paged KV cache, one query token per sequence, computed by roles
// (attention.cuh): each role is one block's share of the live tokens of one (sequence, KV
// head). Limits: up to kAttentionMaxGroup query heads per KV head (rows 0..7 of an mma's A,
// rows 8..15 zero), query heads x head_dim of a KV head up to kAttentionMaxGroupDims (q and
// the new k and v in registers), kAttentionMaxSplits shares per (sequence, KV head).
// The cache is a pool of blocks of block_size positions; a sequence names its row of the
// block table, and position t of row r is row t % block_size of block
// block_table[r * blocks_per_row + t / block_size]. Entries a row has not been given point
// at a scratch block, so every position of a row maps to some block of the pool.
constexpr int kAttentionMaxGroup = 8;
constexpr int kAttentionMaxGroupDims = 2048;
constexpr int kAttentionMaxSplits = 16;
struct DecodeAttention {
  const void* qkv;            // [batch, (heads + 2 kv_heads) head_dim] the qkv projection's rows
  long long qkv_stride;       // elements between rows
  void* k_cache;              // [blocks, kv_heads, block_size, head_dim], contiguous
  void* v_cache;              // same shape as k_cache
  long long cache_block_stride, cache_head_stride, cache_pos_stride;  // elements
  const int* block_table;     // [rows, blocks_per_row] int32: each row's blocks, in position order
  int blocks_per_row;
  int block_shift;            // log2 block_size (a power of two)
  const long long* slots;     // [batch] each sequence's block-table row
  const long long* lengths;   // [batch] live positions, the new one included
  const long long* positions; // [batch] the new token's position (RoPE row, cache row)
  const float* cos;           // [max positions, head_dim] RoPE tables
  const float* sin;
  long long rope_stride;
  float* part;                // [batch, splits, heads, head_dim] partial outputs of the shares
  float* lse;                 // [batch, splits, kv_heads, kAttentionMaxGroup] their log-sum-exps (32-byte slots)
  int* merge_counters;        // [batch * kv_heads], zero, re-armed
  int* flags;                 // counts the heads written (release); the decode step: its attention counter
  void* out;                  // [batch, heads * head_dim] the attention output
  int batch, heads, kv_heads, head_dim;
  int splits;                 // shares per (sequence, KV head)
  float scale;                // softmax scale, 1 / sqrt(head_dim)
};

// A rank's peer allocation (peer_all_reduce.cu, opened by every other rank through CUDA
// IPC): the all-reduce's signals, its two data buffers of `capacity` bytes each, then the
// persistent decode step's area under tensor parallelism (decode_step.cuh):
//   [ counters: 2 a layer (o, down), uint32 | the step's epoch, uint32 | pad to 4 KiB |
//     data, o: kPeerMaxRanks rows of kStepMaxHidden | data, down: the same ]
// The rows are each rank's partial sums of the stage (2-byte activations).
constexpr int kPeerMaxRanks = 8;
constexpr int kPeerBlocks = 32;
constexpr int64_t kPeerSignalBytes = 4096;  // >= kPeerBlocks * kPeerMaxRanks * 4, keeps the data 4 KiB aligned
static_assert(kPeerBlocks * kPeerMaxRanks * 4 <= kPeerSignalBytes, "the signals outgrow their area");
constexpr int kStepPeerHeaderBytes = 4096;
constexpr int kStepPeerEpoch = kStepPeerHeaderBytes / 4 - 1;  // (u32 index; the counters are below it)
constexpr int kStepPeerMaxLayers = kStepPeerEpoch / 2;

// The persistent batch-1 decode step (decode_step.cuh): every decoder layer of a
// Llama-family model in one kernel. Limits: hidden size up to kStepMaxHidden (a block holds
// the normalised x in registers), head_dim up to kStepMaxHeadDim (the roles' p @ v
// accumulators), at most kStepMaxStagedUnits n-tiles of one linear per SM (a block stages
// its outputs of a stage in shared memory), kStepStages counters per layer (qkv,
// attention, o, gate/up, down) and one more for the exits: decode_step_counters.
constexpr int kStepMaxHidden = 8192;
constexpr int64_t kStepPeerDataBytes = int64_t{kPeerMaxRanks} * kStepMaxHidden * 2;  // one stage's rows
constexpr int64_t kStepPeerAreaBytes = kStepPeerHeaderBytes + 2 * kStepPeerDataBytes;
constexpr int kStepMaxHeadDim = 128;
constexpr int kStepMaxStagedUnits = 32;
constexpr int kStepStages = 5;
// What it reads of each layer, built once per model and KV cache (a device array of
// StepLayer, whose pointers must outlive it):
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
  DecodeAttention attention;       // the layer's cache, the block table (every layer's), the shared
                                   // qkv/part/lse/out buffers; slots, lengths, positions and flags
                                   // are set per launch
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
  const long long* slots;   // [1] the sequence's block-table row, live length (its new token
                            // included), position
  const long long* lengths;
  const long long* positions;
  int* counters;            // >= decode_step_counters(n_layers) int32 zeros, left zero
  unsigned long long* stamps = nullptr;  // null, or [n_layers * kStepStages + 1][stamps_per_row]: %globaltimer
                                         // (ns) when each block ended each (layer, stage), then the start
  int stamps_per_row = 0;                // = the grid (one block per SM)
  int hidden, inter;
  int bits, group_size;
  bool zeros;
  int roles;                // attention roles: kv_heads * the layers' attention.splits
  int kv_heads;             // attention outputs (KV heads) o waits for, a layer
  int cache_hints = 0;      // decode_step.cuh's kHint*: the weight stream evict_first in L2, small data prefetched
  int max_slots = 0;        // shared-memory ring slots, at most (0: as many as fit)
  float eps;
  DType dtype;
  // Tensor parallelism (world > 1): o and down are this rank's row-parallel shares; their
  // partial sums go to every rank's step area (peer_area[r]: rank r's, as opened in this
  // process), whose counters order the stages across ranks. Every rank runs the same number
  // of steps on the same number of SMs.
  int rank = 0, world = 1;
  void* peer_area[kPeerMaxRanks] = {};
};
int decode_step_counters(int n_layers);
// cudaErrorNotSupported: not an sm_90 device, or a weight format without an instantiation
// (only int4 g128 is built); cudaErrorInvalidConfiguration: the ring does not fit the shared
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
  unsigned long long* stamps = nullptr;  // a timed launch: each block's start and end (launch.cuh, BlockStamps)
  int stamps_len = 0;
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
  unsigned long long* stamps = nullptr;  // a timed launch: each block's start and end (launch.cuh, BlockStamps)
  int stamps_len = 0;
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
// The workspace floats and counters the GEMV and mixed GEMM launchers need for a weight of
// N output channels on a device of `sms` SMs, the GEMM serving up to max_gemm_m rows
// (woq_kernels.cu: which launcher needs which part). Every layer of a device can share one
// workspace and one counter array of these sizes (the largest N's).
struct ScratchSizes {
  long long workspace_floats, counters;
};
ScratchSizes scratch_sizes(int N, int sms, int max_gemm_m);
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
// default; off makes every launch a plain one.
void set_programmatic_launch(bool enabled);
bool programmatic_launch();

// Launch on `stream`. Returns cudaErrorInvalidValue for unsupported arguments (bits,
// M, alignment, bf16 below sm_80), else the launch status.
cudaError_t launch_gemv(const GemvArgs& args, cudaStream_t stream);
cudaError_t launch_gemm(const GemmArgs& args, cudaStream_t stream);
cudaError_t launch_dequant(const DequantArgs& args, cudaStream_t stream);

// One-shot all-reduce over peer memory (peer_all_reduce.cu: the allocation's layout and
// the epoch protocol). kPeerBlocks blocks run every call on every rank. (kPeerMaxRanks and
// the allocation's layout: above, beside the decode step's area in it.)
enum class PeerDType { kFloat16, kBFloat16, kFloat32 };
struct PeerBuffers {
  void* base[kPeerMaxRanks];  // each rank's allocation, opened in this process (base[rank]: its own)
};
struct PeerAllReduceArgs {
  void* x;             // in place: bytes % 16 == 0, 16-byte aligned
  int64_t bytes;       // at most capacity
  PeerDType dtype;
  PeerBuffers peers;
  uint32_t* counters;  // kPeerBlocks epochs, this rank's own memory, zeroed once
  int rank, world;
  int64_t capacity;    // bytes of each data buffer
};
cudaError_t launch_peer_all_reduce(const PeerAllReduceArgs& args, cudaStream_t stream);

}  // namespace woq
