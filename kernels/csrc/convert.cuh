// Fast int8/int4 -> fp16/bf16 conversion for weight-only kernels (framework-free).
//
// A cvt instruction per element is slow (low throughput, MIO pressure). Instead we build
// the float directly from the integer's bits, as in FasterTransformer / TensorRT-LLM
// (seeds 000, 001, 003):
//
//   fp16:  for 0 <= Y < 1024, the half with exponent field 25 (bias 15 -> 2^10) and
//          mantissa Y is exactly 1024 + Y. Its bits are 0x6400 | Y. So OR-ing a code
//          into 0x6400 yields 1024 + code, and one half subtraction of (1024 + z)
//          leaves code - z, exact (every integer below 2048 is a half).
//
//          0x6400 | Y  =  0 11001 00YYYYYYYY   (sign, exponent 25, 10-bit mantissa)
//
//   bf16:  only 7 mantissa bits, so the same trick works for nibbles only:
//          0x4300 | Y = 128 + Y for 0 <= Y < 128 (exponent 134 -> 2^7, mantissa Y).
//          A byte Y = 128 h + m (h its top bit) does not fit; it is split instead:
//            A = 0x4300 | m              = 128 + m
//            B = 0xC300 | (~Y & 0x80)    = h ? -128 : -256   (bit 7 is the exponent's
//                                          lsb: 0xC300 = -2^7, 0xC380 = -2^8)
//            A + B                       = Y - 128           (one fma with 1: exact)
//          two LOP3s and an fma per pair, plus an fma of (128 - z) for zero points
//          (exact: |Y - z| < 256 needs 8 significant bits, which bf16 has): 7
//          instructions per word (9 with zero points), against 10 through fp32.
//
// Codes are stored *unsigned* (the logical format's symmetric codes are biased by 128 or
// 8), so no sign extension is ever needed; the bias/zero point is folded into the
// subtraction. All conversions are exact: the kernels' A fragments hold the integers
// (code - z), and scales are applied to the fp32 accumulators.
//
// Interleaving (done at pack time, kernels/layout.py) puts the codes where these bit
// tricks find them, so that each 32-bit result register is one mma A-fragment register:
//
//   int8, one 32-bit word -> 2 registers (4 codes e0..e3; e0,e1 go to register 0):
//       byte:      3    2    1    0
//       code:     e3   e1   e2   e0          (logical order 0,2,1,3)
//       prmt(word, 0x64646464, 0x5250) -> [0x64|e1 : 0x64|e0] = half2(1024+e0, 1024+e1)
//       prmt(word, 0x64646464, 0x5351) -> [0x64|e3 : 0x64|e2] = half2(1024+e2, 1024+e3)
//
//   int4, one 32-bit word -> 4 registers (8 codes e0..e7; register r gets e(2r), e(2r+1)):
//       nibble:    7    6    5    4    3    2    1    0
//       code:     e7   e5   e3   e1   e6   e4   e2   e0   (logical order 0,2,4,6,1,3,5,7)
//       fp16: lop3(word, 0x000f000f, 0x64006400, (a&b)|c) picks nibbles 0 and 4 ->
//             half2(1024+e0, 1024+e1). Mask 0x00f0_00f0 picks nibbles 1 and 5, still
//             shifted by 4 bits: half2(1024+16*e2, 1024+16*e3); the shift is undone by
//             one fma: x * (1/16) - (64 + z). The same two masks on word >> 8 give
//             (e4, e5) and (e6, e7). Shifting the word left instead would collide with
//             the 0x64 exponent byte, hence the ">> 8" (seed 000, "top_i4s").
//       bf16: the x16 trick overflows 7 mantissa bits, so each pair is masked with
//             0x000f000f from word, word>>4, word>>8, word>>12 (same layout): three
//             shifts, as a 16-bit lane has room for one nibble window, and with the
//             fma that removes 128 + z, 11 instructions per 8 codes against fp16's 9.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace woq {

// lop3 look-up table for (a & b) | c, computed from the canonical inputs
// a = 0xF0, b = 0xCC, c = 0xAA.
constexpr int kLutAndOr = (0xF0 & 0xCC) | 0xAA;

__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(kLutAndOr));
  return d;
}

// (~a & b) | c
constexpr int kLutAndNotOr = (~0xF0 & 0xCC) | 0xAA;

__device__ __forceinline__ uint32_t lop3_andnot_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(kLutAndNotOr & 0xFF));
  return d;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

__device__ __forceinline__ uint32_t as_u32(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 as_h2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// d = a * b + c on packed pairs (bf16x2 needs sm_80; sub.bf16x2 would need sm_90).
__device__ __forceinline__ uint32_t fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#else
  d = 0;  // bf16 kernels are not launched below sm_80 (checked on the host)
#endif
  return d;
}

