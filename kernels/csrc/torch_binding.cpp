// Thin torch binding of the woq kernels: argument checks, output allocation, the current
// stream. Registered as torch custom ops (torch.ops.woq.*) so they can be captured in
// CUDA graphs and traced by torch.compile (fake implementations: kernels/ops.py).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "woq_kernels.h"

namespace {

// Argument errors are thrown as std::invalid_argument with messages built from strings
// (std::to_string), never through TORCH_CHECK's iostream formatting: formatting an integer
// into a TORCH_CHECK message has crashed inside this library (in ostream::_M_insert<long>).
void check(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("woq: " + message);
}

std::string str(int64_t v) { return std::to_string(v); }

woq::DType dtype_of(const at::Tensor& t) {
  if (t.scalar_type() == at::kHalf) return woq::DType::kFloat16;
  check(t.scalar_type() == at::kBFloat16, "the kernels take float16 or bfloat16 tensors");
  return woq::DType::kBFloat16;
}

// A weight in the GPU layout (kernels/layout.py) for activations of dtype `act`: fp16
// scales (the logical format's, exact), zero points in `act`.
woq::PackedWeight packed_weight(const at::Tensor& qweight, const at::Tensor& scales,
                                const std::optional<at::Tensor>& zeros, int64_t bits, int64_t group_size,
                                int64_t n, int64_t k, at::ScalarType act) {
  check(bits == 4 || bits == 8, "bits must be 4 or 8, got " + str(bits));
  check(qweight.is_cuda() && qweight.scalar_type() == at::kByte && qweight.dim() == 4 && qweight.is_contiguous(),
        "qweight must be a contiguous CUDA uint8 [n_tiles, k_tiles, 32, 16] tensor");
  check(qweight.size(2) == 32 && qweight.size(3) == 16, "qweight must be [n_tiles, k_tiles, 32, 16]");
  check(qweight.size(0) == (n + 15) / 16, "qweight has " + str(qweight.size(0)) + " n-tiles for n = " + str(n));
  check(scales.is_cuda() && scales.dim() == 3 && scales.size(0) == qweight.size(0) && scales.size(2) == 16 &&
            scales.is_contiguous(),
        "scales must be a contiguous CUDA [n_tiles, groups, 16] tensor");
  check(scales.scalar_type() == at::kHalf, "scales must be float16 (the GPU layout keeps the logical fp16 scale)");
  if (zeros) {
    check(zeros->sizes() == scales.sizes() && zeros->scalar_type() == act && zeros->is_contiguous(),
          "zeros must match scales in shape and have the activation dtype");
  }
  woq::PackedWeight w;
  w.qweight = qweight.data_ptr();
  w.scales = scales.data_ptr();
  w.zeros = zeros ? zeros->data_ptr() : nullptr;
  w.bits = static_cast<int>(bits);
  w.N = static_cast<int>(n);
  w.K = static_cast<int>(k);
  w.K_pad = static_cast<int>(qweight.size(1) * (bits == 4 ? 64 : 32));
  w.group_size = static_cast<int>(group_size);
  w.groups_pad = static_cast<int>(scales.size(1));
  check(w.K_pad >= w.K, "qweight covers " + str(w.K_pad) + " input features, fewer than k = " + str(k));
  return w;
}

// x [M, K] (1 <= M <= max_rows), and the bias' agreement with it.
void check_activations(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                       int64_t n, int64_t k, int64_t max_rows, const std::string& rows_message) {
  check(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-D CUDA tensor");
  check(x.size(1) == k, "x has " + str(x.size(1)) + " features, the weight " + str(k));
  // (the kernels copy x in 16-byte cp.async units; a misaligned one would fault on the device)
  check(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, "x must start on a 16-byte boundary (clone a view that does not)");
  check(x.size(0) >= 1 && x.size(0) <= max_rows, rows_message + ", got " + str(x.size(0)));
  if (bias) check(bias->scalar_type() == x.scalar_type() && bias->numel() == n && bias->is_contiguous(), "bad bias");
}

// A timed launch's block stamps (launch.cuh, BlockStamps; blocks past its length write none).
template <typename Args>
void set_stamps(Args& a, const std::optional<at::Tensor>& stamps) {
  if (!stamps) return;
  check(stamps->is_cuda() && stamps->scalar_type() == at::kLong && stamps->is_contiguous() && stamps->numel() <= (1 << 30),
        "stamps must be a contiguous CUDA int64 tensor");
  a.stamps = reinterpret_cast<unsigned long long*>(stamps->data_ptr<int64_t>());
  a.stamps_len = static_cast<int>(stamps->numel());
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                    const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias, int64_t bits,
                    int64_t group_size, int64_t n, int64_t k, int64_t max_blocks, int64_t k_warps, int64_t pipeline,
                    bool swiglu, at::Tensor& workspace, at::Tensor& counters, const std::optional<at::Tensor>& stamps) {
  check_activations(x, bias, n, k, woq::kGemvMaxRows, "the GEMV takes 1 to 32 rows");
  check(!swiglu || n % 16 == 0, "the SwiGLU epilogue takes gate and up rows interleaved in eights: n a multiple of 16, got " + str(n));
  check(pipeline == 0 || pipeline == 1, "pipeline must be 0 (shared-memory ring) or 1 (register stream), got " + str(pipeline));
  const bool stream = pipeline == 1;
  if (stream) {
    check(x.size(0) <= woq::kGemvStreamMaxRows,
          "the register-stream GEMV takes 1 to " + str(woq::kGemvStreamMaxRows) + " rows, got " + str(x.size(0)));
    check(k_warps == 0 || k_warps == 1 || k_warps == 2 || k_warps == 4 || k_warps == 8,
          "the register-stream GEMV takes k_warps 0 (by shape), 1, 2, 4 or 8, got " + str(k_warps));
  } else {
    check(k_warps == 0 || k_warps == 1 || k_warps == 2 || k_warps == 4,
          "k_warps must be 0 (by shape), 1, 2 or 4, got " + str(k_warps));
  }
  const c10::cuda::CUDAGuard guard(x.device());
  woq::GemvArgs a;
  a.weight = packed_weight(qweight, scales, zeros, bits, group_size, n, k, x.scalar_type());
  if (x.size(0) > woq::kGemvAnyWeightMaxRows) {
    const int g = a.weight.group_size >= a.weight.K_pad ? 0 : a.weight.group_size;
    check(g == 0 || g == 64 || g == 128,
          "the GEMV takes more than 16 rows only for per-channel, g64 and g128 weights, got g" + str(g));
    check(k_warps <= 2, "above 16 rows the GEMV takes k_warps 0 (by shape), 1 or 2, got " + str(k_warps));
  }
  a.x = x.data_ptr();
  a.bias = bias ? bias->data_ptr() : nullptr;
  at::Tensor y = at::empty({x.size(0), swiglu ? n / 2 : n}, x.options());
  a.y = y.data_ptr();
  a.epilogue = swiglu ? woq::GemvEpilogue::kSwiGLU : woq::GemvEpilogue::kNone;
  a.M = static_cast<int>(x.size(0));
  check(max_blocks >= 0 && max_blocks <= (1 << 30), "max_blocks must be 0 (by shape) or a grid size, got " + str(max_blocks));
  a.max_blocks = static_cast<int>(max_blocks);
  a.k_warps = static_cast<int>(k_warps);
  a.pipeline = stream ? woq::GemvPipeline::kRegisterStream : woq::GemvPipeline::kSharedRing;
  a.dtype = dtype_of(x);
  check(workspace.is_cuda() && workspace.scalar_type() == at::kFloat && workspace.numel() >= 2 * x.size(0) * 128,
        "workspace must be a CUDA float32 tensor of at least 256 * M elements");
  check(reinterpret_cast<uintptr_t>(workspace.data_ptr()) % 16 == 0,
        "workspace must be 16-byte aligned (the GEMV reads partial sums as float4)");
  check(counters.is_cuda() && counters.scalar_type() == at::kInt &&
            counters.numel() >= woq::gemv_grid_columns(static_cast<int>(n)),
        "counters must be a CUDA int32 tensor with one element per 16 output features");
  a.workspace = workspace.data_ptr<float>();
  a.workspace_floats = workspace.numel();
  a.counters = counters.data_ptr<int>();
  set_stamps(a, stamps);
  const cudaError_t err = woq::launch_gemv(a, at::cuda::getCurrentCUDAStream());
  check(!stream || err != cudaErrorInvalidConfiguration,
        "gemv launch failed: the register stream's x rows do not fit this GPU's shared memory at M=" + str(a.M));
  check(!stream || err != cudaErrorInvalidValue,
        "gemv launch failed: the workspace holds too few partial sums for the register stream's split of K");
  check(err != cudaErrorInvalidConfiguration,
        "gemv launch failed: not even a 2-stage ring " +
            (k_warps > 0 ? "of k_warps=" + str(k_warps) + " at M=" + str(a.M) + " fits this GPU's shared memory (fewer k-warps or rows may)"
                         : "at M=" + str(a.M) + " fits this GPU's shared memory at any k-warp count (fewer rows would)"));
  check(err == cudaSuccess, std::string("gemv launch failed: ") + cudaGetErrorString(err));
  return y;
}


// A paged cache's block table: int32 [rows, blocks_per_row] on the caches' device, contiguous
// (the kernels index it as one array). Its rows cover the batches' slots and its entries
// name blocks of the pool: the caller's to keep.
void check_block_table(const at::Tensor& block_table, const at::Tensor& k_cache) {
  check(block_table.is_cuda() && block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
            block_table.is_contiguous() && block_table.device() == k_cache.device(),
        "block_table must be a contiguous int32 CUDA tensor [rows, blocks_per_row] on the caches' device");
  check(block_table.size(0) >= 1 && block_table.size(1) >= 1 && block_table.numel() < (1LL << 31),
        "block_table must have at least one row and one block a row, fewer than 2^31 entries");
}

// A layer's paged cache [blocks, kv_heads, block_size, head_dim], contiguous, block_size a
// power of two (a position's block and row are a shift and a mask): log2 block_size.
int block_shift_of(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  check(k_cache.is_cuda() && k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
            v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
            v_cache.device() == k_cache.device(),
        "k and v caches must be contiguous CUDA tensors [blocks, kv_heads, block_size, head_dim] alike");
  const int64_t block_size = k_cache.size(2);
  check(block_size >= 1 && block_size <= (1 << 20) && (block_size & (block_size - 1)) == 0,
        "the caches' block_size (dimension 2) must be a power of two, got " + str(block_size));
  int shift = 0;
  while ((int64_t{1} << shift) < block_size) ++shift;
  return shift;
}

// The fields of a decode attention that do not change between its launches: the qkv rows,
// the paged cache and its block table, the RoPE tables, the shares' scratch and the output
// (checked by the caller: check_block_table, block_shift_of).
woq::DecodeAttention decode_attention(const at::Tensor& qkv, int64_t qkv_stride, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& block_table, int block_shift,
                                      const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& part,
                                      const at::Tensor& lse, const at::Tensor& merge_counters, void* out,
                                      int64_t batch, int64_t heads, int64_t head_dim) {
  woq::DecodeAttention a{};
  a.qkv = qkv.data_ptr();
  a.qkv_stride = qkv_stride;
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.cache_block_stride = k_cache.stride(0);
  a.cache_head_stride = k_cache.stride(1);
  a.cache_pos_stride = k_cache.stride(2);
  a.block_table = block_table.data_ptr<int>();
  a.blocks_per_row = static_cast<int>(block_table.size(1));
  a.block_shift = block_shift;
  a.cos = cos.data_ptr<float>();
  a.sin = sin.data_ptr<float>();
  a.rope_stride = cos.stride(0);
  a.part = part.data_ptr<float>();
  a.lse = lse.data_ptr<float>();
  a.merge_counters = merge_counters.data_ptr<int>();
  a.out = out;
  a.batch = static_cast<int>(batch);
  a.heads = static_cast<int>(heads);
  a.kv_heads = static_cast<int>(k_cache.size(1));
  a.head_dim = static_cast<int>(head_dim);
  a.splits = static_cast<int>(part.size(1));
  a.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  return a;
}


// The layer table of the persistent batch-1 decode step (decode_step.cuh), built once per
// model and KV cache: for each layer l, qweights/scales[4 l .. 4 l + 3] are its qkv, o,
// gate/up (rows interleaved for SwiGLU) and down weights in the GPU layout, zeros the same
// or empty (symmetric), norms[2 l], norms[2 l + 1] its input and post-attention RMSNorm
// weights, k_caches/v_caches[l] its paged cache [blocks, kv_heads, block_size, head_dim]
// (contiguous, block_size a power of two), block_table the int32 [rows, blocks_per_row]
// table of every layer (a step's slot is its row); qkv [qkv_n] and attn [hidden] the step's
// buffers, part [1, splits, heads, head_dim] and lse [1, splits, heads] (float32) the
// attention shares' scratch, merge_counters (>= kv_heads) int32 zeros. Returns the table as
// a CUDA uint8 tensor (its pointers: the caller keeps every tensor alive while it is used,
// and rewrites the block table in place, never reallocates it).
at::Tensor decode_step_plan(at::TensorList qweights, at::TensorList scales, at::TensorList zeros, at::TensorList norms,
                            at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& block_table,
                            const at::Tensor& qkv, const at::Tensor& attn, at::Tensor& part, at::Tensor& lse,
                            at::Tensor& merge_counters, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                            int64_t head_dim) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  check(L >= 1 && static_cast<int64_t>(v_caches.size()) == L, "one k and one v cache per layer");
  block_shift_of(k_caches[0], v_caches[0]);  // (4-D: its sizes are read below)
  check_block_table(block_table, k_caches[0]);
  check(static_cast<int64_t>(qweights.size()) == 4 * L && scales.size() == qweights.size() &&
            (zeros.empty() || zeros.size() == qweights.size()) && static_cast<int64_t>(norms.size()) == 2 * L,
        "four weights (and their scales, zeros) and two norms per layer");
  check(qkv.is_cuda() && qkv.dim() == 1 && attn.dim() == 1 && qkv.scalar_type() == attn.scalar_type(),
        "qkv and attn must be 1-D CUDA buffers of the activation dtype");
  const int64_t kv_heads = k_caches[0].size(1);
  check(heads % kv_heads == 0 && heads / kv_heads <= woq::kAttentionMaxGroup && head_dim % 16 == 0 &&
            head_dim <= woq::kStepMaxHeadDim && heads / kv_heads * head_dim <= woq::kAttentionMaxGroupDims,
        "attention shapes the roles do not take (at most " + str(woq::kAttentionMaxGroup) +
            " query heads per KV head, head_dim a multiple of 16 up to " + str(woq::kStepMaxHeadDim) + ")");
  check(qkv.numel() == (heads + 2 * kv_heads) * head_dim && attn.numel() == heads * head_dim,
        "qkv must hold (heads + 2 kv_heads) * head_dim, attn heads * head_dim elements");
  check(part.scalar_type() == at::kFloat && part.is_contiguous() && part.dim() == 4 && part.size(0) == 1 &&
            part.size(2) == heads && part.size(3) == head_dim && lse.scalar_type() == at::kFloat &&
            lse.is_contiguous() && lse.sizes() == at::IntArrayRef({1, part.size(1), kv_heads, woq::kAttentionMaxGroup}),
        "part must be float32 [1, splits, heads, head_dim], lse float32 [1, splits, kv_heads, 8]");
  check(merge_counters.scalar_type() == at::kInt && merge_counters.numel() >= kv_heads, "merge_counters: int32, >= kv_heads");
  check(cos.scalar_type() == at::kFloat && cos.dim() == 2 && cos.size(1) == head_dim && cos.stride(1) == 1 &&
            sin.sizes() == cos.sizes() && sin.strides() == cos.strides(),
        "cos and sin must be float32 [positions, head_dim] tables, rows contiguous");
  std::vector<woq::StepLayer> layers(L);
  for (int64_t l = 0; l < L; ++l) {
    woq::StepLayer& s = layers[l];
    for (int i = 0; i < woq::kStepLinears; ++i) {
      const at::Tensor& q = qweights[4 * l + i];
      const at::Tensor& sc = scales[4 * l + i];
      check(q.is_cuda() && q.scalar_type() == at::kByte && q.dim() == 4 && q.is_contiguous() && q.size(2) == 32 &&
                q.size(3) == 16 && sc.dim() == 3 && sc.size(0) == q.size(0) && sc.size(2) == 16 &&
                sc.is_contiguous() && sc.scalar_type() == at::kHalf &&
                (zeros.empty() || zeros[4 * l + i].scalar_type() == qkv.scalar_type()),
            "weights must be in the GPU layout (kernels/layout.py): fp16 scales, activation-dtype zero points");
      s.linear[i].qweight = q.data_ptr();
      s.linear[i].scales = sc.data_ptr();
      s.linear[i].zeros = zeros.empty() ? nullptr : zeros[4 * l + i].data_ptr();
      s.linear[i].n_tiles = static_cast<int>(q.size(0));
      s.linear[i].ktiles = static_cast<int>(q.size(1));
      s.linear[i].groups_pad = static_cast<int>(sc.size(1));
      s.linear[i].pad_ = 0;
    }
    s.norm[0] = norms[2 * l].data_ptr();
    s.norm[1] = norms[2 * l + 1].data_ptr();
    const at::Tensor& kc = k_caches[l];
    const at::Tensor& vc = v_caches[l];
    const int shift = block_shift_of(kc, vc);
    check(kc.size(1) == kv_heads && kc.size(3) == head_dim && kc.scalar_type() == qkv.scalar_type() &&
              kc.sizes() == k_caches[0].sizes() && kc.device() == block_table.device() &&
              reinterpret_cast<uintptr_t>(kc.data_ptr()) % 16 == 0 &&
              reinterpret_cast<uintptr_t>(vc.data_ptr()) % 16 == 0,
          "every layer's caches: [blocks, kv_heads, block_size, head_dim] of the activation dtype, alike, "
          "16-byte aligned (the roles copy 16-byte units)");
    // (slots, lengths, positions and flags: set by the kernel for each launch)
    s.attention = decode_attention(qkv, qkv.numel(), kc, vc, block_table, shift, cos, sin, part, lse, merge_counters,
                                   attn.data_ptr(), 1, heads, head_dim);
  }
  const int64_t bytes = L * static_cast<int64_t>(sizeof(woq::StepLayer));
  at::Tensor table = at::empty({bytes}, qkv.options().dtype(at::kByte));
  const c10::cuda::CUDAGuard guard(qkv.device());
  check(cudaMemcpy(table.data_ptr(), layers.data(), bytes, cudaMemcpyHostToDevice) == cudaSuccess,
        "copying the decode step's layer table failed");
  return table;
}

// One batch-1 decode step through every layer of `plan` (decode_step_plan): h [hidden]
// (the token's embedding) becomes the residual stream after the last layer, in place; the
// layers' caches get the token's k and v at `positions[0]` of block-table row `slots[0]`
// (the plan's table), attention reads `lengths[0]` positions. counters: int32 zeros (left
// zero). stamps (optional, [layers x stages + 1, SMs]): each block's %globaltimer at the
// end of each (layer, stage), then the start (DecodeStepArgs::stamps).
void decode_step(at::Tensor& h, const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& lengths,
                 const at::Tensor& plan, at::Tensor& qkv, at::Tensor& attn, at::Tensor& act, at::Tensor& counters,
                 at::IntArrayRef shapes, int64_t bits, int64_t group_size, bool zeros, double eps, int64_t roles, int64_t kv_heads,
                 int64_t cache_hints, int64_t max_slots, const std::optional<at::Tensor>& stamps, int64_t rank,
                 at::IntArrayRef peer_areas) {
  check(h.is_cuda() && h.is_contiguous() && h.dim() == 1 && h.scalar_type() == qkv.scalar_type() &&
            reinterpret_cast<uintptr_t>(h.data_ptr()) % 16 == 0,
        "h must be a contiguous, 16-byte aligned 1-D CUDA tensor of the activation dtype");
  for (const at::Tensor* t : {&positions, &slots, &lengths})
    check(t->is_cuda() && t->scalar_type() == at::kLong && t->numel() == 1, "positions, slots, lengths: one int64 each");
  check(plan.is_cuda() && plan.scalar_type() == at::kByte && plan.numel() % sizeof(woq::StepLayer) == 0,
        "plan must be decode_step_plan's table");
  check(shapes.size() == 3 * woq::kStepLinears,
        "shapes: n-tiles, k-tiles and scale groups (padded) of a layer's qkv, o, gate/up and down weights");
  const int n_layers = static_cast<int>(plan.numel() / sizeof(woq::StepLayer));
  check(counters.scalar_type() == at::kInt && counters.numel() >= woq::decode_step_counters(n_layers),
        "counters: int32 zeros, decode_step_counters(n_layers) of them");
  const c10::cuda::CUDAGuard guard(h.device());
  woq::DecodeStepArgs a;
  a.layers = reinterpret_cast<const woq::StepLayer*>(plan.data_ptr());
  a.n_layers = n_layers;
  for (int i = 0; i < woq::kStepLinears; ++i) {
    a.n_tiles[i] = static_cast<int>(shapes[i]);
    a.ktiles[i] = static_cast<int>(shapes[woq::kStepLinears + i]);
    a.groups_pad[i] = static_cast<int>(shapes[2 * woq::kStepLinears + i]);
  }
  a.h = h.data_ptr();
  a.qkv = qkv.data_ptr();
  a.attn = attn.data_ptr();
  a.act = act.data_ptr();
  a.slots = reinterpret_cast<const long long*>(slots.data_ptr<int64_t>());
  a.lengths = reinterpret_cast<const long long*>(lengths.data_ptr<int64_t>());
  a.positions = reinterpret_cast<const long long*>(positions.data_ptr<int64_t>());
  a.counters = counters.data_ptr<int>();
  if (stamps.has_value()) {
    check(stamps->is_cuda() && stamps->scalar_type() == at::kLong && stamps->is_contiguous() && stamps->dim() == 2 &&
              stamps->size(0) == woq::decode_step_counters(n_layers),
          "stamps: a contiguous int64 CUDA tensor [decode_step_counters(n_layers), SMs]");
    a.stamps = reinterpret_cast<unsigned long long*>(stamps->data_ptr<int64_t>());
    a.stamps_per_row = static_cast<int>(stamps->size(1));
  }
  a.hidden = static_cast<int>(h.numel());
  a.inter = static_cast<int>(act.numel());
  a.bits = static_cast<int>(bits);
  a.group_size = static_cast<int>(group_size);
  a.zeros = zeros;
  a.roles = static_cast<int>(roles);
  check(kv_heads >= 1 && roles % kv_heads == 0, "roles: kv_heads times the attention's shares");
  a.kv_heads = static_cast<int>(kv_heads);
  check(cache_hints >= 0 && cache_hints < 4, "cache_hints: a mask of decode_step.cuh's kHint*");
  a.cache_hints = static_cast<int>(cache_hints);
  check(max_slots >= 0, "max_slots: ring slots at most, 0 for as many as fit");
  a.max_slots = static_cast<int>(max_slots);
  a.eps = static_cast<float>(eps);
  a.dtype = dtype_of(h);
  check(peer_areas.size() <= woq::kPeerMaxRanks && (peer_areas.size() <= 1 || (rank >= 0 && rank < int64_t(peer_areas.size()))),
        "peer_areas: one step area a rank (none without tensor parallelism), rank among them");
  a.world = std::max<int>(1, static_cast<int>(peer_areas.size()));
  a.rank = peer_areas.size() > 1 ? static_cast<int>(rank) : 0;
  for (size_t r = 0; r < peer_areas.size(); ++r) a.peer_area[r] = reinterpret_cast<void*>(peer_areas[r]);
  const cudaError_t err = woq::launch_decode_step(a, at::cuda::getCurrentCUDAStream());
  check(err != cudaErrorNotSupported, "the persistent decode step runs on sm_90 with int4 g128 weights only");
  check(err != cudaErrorInvalidConfiguration, "the persistent decode step's ring does not fit the shared memory");
  check(err != cudaErrorInvalidValue,
        "the persistent decode step's stamps need one column per SM; under tensor parallelism, 16-byte aligned "
        "step areas and at most " + str(woq::kStepPeerMaxLayers) + " layers");
  check(err != cudaErrorCooperativeLaunchTooLarge,
        "the persistent decode step needs one resident block per SM and no more attention roles than SMs");
  check(err == cudaSuccess, std::string("decode step launch failed: ") + cudaGetErrorString(err));
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias, int64_t bits,
                int64_t group_size, int64_t n, int64_t k, int64_t config, int64_t splits, at::Tensor& workspace,
                at::Tensor& counters, const std::optional<at::Tensor>& stamps) {
  check_activations(x, bias, n, k, 1 << 24, "the mixed GEMM takes 1 to 2^24 rows");
  check(config >= -1 && config <= 9, "config must be -1 (by M) or 0..9, got " + str(config));
  check(splits >= 0 && splits <= 64, "splits must be 0 (by shape) .. 64, got " + str(splits));
  check(workspace.is_cuda() && workspace.scalar_type() == at::kFloat, "workspace must be a CUDA float32 tensor");
  check(counters.is_cuda() && counters.scalar_type() == at::kInt, "counters must be a CUDA int32 tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  woq::GemmArgs a;
  a.weight = packed_weight(qweight, scales, zeros, bits, group_size, n, k, x.scalar_type());
  a.x = x.data_ptr();
  a.bias = bias ? bias->data_ptr() : nullptr;
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  a.y = y.data_ptr();
  a.M = static_cast<int>(x.size(0));
  a.config = static_cast<int>(config);
  a.splits = static_cast<int>(splits);
  a.dtype = dtype_of(x);
  a.workspace = workspace.data_ptr<float>();
  a.workspace_floats = workspace.numel();
  a.counters = counters.data_ptr<int>();
  a.counters_len = counters.numel();
  set_stamps(a, stamps);
  const cudaError_t err = woq::launch_gemm(a, at::cuda::getCurrentCUDAStream());
  check(err != cudaErrorInvalidConfiguration, "mixed GEMM launch failed: not even a 2-stage ring of tile config " +
                                                  str(config) + " fits this GPU's shared memory (a smaller tile would)");
  check(err != cudaErrorNotSupported, "mixed GEMM launch failed: tile config " + str(config) +
                                          " uses wgmma, which needs an sm_90a build on an H100/H200 (woq.kernels.ops.gemm_configs)");
  check(err == cudaSuccess, std::string("mixed GEMM launch failed: ") + cudaGetErrorString(err));
  return y;
}

void dequantize(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                int64_t bits, int64_t group_size, int64_t n, int64_t k, at::Tensor& out) {
  check(out.is_cuda() && out.is_contiguous() && out.numel() >= n * k,
        "out must be a contiguous CUDA tensor of at least n * k elements");
  const c10::cuda::CUDAGuard guard(out.device());
  woq::DequantArgs a;
  a.weight = packed_weight(qweight, scales, zeros, bits, group_size, n, k, out.scalar_type());
  a.out = out.data_ptr();
  a.dtype = dtype_of(out);
  const cudaError_t err = woq::launch_dequant(a, at::cuda::getCurrentCUDAStream());
  check(err == cudaSuccess, std::string("dequantize launch failed: ") + cudaGetErrorString(err));
}

// y = x weight^T (+ bias) for an unquantized weight [N, K] and x [M, K] at M <= 4
// (dense_gemv.cuh): fp16 or bf16, contiguous, 16-byte aligned, K a multiple of 8. y in x's
// dtype, or float32 with float_out (the values rounded to x's dtype first, as y.float()).
at::Tensor dense_gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      bool float_out) {
  check(x.is_cuda() && x.dim() == 2 && x.is_contiguous() && weight.is_cuda() && weight.dim() == 2 &&
            weight.is_contiguous() && weight.scalar_type() == x.scalar_type() && weight.device() == x.device(),
        "dense_gemv: x [M, K] and weight [N, K] must be contiguous CUDA tensors of one dtype on one device");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  check(weight.size(1) == K, "dense_gemv: weight has " + str(weight.size(1)) + " input features, x " + str(K));
  check(M >= 1 && M <= woq::kDenseGemvMaxRows && K % 8 == 0 && K >= 8 &&
            M * K * 4 <= woq::kDenseGemvMaxXBytes,
        "dense_gemv: M must be 1.." + str(woq::kDenseGemvMaxRows) + ", K a multiple of 8, M K 4 bytes <= " +
            str(woq::kDenseGemvMaxXBytes) + " (got M = " + str(M) + ", K = " + str(K) + ")");
  check(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0,
        "dense_gemv: x and weight must be 16-byte aligned");
  if (bias)
    check(bias->is_cuda() && bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == x.scalar_type(),
          "dense_gemv: bias must be a contiguous CUDA tensor of N elements of x's dtype");
  at::Tensor y = at::empty({M, N}, float_out ? x.options().dtype(at::kFloat) : x.options());
  const c10::cuda::CUDAGuard guard(x.device());
  woq::DenseGemvArgs a;
  a.float_out = float_out;
  a.x = x.data_ptr();
  a.w = weight.data_ptr();
  a.bias = bias ? bias->data_ptr() : nullptr;
  a.y = y.data_ptr();
  a.M = static_cast<int>(M);
  a.N = static_cast<int>(N);
  a.K = static_cast<int>(K);
  a.dtype = dtype_of(x);
  const cudaError_t err = woq::launch_dense_gemv(a, at::cuda::getCurrentCUDAStream());
  check(err == cudaSuccess, std::string("dense GEMV launch failed: ") + cudaGetErrorString(err));
  return y;
}

// Whether the mixed GEMM's wgmma configurations run on the current device (woq_kernels.h).
bool wgmma_available() { return woq::wgmma_available(); }

// Process-wide: whether the GEMV and GEMM launch programmatically on sm_90+ (launch.cuh).
void set_programmatic_launch(bool enabled) { woq::set_programmatic_launch(enabled); }

// Process-wide: a cap on the shared memory the launchers plan rings with (0: none), so
// that a test on a large GPU runs the shallower rings of a smaller one (woq_kernels.h).
void set_shared_memory_limit(int64_t bytes) {
  check(bytes >= 0 && bytes <= (1 << 30), "the shared-memory limit is a byte count >= 0");
  woq::set_shared_memory_limit(static_cast<int>(bytes));
}

// --- What Python mirrors of the kernels: limits, the launch space, scratch sizes --------

// The named constant of woq_kernels.h (the values the kernels use).
int64_t constant(const std::string& name) {
  static const std::pair<const char*, int64_t> table[] = {
      {"gemv_warps", woq::kGemvWarps},
      {"gemv_max_m", woq::kGemvAnyWeightMaxRows},
      {"gemv_wide_max_m", woq::kGemvMaxRows},
      {"stream_max_m", woq::kGemvStreamMaxRows},
      {"dense_gemv_max_m", woq::kDenseGemvMaxRows},
      {"dense_gemv_max_x_bytes", woq::kDenseGemvMaxXBytes},
      {"gemm_configs", woq::kGemmConfigs},
      {"tuning_version", woq::kTuningVersion},
      {"attention_max_group", woq::kAttentionMaxGroup},
      {"attention_max_group_dims", woq::kAttentionMaxGroupDims},
      {"step_max_shares", woq::kAttentionMaxSplits},
      {"step_max_head_dim", woq::kStepMaxHeadDim},
      {"step_max_hidden", woq::kStepMaxHidden},
      {"step_max_staged_units", woq::kStepMaxStagedUnits},
      {"step_stages", woq::kStepStages},
      {"peer_blocks", woq::kPeerBlocks},
      {"peer_max_ranks", woq::kPeerMaxRanks},
      {"peer_signal_bytes", woq::kPeerSignalBytes},
      {"step_peer_area_bytes", woq::kStepPeerAreaBytes},
  };
  for (const auto& [key, value] : table)
    if (name == key) return value;
  check(false, "no kernel constant named '" + name + "'");
  return 0;
}

// [block rows BM, block channels BN, uses wgmma (0/1)] of mixed-GEMM tile config `config`.
std::vector<int64_t> gemm_tile(int64_t config) {
  check(config >= 0 && config < woq::kGemmConfigs,
        "config must be 0.." + str(woq::kGemmConfigs - 1) + ", got " + str(config));
  const woq::GemmTileConfig& c = woq::kGemmTileConfigs[config];
  return {c.bm(), c.bn(), c.wgmma ? 1 : 0};
}

// The k-warp counts built for the ring GEMV (pipeline 0) at m rows, or the register stream
// (pipeline 1): powers of two up to kGemvMaxKWarps (kGemvWideMaxKWarps above 16 rows), or
// up to kGemvWarps.
std::vector<int64_t> k_warps(int64_t m, int64_t pipeline) {
  check(pipeline == 0 || pipeline == 1, "pipeline must be 0 (shared-memory ring) or 1 (register stream)");
  const int most = pipeline == 1 ? woq::kGemvWarps : m <= woq::kGemvAnyWeightMaxRows ? woq::kGemvMaxKWarps
                                                                                     : woq::kGemvWideMaxKWarps;
  std::vector<int64_t> out;
  for (int kw = 1; kw <= most; kw *= 2) out.push_back(kw);
  return out;
}

// Group sizes the mixed GEMM is instantiated for (per-channel is always built as well).
std::vector<int64_t> gemm_groups() {
  return std::vector<int64_t>(std::begin(woq::kGemmGroupSizes), std::end(woq::kGemmGroupSizes));
}

// [workspace floats, counters] the GEMV and mixed GEMM need for a weight of n output
// channels on a device of `sms` SMs, the GEMM serving up to max_gemm_m rows.
std::vector<int64_t> scratch_sizes(int64_t n, int64_t sms, int64_t max_gemm_m) {
  check(n >= 1 && n < (1LL << 31) && sms >= 1 && sms < (1 << 20) && max_gemm_m >= 1 && max_gemm_m < (1LL << 31),
        "scratch_sizes: n, sms and max_gemm_m must be positive 32-bit values");
  const woq::ScratchSizes s =
      woq::scratch_sizes(static_cast<int>(n), static_cast<int>(sms), static_cast<int>(max_gemm_m));
  return {s.workspace_floats, s.counters};
}

int64_t decode_step_counters(int64_t n_layers) {
  check(n_layers >= 1 && n_layers < (1 << 20), "n_layers must be positive");
  return woq::decode_step_counters(static_cast<int>(n_layers));
}

// Peer all-reduce (peer_all_reduce.cu). An allocation of `bytes` on the current device,
// zeroed (its signals start at epoch 0), made with cudaMalloc rather than the caching
// allocator: CUDA IPC opens whole allocations. It lives as long as the process.
int64_t peer_alloc(int64_t bytes) {
  check(bytes > woq::kPeerSignalBytes, "peer_alloc: the allocation must exceed its signal area");
  void* p = nullptr;
  check(cudaMalloc(&p, static_cast<size_t>(bytes)) == cudaSuccess, "peer_alloc: cudaMalloc failed");
  check(cudaMemset(p, 0, static_cast<size_t>(bytes)) == cudaSuccess, "peer_alloc: cudaMemset failed");
  return reinterpret_cast<int64_t>(p);
}

// The CUDA IPC handle of a peer_alloc allocation, as bytes (a CPU uint8 tensor) to send to
// the other ranks.
at::Tensor peer_handle(int64_t ptr) {
  cudaIpcMemHandle_t h;
  check(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(ptr)) == cudaSuccess, "peer_handle: cudaIpcGetMemHandle failed");
  at::Tensor out = at::empty({static_cast<int64_t>(sizeof(h))}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(out.data_ptr(), &h, sizeof(h));
  return out;
}

// Another rank's allocation, opened in this process from its peer_handle bytes.
int64_t peer_open(const at::Tensor& handle) {
  cudaIpcMemHandle_t h;
  check(!handle.is_cuda() && handle.scalar_type() == at::kByte && handle.numel() == sizeof(h) && handle.is_contiguous(),
        "peer_open: the handle must be the CPU uint8 bytes of peer_handle");
  std::memcpy(&h, handle.data_ptr(), sizeof(h));
  void* p = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  check(e == cudaSuccess, std::string("peer_open: cudaIpcOpenMemHandle failed: ") + cudaGetErrorString(e));
  return reinterpret_cast<int64_t>(p);
}

void peer_all_reduce(at::Tensor x, at::IntArrayRef bases, at::Tensor counters, int64_t rank,
                     int64_t capacity) {
  check(x.is_cuda() && x.is_contiguous(), "peer_all_reduce: x must be a contiguous CUDA tensor");
  check(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
        "peer_all_reduce: x must be float16, bfloat16 or float32");
  const int64_t bytes = x.numel() * x.element_size();
  check(bytes % 16 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && bytes <= capacity,
        "peer_all_reduce: x must be 16-byte aligned, a multiple of 16 bytes and at most the capacity");
  check(bases.size() >= 1 && bases.size() <= woq::kPeerMaxRanks && rank >= 0 && rank < int64_t(bases.size()),
        "peer_all_reduce: 1 to " + str(woq::kPeerMaxRanks) + " ranks, rank among them");
  check(counters.is_cuda() && counters.scalar_type() == at::kInt && counters.numel() == woq::kPeerBlocks,
        "peer_all_reduce: counters must be a CUDA int32 tensor of " + str(woq::kPeerBlocks) + " epochs");
  const c10::cuda::CUDAGuard guard(x.device());
  woq::PeerAllReduceArgs a{};
  a.x = x.data_ptr();
  a.bytes = bytes;
  a.dtype = x.scalar_type() == at::kHalf ? woq::PeerDType::kFloat16
            : x.scalar_type() == at::kBFloat16 ? woq::PeerDType::kBFloat16 : woq::PeerDType::kFloat32;
  for (size_t r = 0; r < bases.size(); ++r) a.peers.base[r] = reinterpret_cast<void*>(bases[r]);
  a.counters = reinterpret_cast<uint32_t*>(counters.data_ptr());
  a.rank = static_cast<int>(rank);
  a.world = static_cast<int>(bases.size());
  a.capacity = capacity;
  const cudaError_t e = woq::launch_peer_all_reduce(a, at::cuda::getCurrentCUDAStream());
  check(e == cudaSuccess, std::string("peer_all_reduce: launch failed: ") + cudaGetErrorString(e));
}

}  // namespace

