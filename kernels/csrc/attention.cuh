// Decode attention as "roles" of the persistent decode step (decode_step.cuh): blocks
// 0..roles-1 each take one (sequence, KV head, share of the live tokens), one query token
// per sequence.
//
// What a role does, for its KV head's G = H / Hkv query heads (grouped-query attention: the
// KV bytes are read once per group), over its share [start, end) of the live tokens
// (`splits` equal shares, multiples of 16 tokens, at least a tile):
//   * before the wait: the share's first tile of cached k and v -> shared memory (cp.async);
//   * after it: q and the new k rotated (RoPE, rounded like the torch reference: each
//     product to the activation type, then the sum), the new k and v stored at the
//     position by the share that holds it and patched into its tile;
//   * per tile of kAttentionTile tokens: scores (fp32), an online softmax per head (each
//     thread keeps its head's running maximum and sum: no thread waits for another's
//     update), p @ v into fp32 accumulators;
//   * a share alone writes the output; several leave fp32 partial outputs and their
//     log-sum-exp, and the head's share 0, once the others have counted theirs released
//     (a counter per (sequence, KV head), re-armed by share 0), merges them in share order;
//   * whoever wrote a head's output adds 1 to `flags[0]` -- the step's attention counter.
// The cache is paged (woq_kernels.h, DecodeAttention): a share's [start, end) may cross
// blocks, so rows are addressed one by one through the block table. Each fetching thread
// takes one row of a tile (all 16-byte units of the row: one table entry a tile), and
// loads the entry of its row of the next tile while the current one is consumed, so a
// tile's copies wait for no table read (the first tile's read passes before the wait).
// A tile's scores and p @ v are mma (m16n8k16, fp32 sums): the G query heads are the rows
// of A (the other rows zero); p, fp32, enters as two T operands, its rounding and the rest
// (hi + lo), so it keeps ~16 of its bits rather than T's 8 or 11.
// No role waits for a block that is not running: the step's grid is one resident block per
// SM; roles wait for the qkv stage, and a head's share 0 for the head's other shares, which
// wait for nothing of it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "gemv.cuh"
#include "woq_kernels.h"

