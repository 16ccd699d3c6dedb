// What attention.cpp shares with the other attention kernels (sdpa.cpp): the arguments
// of the inner kernel (attention_group.h) and the copy of it that runs on this CPU.
#pragma once

#include <cstdint>

namespace sizebackend {

// One work item of the inner kernel: `group` query rows that share one key/value head,
// against `length` key and value rows:
//   out[g, :] = softmax_j(scale * q[g, :] . k[j, :] + bias[g, j]) . v[j, :]
// Every row is head_dim dense elements; rows of q, k, v and out are the given strides
// apart (in elements). bias: [group, length] floats added to the scores, or nullptr;
// where it is -inf the key's weight is exactly 0, and a row whose every score is -inf
// gives zeros (ATen's CPU flash attention does the same).
template <typename scalar_t>
struct GroupArgs {
  const scalar_t* q;
  int64_t q_head_stride;
  const scalar_t* k;
  int64_t k_row_stride;
  const scalar_t* v;
  int64_t v_row_stride;
  int64_t group, head_dim, length;
  float scale;
  const float* bias;
  scalar_t* out;
  int64_t out_head_stride;

  // Floats of scratch one call needs (`work`).
  static int64_t work_size(int64_t group, int64_t head_dim, int64_t length) {
    return group * (2 * head_dim + length + 1) + head_dim;
  }
};

template <typename scalar_t>
using GroupKernel = void (*)(const GroupArgs<scalar_t>&, float* work);

// The copy of the inner kernel for ATen's CPU capability (ATEN_CPU_CAPABILITY applies)
// where this CPU has it: float, c10::BFloat16 and c10::Half (attention.cpp).
template <typename scalar_t>
GroupKernel<scalar_t> group_kernel();

}  // namespace sizebackend
