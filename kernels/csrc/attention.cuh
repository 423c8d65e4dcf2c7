// Decode attention run by the first blocks of the o projection's GEMV (gemv_stream.cuh),
// instead of a kernel of its own between the qkv and o projections.
//
// Why. At batch 1 the attention kernel moves a few hundred KB, so what it costs is the
// latency it adds to the chain qkv -> attention -> o: its own launch and wait, and o's
// blocks, which do not fit beside its 176-register programs, starting only once it has
// begun (H100, Llama-3-8B int4, position 128: 9.6 us from qkv's last block to o's first
// returned wait, docs/bench/decode_timeline.md). Here o's GEMV grid does it: blocks
// 0..roles-1 each take one (sequence, KV head, share of the live tokens) and then their
// share of o; every block has its o weights in flight (or, for a working role, in L2)
// before it waits, and the blocks wait for the attention output on a counter in global
// memory rather than on a kernel boundary.
//
// What a role does, for its KV head's G = H / Hkv query heads (grouped-query attention:
// the KV bytes are read once per group), over its share [start, end) of the live tokens
// (as kernels/decode_attention.py: `splits` equal shares, multiples of 16 tokens, at
// least a tile):
//   * before the wait: the share's first tile of cached k and v -> shared memory (cp.async);
//   * after it: q and the new k rotated (RoPE, rounded like the torch reference: each
//     product to the activation type, then the sum), the new k and v stored at the
//     position by the share that holds it and patched into its tile;
//   * per tile of kTile tokens: scores (fp32), an online softmax per head, p @ v into fp32
//     accumulators;
//   * a share alone writes the output; several leave fp32 partial outputs and their
//     log-sum-exp, and the last of a head's shares to finish (a counter per (sequence, KV
//     head), re-armed by that block) merges them in share order;
//   * whoever wrote a head's output adds 1 to `flags[0]` (release). Every block of the
//     grid waits until it reads B * Hkv there (acquire), then reads the output as its x.
//     The last block past that wait re-arms both flags (flags[1] counts them).
// Measured (H100, Llama-3-8B int4 batch-1 graph step): so far 156-289 us a step slower than
// the Triton kernel apart, so the model leaves it off (docs/bench/attention_in_o.md: the
// roles' tiles come one after another and their scores and p @ v are scalar loops).
// No block ever waits for a block that is not running: the grid is at most one resident
// wave (checked at launch), so every role is resident or will be once the previous
// kernel's blocks leave, and roles wait only for the previous kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "gemv.cuh"
#include "woq_kernels.h"

