// The inner loops of sizebackend::panel_linear (panel_linear.cpp): out = x @ W^T + b for a
// float32 weight packed in panels of 16 output columns (`packed[p, k, j]` = W[16p + j, k],
// zero past the last column), a few rows at a time.
//
// panel_linear.cpp includes this file once per instruction set, each inside its own
// namespace and `#pragma GCC target` region, and calls the copy that matches ATen's CPU
// capability (as attention_group.h is). No includes, no include guard.
//
// One tile is R rows by P panels: R x P accumulators of 16 floats held in registers over
// the whole K loop, each step loading P panel rows once and broadcasting one x value per
// row. SIZEBACKEND_TILE_ROWS and SIZEBACKEND_WIDE_ROWS size the tiles to the registers
// of the instruction set (32 of 64 bytes with AVX-512: 3 rows x 4 panels for one to three
// rows, 16 rows x 1 panel for a few more, 8 x 2 from 16 rows; 16 of 32 bytes with AVX2: 6 x 1; 16 of 16 bytes: 2 x 1).

typedef float Floats16 __attribute__((vector_size(64), aligned(4)));

template <int R, int P>
static inline void panel_tile(const float* x, int64_t ldx, const float* panels, int64_t k_len,
                              const float* bias, float* out, int64_t ldo, int64_t cols) {
  Floats16 acc[R][P];
  for (int j = 0; j < P; ++j) {
    Floats16 b = {};
    if (bias != nullptr) {
      for (int64_t c = 0; c < 16 && 16 * j + c < cols; ++c) b[c] = bias[16 * j + c];
    }
    for (int i = 0; i < R; ++i) acc[i][j] = b;
  }
  const int64_t panel_stride = k_len * 16;
  for (int64_t k = 0; k < k_len; ++k) {
    Floats16 w[P];
    for (int j = 0; j < P; ++j) {
#ifdef SIZEBACKEND_PANEL_PREFETCH
      __builtin_prefetch(panels + j * panel_stride + (k + SIZEBACKEND_PANEL_PREFETCH) * 16);
#endif
      w[j] = *reinterpret_cast<const Floats16*>(panels + j * panel_stride + k * 16);
    }
    for (int i = 0; i < R; ++i) {
      const float xi = x[i * ldx + k];
      for (int j = 0; j < P; ++j) acc[i][j] += w[j] * xi;
    }
  }
  for (int j = 0; j < P; ++j) {
    const int64_t valid = cols - 16 * j;
    for (int i = 0; i < R; ++i) {
      float* o = out + i * ldo + 16 * j;
      if (valid >= 16) {
        *reinterpret_cast<Floats16*>(o) = acc[i][j];
      } else {
        for (int64_t c = 0; c < valid; ++c) o[c] = acc[i][j][c];
      }
    }
  }
}

// Rows [0, rows) of one tile column of P panels, R rows at a time (fewer for the last).
template <int R, int P>
static inline void panel_rows(const float* x, int64_t ldx, const float* panels, int64_t k_len,
                              const float* bias, float* out, int64_t ldo, int64_t rows,
                              int64_t cols) {
  int64_t m = 0;
  for (; m + R <= rows; m += R) {
    panel_tile<R, P>(x + m * ldx, ldx, panels, k_len, bias, out + m * ldo, ldo, cols);
  }
  const int64_t left = rows - m;
  if (left == 0) return;
  x += m * ldx;
  out += m * ldo;
  // The remainder, one instantiation per count below R.
  switch (left) {
#define SIZEBACKEND_PANEL_CASE(n) \
  case n:                         \
    if constexpr (n < R) panel_tile<n, P>(x, ldx, panels, k_len, bias, out, ldo, cols); \
    break;
    SIZEBACKEND_PANEL_CASE(1)
    SIZEBACKEND_PANEL_CASE(2)
    SIZEBACKEND_PANEL_CASE(3)
    SIZEBACKEND_PANEL_CASE(4)
    SIZEBACKEND_PANEL_CASE(5)
    SIZEBACKEND_PANEL_CASE(6)
    SIZEBACKEND_PANEL_CASE(7)
    SIZEBACKEND_PANEL_CASE(8)
    SIZEBACKEND_PANEL_CASE(9)
    SIZEBACKEND_PANEL_CASE(10)
    SIZEBACKEND_PANEL_CASE(11)
    SIZEBACKEND_PANEL_CASE(12)
    SIZEBACKEND_PANEL_CASE(13)
    SIZEBACKEND_PANEL_CASE(14)
    SIZEBACKEND_PANEL_CASE(15)
#undef SIZEBACKEND_PANEL_CASE
    default:
      break;
  }
}

// Output panels [first, last) of `rows` rows: x is rows x k_len (row stride ldx), out is
// rows x n (row stride ldo), panels as packed above, bias n floats or null.
static void panel_gemm(const float* x, int64_t ldx, const float* packed, int64_t k_len,
                       const float* bias, float* out, int64_t ldo, int64_t rows, int64_t n,
                       int64_t first, int64_t last) {
  constexpr int kRows = SIZEBACKEND_TILE_ROWS;
  constexpr int kWideRows = SIZEBACKEND_WIDE_ROWS;
  const int64_t panel_stride = k_len * 16;
  int64_t p = first;
  if (kWideRows > 0 && rows <= 3) {
    // One to three rows: 4 panels a tile, else one accumulator chain per row waits on
    // its own multiply-add latency at every step (one row: 23 GFLOP/s with one panel).
    for (; p + 4 <= last; p += 4) {
      panel_rows<3, 4>(x, ldx, packed + p * panel_stride, k_len, bias ? bias + 16 * p : nullptr,
                       out + 16 * p, ldo, rows, n - 16 * p);
    }
  }
  if (kWideRows > 0 && rows >= 2 * kWideRows) {
    for (; p + 2 <= last; p += 2) {
      panel_rows<(kWideRows > 0 ? kWideRows : 1), 2>(
          x, ldx, packed + p * panel_stride, k_len, bias ? bias + 16 * p : nullptr,
          out + 16 * p, ldo, rows, n - 16 * p);
    }
  }
  for (; p < last; ++p) {
    panel_rows<kRows, 1>(x, ldx, packed + p * panel_stride, k_len,
                         bias ? bias + 16 * p : nullptr, out + 16 * p, ldo, rows, n - 16 * p);
  }
}
