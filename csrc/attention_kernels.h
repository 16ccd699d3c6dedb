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

// Several queries of one head against the same keys and values (SDPA's queries of a
// head): row r is query r, which sees keys 0..r when `causal` (top-left), all `keys`
// otherwise:
//   out[r, :] = softmax_j(scale * q[r, :] . k[j, :] + bias[r, j]) . v[j, :]
// Rows of q, k, v and out are the given strides apart; bias as in GroupArgs
// ([rows, keys]). head_dim must be a multiple of tile_lanes().
template <typename scalar_t>
struct RowsArgs {
  const scalar_t* q;
  int64_t q_row_stride;
  const scalar_t* k;
  int64_t k_row_stride;
  const scalar_t* v;
  int64_t v_row_stride;
  int64_t rows, head_dim, keys;
  bool causal;
  float scale;
  const float* bias;
  scalar_t* out;
  int64_t out_row_stride;

  // Floats of scratch one call needs (`work`), for `lanes` = tile_lanes().
  static int64_t work_size(int64_t rows, int64_t head_dim, int64_t keys, int64_t lanes) {
    const int64_t padded_keys = (keys + lanes - 1) / lanes * lanes;
    const int64_t padded_rows = (rows + 3) / 4 * 4;
    return head_dim * padded_keys + padded_rows * (head_dim + padded_keys + 1) +
           keys * head_dim;
  }
};

template <typename scalar_t>
using RowsKernel = void (*)(const RowsArgs<scalar_t>&, float* work);

// The copies of the inner kernels for ATen's CPU capability (ATEN_CPU_CAPABILITY
// applies) where this CPU has it, and the float lanes of that copy's vectors.
template <typename scalar_t>
RowsKernel<scalar_t> rows_kernel();
int64_t tile_lanes();

// The copy of the inner kernel for ATen's CPU capability (ATEN_CPU_CAPABILITY applies)
// where this CPU has it: float, c10::BFloat16 and c10::Half (attention.cpp).
template <typename scalar_t>
GroupKernel<scalar_t> group_kernel();

}  // namespace sizebackend
