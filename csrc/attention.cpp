// CPU kernel of sizebackend::attention (schema in library.cpp).
//
// Shapes: q [T, H, D]; k, v [T, KVH, D]; k_cache, v_cache [num_slots, max_len, KVH, D];
// slots, positions int64 [T]. Token t belongs to sequence slots[t] and sits at
// positions[t] in it. The kernel
//   1. writes k[t], v[t] into cache[slots[t], positions[t]] for every t, then
//   2. computes out[t, h] = softmax(scale * q[t, h] . K[slot, 0..pos]^T) . V[slot, 0..pos]
//      with kv head h / (H / KVH), reading the history from the cache.
// Doing all writes before any read is what lets one batch hold several tokens of the
// same sequence (prefill): token t sees the rows its predecessors in the batch wrote.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_kernels.h"

// The inner kernel, once per instruction set (attention_group.h says why).
#define SIZEBACKEND_VECTOR_BYTES 16
namespace sizebackend::isa_default {
#include "attention_group.h"
}  // namespace sizebackend::isa_default
#undef SIZEBACKEND_VECTOR_BYTES
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SIZEBACKEND_X86_COPIES 1
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define SIZEBACKEND_VECTOR_BYTES 32
namespace sizebackend::isa_avx2 {
#include "attention_group.h"
}  // namespace sizebackend::isa_avx2
#undef SIZEBACKEND_VECTOR_BYTES
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,prefer-vector-width=512")
#define SIZEBACKEND_VECTOR_BYTES 64
namespace sizebackend::isa_avx512 {
#include "attention_group.h"
}  // namespace sizebackend::isa_avx512
#undef SIZEBACKEND_VECTOR_BYTES
#pragma GCC pop_options
#endif

namespace sizebackend {
namespace {

void check_rank(const at::Tensor& t, int64_t rank, const char* name, const char* layout) {
  TORCH_CHECK(
      t.dim() == rank, "sizebackend::attention: ", name, " must have ", rank, " dims ",
      layout, ", got shape ", t.sizes());
}

void check_same_device(const at::Tensor& t, const at::Tensor& q, const char* name) {
  TORCH_CHECK(
      t.device() == q.device(), "sizebackend::attention: ", name, " is on ", t.device(),
      " but q is on ", q.device());
}

void check_same_dtype(const at::Tensor& t, const at::Tensor& q, const char* name) {
  TORCH_CHECK(
      t.scalar_type() == q.scalar_type(), "sizebackend::attention: ", name, " has dtype ",
      t.scalar_type(), " but q has dtype ", q.scalar_type());
}

void check_index_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK(
      t.scalar_type() == at::kLong, "sizebackend::attention: ", name,
      " must be int64, got ", t.scalar_type());
}

void check_num_tokens(const at::Tensor& t, int64_t num_tokens, const char* name) {
  TORCH_CHECK(
      t.size(0) == num_tokens, "sizebackend::attention: ", name, " has ", t.size(0),
      " tokens but q has ", num_tokens);
}

void check_head_dim(const at::Tensor& t, int64_t head_dim, const char* name) {
  TORCH_CHECK(
      t.size(-1) == head_dim, "sizebackend::attention: head_dim mismatch: ", name, " has ",
      t.size(-1), " but q has ", head_dim);
}

void check_num_kv_heads(int64_t actual, int64_t expected, const char* name) {
  TORCH_CHECK(
      actual == expected, "sizebackend::attention: num_kv_heads mismatch: ", name, " has ", actual,
      " but k has ", expected);
}

// Every value of `index` must lie in [0, bound): it becomes a pointer offset into the
// cache, so one bad value is an out-of-bounds write. Checked before anything is written;
// `index` must be contiguous.
void check_index_range(const at::Tensor& index, int64_t bound, const char* name, const char* dim) {
  const int64_t* data = index.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < index.numel(); ++t) {
    TORCH_CHECK(
        data[t] >= 0 && data[t] < bound, "sizebackend::attention: ", name, "[", t, "] = ",
        data[t], " is out of range [0, ", bound, ") (", dim, " of the cache)");
  }
}

