// Warp-level tensor-core and copy primitives, with the fallbacks each architecture needs.
//
//   sm_80+: mma.m16n8k16 (fp16 and bf16), cp.async with zero-fill.
//   sm_75 (T4): two mma.m16n8k8 per k16 (fp16 only: Turing has no bf16 tensor cores) and
//           plain 16-byte copies instead of cp.async. The host refuses bf16 below sm_80.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace woq {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define WOQ_SM80 1
#else
#define WOQ_SM80 0
#endif

// D(16x8, fp32) += A(16x16, row-major) * B(16x8, col-major), A/B in fp16 or bf16.
// Fragments (g = lane / 4, t = lane % 4):
//   a[0]: A[g][2t..2t+1]    a[1]: A[g+8][2t..2t+1]    a[2]: A[g][2t+8..]   a[3]: A[g+8][2t+8..]
//   b[0]: B[2t..2t+1][g]    b[1]: B[2t+8..2t+9][g]
//   c[0..1]: D[g][2t..2t+1] c[2..3]: D[g+8][2t..2t+1]
template <typename T>
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], const uint32_t b[2]);

template <>
__device__ __forceinline__ void mma_16816<__half>(float c[4], const uint32_t a[4], const uint32_t b[2]) {
#if WOQ_SM80
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  // k 0..7 then k 8..15: m16n8k8 takes (a[0], a[1]) with b[0], then (a[2], a[3]) with b[1].
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(b[0]));
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[2]), "r"(a[3]), "r"(b[1]));
#endif
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float c[4], const uint32_t a[4], const uint32_t b[2]) {
#if WOQ_SM80
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Four 8x8 b16 matrices from shared memory; lane l gives the address of row (l % 8) of
// matrix (l / 8), and receives element pair (l / 4, 2 * (l % 4)) of each matrix.
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* smem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}

// The same, each matrix transposed: lane l receives elements (2 * (l % 4), l / 4) and
// (2 * (l % 4) + 1, l / 4) -- for row-major [k][n] data in shared memory, an mma's B
// fragment (b[0] from matrix 0, b[1] from matrix 1).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* smem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}

// Every cp.async asks the L2 to fetch the aligned 128-byte run on a miss (.L2::128B): a
// warp's 16-byte lane copies cover whole 512-byte weight segments and a tile's group scales
// lie in consecutive runs, so nothing fetched goes unused (measured slightly faster on H100
// than no hint or 256 bytes).

__device__ __forceinline__ uint4 load16_shared(uint32_t smem_addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(smem_addr)
               : "memory");
  return v;
}

__device__ __forceinline__ void store16_shared(uint32_t smem_addr, const uint4& v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// 16-byte global -> shared copy; with `valid` false nothing is read and the 16 bytes are
// zero-filled. The destination is a 32-bit shared-window address (what cp.async takes:
// no generic-to-shared conversion per copy).
__device__ __forceinline__ void copy16_async(uint32_t smem_addr, const void* gmem, bool valid) {
#if WOQ_SM80
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(valid ? 16 : 0));
#else
  store16_shared(smem_addr, valid ? *reinterpret_cast<const uint4*>(gmem) : make_uint4(0, 0, 0, 0));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if WOQ_SM80
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if WOQ_SM80
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// The same for a count known only at run time (a ring depth chosen at launch, launch.cuh):
// wait_group takes an immediate, so one uniform branch per count from MAX down.
template <int MAX>
__device__ __forceinline__ void cp_async_wait_dynamic(int n) {
  if constexpr (MAX > 0) {
    if (n >= MAX) {
      cp_async_wait<MAX>();
    } else {
      cp_async_wait_dynamic<MAX - 1>(n);
    }
  } else {
    cp_async_wait<0>();
  }
}

// Streaming 16-byte load of weights: read once, so do not keep them in L1.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

}  // namespace woq