namespace woq {

constexpr int kAttentionTile = 64;  // tokens per tile: 2 x 64 x 136 x 2 B of k and v at D = 128
constexpr int kMaxShares = kAttentionMaxSplits;

// Shared memory of a role, in bytes (the GEMV's dynamic shared memory is at least this
// when the grid holds roles): k and v tiles (rows padded by 8 elements: the score loop's
// 16-byte row reads are conflict-free), q (fp32), the new k and v, scores, softmax state.
template <typename T>
__host__ __device__ constexpr int attention_smem_bytes(int D, int G) {
  return 2 * kAttentionTile * (D + 8) * static_cast<int>(sizeof(T)) + G * D * 4 + 2 * D * static_cast<int>(sizeof(T)) +
         G * kAttentionTile * 4 + 3 * kAttentionMaxGroup * 4 + 16;
}

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void add_release(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
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

struct NoMark {  // (attend_share's timeline hook, unused)
  __device__ void operator()(int) const {}
};

// Role `role` of the grid's attention (see above); false if its share holds no token (it
// did nothing, not even the wait). THREADS threads (256 in the o GEMV's grid, 512 in the
// persistent decode step). `wait()` returns once the qkv rows are
// written (every thread calls it): the previous grid's completion here, a counter in the
// persistent decode step (decode_step.cuh).
// `mark(i)` (every thread calls it; a timeline's hook, benchmarks only) at four points:
// 0 q and the new k and v loaded and rotated, 1 the share's tiles done, 2 its output (or
// partials and the merge counter) written, 3 the head's output released.
// (Inlined, taking the kernel parameter by reference: a call copied the 300-byte struct to
// every thread's stack -- ~86 KB of local-memory stores per block -- and the step was
// ~10 us a layer slower.)
template <typename T, int THREADS = 256, typename Wait, typename Mark = NoMark>
__device__ __forceinline__ bool attend_share(const DecodeAttention& a, int role, Wait&& wait, Mark&& mark = Mark{}) {
  extern __shared__ uint4 smem_attention[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int kThreads = THREADS, TT = kAttentionTile;
  constexpr int kAcc = kAttentionMaxGroupDims / 2 / kThreads;  // (head, two dims) accumulators a thread holds
  static_assert(kThreads % 256 == 0 && kAcc >= 1, "whole multiples of 256 threads");
  const int D = a.head_dim, G = a.heads / a.kv_heads, S = a.splits, RS = D + 8;  // RS: padded row
  const AttentionShare share = attention_share(a, role);
  const int b = share.b, hkv = share.hkv, split = share.split, used = share.used, start = share.start, end = share.end;
  if (start >= end) return false;
  const long long slot = a.slots[b];
  const int pos = static_cast<int>(a.positions[b]);  // the new token's (= length - 1)

  T* k_s = reinterpret_cast<T*>(smem_attention);
  T* v_s = k_s + TT * RS;
  float* q_s = reinterpret_cast<float*>(v_s + TT * RS);
  T* kn = reinterpret_cast<T*>(q_s + G * D);
  T* vn = kn + D;
  float* sc = reinterpret_cast<float*>(vn + D);
  float* m_s = sc + G * TT;
  float* l_s = m_s + kAttentionMaxGroup;
  float* alpha_s = l_s + kAttentionMaxGroup;
  int* last_s = reinterpret_cast<int*>(alpha_s + kAttentionMaxGroup);

  T* k_head = static_cast<T*>(a.k_cache) + slot * a.cache_slot_stride + hkv * a.cache_head_stride;
  T* v_head = static_cast<T*>(a.v_cache) + slot * a.cache_slot_stride + hkv * a.cache_head_stride;
  // A tile's cached rows (the new position's row is patched in after the wait).
  auto fetch_tile = [&](int t0) {
    const int units = D / 8;
    for (int u = tid; u < TT * units; u += kThreads) {
      const int t = u / units, c = (u % units) * 8, tok = t0 + t;
      const bool valid = tok < end && tok != pos;
      const long long off = static_cast<long long>(valid ? tok : t0) * a.cache_pos_stride + c;
      copy16_async(static_cast<uint32_t>(__cvta_generic_to_shared(k_s + t * RS + c)), k_head + off, valid);
      copy16_async(static_cast<uint32_t>(__cvta_generic_to_shared(v_s + t * RS + c)), v_head + off, valid);
    }
    cp_async_commit();
  };
  fetch_tile(start);
  wait();

  // q of the group's heads and the new k rotated, the new v; the share holding the
  // position caches k and v.
  const T* row = static_cast<const T*>(a.qkv) + static_cast<long long>(b) * a.qkv_stride;
  const bool mine = pos >= start && pos < end;
  // (all loads first: one L2 round trip, not one per element a thread takes)
  constexpr int kPerThread = (kAttentionMaxGroupDims + 2 * 256) / kThreads;  // (G + 2) * D <= this * kThreads
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
      q_s[h * D + d] = v;
    } else {
      (h == G ? kn : vn)[d] = from_float<T>(v);
      if (mine) (h == G ? k_head : v_head)[static_cast<long long>(pos) * a.cache_pos_stride + d] = from_float<T>(v);
    }
  }
  if (tid < kAttentionMaxGroup) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.f;
  }
  mark(0);

