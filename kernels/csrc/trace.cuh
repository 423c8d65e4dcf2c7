// An optional timeline of the register-stream GEMV's blocks, for seeing what a decode
// step loses between kernels (benchmarks/decode_timeline.py). Compiled in only with
// WOQ_NVCC_FLAGS="-DWOQ_TRACE=1" (a separate JIT build): the served kernels carry none
// of it. Each block's thread 0 appends one record of kTraceWordsPerRecord (8) 64-bit
// words to the buffer set with set_trace_buffer (word 0 counts the records):
//   weight pointer (which layer), block, SM, gridDim.x,
//   %globaltimer (ns) at the block's start, after griddepcontrol.wait, and at its exit.
// %globaltimer is one clock for the whole GPU, so records of different kernels and SMs
// line up; thread 0's exit stands for the block's.
#pragma once

#include <cstdint>

#include "woq_kernels.h"

#ifndef WOQ_TRACE
#define WOQ_TRACE 0
#endif

namespace woq {

struct TraceTarget {
  unsigned long long* data;  // [1 + capacity * kTraceWordsPerRecord]
  long long capacity;        // records
};

// The buffer set with set_trace_buffer (woq_kernels.h); what set_operands hands the kernels.
TraceTarget trace_target();

#if WOQ_TRACE
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned sm_id() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

// Lives for the kernel's body: constructed first thing, told when the wait returned,
// written out by its destructor on whichever return the block takes.
class BlockTrace {
 public:
  __device__ BlockTrace(TraceTarget target, const void* weight)
      : target_(target), weight_(weight), start_(global_ns()), waited_(0) {}
  __device__ void waited() { waited_ = global_ns(); }
  __device__ ~BlockTrace() {
    if (threadIdx.x != 0 || target_.data == nullptr) return;
    const unsigned long long end = global_ns();
    const unsigned long long slot = atomicAdd(target_.data, 1ULL);
    if (static_cast<long long>(slot) >= target_.capacity) return;
    unsigned long long* r = target_.data + 1 + slot * kTraceWordsPerRecord;
    r[0] = reinterpret_cast<unsigned long long>(weight_);
    r[1] = blockIdx.x;
    r[2] = sm_id();
    r[3] = gridDim.x;
    r[4] = start_;
    r[5] = waited_;
    r[6] = end;
    r[7] = 0;
  }

 private:
  TraceTarget target_;
  const void* weight_;
  unsigned long long start_, waited_;
};
#else
class BlockTrace {
 public:
  __device__ BlockTrace(TraceTarget, const void*) {}
  __device__ void waited() {}
};
#endif

}  // namespace woq
