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
// row. SIZEBACKEND_TILE_ROWS, SIZEBACKEND_WIDE_ROWS and SIZEBACKEND_FEW_ROWS_PANELS size
// the tiles to the registers of the instruction set (32 of 64 bytes with AVX-512: 3 rows
// x 4 panels for one to three rows, 16 rows x 1 panel for a few more, 8 x 2 from 16 rows;
// 16 of 32 bytes with AVX2: 3 x 2 for one to three rows, 6 x 1 for more; 16 of 16 bytes:
// 2 x 1). AVX2 at one to three rows, 256 x 1024 in L2 (same CPU as below): 3 x 2 tiles
// 14.2 / 13.7 / 16.5 us, 6 x 1 tiles 17.9 / 18.4 / 19.0, 3 x 4 (spilling) 14.5 / 16.4 / 24.7.
//
// SIZEBACKEND_VECTOR_BYTES is the instruction set's vector (64, 32 or 16 bytes): 16 floats
// are 1, 2 or 4 of them. GCC lowers a vector wider than the target has to scalar code:
// with one 64-byte vector type for every copy, the AVX2 copy ran 4 x 256 x 1024 in 322 us
// and the baseline copy in 203 us, against 23.5 us with AVX-512 (AMD EPYC family 25
// model 17, one thread, 2026-12-07); in their own widths 20.3 and 54.5 us.
//
// SIZEBACKEND_PANEL_PREFETCH: while a tile streams its P panels, it asks for the same
// step of the next P panels into L2 (`prefetcht1`). The weight is read once per call, in
// the order it is stored; at a few rows a call is a memory stream once the model's weights
// no longer fit in the caches, and the hardware prefetcher alone runs it well below the
// memory's speed (same CPU, 48 MiB of weights in rotation, AVX-512: 4 x 1024 x 256 in
// 56.6 us with a prefetch 16 steps ahead in the same panel, 42.7 us one tile ahead; 1 to
// 8 rows 0.66-0.92x the time; 12 MiB, within L3, 0.8-1.07x; in L2 equal from 2 rows, 1.1x
// at one row). AVX2: 4 rows 61.5 us against 98.7 without it.

typedef float Vec __attribute__((vector_size(SIZEBACKEND_VECTOR_BYTES), aligned(4)));
constexpr int kLanes = SIZEBACKEND_VECTOR_BYTES / 4;
constexpr int kParts = 16 / kLanes;  // vectors per panel row

// `ahead`: P panels to fetch into L2 while this tile runs (the next tile's).
template <int R, int P>
static inline void panel_tile(const float* x, int64_t ldx, const float* panels, int64_t k_len,
                              const float* bias, float* out, int64_t ldo, int64_t cols,
                              const float* ahead) {
  Vec acc[R][P][kParts];
  for (int j = 0; j < P; ++j) {
    for (int v = 0; v < kParts; ++v) {
      Vec b = {};
      if (bias != nullptr) {
        for (int64_t c = 0; c < kLanes && 16 * j + kLanes * v + c < cols; ++c) {
          b[c] = bias[16 * j + kLanes * v + c];
        }
      }
      for (int i = 0; i < R; ++i) acc[i][j][v] = b;
    }
  }
  const int64_t panel_stride = k_len * 16;
  (void)ahead;
  for (int64_t k = 0; k < k_len; ++k) {
    Vec w[P][kParts];
    for (int j = 0; j < P; ++j) {
#ifdef SIZEBACKEND_PANEL_PREFETCH
      __builtin_prefetch(ahead + j * panel_stride + k * 16, 0, 2);
#endif
      for (int v = 0; v < kParts; ++v) {
        w[j][v] = *reinterpret_cast<const Vec*>(panels + j * panel_stride + k * 16 + kLanes * v);
      }
    }
    for (int i = 0; i < R; ++i) {
      const float xi = x[i * ldx + k];
      for (int j = 0; j < P; ++j) {
        for (int v = 0; v < kParts; ++v) acc[i][j][v] += w[j][v] * xi;
      }
    }
  }
  for (int j = 0; j < P; ++j) {
    for (int v = 0; v < kParts; ++v) {
      const int64_t valid = cols - 16 * j - kLanes * v;
      for (int i = 0; i < R; ++i) {
        float* o = out + i * ldo + 16 * j + kLanes * v;
        if (valid >= kLanes) {
          *reinterpret_cast<Vec*>(o) = acc[i][j][v];
        } else {
          for (int64_t c = 0; c < valid; ++c) o[c] = acc[i][j][v][c];
        }
      }
    }
  }
}