  float acc[kAcc][2] = {};
  const int pairs = G * D / 2;
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
    for (int i = tid; i < G * TT; i += kThreads) {  // a warp: 32 tokens of one head
      const int g = i / TT, t = i % TT;
      float s = -INFINITY;
      if (t < n) {
        s = 0.f;
        const float* q = q_s + g * D;
        for (int d = 0; d < D; d += 8) {
          const uint4 u = *reinterpret_cast<const uint4*>(k_s + t * RS + d);
          const T* k8 = reinterpret_cast<const T*>(&u);
#pragma unroll
          for (int j = 0; j < 8; ++j) s = fmaf(q[d + j], to_float(k8[j]), s);
        }
        s *= a.scale;
      }
      sc[i] = s;
    }
    __syncthreads();
    if (warp < G) {  // online softmax, warp g for head g
      float mx = -INFINITY;
      for (int t = lane; t < TT; t += 32) mx = fmaxf(mx, sc[warp * TT + t]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_new = fmaxf(m_s[warp], mx);
      float sum = 0.f;
      for (int t = lane; t < TT; t += 32) {
        const float p = t < n ? expf(sc[warp * TT + t] - m_new) : 0.f;
        sc[warp * TT + t] = p;
        sum += p;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      __syncwarp();
      if (lane == 0) {
        const float alpha = expf(m_s[warp] - m_new);  // 0 on the first tile (m = -inf)
        alpha_s[warp] = alpha;
        l_s[warp] = l_s[warp] * alpha + sum;
        m_s[warp] = m_new;
      }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kAcc; ++j) {  // (head, two dims) per thread
      const int i = tid + j * kThreads;
      if (i >= pairs) break;
      const int g = i / (D / 2), d = (i % (D / 2)) * 2;
      const float alpha = alpha_s[g];
      float x0 = acc[j][0] * alpha, x1 = acc[j][1] * alpha;
      for (int t = 0; t < n; ++t) {
        const float p = sc[g * TT + t];
        x0 = fmaf(p, to_float(v_s[t * RS + d]), x0);
        x1 = fmaf(p, to_float(v_s[t * RS + d + 1]), x1);
      }
      acc[j][0] = x0;
      acc[j][1] = x1;
    }
    __syncthreads();  // the tile and the scores are free again
  }
  mark(1);

  const int H = a.heads, head0 = hkv * G;
  T* out = static_cast<T*>(a.out) + static_cast<long long>(b) * H * D;
  // Each accumulator pair over its head's sum: store(offset in [H, D], value, value of the next dim).
  auto for_each_output = [&](auto store) {
#pragma unroll
    for (int j = 0; j < kAcc; ++j) {
      const int i = tid + j * kThreads;
      if (i >= pairs) break;
      const int g = i / (D / 2), d = (i % (D / 2)) * 2;
      const float inv = 1.f / l_s[g];
      store((head0 + g) * D + d, acc[j][0] * inv, acc[j][1] * inv);
    }
  };
  if (used == 1) {
    for_each_output([&](int o, float x0, float x1) {
      out[o] = from_float<T>(x0);
      out[o + 1] = from_float<T>(x1);
    });
    mark(2);
  } else {
    // Partial outputs [B, S, H, D] and log-sum-exps [B, S, H]; the last share merges.
    float* part = a.part + (static_cast<long long>(b) * S + split) * H * D;
    for_each_output([&](int o, float x0, float x1) {
      part[o] = x0;
      part[o + 1] = x1;
    });
    if (tid < G) a.lse[(static_cast<long long>(b) * S + split) * H + head0 + tid] = m_s[tid] + logf(l_s[tid]);
    __syncthreads();  // every partial written before thread 0 releases them
    int* counter = a.merge_counters + b * a.kv_heads + hkv;
    if (tid == 0) *last_s = atomic_add_acq_rel(counter, 1) == used - 1;
    __syncthreads();
    mark(2);
    if (!*last_s) return true;
    if (tid == 0) *counter = 0;  // re-armed for the next launch
    const float* lse0 = a.lse + static_cast<long long>(b) * S * H;
    const float* part0 = a.part + static_cast<long long>(b) * S * H * D;
    for (int i = tid; i < G * D; i += kThreads) {  // in share order: deterministic
      const int h = head0 + i / D, d = i % D;
      float lse[kMaxShares], part[kMaxShares];  // (every share's loads in flight together)
#pragma unroll
      for (int s = 0; s < kMaxShares; ++s) {
        lse[s] = s < used ? __ldcg(lse0 + s * H + h) : -INFINITY;
        part[s] = s < used ? __ldcg(part0 + (static_cast<long long>(s) * H + h) * D + d) : 0.f;
      }
      float mx = -INFINITY;
#pragma unroll
      for (int s = 0; s < kMaxShares; ++s) mx = fmaxf(mx, lse[s]);
      float total = 0.f, weight = 0.f;
#pragma unroll
      for (int s = 0; s < kMaxShares; ++s) {
        const float w = s < used ? __expf(lse[s] - mx) : 0.f;
        total = fmaf(w, part[s], total);
        weight += w;
      }
      out[h * D + d] = from_float<T>(total / weight);
    }
  }
  __syncthreads();  // the head's output written before thread 0 releases it
  if (tid == 0) add_release(a.flags, 1);
  mark(3);
  return true;
}

// Every block: wait until all B * Hkv heads' outputs are written; the last block past the
// wait re-arms the flags (no block reads them again in this launch).
__device__ __forceinline__ void wait_for_attention(const DecodeAttention& a) {
  if (threadIdx.x == 0) {
    const int target = a.batch * a.kv_heads;
    while (load_acquire(a.flags) < target) __nanosleep(32);
    if (atomicAdd(a.flags + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      a.flags[0] = 0;
      a.flags[1] = 0;
    }
  }
  __syncthreads();
}

}  // namespace woq