// Per-group constants folding the zero point into the magic-number subtraction, for the
// two output rows a thread owns (row gid -> "lo", row gid + 8 -> "hi").
//
// Each is built from floats (the fixed symmetric bias; per-channel zero points, once per
// tile) or, per group, from the stored pair (z_lo, z_hi) in T with packed half / bf16
// arithmetic (2-3 instructions): no conversions to fp32 and back per row, which the bf16
// and int8 constants took before. The result is the same: zero points are codes (small
// integers, exact), and for any stored value both routes round the exact sum once (an
// fp32 sum of two values of at most 11 significant bits is exact).
template <typename T, int BITS>
struct ZeroConsts;

template <>
struct ZeroConsts<__half, 8> {
  uint32_t sub_lo, sub_hi;  // half2(1024 + z)
  ZeroConsts() = default;
  __device__ __forceinline__ ZeroConsts(float z_lo, float z_hi)
      : sub_lo(as_u32(__float2half2_rn(1024.f + z_lo))), sub_hi(as_u32(__float2half2_rn(1024.f + z_hi))) {}
  __device__ __forceinline__ explicit ZeroConsts(uint32_t z_pair) {  // (operand swizzles: 2 adds)
    const __half2 z = as_h2(z_pair);
    sub_lo = as_u32(__hadd2(__low2half2(z), as_h2(0x64006400u)));  // + half2(1024, 1024)
    sub_hi = as_u32(__hadd2(__high2half2(z), as_h2(0x64006400u)));
  }
};

// int4: the unshifted nibbles (mask 0x000f000f) always land in row gid's registers and the
// shifted ones in row gid + 8's (see the layout above), so each row needs one constant.
template <>
struct ZeroConsts<__half, 4> {
  uint32_t sub_lo;  // half2(1024 + z_lo): row gid, unshifted nibbles
  uint32_t add_hi;  // half2(-(64 + z_hi)): row gid + 8, nibbles shifted by 4 bits
  ZeroConsts() = default;
  __device__ __forceinline__ ZeroConsts(float z_lo, float z_hi)
      : sub_lo(as_u32(__float2half2_rn(1024.f + z_lo))), add_hi(as_u32(__float2half2_rn(-64.f - z_hi))) {}
  // From the stored pair half2(z_lo, z_hi): two half adds with operand swizzles, instead
  // of two conversions to fp32 and back (exact: small integers).
  __device__ __forceinline__ explicit ZeroConsts(uint32_t z_pair) {
    const __half2 z = as_h2(z_pair);
    sub_lo = as_u32(__hadd2(__low2half2(z), as_h2(0x64006400u)));   // + half2(1024, 1024)
    add_hi = as_u32(__hsub2(as_h2(0xd400d400u), __high2half2(z)));  // half2(-64, -64) - z
  }
};

template <>
struct ZeroConsts<__nv_bfloat16, 4> {
  uint32_t neg_lo, neg_hi;  // bf16x2(-(128 + z))
  ZeroConsts() = default;
  __device__ __forceinline__ ZeroConsts(float z_lo, float z_hi) {
    __nv_bfloat162 lo = __float2bfloat162_rn(-128.f - z_lo), hi = __float2bfloat162_rn(-128.f - z_hi);
    neg_lo = *reinterpret_cast<uint32_t*>(&lo);
    neg_hi = *reinterpret_cast<uint32_t*>(&hi);
  }
  __device__ __forceinline__ explicit ZeroConsts(uint32_t z_pair) {
    const uint32_t neg = fma_bf16x2(z_pair, 0xbf80bf80u, 0xc300c300u);  // z * -1 + -128
    neg_lo = prmt(neg, neg, 0x1010);
    neg_hi = prmt(neg, neg, 0x3232);
  }
};

template <>
struct ZeroConsts<__nv_bfloat16, 8> {
  uint32_t add_lo, add_hi;  // bf16x2(128 - z): the converter yields code - 128 first
  ZeroConsts() = default;
  __device__ __forceinline__ ZeroConsts(float z_lo, float z_hi) {
    __nv_bfloat162 lo = __float2bfloat162_rn(128.f - z_lo), hi = __float2bfloat162_rn(128.f - z_hi);
    add_lo = *reinterpret_cast<uint32_t*>(&lo);
    add_hi = *reinterpret_cast<uint32_t*>(&hi);
  }
  __device__ __forceinline__ explicit ZeroConsts(uint32_t z_pair) {
    const uint32_t add = fma_bf16x2(z_pair, 0xbf80bf80u, 0x43004300u);  // z * -1 + 128
    add_lo = prmt(add, add, 0x1010);
    add_hi = prmt(add, add, 0x3232);
  }
};

// The constants of a stored zero-point pair (rows gid, gid + 8), in T.
template <typename T, int BITS>
__device__ __forceinline__ ZeroConsts<T, BITS> zero_consts(uint32_t z_pair) {
  return ZeroConsts<T, BITS>(z_pair);
}

