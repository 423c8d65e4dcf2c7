// A whole batch-1 decode step of a Llama-family decoder in one persistent kernel: every
// layer's qkv projection, attention (RoPE, the cache write), o projection, residual adds,
// RMSNorms, gate/up with SwiGLU and down projection. The embedding before it and the final
// norm and LM head after it stay separate kernels.
//
// Why: as separate kernels, each GEMV boundary is a dependent chain (the previous grid
// completes, x comes from L2, sums are reduced and stored) during which DRAM idles, and
// programmatic launches can prefetch only the next kernel's first weights. Here the weight
// stream never waits for activations.
//
// How. One block of 16 warps per SM, all resident for the kernel's life. Each block owns a
// fixed list of "units" -- one n-tile (16 output channels, all of K) of one weight -- in
// the order the step uses them: layer 0's qkv units, o, gate/up, down, then layer 1's...
// (unit u of a weight goes to block (u + rotation) % grid; the rotation keeps every block's
// share of a layer's bytes within one unit of the others'). A unit's packed weights, scales
// and zero points are contiguous in the GPU layout (kernels/layout.py), so a "chunk" --
// kChunkSegs 512-byte segments along K with their groups' scales and zeros -- is three bulk
// copies (cp.async.bulk, completing on an mbarrier) into one slot of a shared-memory ring.
// One thread (kIssuer) refills a slot as soon as the block has consumed it, with the
// block's next chunk whatever layer or stage it belongs to: the ring stays full while the
// block waits for an activation, so DRAM keeps streaming through every dependency.
//
// Dependencies are counters in global memory, one per (layer, stage): every block adds 1
// when its part of a stage's output is written, and a block about to read a stage's output
// waits until the counter reaches the grid size (acquire). Outputs leave a block as bulk
// stores whose completion it awaits, so adding 1 needs no fence (attention.cuh, bulk_store).
//   * qkv and gate/up inputs: RMSNorm of the residual stream h, computed by every block
//     (cheaper than one more dependency round trip);
//   * attention: blocks 0..roles-1 each run one attention.cuh role;
//   * o and down: their units add their outputs into h (one writer per channel).
// Rounding follows the model's torch path (models/llama.py, kernels/fused.py): fp32 sums,
// each projection's output rounded to T, the residual add rounded once, the normalised
// value rounded before the weight multiply, SiLU and its product as the GEMV's epilogue.
//
// Tensor parallelism (DecodeStepParams::world > 1; the area's layout: woq_kernels.h). qkv,
// attention and gate/up are this rank's column shares and stay local. o and down are row
// shares: a unit's outputs are a partial sum of the whole residual stream's channels, so
// instead of adding into h a block writes its units' partial sums, rounded to T, into row
// `rank` of that stage's data buffer in every rank's area (plain stores to peer memory,
// NVLink), then adds 1 to every rank's counter of (layer, stage) with release semantics at
// system scope (cumulative over the block's stores, after a CTA barrier). A block about to
// normalise h waits until its own counter has every block of every rank (epoch x grid x
// world: the counters only grow, the epoch counts this area's steps) and adds the rows to
// its copy of h: fp32 in rank order, rounded once, then rounded into h -- what the
// kernel-per-op step computes through kernels/peer_all_reduce.py and the fused add + norm.
// Every block thus keeps all of h in shared memory, and h in global memory is written once,
// at the end, by block 0. One buffer a stage kind (o, down) is enough: a rank writes stage
// s + 2's rows (the same buffer as s) only after every block of every rank has signalled
// stage s + 1, which each block does after reading stage s's rows.
// Deadlock freedom: one resident block per SM (checked at launch), so every block a counter
// waits on is running or will be once the previous kernel's blocks leave; no block waits on
// a later stage than the one it is working towards. The last block out re-arms the counters.
// sm_90 only (bulk copies, mbarrier transaction counts); elsewhere the body is empty and
// the launcher refuses.
#pragma once

#include <cstdint>

#include "attention.cuh"
#include "gemv.cuh"
#include "launch.cuh"
#include "peer_sync.cuh"
#include "woq_kernels.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define WOQ_STEP_SM90 1
#else
#define WOQ_STEP_SM90 0
#endif

