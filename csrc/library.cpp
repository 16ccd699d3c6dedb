// The `sizebackend` op library: every schema lives in this one TORCH_LIBRARY block,
// kernels live next to their implementation in one TORCH_LIBRARY_IMPL per dispatch key.
//
// The shared object is also a Python extension module: importing it loads the library,
// and it holds the FrozenGuard class (csrc/frozen_guard.cpp), the packed-linear cache's
// two functions (csrc/packed_linear.cpp), the Chain class (csrc/chain.cpp),
// attention_isa (csrc/attention.cpp) and sdpa_counts (csrc/sdpa.cpp).
#include <torch/extension.h>

#include <torch/library.h>

namespace sizebackend {
void bind_frozen_guard(pybind11::module_& m);  // csrc/frozen_guard.cpp
void bind_packed_linear(pybind11::module_& m);  // csrc/packed_linear.cpp
void bind_chain(pybind11::module_& m);  // csrc/chain.cpp
const char* attention_isa();  // csrc/attention.cpp
std::pair<int64_t, int64_t> sdpa_counts();  // csrc/sdpa.cpp
}

// `from dynamo_sizebackend import _C` loads the .so, which runs the static registrars
// below (the ops are then torch.ops.sizebackend.*), and gives the module its class and functions.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Custom-op library of dynamo_sizebackend; importing it registers torch.ops.sizebackend.";
  sizebackend::bind_frozen_guard(m);
  sizebackend::bind_packed_linear(m);
  sizebackend::bind_chain(m);
  m.def("attention_isa", &sizebackend::attention_isa,
        "The instruction set sizebackend::attention's CPU kernel runs on: 'avx512', 'avx2' "
        "or 'default' (ATen's CPU capability, ATEN_CPU_CAPABILITY included).");
  m.def("sdpa_counts", &sizebackend::sdpa_counts,
        "(direct, aten): sizebackend::sdpa's CPU calls since the process started, run by "
        "the direct kernel and handed to ATen's SDPA.");
}

TORCH_LIBRARY(sizebackend, m) {
  // Serving-style attention over a flattened token batch (one row per token).
  // k_cache and v_cache are written in place (cache[slots[t], positions[t]] = k[t],
  // v[t]) before the attention reads them, hence the (a!) / (b!) annotations:
  // functionalization and Inductor must know that the op mutates them.
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slots, Tensor positions, float scale) -> Tensor");
  // A tensor over t's memory that does not own it (csrc/weak_ref.cpp): it dangles once
  // t's owner frees the memory. Only for memory a CUDA graph pool keeps reserved. The
  // result has a storage of its own, so to the dispatcher it aliases nothing.
  m.def("weak_ref(Tensor t) -> Tensor");
  // linear(x, w, b) on a copy of w packed for oneDNN once and kept while w is unchanged
  // (csrc/packed_linear.cpp); calls of fewer than min_rows rows run aten's linear, calls
  // of 1 to panel_rows rows panel_linear on a copy packed in panels.
  m.def("packed_linear(Tensor x, Tensor w, Tensor? b, int min_rows, int panel_rows=0) -> Tensor");
  // A float32 linear weight (N x K) copied into panels of 16 output columns
  // ([ceil(N / 16), K, 16], zero past column N), and linear(x, W, b) on such a copy with
  // N = n (csrc/panel_linear.cpp): what a frozen piece calls where it is the faster GEMM.
  m.def("pack_panels(Tensor w) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor packed, Tensor? b, int n) -> Tensor");
  // aten::scaled_dot_product_attention's schema and results; small CPU calls run a direct
  // kernel (csrc/sdpa.cpp), the rest ATen's op.
  m.def(
      "sdpa(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
      "float dropout_p=0.0, bool is_causal=False, *, float? scale=None, "
      "bool enable_gqa=False) -> Tensor");
}
