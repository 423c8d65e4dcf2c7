// Cross-GPU ordering over peer memory (CUDA IPC mappings over NVLink), shared by the peer
// all-reduce (peer_all_reduce.cu) and the persistent decode step across tensor-parallel
// ranks (decode_step.cuh). A block's plain stores to a peer's memory, then a CTA barrier,
// then one thread's release at system scope publish them all (the release is cumulative);
// the reader's acquire at system scope, then a CTA barrier, makes them visible to its whole
// block.
#pragma once

#include <cstdint>

namespace woq {

__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void add_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

}  // namespace woq