namespace woq {

namespace step {

constexpr int kThreads = 512;            // 16 warps of <= 128 registers: with 8, the arithmetic, not DRAM, set the pace
constexpr int kWarps = kThreads / 32;
constexpr int kSegBytes = 512;           // one n-tile's 16 channels x KT k (a warp's 32 lane loads)
constexpr int kChunkSegs = 64;           // segments per chunk: 32 KB of weights, 4 a warp
constexpr int kSegsPerWarp = kChunkSegs / kWarps;
// The thread that issues the ring's copies: lane 0 of the last warp -- warp 0 adds each
// unit's sums (run_units) while it refills the slot.
constexpr int kIssuer = kThreads - 32;
constexpr int kMaxSlots = 16;
constexpr int kMaxStagedUnits = kStepMaxStagedUnits;  // units of one linear a block takes, at most (launch checks)
constexpr int kStages = kStepStages;     // counters per layer: qkv, attention, o, gate/up, down
enum Stage : int { kQkv = 0, kAttention = 1, kO = 2, kGateUp = 3, kDown = 4 };
constexpr int kLinears = kStepLinears;   // qkv, o, gate/up, down (StepLayer::linear)

// A chunk's slot: its weights, then its groups' scale pairs, then their zero pairs.
template <int BITS, int GROUP>
struct Slot {
  static constexpr int kGroups = kChunkSegs * TileShape<BITS>::kK / GROUP;  // groups a whole chunk spans
  static constexpr int kWBytes = kChunkSegs * kSegBytes;
  static constexpr int kPairBytes = kGroups * 8 * 4;  // 8 u32 pairs (rows g, g + 8) per group
  static constexpr int kBytes = kWBytes + 2 * kPairBytes;
  static_assert(kChunkSegs * TileShape<BITS>::kK % GROUP == 0, "a chunk holds whole groups");
  static_assert(kSegsPerWarp * TileShape<BITS>::kK % GROUP == 0, "a warp's segments hold whole groups");
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void barrier_init(uint32_t bar, uint32_t count) {
#if WOQ_STEP_SM90
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}

__device__ __forceinline__ void barrier_expect_bytes(uint32_t bar, uint32_t bytes) {
#if WOQ_STEP_SM90
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void barrier_wait(uint32_t bar, uint32_t parity) {
#if WOQ_STEP_SM90
  asm volatile(
      "{\n.reg .pred done;\n"
      "WOQ_STEP_WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WOQ_STEP_WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}

// The weight stream's L2 policy (DecodeStepParams::cache_hints). Under the default
// (evict_normal) the ~4.5 GB of weights that pass through the 50 MB L2 once a step turn it
// over every ~16 us, so whatever the step reads again later -- norm weights, the RoPE rows,
// the attention's parameters, cached k and v -- came back from DRAM, behind the ring's
// ~7 us queue of weight requests, on the stages' critical path. evict_first makes the
// weights the victims instead.
__device__ __forceinline__ uint64_t stream_policy(bool evict_first) {
  uint64_t policy = 0;
#if WOQ_STEP_SM90
  if (evict_first)
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  else
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(policy));
#endif
  return policy;
}

// `bytes` (a multiple of 16, 16-byte aligned both ends) from global to shared memory under
// an L2 policy (stream_policy); the barrier's transaction count drops by them as they land.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                          uint64_t policy) {
#if WOQ_STEP_SM90
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
#endif
}

// `bytes` (a multiple of 16, 16-byte aligned) fetched into L2, no completion: small data
// the step will need (kHintPrefetch). Not for the weights: prefetched beyond the ring they
// deepen the DRAM queue the critical path's misses wait in.
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
#if WOQ_STEP_SM90
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
#endif
}

// Per layer, the pointers the step's control path reads, kept in shared memory (the kernel).
struct LayerPointers {
  const void* w[kLinears][3];  // qweight, scales, zeros of qkv, o, gate/up, down
  const void* norm[2];
  const void* cache[2];        // the layer's k and v caches
};
constexpr int kHintEvictFirst = 1, kHintPrefetch = 2;  // DecodeStepParams::cache_hints

}  // namespace step

struct DecodeStepParams {
  const StepLayer* layers;
  int n_layers;
  void* h;                  // [hidden] the residual stream: the embedding in, the last layer's sum out
  void* x_qkv;              // [(heads + 2 kv_heads) head_dim] the qkv projection's output (= attention.qkv)
  void* attn;               // [hidden] the attention output (= attention.out)
  void* act;                // [inter] silu(gate) * up
  const long long* slots;   // [1] this step's block-table row, live length and position
  const long long* lengths;
  const long long* positions;
  int* counters;            // [n_layers * kStages + 1], zero, re-armed by the kernel
  unsigned long long* stamps;  // null, or [n_layers * kStages + 1][grid]: when each block ended each
                               // (layer, stage), then when the step started (%globaltimer, ns): the
                               // kernel metrics take a row's latest as the stage's end
  int hidden, inter;
  int roles;                // attention roles: kv_heads * attention.splits
  int slots_in_ring;        // ring slots (shared memory)
  int region_bytes;         // shared memory before the ring: attention's or x's, whichever is larger,
                            // h's copy (residual_offset), then n_layers step::LayerPointers
  int residual_offset;      // bytes into the region: h as the stage's norm read it (hidden elements)
  int kv_heads;             // attention heads written per layer (batch 1)
  int cache_hints;          // step::kHint*: the weight stream evict_first in L2; small data prefetched
  int rotation[step::kLinears];  // unit u of linear i goes to block (u + rotation[i]) % grid
  int n_tiles[step::kLinears];   // each linear's shape, the same in every layer
  int ktiles[step::kLinears];
  int groups_pad[step::kLinears];
  float eps;
  int rank, world;                                // tensor parallelism (world 1: none)
  unsigned char* peer_area[kPeerMaxRanks];        // each rank's step area (woq_kernels.h)
};

// (TP: p.world > 1, an instantiation of its own: the single-GPU step's registers stay as they were)
template <typename T, int BITS, int GROUP, bool ZEROS, bool TP>
__global__ void __launch_bounds__(step::kThreads, 1) decode_step_kernel(const DecodeStepParams p) {
#if WOQ_STEP_SM90
  using namespace step;
  using SlotT = Slot<BITS, GROUP>;
  constexpr int KT = TileShape<BITS>::kK, K16 = TileShape<BITS>::kK16;
  constexpr int kSegsPerGroup = GROUP / KT;
  extern __shared__ __align__(128) uint4 smem[];
  __shared__ __align__(8) uint64_t full[kMaxSlots];
  __shared__ float red[2][kWarps][16];  // per-warp unit sums, double-buffered by unit parity
  __shared__ float norm_part[kWarps];
  __shared__ __align__(16) T staging[kMaxStagedUnits][16];  // a stage's outputs of the block (run_units)
  __shared__ DecodeAttention att;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, t4 = lane & 3;
  const int grid = static_cast<int>(gridDim.x), block = static_cast<int>(blockIdx.x);
  T* xs = reinterpret_cast<T*>(smem);  // the stage's x (aliases the attention role's tiles)
  // (the layers' pointers sit at the region's end: n_layers LayerPointers)
  LayerPointers* table = reinterpret_cast<LayerPointers*>(reinterpret_cast<unsigned char*>(smem) + p.region_bytes) -
                         p.n_layers;
  unsigned char* ring = reinterpret_cast<unsigned char*>(smem) + p.region_bytes;
  const uint32_t ring0 = smem_addr(ring), full0 = smem_addr(full);
  const int S = p.slots_in_ring;
  T* hs = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(smem) + p.residual_offset);  // h, as the norm read it