// Rows [0, rows) of one tile column of P panels, R rows at a time (fewer for the last);
// `ahead` as panel_tile takes it.
template <int R, int P>
static inline void panel_rows(const float* x, int64_t ldx, const float* panels, int64_t k_len,
                              const float* bias, float* out, int64_t ldo, int64_t rows,
                              int64_t cols, const float* ahead) {
  int64_t m = 0;
  for (; m + R <= rows; m += R) {
    panel_tile<R, P>(x + m * ldx, ldx, panels, k_len, bias, out + m * ldo, ldo, cols, ahead);
  }
  const int64_t left = rows - m;
  if (left == 0) return;
  x += m * ldx;
  out += m * ldo;
  // The remainder, one instantiation per count below R.
  switch (left) {
#define SIZEBACKEND_PANEL_CASE(n)                                                   \
  case n:                                                                           \
    if constexpr (n < R) panel_tile<n, P>(x, ldx, panels, k_len, bias, out, ldo, cols, ahead); \
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

// One tile column of P panels from panel p. It fetches the next P panels ahead, or its
// own where fewer than P are left in [p + P, last): always memory of the weight, and the
// prefetch unconditional (a test in the loop cost 5% at 16 to 32 rows in L2).
template <int R, int P>
static inline void panel_column(const float* x, int64_t ldx, const float* packed, int64_t k_len,
                                const float* bias, float* out, int64_t ldo, int64_t rows,
                                int64_t n, int64_t p, int64_t last) {
  const int64_t panel_stride = k_len * 16;
  const int64_t ahead = p + 2 * P <= last ? p + P : p;
  panel_rows<R, P>(x, ldx, packed + p * panel_stride, k_len, bias ? bias + 16 * p : nullptr,
                   out + 16 * p, ldo, rows, n - 16 * p, packed + ahead * panel_stride);
}

// Output panels [first, last) of `rows` rows: x is rows x k_len (row stride ldx), out is
// rows x n (row stride ldo), panels as packed above, bias n floats or null.
static void panel_gemm(const float* x, int64_t ldx, const float* packed, int64_t k_len,
                       const float* bias, float* out, int64_t ldo, int64_t rows, int64_t n,
                       int64_t first, int64_t last) {
  constexpr int kRows = SIZEBACKEND_TILE_ROWS;
  constexpr int kWideRows = SIZEBACKEND_WIDE_ROWS;
  int64_t p = first;
  constexpr int kFew = SIZEBACKEND_FEW_ROWS_PANELS;
  if (kFew > 1 && rows <= 3) {
    // One to three rows: kFew panels a tile, else one accumulator chain per row waits on
    // its own multiply-add latency at every step (one row: 23 GFLOP/s with one panel).
    for (; p + kFew <= last; p += kFew) {
      panel_column<3, (kFew > 1 ? kFew : 1)>(x, ldx, packed, k_len, bias, out, ldo, rows, n, p,
                                            last);
    }
  }
  if (kWideRows > 0 && rows >= 2 * kWideRows) {
    for (; p + 2 <= last; p += 2) {
      panel_column<(kWideRows > 0 ? kWideRows : 1), 2>(x, ldx, packed, k_len, bias, out, ldo,
                                                        rows, n, p, last);
    }
  }
  for (; p < last; ++p) {
    panel_column<kRows, 1>(x, ldx, packed, k_len, bias, out, ldo, rows, n, p, last);
  }
}
