// The inner kernel of sizebackend::attention (attention.cpp) and sizebackend::sdpa
// (sdpa.cpp): the query rows that share one kv head, over that head's key and value rows
// (a sequence's history in the cache, or SDPA's keys), accumulated in float
// (GroupArgs in attention_kernels.h).
//
// attention.cpp includes this file once per instruction set, each time inside its own
// namespace and `#pragma GCC target` region, and calls the copy that matches ATen's CPU
// capability (so ATEN_CPU_CAPABILITY=default runs the baseline copy here too). Hence no
// includes and no include guard: everything used here is included before.
//
// The dot products and the weighted sum of value rows use GCC vector types of the
// instruction set's width: an `omp simd` dot product ends in one scalar add per lane, in
// order, for every key, and a running sum of value rows kept in memory waits on its own
// store at every row; the two took most of the kernel's time before (68.7 -> 28.1 us
// for 8 decode tokens, 8 heads of 32 over 101 rows, AVX-512). The softmax along the
// history is left to the compiler to vectorize (`omp simd`, no calls: hence
// exp_nonpositive below, where std::exp would stay a scalar libm call per score).

// e^x for x <= 0 (a score minus the row's max): 2^n * p(r) with x = n ln2 + r,
// |r| <= ln2 / 2, p of degree 7; within 1 ulp of the correctly rounded e^x for every
// float in [-87, 0] (checked one by one against double-precision exp). Below -87
// it returns e^-87 (~1.6e-38) instead of a smaller value or 0: next to the row's largest
// term, which is 1, such a weight is lost in the sum either way. NaN stays NaN.
static inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  // Round-to-nearest of x / ln2 by the 1.5 * 2^23 trick (exact for |n| < 2^22).
  const float shifted = x * 1.44269504088896341f + 12582912.0f;
  const float n = shifted - 12582912.0f;
  // ln2 in two parts, the first exact in few bits, so r is exact enough.
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^n as a float: n in [-126, 0] here, so the biased exponent stays in [1, 127].
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

// Vector types (any target: GCC lowers a width the target lacks to narrower ones).
typedef float Vec16 __attribute__((vector_size(64)));
typedef float Vec8 __attribute__((vector_size(32)));
typedef float Vec4 __attribute__((vector_size(16)));
// The instruction set's own width (SIZEBACKEND_VECTOR_BYTES, set by the includer).
typedef float Vec __attribute__((vector_size(SIZEBACKEND_VECTOR_BYTES)));
constexpr int64_t kLanes = SIZEBACKEND_VECTOR_BYTES / sizeof(float);

// The sum of a vector's lanes, halving it (__builtin_shufflevector: GCC 12, clang).
#if defined(__clang__) || __GNUC__ >= 12
static inline float sum_lanes(Vec4 v) {
  const Vec4 pairs = v + __builtin_shufflevector(v, v, 2, 3, 0, 1);
  return pairs[0] + pairs[1];
}

static inline float sum_lanes(Vec8 v) {
  return sum_lanes(__builtin_shufflevector(v, v, 0, 1, 2, 3) +
                   __builtin_shufflevector(v, v, 4, 5, 6, 7));
}