  // The chunk sequence, walked twice in the same order: by the issuer's copies and by
  // the block consuming them. Chunk q of the sequence lives in slot q % S, its barrier's
  // phase parity is (q / S) % 2. The issuer issues a chunk between two of the block's chunks,
  // so its bookkeeping sits on the block's critical path: it reads only registers, the
  // kernel parameters and, once per (layer, linear), a weight's three pointers from the
  // shared-memory table below.
  auto first_unit = [&](int linear) { return (block - p.rotation[linear] % grid + grid) % grid; };
  auto chunks_of = [&](int linear) { return (p.ktiles[linear] + kChunkSegs - 1) / kChunkSegs; };
  struct Cursor {
    int layer, linear, unit, chunk;
    const uint4* w;  // the weight's qweight, scale pairs, zero pairs
    const uint32_t* s;
    const uint32_t* z;
  };
  auto point = [&](Cursor& c) {  // (a new weight: its pointers)
    if (c.layer >= p.n_layers) return;
    const LayerPointers& t = table[c.layer];
    c.w = static_cast<const uint4*>(t.w[c.linear][0]);
    c.s = static_cast<const uint32_t*>(t.w[c.linear][1]);
    c.z = static_cast<const uint32_t*>(t.w[c.linear][2]);
  };
  // Settle a cursor on a real chunk: past a weight's units, the next weight, the next layer.
  auto settle = [&](Cursor& c) {
    bool moved = false;
    while (c.layer < p.n_layers && c.unit >= p.n_tiles[c.linear]) {
      if (++c.linear == kLinears) {
        c.linear = 0;
        ++c.layer;
      }
      c.unit = first_unit(c.linear);
      c.chunk = 0;
      moved = true;
    }
    if (moved) point(c);
  };
  // The pointers the issuer and the stages read, copied once into shared memory: read from
  // the global table, each was a DRAM miss queued behind the ring's ~7 us of weight
  // requests, and the issuer's (a new weight's pointers) held the whole block.
  for (int layer = tid; layer < p.n_layers; layer += kThreads) {  // (a thread a layer: one round trip)
    const StepLayer& L = p.layers[layer];
    LayerPointers& t = table[layer];
#pragma unroll
    for (int i = 0; i < kLinears; ++i) {
      t.w[i][0] = L.linear[i].qweight;
      t.w[i][1] = L.linear[i].scales;
      t.w[i][2] = L.linear[i].zeros;
    }
    t.norm[0] = L.norm[0];
    t.norm[1] = L.norm[1];
    t.cache[0] = L.attention.k_cache;
    t.cache[1] = L.attention.v_cache;
  }
  __syncthreads();
  Cursor fetch{0, 0, first_unit(0), 0, nullptr, nullptr, nullptr};
  int fetch_slot = 0;
  if (tid == kIssuer) {
    point(fetch);
    settle(fetch);
  }
  const bool evict_first = p.cache_hints & kHintEvictFirst;
  auto issue = [&]() {  // (kIssuer) the next chunk into its slot (free: consumed, or never used)
    if (fetch.layer >= p.n_layers) return;
    const uint64_t policy = stream_policy(evict_first);
    const int li = fetch.linear, kt = p.ktiles[li];
    const int seg0 = fetch.chunk * kChunkSegs, segs = min(kChunkSegs, kt - seg0);
    const int g0 = seg0 / kSegsPerGroup, groups = segs / kSegsPerGroup;
    const uint32_t dst = ring0 + fetch_slot * SlotT::kBytes, bar = full0 + 8u * fetch_slot;
    const uint32_t w_bytes = segs * kSegBytes, pair_bytes = groups * 32;
    barrier_expect_bytes(bar, w_bytes + (ZEROS ? 2 : 1) * pair_bytes);
    bulk_copy(dst, fetch.w + (static_cast<size_t>(fetch.unit) * kt + seg0) * 32, w_bytes, bar, policy);
    const size_t pairs = (static_cast<size_t>(fetch.unit) * p.groups_pad[li] + g0) * 8;  // u32 index
    bulk_copy(dst + SlotT::kWBytes, fetch.s + pairs, pair_bytes, bar, policy);
    if constexpr (ZEROS)
      bulk_copy(dst + SlotT::kWBytes + SlotT::kPairBytes, fetch.z + pairs, pair_bytes, bar, policy);
    if (++fetch_slot == S) fetch_slot = 0;
    if (++fetch.chunk == chunks_of(li)) {
      fetch.chunk = 0;
      fetch.unit += grid;
      settle(fetch);
    }
  };
  if (tid < S) barrier_init(full0 + 8u * tid, 1);
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  __syncthreads();
  // The first S chunks before anything else: weights do not depend on the previous kernel.
  if (tid == kIssuer)
    for (int i = 0; i < S; ++i) issue();
  // Every layer's norm weights into L2 ahead (kHintPrefetch; kept there by the stream's
  // evict_first): read from DRAM behind the ring's queue, they were late for the norms.
  if ((p.cache_hints & kHintPrefetch) && tid == kIssuer)
    for (int i = block; i < 2 * p.n_layers; i += grid) prefetch_l2(table[i / 2].norm[i % 2], p.hidden * sizeof(T));
  // The attention's parameters, once (layer by layer only its caches change; the block
  // table is every layer's). The step's block-table row, length and position are copied
  // into shared memory after the wait (earlier kernels of the graph may write them, as they
  // may write the table, which the roles read only after it): the roles read them every
  // layer, and from global memory each read was one more round trip on the attention's path.
  __shared__ long long sequence[3];
  if (block < p.roles && tid == 0) att = p.layers[0].attention;
  wait_for_prior_grid();  // (the embedding, which wrote h)
  if (block < p.roles && tid == 0) {
    sequence[0] = *p.slots;
    sequence[1] = *p.lengths;
    sequence[2] = *p.positions;
    att.slots = sequence;
    att.lengths = sequence + 1;
    att.positions = sequence + 2;
    if (p.cache_hints & kHintPrefetch) {  // (the RoPE rows, every layer's)
      prefetch_l2(att.cos + sequence[2] * att.rope_stride, att.head_dim * 4);
      prefetch_l2(att.sin + sequence[2] * att.rope_stride, att.head_dim * 4);
    }
  }

