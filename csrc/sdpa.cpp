// sizebackend::sdpa: F.scaled_dot_product_attention with the same schema and results,
// and a direct CPU kernel for the small calls a serving step makes.
//
// ATen's CPU flash attention is built for long sequences: blocked GEMMs over tiles of
// 32+ queries and 512 keys, scratch buffers sized for those tiles on every call. For the
// few tokens of a decode or small-batch step it spends most of its time on that set-up
// (8.8 us for 4 heads of 64 over 4 tokens on one core, where the arithmetic is 5K
// multiply-adds). The split graph runs every attention between compiled pieces as a
// plain op call, so the backend calls this op there instead (compile/cpu_sdpa.py): it
// takes the calls ATen would give its flash kernel, small enough for a direct loop
// (kMaxWork), and hands everything else to ATen unchanged.
//
// What "the same" means here, so that compiled pieces downstream see no difference:
// - the same output layout as ATen's CPU flash kernel (q's: empty_like(q)); the direct
//   kernel runs only when ATen itself would pick flash (at::_fused_sdp_choice), whose
//   layout that is (its math kernel returns a contiguous tensor);
// - the same semantics: top-left causal mask (query i sees keys 0..i), a bool mask
//   (true: attend) or an additive float mask broadcast to [B, H, L, S], grouped-query
//   heads (enable_gqa: head h reads kv head h / (H / KVH)), and zeros for a query whose
//   every key is masked, as ATen's flash kernel gives;
// - values equal to float rounding (sums run in another order; accumulated in float).
// Gradients: with grad mode on and an input that requires grad, the op is ATen's SDPA
// (its autograd formula included); otherwise the direct kernel or ATen's, below autograd.
#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "attention_kernels.h"

namespace sizebackend {
namespace {

// The calls the direct kernel takes: per head, at most kMaxWork query-key pairs times the
// head dim for one query per head (a decode step), half that for several. The direct
// loop costs in proportion to that, a little more per query; ATen's flash kernel costs
// a set-up of its own plus blocked GEMMs that pay off as the sequences grow. Measured
// on one core (Intel Xeon with AVX-512, 8 heads, 2026-12-07, best of 7 runs each): one
// query over 64 / 128 keys of 64: 0.60x / 0.68x ATen's time; 4 causal queries of 64:
// 0.64-0.85x; 8 causal queries of 64: 0.74-0.97x; at the bound's edge, 4 queries over 32
// keys of 64 (8192): 1.12x, 2 over 64: 1.05x; 16 causal queries of 64: 1.56-1.70x.
constexpr int64_t kMaxWork = 8192;

std::atomic<int64_t> direct_calls{0};
std::atomic<int64_t> aten_calls{0};

bool dense_rows(const at::Tensor& t) {
  return t.stride(3) == 1 || t.size(3) == 1;
}

// Whether the direct kernel takes this call (else ATen's SDPA runs it).
bool direct(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
            std::optional<double> scale, bool enable_gqa) {
  const auto dtype = q.scalar_type();
  for (const at::Tensor* t : {&q, &k, &v}) {
    if (t->is_nested() || t->layout() != at::kStrided) {
      return false;
    }
  }
  if (mask.has_value() && (mask->is_nested() || mask->layout() != at::kStrided)) {
    return false;
  }
  if (!q.device().is_cpu() || q.dim() != 4 || k.dim() != 4 || v.dim() != 4 ||
      (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) ||
      k.scalar_type() != dtype || v.scalar_type() != dtype || dropout_p != 0.0) {
    return false;
  }
  const int64_t batch = q.size(0), heads = q.size(1), queries = q.size(2), dim = q.size(3);
  const int64_t kv_heads = k.size(1), keys = k.size(2);
  if (k.size(0) != batch || v.size(0) != batch || v.size(1) != kv_heads || v.size(2) != keys ||
      k.size(3) != dim || v.size(3) != dim || kv_heads == 0 ||
      (enable_gqa ? heads % kv_heads != 0 : heads != kv_heads) || batch * heads == 0 ||
      queries == 0 || keys == 0 || dim == 0 || !dense_rows(q) || !dense_rows(k) ||
      !dense_rows(v) || queries > kMaxWork || keys > kMaxWork) {  // (pairs below can't overflow)
    return false;
  }
  // Query-key pairs per head: query i sees keys 0..i when causal.
  const int64_t pairs = is_causal && queries <= keys ? queries * (queries + 1) / 2
                        : is_causal ? keys * (keys + 1) / 2 + (queries - keys) * keys
                                    : queries * keys;
  if (pairs * dim > (queries == 1 ? kMaxWork : kMaxWork / 2)) {
    return false;
  }
  if (mask.has_value()) {
    const auto mask_dtype = mask->scalar_type();
    if (is_causal || !mask->device().is_cpu() || mask->dim() > 4 ||
        (mask_dtype != at::kBool && mask_dtype != dtype) ||
        !at::is_expandable_to(mask->sizes(), {batch, heads, queries, keys})) {
      return false;
    }
  }
  // Only where ATen would run its flash kernel, whose output layout ours copies.
  return at::_fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa) ==
         static_cast<int64_t>(sdp::SDPBackend::flash_attention);
}

template <typename scalar_t>
void attend_direct(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const std::optional<at::Tensor>& mask, bool is_causal, float scale,
                   at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), queries = q.size(2), dim = q.size(3);
  const int64_t kv_heads = k.size(1), keys = k.size(2), group = heads / kv_heads;
  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  const scalar_t* k_data = k.const_data_ptr<scalar_t>();
  const scalar_t* v_data = v.const_data_ptr<scalar_t>();
  scalar_t* out_data = out.mutable_data_ptr<scalar_t>();  // rows of E dense (dense_rows(q))