static inline float sum_lanes(Vec16 v) {
  return sum_lanes(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}
#else
template <typename VecT>
static inline float sum_lanes(VecT v) {
  float sum = 0.0f;
  for (size_t i = 0; i < sizeof(VecT) / sizeof(float); ++i) {
    sum += v[i];
  }
  return sum;
}
#endif

// a . b over n floats; n a multiple of the vector's lanes.
template <typename VecT>
static inline float dot_lanes(const float* a, const float* b, int64_t n) {
  constexpr int64_t lanes = sizeof(VecT) / sizeof(float);
  VecT acc = {};
  for (int64_t d = 0; d < n; d += lanes) {
    VecT x, y;
    __builtin_memcpy(&x, a + d, sizeof(VecT));
    __builtin_memcpy(&y, b + d, sizeof(VecT));
    acc += x * y;
  }
  return sum_lanes(acc);
}

// a . b over n floats, with the widest vector that divides n.
static inline float dot(const float* a, const float* b, int64_t n) {
  if (n % kLanes == 0) {
    return dot_lanes<Vec>(a, b, n);
  }
  if (n % 4 == 0) {
    return dot_lanes<Vec4>(a, b, n);
  }
  float sum = 0.0f;
  for (int64_t d = 0; d < n; ++d) {
    sum += a[d] * b[d];
  }
  return sum;
}

// acc[0:n] = sum_j weights[j] * rows[j * row_stride + 0:n] for j < length; n a multiple
// of the vector's lanes. Four accumulators per lane group, in registers: a running sum
// kept in memory makes every row wait for the previous row's store.
template <typename VecT>
static inline void weighted_sum_lanes(const float* weights, const float* rows, int64_t row_stride,
                                      int64_t length, int64_t n, float* acc) {
  constexpr int64_t lanes = sizeof(VecT) / sizeof(float);
  for (int64_t c = 0; c < n; c += lanes) {
    VecT a0 = {}, a1 = {}, a2 = {}, a3 = {};
    const float* col = rows + c;
    int64_t j = 0;
    for (; j + 4 <= length; j += 4) {
      VecT x0, x1, x2, x3;
      __builtin_memcpy(&x0, col + j * row_stride, sizeof(VecT));
      __builtin_memcpy(&x1, col + (j + 1) * row_stride, sizeof(VecT));
      __builtin_memcpy(&x2, col + (j + 2) * row_stride, sizeof(VecT));
      __builtin_memcpy(&x3, col + (j + 3) * row_stride, sizeof(VecT));
      a0 += weights[j] * x0;
      a1 += weights[j + 1] * x1;
      a2 += weights[j + 2] * x2;
      a3 += weights[j + 3] * x3;
    }
    for (; j < length; ++j) {
      VecT x;
      __builtin_memcpy(&x, col + j * row_stride, sizeof(VecT));
      a0 += weights[j] * x;
    }
    const VecT total = (a0 + a1) + (a2 + a3);
    __builtin_memcpy(acc + c, &total, sizeof(VecT));
  }
}

// One work item (GroupArgs, attention_kernels.h). work: GroupArgs::work_size floats.
template <typename scalar_t>
void attend_group(const GroupArgs<scalar_t>& a, float* work) {
  const int64_t group = a.group, head_dim = a.head_dim, length = a.length;
  float* query = work;
  float* acc = query + group * head_dim;
  float* scores = acc + group * head_dim;  // [group, length]
  float* inv_total = scores + group * length;  // [group]
  float* key = inv_total + group;               // [head_dim]: a key row in float
  for (int64_t g = 0; g < group; ++g) {
    const scalar_t* q_row = a.q + g * a.q_head_stride;
    float* query_row = query + g * head_dim;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) {
      query_row[d] = static_cast<float>(q_row[d]) * a.scale;
    }
  }

  // Each key row is read once for all the group's heads.
  for (int64_t j = 0; j < length; ++j) {
    const scalar_t* k_row = a.k + j * a.k_row_stride;
    const float* key_row;
    if constexpr (std::is_same_v<scalar_t, float>) {
      key_row = k_row;
    } else {
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) {
        key[d] = static_cast<float>(k_row[d]);
      }
      key_row = key;
    }
    for (int64_t g = 0; g < group; ++g) {
      scores[g * length + j] = dot(query + g * head_dim, key_row, head_dim);
    }
  }

  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * length;
    if (a.bias != nullptr) {
      const float* bias = a.bias + g * length;
#pragma omp simd
      for (int64_t j = 0; j < length; ++j) {
        row[j] += bias[j];
      }
    }
    float max_score = row[0];
#pragma omp simd reduction(max : max_score)
    for (int64_t j = 0; j < length; ++j) {
      max_score = row[j] > max_score ? row[j] : max_score;
    }
    if (a.bias != nullptr && max_score == -std::numeric_limits<float>::infinity()) {
      // Every key masked: zeros, not the NaN that -inf - -inf would give.
      for (int64_t j = 0; j < length; ++j) {
        row[j] = 0.0f;
      }
      inv_total[g] = 0.0f;
      continue;
    }
    // The largest term is e^0 = 1, so the sum is >= 1 and dividing by it is safe.
    float total = 0.0f;
    if (a.bias == nullptr) {
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < length; ++j) {
        const float e = exp_nonpositive(row[j] - max_score);
        row[j] = e;
        total += e;
      }
    } else {  // a masked key (-inf) weighs exactly 0, not exp_nonpositive's e^-87
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < length; ++j) {
        const float x = row[j];
        const float e = x == -std::numeric_limits<float>::infinity()
                            ? 0.0f : exp_nonpositive(x - max_score);
        row[j] = e;
        total += e;
      }
    }
    inv_total[g] = 1.0f / total;
  }

  if (std::is_same_v<scalar_t, float> && head_dim % kLanes == 0) {
    for (int64_t g = 0; g < group; ++g) {
      weighted_sum_lanes<Vec>(scores + g * length, reinterpret_cast<const float*>(a.v),
                               a.v_row_stride, length, head_dim, acc + g * head_dim);
    }
  } else {
    for (int64_t i = 0; i < group * head_dim; ++i) {
      acc[i] = 0.0f;
    }
    for (int64_t j = 0; j < length; ++j) {
      const scalar_t* v_row = a.v + j * a.v_row_stride;
      for (int64_t g = 0; g < group; ++g) {
        const float weight = scores[g * length + j];
        float* acc_row = acc + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) {
          acc_row[d] += weight * static_cast<float>(v_row[d]);
        }
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    scalar_t* out_row = a.out + g * a.out_head_stride;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) {
      out_row[d] = static_cast<scalar_t>(acc[g * head_dim + d] * inv_total[g]);
    }
  }
}