// --- int8: two words (8 codes) -> the 4 A-fragment registers of one k16 block ----------
__device__ __forceinline__ void convert_k16(uint32_t w0, uint32_t w1, const ZeroConsts<__half, 8>& z, uint32_t a[4]) {
  constexpr uint32_t kExp = 0x64646464, kSel01 = 0x5250, kSel23 = 0x5351;
  a[0] = as_u32(__hsub2(as_h2(prmt(w0, kExp, kSel01)), as_h2(z.sub_lo)));  // row gid,   k 2t..2t+1
  a[1] = as_u32(__hsub2(as_h2(prmt(w0, kExp, kSel23)), as_h2(z.sub_hi)));  // row gid+8, k 2t..2t+1
  a[2] = as_u32(__hsub2(as_h2(prmt(w1, kExp, kSel01)), as_h2(z.sub_lo)));  // row gid,   k 2t+8..2t+9
  a[3] = as_u32(__hsub2(as_h2(prmt(w1, kExp, kSel23)), as_h2(z.sub_hi)));  // row gid+8, k 2t+8..2t+9
}

// ZEROS = false: the kernel's zero point is the fixed bias 128 (symmetric codes), which
// the converter's A + B already removes -- one fma per register fewer.
template <bool ZEROS = true>
__device__ __forceinline__ void convert_k16(uint32_t w0, uint32_t w1, const ZeroConsts<__nv_bfloat16, 8>& z,
                                            uint32_t a[4]) {
  // Bytes 0, 2 of a word are row gid's pair, bytes 1, 3 row gid + 8's (layout above):
  // masks on the word and on word >> 8 put each byte in the low byte of a 16-bit lane.
  constexpr uint32_t kMant = 0x007f007f, kTop = 0x00800080;
  constexpr uint32_t kExpA = 0x43004300;  // bf16x2(128, 128): A = 128 + m
  constexpr uint32_t kExpB = 0xc300c300;  // bf16x2(-128, -128); bit 7 set: -256
  constexpr uint32_t kOne = 0x3f803f80;   // bf16x2(1, 1)
  const uint32_t words[2] = {w0, w1};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t lo = words[h], hi = words[h] >> 8;
    a[2 * h + 0] = fma_bf16x2(lop3_and_or(lo, kMant, kExpA), kOne, lop3_andnot_or(lo, kTop, kExpB));  // row gid
    a[2 * h + 1] = fma_bf16x2(lop3_and_or(hi, kMant, kExpA), kOne, lop3_andnot_or(hi, kTop, kExpB));  // row gid+8
    if constexpr (ZEROS) {
      a[2 * h + 0] = fma_bf16x2(a[2 * h + 0], kOne, z.add_lo);
      a[2 * h + 1] = fma_bf16x2(a[2 * h + 1], kOne, z.add_hi);
    }
  }
}

// --- int4: one word (8 codes) -> the 4 A-fragment registers of one k16 block -----------
__device__ __forceinline__ void convert_k16(uint32_t w, const ZeroConsts<__half, 4>& z, uint32_t a[4]) {
  constexpr uint32_t kLo = 0x000f000f, kHi = 0x00f000f0, kExp = 0x64006400;
  const uint32_t kSixteenth = 0x2c002c00;  // half2(1/16, 1/16)
  const uint32_t top = w >> 8;
  a[0] = as_u32(__hsub2(as_h2(lop3_and_or(w, kLo, kExp)), as_h2(z.sub_lo)));
  a[1] = as_u32(__hfma2(as_h2(lop3_and_or(w, kHi, kExp)), as_h2(kSixteenth), as_h2(z.add_hi)));
  a[2] = as_u32(__hsub2(as_h2(lop3_and_or(top, kLo, kExp)), as_h2(z.sub_lo)));
  a[3] = as_u32(__hfma2(as_h2(lop3_and_or(top, kHi, kExp)), as_h2(kSixteenth), as_h2(z.add_hi)));
}

__device__ __forceinline__ void convert_k16(uint32_t w, const ZeroConsts<__nv_bfloat16, 4>& z, uint32_t a[4]) {
  constexpr uint32_t kLo = 0x000f000f, kExp = 0x43004300, kOne = 0x3f803f80;  // bf16x2(1, 1)
  a[0] = fma_bf16x2(lop3_and_or(w, kLo, kExp), kOne, z.neg_lo);
  a[1] = fma_bf16x2(lop3_and_or(w >> 4, kLo, kExp), kOne, z.neg_hi);
  a[2] = fma_bf16x2(lop3_and_or(w >> 8, kLo, kExp), kOne, z.neg_lo);
  a[3] = fma_bf16x2(lop3_and_or(w >> 12, kLo, kExp), kOne, z.neg_hi);
}

}  // namespace woq