namespace woq {

constexpr int kAttentionTile = 64;  // tokens per tile: 2 x 64 x 136 x 2 B of k and v at D = 128
constexpr int kMaxShares = kAttentionMaxSplits;

// Shared memory of a role, in bytes: k and v tiles, q, the new k and v, scores, the score
// warps' maxima and sums. Rows of k, v and q are padded by 8 elements: row r starts 4 r
// banks further (mod 32), so the 8 rows of an ldmatrix matrix, or 8 lanes' 4-byte reads of
// 8 rows, are conflict-free. (q takes G (D + 8) elements of T, within the G D floats
// counted for it.)
template <typename T>
__host__ __device__ constexpr int attention_smem_bytes(int D, int G) {
  return 2 * kAttentionTile * (D + 8) * static_cast<int>(sizeof(T)) + G * D * 4 + 2 * D * static_cast<int>(sizeof(T)) +
         G * kAttentionTile * 4 + 2 * (kAttentionTile / 8) * kAttentionMaxGroup * 4 + 16;
}

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Outputs that leave a block as bulk stores (shared -> global, in the issuing thread's bulk
// groups) need no fence before their release: the decode step's stages and its attention
// roles. A gpu-scope fence (the release of red.release / atom.acq_rel) waits for every
// memory request the SM has in flight, the ring's bulk loads included (~1-2 us on H100).
// A bulk store's completion (wait_group) waits for the thread's bulk stores only; once
// complete, the outputs are in L2, where every reader's acquire-then-L2 load finds them, so
// the counter increment after it is relaxed. (This rests on that completion -- the bytes
// written to L2, the readers' point of coherence -- not on a formal release of the PTX
// memory model; the GPU tests, logits against the kernel-per-op step and graph replays
// bit-equal to eager steps, check it.)
__device__ __forceinline__ void bulk_store(void* dst, uint32_t src, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

// Until every bulk store of the thread is complete (its bytes written to global memory).
__device__ __forceinline__ void bulk_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

// This thread's shared-memory writes made visible to the bulk copies (the async proxy).
__device__ __forceinline__ void fence_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void add_relaxed(int* p, int v) {
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

template <typename T>
__device__ __forceinline__ float round_to(float v) {  // through the activation type, as the reference rounds
  return to_float(from_float<T>(v));
}

// A role's share of the live tokens: [start, end) of sequence b's KV head hkv, `used` of
// the head's shares holding a token.
struct AttentionShare {
  int b, hkv, split, start, end, used;
};
__device__ __forceinline__ AttentionShare attention_share(const DecodeAttention& a, int role) {
  const int S = a.splits;
  const int b = role / (a.kv_heads * S), hkv = role / S % a.kv_heads, split = role % S;
  const int length = static_cast<int>(a.lengths[b]);
  const int share = max((((length + S - 1) / S + 15) / 16) * 16, kAttentionTile);
  const int start = split * share;
  return {b, hkv, split, start, min(start + share, length), (length + share - 1) / share};
}

// A KV head's output [G, D] (-> out) from its `used` shares' partials (share s's at
// part + s part_share, [G, D]) and log-sum-exps (at lse + s lse_share, [G]), in share order
// (deterministic). Not inlined: its loads, every share's in flight together, need registers
// that the decode step's kernel, at its 128, would otherwise take from its other values
// (more spills).
template <typename T, int THREADS>
__device__ __noinline__ void merge_shares(const float* part, int part_share, const float* lse, int lse_share, int used,
                                          int G, int D, T* out) {
  for (int i = threadIdx.x; i < G * D; i += THREADS) {
    const int h = i / D;
    float lse_s[kMaxShares], part_s[kMaxShares];
#pragma unroll
    for (int s = 0; s < kMaxShares; ++s) {
      lse_s[s] = s < used ? __ldcg(lse + s * lse_share + h) : -INFINITY;
      part_s[s] = s < used ? __ldcg(part + static_cast<long long>(s) * part_share + i) : 0.f;
    }
    float mx = -INFINITY;
#pragma unroll
    for (int s = 0; s < kMaxShares; ++s) mx = fmaxf(mx, lse_s[s]);
    float total = 0.f, weight = 0.f;
#pragma unroll
    for (int s = 0; s < kMaxShares; ++s) {
      const float w = s < used ? __expf(lse_s[s] - mx) : 0.f;
      total = fmaf(w, part_s[s], total);
      weight += w;
    }
    out[i] = from_float<T>(total / weight);
  }
}

// Role `role` of the attention (see above); false if its share holds no token (it did
// nothing, not even the wait). THREADS threads, head_dim at most MAX_D (its p @ v
// accumulators). `wait()` returns once the qkv rows are written (every thread calls it).
// The outputs and partials leave as bulk stores and are released without a fence
// (bulk_store). Inlined, taking the kernel parameter by reference: a call copied the
// 300-byte struct to every thread's stack.
template <typename T, int THREADS, int MAX_D, typename Wait>
__device__ __forceinline__ bool attend_share(const DecodeAttention& a, int role, Wait&& wait) {
  extern __shared__ uint4 smem_attention[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int kThreads = THREADS, TT = kAttentionTile, W = THREADS / 32;
  // p @ v: warp w takes the 8-dim n-tiles w, w + W, ... of the head dimension.
  constexpr int kPvTiles = (MAX_D / 8 + W - 1) / W;  // (MAX_D: the largest head_dim the caller takes)
  static_assert(kThreads % 256 == 0 && W >= TT / 8 && kPvTiles >= 1, "whole multiples of 256 threads");
  const int gid = lane >> 2, t4 = lane & 3;  // (an mma fragment's row and column pair)
  const int D = a.head_dim, G = a.heads / a.kv_heads, S = a.splits, RS = D + 8;  // RS: padded row
  const AttentionShare share = attention_share(a, role);
  const int b = share.b, hkv = share.hkv, split = share.split, used = share.used, start = share.start, end = share.end;
  if (start >= end) return false;
  // The block holding position t of the sequence. (Its operands are re-read from `a` at
  // each use, not held in registers across the tile loop: the decode step keeps `a` in
  // shared memory, and registers held there cost its kernel spills elsewhere.)
  auto block_of = [&](int t) { return a.block_table[a.slots[b] * a.blocks_per_row + (t >> a.block_shift)]; };
  auto row_in_block = [&](int t) { return t & ((1 << a.block_shift) - 1); };
  const int pos = static_cast<int>(a.positions[b]);  // the new token's (= length - 1)
  const bool mine = pos >= start && pos < end;        // this share caches the new k and v
  const int pos_block = mine ? block_of(pos) : 0;     // (read before the wait, stored after it)

  T* k_s = reinterpret_cast<T*>(smem_attention);
  T* v_s = k_s + TT * RS;
  T* q_s = v_s + TT * RS;  // [G][RS]: rounded to T by the rotation, so exact in T
  T* kn = reinterpret_cast<T*>(reinterpret_cast<float*>(q_s) + G * D);
  T* vn = kn + D;
  float* sc = reinterpret_cast<float*>(vn + D);
  float* warp_max = sc + G * TT;  // [TT / 8][kAttentionMaxGroup]: a score warp's per head
  float* warp_sum = warp_max + TT / 8 * kAttentionMaxGroup;

  T* k_head = static_cast<T*>(a.k_cache) + hkv * a.cache_head_stride;  // (+ a block's offset)
  T* v_head = static_cast<T*>(a.v_cache) + hkv * a.cache_head_stride;
  // A tile's cached rows (the new position's row is patched in after the wait): kRowThreads
  // threads a row, thread `tid` row fetch_row of every tile, its units fetch_col,
  // fetch_col + kRowThreads, ... Rows past the share's end are zero-filled, their addresses
  // taken in the block of the share's last row: the table has entries up to the sequence's
  // length only (a tile's last row may lie past the table row's end).
  constexpr int kRowThreads = kThreads / TT;
  static_assert(kThreads % TT == 0, "whole threads a tile row");
  const int fetch_row = tid / kRowThreads, fetch_col = tid % kRowThreads;
  auto row_block = [&](int t0) { return block_of(min(t0 + fetch_row, end - 1)); };
  int tile_block = row_block(start);  // the block of this thread's row of the next tile fetched
  auto fetch_tile = [&](int t0) {
    const int tok = t0 + fetch_row;
    const bool valid = tok < end && tok != pos;
    const long long off = tile_block * a.cache_block_stride + row_in_block(tok) * a.cache_pos_stride;
    for (int c = fetch_col * 8; c < D; c += kRowThreads * 8) {
      copy16_async(static_cast<uint32_t>(__cvta_generic_to_shared(k_s + fetch_row * RS + c)), k_head + off + c, valid);
      copy16_async(static_cast<uint32_t>(__cvta_generic_to_shared(v_s + fetch_row * RS + c)), v_head + off + c, valid);
    }
    cp_async_commit();
    if (t0 + TT < end) tile_block = row_block(t0 + TT);  // (in flight while this tile is consumed)
  };
  fetch_tile(start);
  wait();

  // q of the group's heads and the new k rotated, the new v; the share holding the
  // position caches k and v.
  const T* row = static_cast<const T*>(a.qkv) + static_cast<long long>(b) * a.qkv_stride;
  // (all loads first: one L2 round trip, not one per element a thread takes)
  constexpr int kPerThread = (kAttentionMaxGroupDims + 2 * 256) / kThreads;  // (G + 2) * D <= this * kThreads (D <= 256)
  float xv[kPerThread], pv[kPerThread], cv[kPerThread], sv[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int e = tid + j * kThreads, h = e / D, d = e % D;
    if (e >= (G + 2) * D) break;
    const T* src = row + (h < G ? (hkv * G + h) * D : h == G ? (a.heads + hkv) * D : (a.heads + a.kv_heads + hkv) * D);
    xv[j] = to_float(src[d]);
    pv[j] = to_float(src[(d + D / 2) % D]);
    cv[j] = a.cos[static_cast<long long>(pos) * a.rope_stride + d];
    sv[j] = a.sin[static_cast<long long>(pos) * a.rope_stride + d];
  }
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int e = tid + j * kThreads, h = e / D, d = e % D;
    if (e >= (G + 2) * D) break;
    float v = xv[j];
    if (h <= G) {  // rotate_half: the first half's partner negated
      const float c = round_to<T>(cv[j]), s = round_to<T>(sv[j]);
      v = round_to<T>(round_to<T>(v * c) + round_to<T>((d < D / 2 ? -pv[j] : pv[j]) * s));
    }
    if (h < G) {
      q_s[h * RS + d] = from_float<T>(v);
    } else {
      (h == G ? kn : vn)[d] = from_float<T>(v);
      if (mine)
        (h == G ? k_head : v_head)[pos_block * a.cache_block_stride + row_in_block(pos) * a.cache_pos_stride + d] =
            from_float<T>(v);
    }
  }

  // p @ v accumulators: (head gid, dims 8 nt + 2 t4, + 1) in acc[j][0..1] for the warp's
  // n-tiles nt = warp + j W, the products with p's rounding; acc_lo with its rest (two
  // chains of dependent mma, not one). Rows gid + 8 of the mma, [2..3], stay zero.
  float acc[kPvTiles][4] = {}, acc_lo[kPvTiles][4] = {};
  // Head gid's online softmax state, the same in every thread of that gid (so no thread
  // waits for another's update): the running maximum and sum of exp(score - maximum).
  float m_run = -INFINITY, l_run = 0.f;
  const uint32_t* q_row = reinterpret_cast<const uint32_t*>(q_s + gid * RS + 2 * t4);  // (rows < G only)
  for (int t0 = start; t0 < end; t0 += TT) {
    if (t0 != start) fetch_tile(t0);  // (the previous tile was consumed: barrier at the loop's end)
    cp_async_wait<0>();
    __syncthreads();
    if (pos >= t0 && pos < t0 + TT && pos < end) {
      for (int d = tid; d < D; d += kThreads) {
        k_s[(pos - t0) * RS + d] = kn[d];
        v_s[(pos - t0) * RS + d] = vn[d];
      }
      __syncthreads();
    }
    const int n = min(TT, end - t0);
    // Scores: warp w < TT / 8 takes tokens 8w..8w+7 (B: k's rows, as ldmatrix reads them)
    // against the G heads (A: q, rows gid < G), 32 dims an ldmatrix; two accumulators
    // halve the chain of dependent mma. Rows past n are zero-filled (finite) and masked.
    // Lane (gid, t4) holds head gid's scores of tokens 8w + 2 t4 + e; the warp's maximum per
    // head (over t4) goes to warp_max.
    float score[2] = {-INFINITY, -INFINITY};
    if (warp < TT / 8) {
      float c[2][4] = {};
      const T* k_lane = k_s + (warp * 8 + (lane & 7)) * RS + 8 * (lane >> 3);
      for (int k0 = 0; k0 < D; k0 += 32) {
        uint32_t kb[4];
        ldmatrix_x4(kb, k_lane + k0);  // dims k0..k0+31 (past D: padding or the next row, unused)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (h == 1 && k0 + 16 >= D) break;
          const int k = k0 + 16 * h;
          const uint32_t qa[4] = {gid < G ? q_row[k / 2] : 0u, 0u, gid < G ? q_row[k / 2 + 4] : 0u, 0u};
          const uint32_t b[2] = {kb[2 * h], kb[2 * h + 1]};
          mma_16816<T>(c[h], qa, b);
        }
      }
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (warp * 8 + 2 * t4 + e < n) score[e] = (c[0][e] + c[1][e]) * a.scale;
      float mx = fmaxf(score[0], score[1]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      if (t4 == 0 && gid < G) warp_max[warp * kAttentionMaxGroup + gid] = mx;
    }
    __syncthreads();
    // Every thread: head gid's new maximum (warp order: the same bits everywhere); the score
    // warps' p = exp(score - maximum) -> sc, their sums per head -> warp_sum.
    float m_tile = -INFINITY;
    if (gid < G) {
#pragma unroll
      for (int w = 0; w < TT / 8; ++w) m_tile = fmaxf(m_tile, warp_max[w * kAttentionMaxGroup + gid]);
    }
    const float m_new = fmaxf(m_run, m_tile);  // (finite for gid < G: the tile holds a token)
    if (warp < TT / 8) {
      const float p0 = gid < G ? expf(score[0] - m_new) : 0.f, p1 = gid < G ? expf(score[1] - m_new) : 0.f;
      if (gid < G) *reinterpret_cast<float2*>(sc + gid * TT + warp * 8 + 2 * t4) = make_float2(p0, p1);
      float sum = p0 + p1;
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (t4 == 0 && gid < G) warp_sum[warp * kAttentionMaxGroup + gid] = sum;
    }
    __syncthreads();
    float tile_sum = 0.f;
    if (gid < G) {
#pragma unroll
      for (int w = 0; w < TT / 8; ++w) tile_sum += warp_sum[w * kAttentionMaxGroup + gid];
    }
    const float alpha = gid < G ? expf(m_run - m_new) : 0.f;  // 0 on the first tile (m_run = -inf)
    l_run = l_run * alpha + tile_sum;
    m_run = m_new;
    // p @ v: A = p (rows gid < G; tokens past n have p = 0 and zero-filled v), fp32 p as
    // its rounding to T plus the rest, each an mma; B = v's rows through ldmatrix.trans.
    uint32_t p_hi[TT / 16][2], p_lo[TT / 16][2];
#pragma unroll
    for (int ks = 0; ks < TT / 16; ++ks)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float2 pv = gid < G ? *reinterpret_cast<const float2*>(sc + gid * TT + ks * 16 + 8 * i + 2 * t4)
                                  : make_float2(0.f, 0.f);
        p_hi[ks][i] = float2_to_pair<T>(pv.x, pv.y);
        const float2 hi = pair_to_float2<T>(p_hi[ks][i]);
        p_lo[ks][i] = float2_to_pair<T>(pv.x - hi.x, pv.y - hi.y);
      }
#pragma unroll
    for (int j = 0; j < kPvTiles; ++j) {
      const int nt = warp + j * W;
      if (nt >= D / 8) break;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        acc[j][i] *= alpha;
        acc_lo[j][i] *= alpha;
      }
#pragma unroll
      for (int k0 = 0; k0 < TT; k0 += 32) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_s + (k0 + lane) * RS + nt * 8);  // tokens k0..k0+31 of dims 8 nt..8 nt+7
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int ks = k0 / 16 + h;
          const uint32_t b[2] = {vb[2 * h], vb[2 * h + 1]};
          const uint32_t ahi[4] = {p_hi[ks][0], 0u, p_hi[ks][1], 0u};
          const uint32_t alo[4] = {p_lo[ks][0], 0u, p_lo[ks][1], 0u};
          mma_16816<T>(acc[j], ahi, b);
          mma_16816<T>(acc_lo[j], alo, b);
        }
      }
    }
    __syncthreads();  // the tile, the scores and the warps' maxima and sums are free again
  }

  const int H = a.heads, head0 = hkv * G;
  T* out = static_cast<T*>(a.out) + (static_cast<long long>(b) * H + head0) * D;  // the group's heads: [G, D]
  // The outputs are staged in shared memory (the k tile, free now) and leave as bulk stores
  // whose completion the releasing thread awaits, so that its counter increment needs no
  // fence (bulk_store).
  // (G D floats and a slot <= 8 KB + 32 B, within the k tile's 64 (D + 8) elements: 2048 >= G D, 8 >= G)
  float* staged = reinterpret_cast<float*>(k_s);  // partials [G, D], then the lse slot
  T* staged_out = k_s;                            // or the output [G, D]
  auto to_shared = [](const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); };
  auto staged_written = [&] {  // (every thread, after its writes to `staged`)
    fence_async_shared();
    __syncthreads();
  };
  auto release = [&](int* counter) {  // (thread 0, after its bulk stores)
    bulk_wait_all();
    add_relaxed(counter, 1);
  };
  // Each accumulator pair over its head's sum: store(offset in the group's [G, D], value, value of the next dim).
  auto for_each_output = [&](auto store) {
    if (gid >= G) return;
    const float inv = 1.f / l_run;
#pragma unroll
    for (int j = 0; j < kPvTiles; ++j) {
      const int nt = warp + j * W;
      if (nt >= D / 8) break;
      store(gid * D + nt * 8 + 2 * t4, (acc[j][0] + acc_lo[j][0]) * inv, (acc[j][1] + acc_lo[j][1]) * inv);
    }
  };
  if (used == 1) {
    for_each_output([&](int o, float x0, float x1) {
      staged_out[o] = from_float<T>(x0);
      staged_out[o + 1] = from_float<T>(x1);
    });
  } else {
    // Partial outputs [B, S, H, D] and log-sum-exps [B, S, kv_heads, kAttentionMaxGroup] (a
    // group's G in a 32-byte slot: one bulk store); share 0 merges.
    float* part = a.part + ((static_cast<long long>(b) * S + split) * H + head0) * D;
    float* lse = a.lse + ((static_cast<long long>(b) * S + split) * a.kv_heads + hkv) * kAttentionMaxGroup;
    for_each_output([&](int o, float x0, float x1) {
      staged[o] = x0;
      staged[o + 1] = x1;
    });
    if (warp == 0 && t4 == 0 && gid < G) staged[G * D + gid] = m_run + logf(l_run);
    staged_written();  // every partial written before thread 0 releases them
    if (tid == 0) {
      bulk_store(part, to_shared(staged), G * D * 4);
      bulk_store(lse, to_shared(staged + G * D), kAttentionMaxGroup * 4);
    }
    // Share 0 merges, once the others have released theirs: they leave at once, and share 0
    // waits one round trip less than a last-to-finish merger would (an atomic's return).
    int* counter = a.merge_counters + b * a.kv_heads + hkv;
    if (split != 0) {
      if (tid == 0) release(counter);
      return true;
    }
    if (tid == 0) {
      bulk_wait_all();  // (its own partials, read back below; `staged` is rewritten)
      while (load_acquire(counter) < used - 1) {
      }
      *counter = 0;  // re-armed: every other share has added its 1 (the next layer's or launch's come later)
    }
    __syncthreads();
    merge_shares<T, kThreads>(a.part + (static_cast<long long>(b) * S * H + head0) * D, H * D,
                              a.lse + (static_cast<long long>(b) * S * a.kv_heads + hkv) * kAttentionMaxGroup,
                              a.kv_heads * kAttentionMaxGroup, used, G, D, staged_out);
  }
  staged_written();  // the head's output written before thread 0 releases it
  if (tid == 0) {
    bulk_store(out, to_shared(staged_out), G * D * static_cast<int>(sizeof(T)));
    release(a.flags);
  }
  return true;
}

}  // namespace woq
