"""How fast can this GPU stream weights with a given load pattern? (diagnosis for the GEMV)

Each variant reads a 512 MiB buffer once with 16-byte loads (warps per block, loads in
flight per lane, cache hint) and xors it into one word per thread, so nothing is
compute-bound. The best variant is the practical ceiling for the GEMV's weight stream.
"""
import statistics

import torch
from torch.utils.cpp_extension import load_inline

SRC = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>

template <int DEPTH, int HINT>
__device__ __forceinline__ uint4 ld(const uint4* p) {
  uint4 v;
  if (HINT == 0) asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else if (HINT == 1) asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else if (HINT == 2) asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else v = *p;
  return v;
}

// Each warp streams a contiguous run of `per_warp` uint4 (like one n-tile's K range),
// keeping DEPTH loads per lane in flight.
template <int DEPTH, int HINT>
__global__ void stream(const uint4* __restrict__ buf, uint32_t* out, long per_warp, long warps_total) {
  const int lane = threadIdx.x & 31;
  const long warp = (long)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
  uint32_t acc = 0;
  for (long w = warp; w < warps_total; w += (long)gridDim.x * (blockDim.x / 32)) {
    const uint4* p = buf + w * per_warp + lane;
    uint4 r[DEPTH];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) r[d] = ld<DEPTH, HINT>(p + d * 32);
    for (long i = DEPTH; i < per_warp / 32; i += DEPTH) {
#pragma unroll
      for (int d = 0; d < DEPTH; ++d) {
        acc ^= r[d].x ^ r[d].y ^ r[d].z ^ r[d].w;
        r[d] = ld<DEPTH, HINT>(p + (i + d) * 32);
      }
    }
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) acc ^= r[d].x ^ r[d].y ^ r[d].z ^ r[d].w;
  }
  if (acc == 0x12345678) out[0] = acc;
}

void run(torch::Tensor buf, torch::Tensor out, int64_t depth, int64_t hint, int64_t warps_per_block,
         int64_t blocks, int64_t per_warp_bytes) {
  const long per_warp = per_warp_bytes / 16;
  const long warps_total = buf.numel() / per_warp_bytes;
  auto b = reinterpret_cast<const uint4*>(buf.data_ptr());
  auto o = reinterpret_cast<uint32_t*>(out.data_ptr());
  dim3 grid(blocks), block(warps_per_block * 32);
#define L(D, H) if (depth == D && hint == H) stream<D, H><<<grid, block>>>(b, o, per_warp, warps_total);
  L(4, 0) L(8, 0) L(16, 0) L(8, 1) L(8, 2) L(8, 3) L(16, 1) L(16, 3)
}
"""

mod = load_inline("woq_probe_bw", cpp_sources="void run(torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t);",
                  cuda_sources=SRC, functions=["run"], extra_cuda_cflags=["-O3"], verbose=False)
sms = torch.cuda.get_device_properties(0).multi_processor_count
buf = torch.randint(0, 255, (512 << 20,), dtype=torch.uint8, device="cuda")
out = torch.zeros(4, dtype=torch.int32, device="cuda")


def measure(**kw) -> float:
    args = (kw["depth"], kw["hint"], kw["wpb"], kw["blocks"], kw["per_warp"])
    for _ in range(2):
        mod.run(buf, out, *args)
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        mod.run(buf, out, *args)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return buf.numel() / statistics.median(ts) / 1e12


hints = {0: "nc.no_alloc", 1: "cg", 2: "cs", 3: "plain"}
for depth, hint in [(4, 0), (8, 0), (16, 0), (8, 1), (8, 2), (8, 3), (16, 1), (16, 3)]:
    for wpb, bps in [(8, 2), (8, 4), (4, 8), (16, 2)]:
        for per_warp in (64 << 10, 8 << 10):
            tb = measure(depth=depth, hint=hint, wpb=wpb, blocks=sms * bps, per_warp=per_warp)
            print(f"PROBE depth={depth:2d} {hints[hint]:11s} warps/block={wpb:2d} blocks/SM={bps} run={per_warp >> 10:3d}KiB/warp: {tb:.2f} TB/s read")