void check_inputs(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& positions) {
  check_rank(q, 3, "q", "[num_tokens, num_heads, head_dim]");
  check_rank(k, 3, "k", "[num_tokens, num_kv_heads, head_dim]");
  check_rank(v, 3, "v", "[num_tokens, num_kv_heads, head_dim]");
  check_rank(k_cache, 4, "k_cache", "[num_slots, max_len, num_kv_heads, head_dim]");
  check_rank(v_cache, 4, "v_cache", "[num_slots, max_len, num_kv_heads, head_dim]");
  check_rank(slots, 1, "slots", "[num_tokens]");
  check_rank(positions, 1, "positions", "[num_tokens]");

  check_same_device(k, q, "k");
  check_same_device(v, q, "v");
  check_same_device(k_cache, q, "k_cache");
  check_same_device(v_cache, q, "v_cache");
  check_same_device(slots, q, "slots");
  check_same_device(positions, q, "positions");
  TORCH_CHECK(
      q.device().is_cpu(), "sizebackend::attention: the CPU kernel got tensors on ", q.device());

  const auto dtype = q.scalar_type();
  TORCH_CHECK(
      dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble,
      "sizebackend::attention: q must be float32, bfloat16, float16 or float64, got ", dtype);
  check_same_dtype(k, q, "k");
  check_same_dtype(v, q, "v");
  check_same_dtype(k_cache, q, "k_cache");
  check_same_dtype(v_cache, q, "v_cache");
  check_index_dtype(slots, "slots");
  check_index_dtype(positions, "positions");

  const int64_t num_tokens = q.size(0);
  check_num_tokens(k, num_tokens, "k");
  check_num_tokens(v, num_tokens, "v");
  check_num_tokens(slots, num_tokens, "slots");
  check_num_tokens(positions, num_tokens, "positions");

  const int64_t head_dim = q.size(2);
  check_head_dim(k, head_dim, "k");
  check_head_dim(v, head_dim, "v");
  check_head_dim(k_cache, head_dim, "k_cache");
  check_head_dim(v_cache, head_dim, "v_cache");

  const int64_t num_kv_heads = k.size(1);
  check_num_kv_heads(v.size(1), num_kv_heads, "v");
  check_num_kv_heads(k_cache.size(2), num_kv_heads, "k_cache");
  check_num_kv_heads(v_cache.size(2), num_kv_heads, "v_cache");
  TORCH_CHECK(
      num_kv_heads > 0 && q.size(1) % num_kv_heads == 0, "sizebackend::attention: num_heads (",
      q.size(1), ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  for (int64_t dim = 0; dim < 2; ++dim) {
    TORCH_CHECK(
        v_cache.size(dim) == k_cache.size(dim), "sizebackend::attention: v_cache has ",
        v_cache.size(dim), " but k_cache has ", k_cache.size(dim), " in dim ", dim);
  }
  TORCH_CHECK(
      k_cache.is_contiguous() && v_cache.is_contiguous(),
      "sizebackend::attention: k_cache and v_cache must be contiguous (they are written in place)");
  const auto overlap = at::get_overlap_status(k_cache, v_cache);
  TORCH_CHECK(
      overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial,
      "sizebackend::attention: k_cache and v_cache must not share memory");
}

// Pass 1: cache[slots[t], positions[t]] = src[t]. Serial on purpose: it moves T rows of
// KVH * D elements (tiny next to pass 2), and a fixed order makes a batch that names the
// same (slot, position) twice deterministic (the last token wins) instead of a race.
// `src` is [T, KVH, D] with dense rows of D (stride 1 in the last dim); tokens and heads
// may be strided (a slice of a fused projection's output).
template <typename scalar_t>
void write_cache(
    const at::Tensor& src, at::Tensor& cache, const int64_t* slots, const int64_t* positions) {
  const int64_t heads = src.size(1);
  const int64_t head_dim = src.size(2);
  const int64_t row = heads * head_dim;
  const int64_t token_stride = src.stride(0);
  const int64_t head_stride = src.stride(1);
  const int64_t max_len = cache.size(1);
  const scalar_t* in = src.const_data_ptr<scalar_t>();
  scalar_t* out = cache.mutable_data_ptr<scalar_t>();
  for (int64_t t = 0; t < src.size(0); ++t) {
    scalar_t* dst = out + (slots[t] * max_len + positions[t]) * row;
    const scalar_t* from = in + t * token_stride;
    if (head_stride == head_dim || heads == 1) {
      std::memcpy(dst, from, row * sizeof(scalar_t));
    } else {
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(dst + h * head_dim, from + h * head_stride, head_dim * sizeof(scalar_t));
      }
    }
  }
}

// What both versions of pass 2 (float and float64 accumulation) read of q and the
// caches: sizes, strides and the parallel_for grain.
struct Layout {
  int64_t num_tokens, num_heads, head_dim, num_kv_heads, group, max_len;
  int64_t position_stride, slot_stride;  // of the caches, in elements
  int64_t q_token_stride, q_head_stride;