  if (p.stamps != nullptr && block == 0 && tid == 0) p.stamps[p.n_layers * kStages * grid] = global_timer();
  // (tensor parallelism) this step's number in the area's sequence, from 1; read and used by
  // thread 0 only (the last block out stores it back)
  constexpr bool tp = TP;
  __shared__ uint32_t epoch;
  if (tp && tid == 0) epoch = __ldcg(reinterpret_cast<const unsigned int*>(p.peer_area[p.rank]) + kStepPeerEpoch) + 1;
  // The area's counter of (layer, stage kind: 0 o, 1 down) in rank r's area, and the kind's
  // rows (rank r's partial sums at row r) in this rank's.
  auto peer_counter = [&](int r, int layer, int which) {
    return reinterpret_cast<uint32_t*>(p.peer_area[r]) + 2 * layer + which;
  };
  auto peer_rows = [&](int r, int which) {
    return reinterpret_cast<T*>(p.peer_area[r] + kStepPeerHeaderBytes + which * kStepPeerDataBytes);
  };
  // Wait until every block of every rank has added its rows of (layer, kind) (acquire).
  auto wait_peers = [&](int layer, int which) {
    if (tid == 0) {
      const uint32_t* c = peer_counter(p.rank, layer, which);
      const uint32_t target = epoch * static_cast<uint32_t>(grid * p.world);
      while (static_cast<int32_t>(load_acquire_sys(c) - target) < 0) {  // (wraps past 2^32 steps)
      }
    }
    __syncthreads();
  };

