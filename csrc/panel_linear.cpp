// CPU kernels of sizebackend::pack_panels and sizebackend::panel_linear (schemas in
// library.cpp): a float32 linear for few rows on a weight packed once, at compile time,
// into panels of 16 output columns (panel_gemm.h has the loops).
//
// Why: a frozen sized piece calls oneDNN's or MKL's packed GEMM (or Inductor's C++ GEMM
// template) for each linear, and at the row counts a listed size has (1 to 64) neither
// library comes near this CPU's arithmetic: on an AMD EPYC family 25 (Zen 4), one thread,
// 2026-12-07, oneDNN's packed GEMM ran 4 x 256 x 768 at 34 GFLOP/s and 32 x 256 x 768 at
// 84, where a register tile of R rows by 16 or 32 columns, the weight read once per
// tile row in the order it is stored, ran both at 106-111 (0.45x and 0.79x oneDNN's
// time). Which kernel a piece gets is still measured per shape
// (dynamo_sizebackend/_torch/packed_linear.py): this one only where it is faster.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

// The loops, once per instruction set.
#define SIZEBACKEND_TILE_ROWS 2
#define SIZEBACKEND_WIDE_ROWS 0
#define SIZEBACKEND_FEW_ROWS_PANELS 0
#define SIZEBACKEND_VECTOR_BYTES 16
namespace sizebackend::panel_default {
#include "panel_gemm.h"
}  // namespace sizebackend::panel_default
#undef SIZEBACKEND_TILE_ROWS
#undef SIZEBACKEND_WIDE_ROWS
#undef SIZEBACKEND_FEW_ROWS_PANELS
#undef SIZEBACKEND_VECTOR_BYTES
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SIZEBACKEND_PANEL_X86_COPIES 1
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define SIZEBACKEND_TILE_ROWS 6
#define SIZEBACKEND_WIDE_ROWS 0
#define SIZEBACKEND_FEW_ROWS_PANELS 2
#define SIZEBACKEND_VECTOR_BYTES 32
#define SIZEBACKEND_PANEL_PREFETCH 1
namespace sizebackend::panel_avx2 {
#include "panel_gemm.h"
}  // namespace sizebackend::panel_avx2
#undef SIZEBACKEND_PANEL_PREFETCH
#undef SIZEBACKEND_TILE_ROWS
#undef SIZEBACKEND_WIDE_ROWS
#undef SIZEBACKEND_FEW_ROWS_PANELS
#undef SIZEBACKEND_VECTOR_BYTES
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,prefer-vector-width=512")
#define SIZEBACKEND_TILE_ROWS 16
#define SIZEBACKEND_WIDE_ROWS 8
#define SIZEBACKEND_FEW_ROWS_PANELS 4
#define SIZEBACKEND_VECTOR_BYTES 64
#define SIZEBACKEND_PANEL_PREFETCH 1
namespace sizebackend::panel_avx512 {
#include "panel_gemm.h"
}  // namespace sizebackend::panel_avx512
#undef SIZEBACKEND_PANEL_PREFETCH
#undef SIZEBACKEND_VECTOR_BYTES
#undef SIZEBACKEND_TILE_ROWS
#undef SIZEBACKEND_WIDE_ROWS
#undef SIZEBACKEND_FEW_ROWS_PANELS
#pragma GCC pop_options
#endif

namespace sizebackend {

const char* attention_isa();  // csrc/attention.cpp: the copy ATen's CPU capability picks

namespace {

using PanelGemm = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*,
                           int64_t, int64_t, int64_t, int64_t, int64_t);

PanelGemm panel_kernel() {
  // The same choice as the attention kernel's (ATEN_CPU_CAPABILITY applies).
  static const PanelGemm chosen = [] {
    const std::string isa = attention_isa();
#ifdef SIZEBACKEND_PANEL_X86_COPIES
    if (isa == "avx512") return &panel_avx512::panel_gemm;
    if (isa == "avx2") return &panel_avx2::panel_gemm;
#endif
    return &panel_default::panel_gemm;
  }();
  return chosen;
}

constexpr int64_t kPanel = 16;

at::Tensor pack_panels(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "sizebackend::pack_panels: w must be 2-D (N x K), got shape ",
              w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kFloat, "sizebackend::pack_panels: w must be float32, got ",
              w.scalar_type());
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  // [panels, 16, K] -> [panels, K, 16]: panel p, step k holds W[16p .. 16p + 15, k].
  at::Tensor padded = at::zeros({panels * kPanel, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed,
                        const std::optional<at::Tensor>& b, int64_t n) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              "sizebackend::panel_linear: packed must be a contiguous float32 "
              "[panels, K, 16] tensor from sizebackend::pack_panels, got shape ",
              packed.sizes());
  const int64_t k = packed.size(1);
  TORCH_CHECK(n > (packed.size(0) - 1) * kPanel && n <= packed.size(0) * kPanel,
              "sizebackend::panel_linear: n = ", n, " does not fit ", packed.size(0),
              " panels of 16 columns");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "sizebackend::panel_linear: x has ",
              x.dim() ? x.size(-1) : 0, " features, the weight takes ", k);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "sizebackend::panel_linear: x must be float32, got ",
              x.scalar_type());
  const float* bias = nullptr;
  at::Tensor b_contig;
  if (b.has_value() && b->defined()) {
    TORCH_CHECK(b->dim() == 1 && b->size(0) == n && b->scalar_type() == at::kFloat,
                "sizebackend::panel_linear: bias must be float32 of ", n, " values, got shape ",
                b->sizes());
    b_contig = b->contiguous();
    bias = b_contig.data_ptr<float>();
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty(out_shape, x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = k > 0 ? x.numel() / k : (n > 0 ? out.numel() / n : 0);
  if (rows == 0 || n == 0) {
    return out;
  }
  if (k == 0) {
    return b_contig.defined() ? out.copy_(b_contig.expand_as(out)) : out.zero_();
  }
  const at::Tensor x2 = x.reshape({rows, k});
  const at::Tensor xc = x2.stride(1) == 1 ? x2 : x2.contiguous();
  const float* xp = xc.data_ptr<float>();
  const int64_t ldx = xc.stride(0);
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const PanelGemm kernel = panel_kernel();
  const int64_t panels = packed.size(0);
  // Threads split the output panels; below ~64K multiply-adds a chunk, one thread.
  const int64_t per_panel = rows * k * kPanel;
  const int64_t grain = std::max<int64_t>(2, (65536 + per_panel - 1) / per_panel);
  at::parallel_for(0, panels, grain, [&](int64_t first, int64_t last) {
    kernel(xp, ldx, wp, k, bias, op, n, rows, n, first, last);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(sizebackend, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
}

}  // namespace sizebackend