  // The mask as bool or float, its strides those of [B, H, L, S] (0 where broadcast).
  at::Tensor m;
  if (mask.has_value()) {
    m = (mask->scalar_type() == at::kBool ? *mask : mask->to(at::kFloat))
            .expand({batch, heads, queries, keys});
  }
  const bool has_mask = m.defined(), bool_mask = has_mask && m.scalar_type() == at::kBool;
  const bool* mask_bool = bool_mask ? m.const_data_ptr<bool>() : nullptr;
  const float* mask_float = has_mask && !bool_mask ? m.const_data_ptr<float>() : nullptr;

  const GroupKernel<scalar_t> kernel = group_kernel<scalar_t>();
  const int64_t scratch = GroupArgs<scalar_t>::work_size(group, dim, keys);
  // Enough multiply-adds per chunk (about 64K) that waking a thread costs less.
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, 2 * group * keys * dim));
  at::parallel_for(0, batch * kv_heads * queries, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> work(scratch + (has_mask ? group * keys : 0));
    float* bias = work.data() + scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item % queries;
      const int64_t kv_head = (item / queries) % kv_heads;
      const int64_t b = item / (queries * kv_heads);
      const int64_t length = is_causal ? std::min(i + 1, keys) : keys;
      if (has_mask) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t offset = b * m.stride(0) + (kv_head * group + g) * m.stride(1) + i * m.stride(2);
          const int64_t step = m.stride(3);
          float* row = bias + g * length;
          if (bool_mask) {
            for (int64_t j = 0; j < length; ++j) {
              row[j] = mask_bool[offset + j * step] ? 0.0f : -std::numeric_limits<float>::infinity();
            }
          } else {
            for (int64_t j = 0; j < length; ++j) {
              row[j] = mask_float[offset + j * step];
            }
          }
        }
      }
      const GroupArgs<scalar_t> args{
          q_data + b * q.stride(0) + kv_head * group * q.stride(1) + i * q.stride(2), q.stride(1),
          k_data + b * k.stride(0) + kv_head * k.stride(1), k.stride(2),
          v_data + b * v.stride(0) + kv_head * v.stride(1), v.stride(2),
          group, dim, length, scale, has_mask ? bias : nullptr,
          out_data + b * out.stride(0) + kv_head * group * out.stride(1) + i * out.stride(2),
          out.stride(1)};
      kernel(args, work.data());
    }
  });
}

at::Tensor sdpa_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                    std::optional<double> scale, bool enable_gqa) {
  if (!direct(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)) {
    aten_calls.fetch_add(1, std::memory_order_relaxed);
    return at::scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
  }
  direct_calls.fetch_add(1, std::memory_order_relaxed);
  // ATen's flash kernel's layout: q's (dense strides in q's dim order, as empty_like
  // gives them): [B, H, L, E] for a contiguous q, [B, L, H, E] in memory for heads split
  // off a projection's output.
  at::Tensor out = at::empty_like(q);
  // As ATen computes the default (sdp::calculate_scale): in double, then float.
  const float factor = static_cast<float>(
      scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(3))));
  AT_DISPATCH_V2(q.scalar_type(), "sizebackend::sdpa", AT_WRAP([&] {
    attend_direct<scalar_t>(q, k, v, mask, is_causal, factor, out);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}

// Any other device, and meta/fake tensors: ATen's SDPA itself.
at::Tensor sdpa_aten(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                     std::optional<double> scale, bool enable_gqa) {
  return at::scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
}

at::Tensor sdpa_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                         std::optional<double> scale, bool enable_gqa) {
  const bool needs_grad = at::GradMode::is_enabled() &&
      (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
       (mask.has_value() && mask->requires_grad()));
  if (needs_grad) {  // ATen's op, with its autograd formula
    if (q.device().is_cpu()) {
      aten_calls.fetch_add(1, std::memory_order_relaxed);
    }
    return at::scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("sizebackend::sdpa", "")
                             .typed<decltype(sdpa_cpu)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
}

}  // namespace

std::pair<int64_t, int64_t> sdpa_counts() {
  return {direct_calls.load(std::memory_order_relaxed), aten_calls.load(std::memory_order_relaxed)};
}

TORCH_LIBRARY_IMPL(sizebackend, CPU, m) {
  m.impl("sdpa", &sdpa_cpu);
}

TORCH_LIBRARY_IMPL(sizebackend, CompositeExplicitAutograd, m) {
  m.impl("sdpa", &sdpa_aten);
}

TORCH_LIBRARY_IMPL(sizebackend, Autograd, m) {
  m.impl("sdpa", &sdpa_autograd);
}

}  // namespace sizebackend