TORCH_LIBRARY(woq, m) {
  m.def(
      "gemv(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int bits, int group_size, int n, "
      "int k, int max_blocks, int k_warps, int pipeline, bool swiglu, Tensor(a!) workspace, Tensor(b!) counters, "
      "Tensor(c!)? stamps=None) -> Tensor");
  m.def(
      "gemm(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int bits, int group_size, int n, "
      "int k, int config, int splits, Tensor(a!) workspace, Tensor(b!) counters, Tensor(c!)? stamps=None) -> Tensor");
  m.def(
      "dequantize(Tensor qweight, Tensor scales, Tensor? zeros, int bits, int group_size, int n, int k, "
      "Tensor(a!) out) -> ()");
  m.def(
      "decode_step_plan(Tensor[] qweights, Tensor[] scales, Tensor[] zeros, Tensor[] norms, Tensor[] k_caches, "
      "Tensor[] v_caches, Tensor block_table, Tensor qkv, Tensor attn, Tensor(a!) part, Tensor(b!) lse, "
      "Tensor(c!) merge_counters, Tensor cos, Tensor sin, int heads, int head_dim) -> Tensor");
  m.def(
      "decode_step(Tensor(a!) h, Tensor positions, Tensor slots, Tensor lengths, Tensor plan, Tensor(b!) qkv, "
      "Tensor(c!) attn, Tensor(d!) act, Tensor(e!) counters, int[] shapes, int bits, int group_size, bool zeros, "
      "float eps, int roles, int kv_heads, int cache_hints, int max_slots, Tensor(f!)? stamps=None, int rank=0, "
      "int[] peer_areas=[]) -> ()");
  m.def("dense_gemv(Tensor x, Tensor weight, Tensor? bias, bool float_out=False) -> Tensor");
  m.def("set_programmatic_launch(bool enabled) -> ()", &set_programmatic_launch);
  m.def("decode_step_counters(int n_layers) -> int", &decode_step_counters);
  m.def("wgmma_available() -> bool", &wgmma_available);
  m.def("set_shared_memory_limit(int bytes) -> ()", &set_shared_memory_limit);
  m.def("constant(str name) -> int", &constant);
  m.def("gemm_tile(int config) -> int[]", &gemm_tile);
  m.def("k_warps(int m, int pipeline) -> int[]", &k_warps);
  m.def("gemm_groups() -> int[]", &gemm_groups);
  m.def("scratch_sizes(int n, int sms, int max_gemm_m) -> int[]", &scratch_sizes);
  m.def("peer_alloc(int bytes) -> int", &peer_alloc);
  m.def("peer_handle(int ptr) -> Tensor", &peer_handle);
  m.def("peer_open(Tensor handle) -> int", &peer_open);
  m.def("peer_all_reduce(Tensor(a!) x, int[] bases, Tensor(b!) counters, int rank, int capacity) -> ()");
}

TORCH_LIBRARY_IMPL(woq, CUDA, m) {
  m.impl("gemv", &gemv);
  m.impl("decode_step_plan", &decode_step_plan);
  m.impl("decode_step", &decode_step);
  m.impl("gemm", &gemm);
  m.impl("dequantize", &dequantize);
  m.impl("dense_gemv", &dense_gemv);
  m.impl("peer_all_reduce", &peer_all_reduce);
}