  Layout(const at::Tensor& q, const at::Tensor& k_cache)
      : num_tokens(q.size(0)),
        num_heads(q.size(1)),
        head_dim(q.size(2)),
        num_kv_heads(k_cache.size(2)),
        group(num_heads / num_kv_heads),
        max_len(k_cache.size(1)),
        position_stride(num_kv_heads * head_dim),
        slot_stride(max_len * position_stride),
        q_token_stride(q.stride(0)),
        q_head_stride(q.stride(1)) {}

  // Decode batches are many short items: give each thread enough of them that waking
  // the thread pool costs less than the work (about 64K multiply-adds per chunk).
  // `heads_per_item`: the query heads one work item covers.
  int64_t grain(const int64_t* positions, int64_t heads_per_item) const {
    int64_t history = 0;
    for (int64_t t = 0; t < num_tokens; ++t) {
      history += positions[t] + 1;
    }
    const int64_t work_per_item =
        std::max<int64_t>(1, history / num_tokens * head_dim * 2 * heads_per_item);
    return std::max<int64_t>(1, (int64_t{1} << 16) / work_per_item);
  }
};

// Which copy of attend_group runs: ATen's CPU capability (ATEN_CPU_CAPABILITY applies, so
// what ATen's own kernels run on this CPU, our op runs too), where this CPU has it.
enum class Isa { kDefault, kAvx2, kAvx512 };

Isa choose_isa() {
#ifdef SIZEBACKEND_X86_COPIES
  const std::string capability = at::get_cpu_capability();
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (capability == "AVX512" && avx2 && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq")) {
    return Isa::kAvx512;
  }
  if ((capability == "AVX2" || capability == "AVX512") && avx2) {
    return Isa::kAvx2;
  }
#endif
  return Isa::kDefault;
}

Isa isa() {
  static const Isa chosen = choose_isa();
  return chosen;
}

}  // namespace

template <typename scalar_t>
GroupKernel<scalar_t> group_kernel() {
  switch (isa()) {
#ifdef SIZEBACKEND_X86_COPIES
    case Isa::kAvx512:
      return &isa_avx512::attend_group<scalar_t>;
    case Isa::kAvx2:
      return &isa_avx2::attend_group<scalar_t>;
#endif
    default:
      return &isa_default::attend_group<scalar_t>;
  }
}

template GroupKernel<float> group_kernel<float>();
template GroupKernel<c10::BFloat16> group_kernel<c10::BFloat16>();
template GroupKernel<c10::Half> group_kernel<c10::Half>();

namespace {

// Pass 2 for float, bfloat16 and float16 (accumulated in float): one work item per
// (token, kv head), covering the query heads that share that kv head, so that each key
// and value row of the history is loaded once for all of them. Items only read the
// caches and write their own output rows: they run in parallel without synchronization.
// `q` has dense rows of D; its tokens and heads may be strided.
template <typename scalar_t>
void attend_float(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const int64_t* slots, const int64_t* positions, double scale, at::Tensor& out) {
  const Layout l(q, k_cache);
  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  const scalar_t* k_data = k_cache.const_data_ptr<scalar_t>();
  const scalar_t* v_data = v_cache.const_data_ptr<scalar_t>();
  scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
  const GroupKernel<scalar_t> kernel = group_kernel<scalar_t>();

  at::parallel_for(0, l.num_tokens * l.num_kv_heads, l.grain(positions, l.group),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> work(GroupArgs<scalar_t>::work_size(l.group, l.head_dim, l.max_len));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / l.num_kv_heads;
      const int64_t kv_head = item % l.num_kv_heads;
      const int64_t base = slots[t] * l.slot_stride + kv_head * l.head_dim;
      const GroupArgs<scalar_t> args{
          q_data + t * l.q_token_stride + kv_head * l.group * l.q_head_stride, l.q_head_stride,
          k_data + base, l.position_stride, v_data + base, l.position_stride, l.group,
          l.head_dim, positions[t] + 1, static_cast<float>(scale), nullptr,
          out_data + (t * l.num_heads + kv_head * l.group) * l.head_dim, l.head_dim};
      kernel(args, work.data());
    }
  });
}