  // Stage counters: add this block's completion (after all of its threads' stores), wait for all blocks'.
  auto counter = [&](int layer, int stage) { return p.counters + layer * kStages + stage; };
  // (no fence: every output of the stage left the block as a bulk store, whose completion
  // each issuing warp awaits here -- run_units, bulk_store)
  // With stamps, each block stamps its end of the stage in its own column: a plain store, off
  // the critical path (finding the last block with an atomic's return costs a round trip).
  auto done = [&](int* c) {
    if (lane == 0) bulk_wait_all();
    __syncthreads();
    if (tid == 0) {
      add_relaxed(c, 1);
      if (p.stamps != nullptr) p.stamps[(c - p.counters) * grid + block] = global_timer();
    }
  };
  auto wait_all = [&](const int* c) {  // (null: nothing to wait for)
    if (tid == 0 && c != nullptr)
      while (load_acquire(c) < grid) {
      }
    __syncthreads();
  };

  // x = RMSNorm(h) * weight -> xs (hidden elements), as kernels/fused.py's add_rms_norm:
  // fp32 sum of squares, the normalised value rounded to T before the weight multiply;
  // h itself -> hs, the old value of the stage's residual adds. The weight is loaded
  // before the wait. (Fixed summation order: every block gets the same x bit for bit.)
  constexpr int kNormUnits = kStepMaxHidden / 8 / kThreads;  // 16-byte units a thread holds
  // (tensor parallelism) 8 channels of h (unit u) plus the ranks' rows of a stage kind:
  // the rows summed in fp32 in rank order and rounded, then added and rounded (the
  // kernel-per-op step's peer all-reduce, then its residual add). hs holds h as this block's
  // previous norm computed it.
  auto summed_h = [&](int u, int which) {
    float acc[8] = {};
    const T* rows = peer_rows(p.rank, which);
    for (int r = 0; r < p.world; ++r) {
      const uint4 v = __ldcg(reinterpret_cast<const uint4*>(rows + r * p.hidden) + u);
      const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += to_float(e[i]);
    }
    const uint4 old = reinterpret_cast<const uint4*>(hs)[u];
    const T* o = reinterpret_cast<const T*>(&old);
    uint4 out;
    T* n = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int i = 0; i < 8; ++i) n[i] = from_float<T>(to_float(o[i]) + to_float(from_float<T>(acc[i])));
    return out;
  };
  // (reduced >= 0, tensor parallelism: h is hs plus the rows of (reduced, which), not p.h)
  auto norm_input = [&](const void* weight, const int* ready, int reduced, int which) {
    const uint4* w8 = static_cast<const uint4*>(weight);
    const uint4* h8 = static_cast<const uint4*>(p.h);
    const int units = p.hidden / 8;
    uint4 wv[kNormUnits], hv[kNormUnits];
#pragma unroll
    for (int j = 0; j < kNormUnits; ++j)
      if (tid + j * kThreads < units) wv[j] = __ldg(w8 + tid + j * kThreads);
    if (!tp || reduced < 0)
      wait_all(ready);
    else
      wait_peers(reduced, which);
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < kNormUnits; ++j) {
      if (tid + j * kThreads < units) {
        hv[j] = !tp || reduced < 0 ? __ldcg(h8 + tid + j * kThreads) : summed_h(tid + j * kThreads, which);
        reinterpret_cast<uint4*>(hs)[tid + j * kThreads] = hv[j];
        const T* e = reinterpret_cast<const T*>(&hv[j]);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss = fmaf(to_float(e[i]), to_float(e[i]), ss);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) norm_part[warp] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) total += norm_part[i];
    const float rstd = rsqrtf(total / p.hidden + p.eps);
#pragma unroll
    for (int j = 0; j < kNormUnits; ++j) {
      if (tid + j * kThreads < units) {
        const T* e = reinterpret_cast<const T*>(&hv[j]);
        const T* g = reinterpret_cast<const T*>(&wv[j]);
        uint4 out;
        T* o = reinterpret_cast<T*>(&out);
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = from_float<T>(to_float(g[i]) * to_float(from_float<T>(to_float(e[i]) * rstd)));
        reinterpret_cast<uint4*>(xs)[tid + j * kThreads] = out;
      }
    }
    __syncthreads();
  };
  // x = a stage's output (n elements, L2) -> xs.
  auto copy_input = [&](const void* src, int n, const int* ready) {
    wait_all(ready);
    const uint4* s8 = static_cast<const uint4*>(src);
    const int units = n / 8;
    for (int u0 = tid; u0 < units; u0 += 4 * kThreads) {  // four loads in flight per thread
      uint4 v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (u0 + j * kThreads < units) v[j] = __ldcg(s8 + u0 + j * kThreads);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (u0 + j * kThreads < units) reinterpret_cast<uint4*>(xs)[u0 + j * kThreads] = v[j];
    }
    __syncthreads();
  };

  // This block's units of one linear: chunks from the ring, each warp's piece of a chunk
  // (kSegsPerWarp segments) multiplied into its acc by piece_sums; the kWarps warps' sums
  // added in shared memory (fixed order), then `store(unit, row, sum, sum of row ^ 8)` by
  // threads 0..15 for the unit's 16 channels.
  int parity_unit = 0;     // which of red's buffers the next unit's sums go to
  int slot = 0;            // the next chunk's slot
  uint32_t parity = 0;     // and its barrier phase
  const T* x_lane = xs + 8 * (lane >> 3);
  // A warp's piece (its first `segs` segments valid; x: the stage's x at the piece's first k)
  // times x, added into acc: an mma per k16 block (x as the B operand, all 8 of its rows row 0:
  // M = 1), fp32 sums per group, scaled. The segments' mma chains are interleaved k16 block
  // by k16 block, with no branch between them: with a branch a segment (`continue` past
  // the valid ones) the compiler ran the four chains one after another, each mma waiting
  // for the one before. Segments past `segs` compute on zero
  // weights and x beyond the stage's (still the block's shared memory) and are dropped
  // with their group.
  constexpr int kWarpGroups = kSegsPerWarp / kSegsPerGroup;
  static_assert(K16 % 2 == 0, "x is loaded for two k16 blocks at a time");
  auto piece_sums = [&](const uint4 (&wv)[kSegsPerWarp], const uint32_t (&sv)[kWarpGroups],
                        const uint32_t (&zv)[kWarpGroups], int segs, const T* x, float (&acc)[4]) {
    float part[kSegsPerWarp][4];
    ZeroConsts<T, BITS> zc[kWarpGroups];
#pragma unroll
    for (int g = 0; g < kWarpGroups; ++g) {
      zc[g] = ZeroConsts<T, BITS>(zero_point_bias(BITS), zero_point_bias(BITS));
      if constexpr (ZEROS) zc[g] = zero_consts<T, BITS>(zv[g]);
    }
#pragma unroll
    for (int i = 0; i < kSegsPerWarp; ++i)
#pragma unroll
      for (int q = 0; q < 4; ++q) part[i][q] = 0.f;
#pragma unroll
    for (int j = 0; j < K16; j += 2) {  // (one ldmatrix_x4: x for two k16 blocks)
      uint32_t bx[kSegsPerWarp][4];
#pragma unroll
      for (int i = 0; i < kSegsPerWarp; ++i) ldmatrix_x4(bx[i], x + i * KT + j * 16);
#pragma unroll
      for (int jj = 0; jj < 2; ++jj)
#pragma unroll
        for (int i = 0; i < kSegsPerWarp; ++i) {
          uint32_t a[4];
          convert_segment_k16<T, BITS, ZEROS>(wv[i], j + jj, zc[i / kSegsPerGroup], a);
          const uint32_t bb[2] = {bx[i][jj * 2], bx[i][jj * 2 + 1]};
          mma_16816<T>(part[i], a, bb);
        }
    }
#pragma unroll
    for (int g = 0; g < kWarpGroups; ++g) {  // each group's sums, scaled (fixed order)
      if (g * kSegsPerGroup >= segs) continue;
      const float2 sc = pair_to_float2<Scale>(sv[g]);
      float s0 = 0.f, s2 = 0.f;
#pragma unroll
      for (int i = 0; i < kSegsPerGroup; ++i) {
        s0 += part[g * kSegsPerGroup + i][0];
        s2 += part[g * kSegsPerGroup + i][2];
      }
      acc[0] += sc.x * s0;
      acc[2] += sc.y * s2;
    }
  };
  auto run_units = [&](int linear, T* outputs, int per_unit, auto store) {
    const int chunks = chunks_of(linear), kt = p.ktiles[linear];
    const int first = first_unit(linear);
    const int n_units = first < p.n_tiles[linear] ? (p.n_tiles[linear] - first - 1) / grid + 1 : 0;
    // A unit's sums, added by threads 0..15 from red after the block barrier that follows
    // them -- the next chunk's (one block barrier a chunk): while warp 0 adds them, the
    // issuer warp refills the slot and the other warps go on with their pieces.
    auto reduce = [&](int k, float (*sums)[16]) {
      const int unit = first + k * grid;
      auto channel = [&](int r) {
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < kWarps; ++i) sum += sums[i][r];
        return sum;
      };
      store(staging[k], unit, tid, channel(tid), channel(tid ^ 8));  // (its partner row: SwiGLU's gate and up)
    };
    int pending = -1;  // the unit whose sums wait in red[parity_unit ^ 1]
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int k = 0, c = 0; k < n_units;) {
      // The warp's segments and their groups' scale and zero pairs into registers, then
      // the slot is refilled at once: it is held only for these loads, not for the
      // arithmetic, so the ring keeps as many bytes in flight as it can.
      barrier_wait(full0 + 8u * slot, parity);
      const unsigned char* base = ring + slot * SlotT::kBytes;
      const uint4* wseg = reinterpret_cast<const uint4*>(base);
      const uint32_t* sp = reinterpret_cast<const uint32_t*>(base + SlotT::kWBytes);
      [[maybe_unused]] const uint32_t* zp = reinterpret_cast<const uint32_t*>(base + SlotT::kWBytes + SlotT::kPairBytes);
      const int seg0 = c * kChunkSegs, segs = min(kChunkSegs, kt - seg0);
      const int wsegs = min(kSegsPerWarp, segs - warp * kSegsPerWarp);
      uint4 wv[kSegsPerWarp];
      uint32_t sv[kWarpGroups], zv[kWarpGroups];
#pragma unroll
      for (int i = 0; i < kSegsPerWarp; ++i) {
        const int seg = warp * kSegsPerWarp + i;
        wv[i] = i < wsegs ? wseg[seg * 32 + lane] : make_uint4(0u, 0u, 0u, 0u);
        if (i % kSegsPerGroup == 0) {
          sv[i / kSegsPerGroup] = i < wsegs ? sp[seg / kSegsPerGroup * 8 + gid] : 0u;
          zv[i / kSegsPerGroup] = ZEROS && i < wsegs ? zp[seg / kSegsPerGroup * 8 + gid] : 0u;
        }
      }
      __syncthreads();  // every warp has its share of the slot (refill it), the last unit's sums are in red
      if (tid == kIssuer) issue();
      if (pending >= 0 && tid < 16) reduce(pending, red[parity_unit ^ 1]);
      pending = -1;
      if (++slot == S) {
        slot = 0;
        parity ^= 1u;
      }
      if (wsegs > 0)
        piece_sums(wv, sv, zv, wsegs, x_lane + (seg0 + warp * kSegsPerWarp) * KT, acc);
      if (++c == chunks) {
        // acc[0] / acc[2]: channel gid / gid + 8 of the unit, row m = 2 * t4 (row 0 at t4 =
        // 0). The warps' sums meet in shared memory (the buffer alternates between units),
        // added in warp order after the next barrier, and staged with the block's other
        // outputs of the stage.
        if (t4 == 0) {
          red[parity_unit][warp][gid] = acc[0];
          red[parity_unit][warp][gid + 8] = acc[2];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] = 0.f;
        pending = k;
        parity_unit ^= 1;
        c = 0;
        ++k;
      }
    }
    __syncthreads();
    if (pending >= 0 && tid < 16) reduce(pending, red[parity_unit ^ 1]);
    // The staged outputs out: unit k's by lane 0 of warp k % kWarps, the warps' bulk stores
    // issued side by side (done() awaits them).
    if (tid < 16) fence_async_shared();
    __syncthreads();
    if (lane == 0 && outputs != nullptr)
      for (int unit = first + warp * grid, k = warp; unit < p.n_tiles[linear]; unit += kWarps * grid, k += kWarps)
        bulk_store(outputs + unit * per_unit, smem_addr(staging[k]), per_unit * sizeof(T));
  };
  // (tensor parallelism) This block's staged outputs of `linear` (o or down: `which` 0 or 1,
  // run_units without outputs) into row `rank` of the kind's rows in every rank's area, then
  // every rank's counter of (layer, which) up by one. A unit is 16 channels: two 16-byte
  // pieces.
  auto publish = [&](int linear, int layer, int which) {
    const int first = first_unit(linear);
    const int n_units = first < p.n_tiles[linear] ? (p.n_tiles[linear] - first - 1) / grid + 1 : 0;
    for (int i = tid; i < 2 * n_units * p.world; i += kThreads) {
      const int r = i % p.world, piece = i / p.world, k = piece >> 1;
      uint4* row = reinterpret_cast<uint4*>(peer_rows(r, which) + p.rank * p.hidden + 16 * (first + k * grid));
      row[piece & 1] = reinterpret_cast<const uint4*>(staging[k])[piece & 1];
    }
    __syncthreads();
    if (tid < p.world) add_release_sys(peer_counter(tid, layer, which), 1);
  };

  T* h = static_cast<T*>(p.h);
  T* qkv = static_cast<T*>(p.x_qkv);
  T* act = static_cast<T*>(p.act);
  // o and down: h += y, rounded as torch's add. h's old value is the one the stage's norm
  // read (no other block writes channel n in between), kept in shared memory: read from
  // L2 it was a round trip at the end of every o and down unit on warp 0's path, which the
  // block's next chunk waited for.
  // (store(the unit's staged outputs, unit, row r, y, y of row r ^ 8))
  auto add_to_stream = [&](T* staged, int unit, int r, float y, float) {
    staged[r] = from_float<T>(to_float(hs[16 * unit + r]) + to_float(from_float<T>(y)));
  };

  auto rounded = [&](T* staged, int, int r, float y, float) { staged[r] = from_float<T>(y); };
  // (heads x head_dim: the hidden size, or a rank's share of whole k-tiles: DecodeStep.supported)
  const int o_inputs = tp ? p.ktiles[1] * KT : p.hidden;

  for (int layer = 0; layer < p.n_layers; ++layer) {
    // qkv = RMSNorm(h) @ Wqkv^T  (layer 0: h is the embedding, written before this kernel)
    norm_input(table[layer].norm[0], layer == 0 ? nullptr : counter(layer - 1, kDown), tp && layer > 0 ? layer - 1 : -1,
               1);
    run_units(0, qkv, 16, rounded);
    done(counter(layer, kQkv));
    // attention: RoPE, the cache write, softmax(q k^T) v over the live tokens
    if (block < p.roles) {
      if (tid == 0) {  // (the layers' entries differ only in their caches: decode_step_plan)
        att.k_cache = const_cast<void*>(table[layer].cache[0]);
        att.v_cache = const_cast<void*>(table[layer].cache[1]);
        att.flags = counter(layer, kAttention);
      }
      __syncthreads();
      const int* qkv_ready = counter(layer, kQkv);
      attend_share<T, kThreads, kStepMaxHeadDim>(att, block, [&] {
        if (tid == 0)
          while (load_acquire(qkv_ready) < grid) {
          }
        __syncthreads();
      });
      __syncthreads();  // (the role's shared memory is free again)
      // The next layer's cached rows of this share into L2 (kHintPrefetch): their tile is
      // then an L2 hit, not a DRAM read queued behind the weight stream. The share's rows
      // are contiguous within each cache block (the head's [block_size, head_dim]), not
      // across blocks: one prefetch per block, a block per thread of warps 1.., whose table
      // reads pass while thread 0 polls the attention counter below (no barrier between).
      if ((p.cache_hints & kHintPrefetch) && warp > 0 && layer + 1 < p.n_layers) {
        const AttentionShare s = attention_share(att, block);
        const int shift = att.block_shift, in_block = (1 << att.block_shift) - 1;
        const int first = s.start >> shift, blocks = s.start < s.end ? ((s.end - 1) >> shift) - first + 1 : 0;
        const int* table_row = att.block_table + sequence[0] * att.blocks_per_row;
        for (int i = tid - 32; i < blocks; i += kThreads - 32) {
          const int lo = max(s.start, (first + i) << shift), hi = min(s.end, (first + i + 1) << shift);
          const long long row0 = table_row[first + i] * att.cache_block_stride + s.hkv * att.cache_head_stride +
                                 (lo & in_block) * att.cache_pos_stride;
          const uint32_t bytes = static_cast<uint32_t>((hi - lo) * att.cache_pos_stride * sizeof(T));
          prefetch_l2(static_cast<const T*>(table[layer + 1].cache[0]) + row0, bytes);
          prefetch_l2(static_cast<const T*>(table[layer + 1].cache[1]) + row0, bytes);
        }
      }
    }
    // h += attn @ Wo^T  (the attention counter counts heads written, not blocks)
    if (tid == 0) {
      while (load_acquire(counter(layer, kAttention)) < p.kv_heads) {
      }
      // (block 0 is an attention role and waits here as soon as its share is done: it sees
      // the last head land within a poll)
      if (p.stamps != nullptr && block == 0) p.stamps[(layer * kStages + kAttention) * grid] = global_timer();
    }
    copy_input(p.attn, o_inputs, nullptr);
    if constexpr (tp) {
      run_units(1, nullptr, 16, rounded);
      publish(1, layer, 0);
    } else {
      run_units(1, h, 16, add_to_stream);
    }
    done(counter(layer, kO));
    // act = silu(gate) * up of RMSNorm(h) @ Wgate_up^T
    norm_input(table[layer].norm[1], counter(layer, kO), tp ? layer : -1, 0);
    run_units(2, act, 8, [&](T* staged, int, int r, float gate, float up) {
      // rows 0..7 of a unit are gate, 8..15 up, of channels 8 unit + r (swiglu_column)
      if (r < 8) staged[r] = swiglu<T>(gate, up);
    });
    done(counter(layer, kGateUp));
    // h += act @ Wdown^T
    copy_input(p.act, p.inter, counter(layer, kGateUp));
    if constexpr (tp) {
      run_units(3, nullptr, 16, rounded);
      publish(3, layer, 1);
    } else {
      run_units(3, h, 16, add_to_stream);
    }
    done(counter(layer, kDown));
  }
  // (tensor parallelism) h out, the last layer's down summed in: block 0's copy
  if (tp && block == 0) {
    wait_peers(p.n_layers - 1, 1);
    for (int u = tid; u < p.hidden / 8; u += kThreads) reinterpret_cast<uint4*>(h)[u] = summed_h(u, 1);
  }

  // The last block out re-arms the counters for the next launch (stream-ordered after this one).
  if (tid == 0) {
    int* exits = p.counters + p.n_layers * kStages;
    if (atomic_add_acq_rel(exits, 1) == grid - 1) {
      for (int i = 0; i <= p.n_layers * kStages; ++i) p.counters[i] = 0;
      if (tp) reinterpret_cast<uint32_t*>(p.peer_area[p.rank])[kStepPeerEpoch] = epoch;
    }
  }
#endif
}

}  // namespace woq
