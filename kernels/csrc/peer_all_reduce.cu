// One-shot all-reduce over peer GPU memory (CUDA IPC), for tensor parallelism's small
// messages: a decode step's row-parallel outputs are batch x hidden x 2 bytes, where
// NCCL's ring pays its protocol latency several times over.
//
// Every rank owns one peer allocation (opened by the others through CUDA IPC):
//
//   [ signals: kPeerBlocks x kPeerMaxRanks uint32 | data, parity 0 | data, parity 1 ]
//
// signals[b][r] is the epoch at which rank r's block b last published its slice. A call
// runs kPeerBlocks blocks on every rank, always all of them, each with its own epoch
// counter in plain device memory (`counters[b]`, never shared): so every block of every
// rank is at the same epoch, whatever the message size. Block b of a call:
//
//  1. copies its elements of x (a grid-stride share, the same on every rank for the same
//     size) into its rank's data buffer of parity epoch & 1;
//  2. after a CTA barrier, thread r stores the epoch into rank r's signals[b][rank] with
//     release semantics at system scope (cumulative: it publishes the block's copies), then
//     spins on its own signals[b][r] with acquire loads until rank r's block b has
//     published this epoch (or already the next: it may have finished this call and begun
//     the next before this block looked);
//  3. reads its elements from every rank's buffer, sums them in fp32 in rank order and
//     rounds once: every rank computes the same bits (NCCL's rings reduce in other orders).
//
// Two data buffers make a closing barrier unnecessary: before rank A overwrites its
// parity-p buffer at epoch e + 2, its block b has seen every rank's block b at epoch e + 1,
// whose kernel started after that rank's epoch-e kernel (the one reading A's parity-p
// buffer) had finished, in stream order. The epoch and the buffers are device state, so a
// CUDA graph replays the kernel as is. No multicast object is created (NVLS stays off).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "peer_sync.cuh"
#include "woq_kernels.h"

namespace woq {
namespace {

constexpr int kPeerThreads = 512;

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float(float v) { return v; }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ float from_float(float v) { return v; }

// A 16-byte unit: E elements of T, moved as one uint4.
template <typename T>
union Unit {
  static constexpr int E = 16 / sizeof(T);
  uint4 raw;
  T v[E];
};

template <typename T>
__global__ void __launch_bounds__(kPeerThreads)
    peer_all_reduce_kernel(T* __restrict__ x, int64_t units, PeerBuffers peers, uint32_t* __restrict__ counters,
                           int rank, int world, int64_t capacity) {
  __shared__ uint32_t epoch_shared;
  const int b = blockIdx.x;
  if (threadIdx.x == 0) epoch_shared = counters[b] + 1;
  __syncthreads();
  const uint32_t epoch = epoch_shared;
  const int64_t data = kPeerSignalBytes + static_cast<int64_t>(epoch & 1) * capacity;
  const int64_t first = static_cast<int64_t>(b) * kPeerThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(kPeerBlocks) * kPeerThreads;
  uint4* own = reinterpret_cast<uint4*>(static_cast<char*>(peers.base[rank]) + data);
  const uint4* in = reinterpret_cast<const uint4*>(x);
  for (int64_t i = first; i < units; i += stride) own[i] = in[i];
  __syncthreads();
  if (threadIdx.x < world) {
    store_release_sys(static_cast<uint32_t*>(peers.base[threadIdx.x]) + b * kPeerMaxRanks + rank, epoch);
    const uint32_t* mine = static_cast<const uint32_t*>(peers.base[rank]) + b * kPeerMaxRanks + threadIdx.x;
    // (at or past the epoch: rank r's block b may already have finished this call and
    // published the next one's; the signed difference keeps the test right past 2^32 calls)
    while (static_cast<int32_t>(load_acquire_sys(mine) - epoch) < 0) {
    }
  }
  __syncthreads();
  uint4* out = reinterpret_cast<uint4*>(x);
  for (int64_t i = first; i < units; i += stride) {
    float acc[Unit<T>::E] = {};
    for (int r = 0; r < world; ++r) {
      Unit<T> u;
      u.raw = __ldcg(reinterpret_cast<const uint4*>(static_cast<const char*>(peers.base[r]) + data) + i);
#pragma unroll
      for (int e = 0; e < Unit<T>::E; ++e) acc[e] += to_float(u.v[e]);
    }
    Unit<T> o;
#pragma unroll
    for (int e = 0; e < Unit<T>::E; ++e) o.v[e] = from_float<T>(acc[e]);
    out[i] = o.raw;
  }
  if (threadIdx.x == 0) counters[b] = epoch;
}

}  // namespace

cudaError_t launch_peer_all_reduce(const PeerAllReduceArgs& a, cudaStream_t stream) {
  const int64_t units = a.bytes / 16;
  if (a.bytes % 16 != 0 || reinterpret_cast<uintptr_t>(a.x) % 16 != 0 || a.bytes > a.capacity ||
      a.world < 1 || a.world > kPeerMaxRanks || a.rank < 0 || a.rank >= a.world)
    return cudaErrorInvalidValue;
  const dim3 grid(kPeerBlocks), block(kPeerThreads);
  switch (a.dtype) {
    case PeerDType::kFloat16:
      peer_all_reduce_kernel<__half><<<grid, block, 0, stream>>>(static_cast<__half*>(a.x), units, a.peers,
                                                                 a.counters, a.rank, a.world, a.capacity);
      break;
    case PeerDType::kBFloat16:
      peer_all_reduce_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(
          static_cast<__nv_bfloat16*>(a.x), units, a.peers, a.counters, a.rank, a.world, a.capacity);
      break;
    case PeerDType::kFloat32:
      peer_all_reduce_kernel<float><<<grid, block, 0, stream>>>(static_cast<float*>(a.x), units, a.peers,
                                                                a.counters, a.rank, a.world, a.capacity);
      break;
  }
  return cudaGetLastError();
}

}  // namespace woq