// Pass 2 for float64 (accumulated in double): one (token, head) pair per work item;
// every item only reads the caches and writes its own output row, so items run in
// parallel without synchronization. `q` has dense rows of D; its tokens and heads may be
// strided.
template <typename scalar_t>
void attend(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const int64_t* slots, const int64_t* positions, double scale, at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const Layout l(q, k_cache);
  const int64_t num_heads = l.num_heads, head_dim = l.head_dim, group = l.group;
  const int64_t max_len = l.max_len, position_stride = l.position_stride;
  const int64_t slot_stride = l.slot_stride;
  const int64_t q_token_stride = l.q_token_stride, q_head_stride = l.q_head_stride;
  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  const scalar_t* k_data = k_cache.const_data_ptr<scalar_t>();
  const scalar_t* v_data = v_cache.const_data_ptr<scalar_t>();
  scalar_t* out_data = out.mutable_data_ptr<scalar_t>();

  at::parallel_for(0, l.num_tokens * num_heads, l.grain(positions, 1),
                   [&](int64_t begin, int64_t end) {
    std::vector<acc_t> scores(max_len);
    std::vector<acc_t> query(head_dim);
    std::vector<acc_t> acc(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / num_heads;
      const int64_t kv_head = (item % num_heads) / group;
      const int64_t length = positions[t] + 1;
      const int64_t base = slots[t] * slot_stride + kv_head * head_dim;

      const scalar_t* q_row = q_data + t * q_token_stride + (item % num_heads) * q_head_stride;
      for (int64_t d = 0; d < head_dim; ++d) {
        query[d] = static_cast<acc_t>(q_row[d]) * static_cast<acc_t>(scale);
      }

      acc_t max_score = -std::numeric_limits<acc_t>::infinity();
      for (int64_t j = 0; j < length; ++j) {
        const scalar_t* k_row = k_data + base + j * position_stride;
        acc_t dot = 0;
        // Lets the compiler split the sum into vector lanes (a reordering of the
        // additions that strict IEEE semantics would otherwise forbid).
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) {
          dot += query[d] * static_cast<acc_t>(k_row[d]);
        }
        scores[j] = dot;
        max_score = std::max(max_score, dot);
      }

      // Subtracting the max keeps exp() finite; the largest term is exp(0) = 1, so the
      // sum is >= 1 and the division below is safe.
      acc_t total = 0;
      for (int64_t j = 0; j < length; ++j) {
        scores[j] = std::exp(scores[j] - max_score);
        total += scores[j];
      }

      std::fill(acc.begin(), acc.end(), acc_t(0));
      for (int64_t j = 0; j < length; ++j) {
        const scalar_t* v_row = v_data + base + j * position_stride;
        const acc_t weight = scores[j];
        for (int64_t d = 0; d < head_dim; ++d) {
          acc[d] += weight * static_cast<acc_t>(v_row[d]);
        }
      }

      scalar_t* out_row = out_data + item * head_dim;
      const acc_t inv_total = acc_t(1) / total;
      for (int64_t d = 0; d < head_dim; ++d) {
        out_row[d] = static_cast<scalar_t>(acc[d] * inv_total);
      }
    }
  });
}

at::Tensor attention_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
    at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& positions, double scale) {
  check_inputs(q, k, v, k_cache, v_cache, slots, positions);
  const at::Tensor slots_c = slots.contiguous();
  const at::Tensor positions_c = positions.contiguous();
  check_index_range(slots_c, k_cache.size(0), "slots", "num_slots");
  check_index_range(positions_c, k_cache.size(1), "positions", "max_len");

  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.size(0) == 0) {
    return out;
  }
  // q/k/v usually arrive as views of a fused projection (slices of its last dim, heads
  // split off): the kernels read them through their token and head strides and need
  // only each head's D elements to be dense. A copy for anything else (about 2 us per
  // call for a decode step's view, called once per layer).
  auto dense_rows = [](const at::Tensor& x) {
    return x.stride(2) == 1 || x.size(2) == 1 ? x : x.contiguous();
  };
  const at::Tensor q_c = dense_rows(q);
  const at::Tensor k_c = dense_rows(k);
  const at::Tensor v_c = dense_rows(v);
  const int64_t* slot_data = slots_c.const_data_ptr<int64_t>();
  const int64_t* position_data = positions_c.const_data_ptr<int64_t>();

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, q.scalar_type(), "sizebackend::attention", [&] {
        write_cache<scalar_t>(k_c, k_cache, slot_data, position_data);
        write_cache<scalar_t>(v_c, v_cache, slot_data, position_data);
        if constexpr (std::is_same_v<at::opmath_type<scalar_t>, float>) {
          attend_float<scalar_t>(q_c, k_cache, v_cache, slot_data, position_data, scale, out);
        } else {
          attend<scalar_t>(q_c, k_cache, v_cache, slot_data, position_data, scale, out);
        }
      });
  return out;
}

}  // namespace

const char* attention_isa() {
  switch (isa()) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "default";
  }
}

TORCH_LIBRARY_IMPL(sizebackend, CPU, m) {
  m.impl("attention", &attention_cpu);
}

}  // namespace sizebackend
