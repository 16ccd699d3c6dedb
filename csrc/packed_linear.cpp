// CPU kernel of sizebackend::packed_linear (schema in library.cpp): `linear(x, w, b)` on a
// copy of `w` packed for oneDNN's GEMM, made on first use and kept while `w` is as it was.
//
// Why: a general (symbolic-batch) piece compiles with its weights as inputs, so
// Inductor calls aten's float32 GEMM on them, which on x86 is MKL's unpacked sgemm. On
// some CPUs that is 2-5x slower than oneDNN's GEMM on a packed weight at every row count
// above one (dynamo_sizebackend/compile/linears.py has the figures). Packing needs the
// weight's values, which a compile with weights as inputs never has; this op packs at
// run time instead, once per weight, and packs again when the weight changes.
//
// "As it was" is the check csrc/frozen_guard.cpp makes for frozen pieces (the same
// TensorState, csrc/tensor_state.h: storage, data pointer, offset, version counter), on
// the same TensorImpl (held weakly here, so its address cannot be reused by another
// tensor while the entry lives) with the same sizes and strides.
// An in-place write (`w.mul_(2)`, `load_state_dict`, an optimizer step, a write through
// a view) bumps the version: the next call packs again. A write through `w.data` is not
// seen (`.data` has a counter of its own): `weights_updated()` empties the cache for it.
//
// Calls of 1 to `panel_rows` rows run sizebackend::panel_linear (csrc/panel_linear.cpp)
// on a second copy, packed in panels by sizebackend::pack_panels, kept under the same
// check: the caller measured that kernel faster than what would otherwise run at those
// rows (dynamo_sizebackend/_torch/packed_linear.py, `runtime_panel_rows`).
//
// Calls that do not fit run aten's `linear` unchanged: fewer rows than `min_rows` (the
// caller's measurement of where oneDNN stops winning) and more than `panel_rows`, a
// dtype other than float32, an inference tensor (no version counter, so a write could
// never be seen), a weight that is not 2-D, a torch without oneDNN (for its copy).
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>
#include <torch/library.h>

#include "tensor_state.h"

#include <mutex>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace sizebackend {
namespace {

struct Packed {
  c10::weak_intrusive_ptr<c10::TensorImpl> weight;  // keeps the address ours, not the data
  TensorState state;
  std::vector<int64_t> sizes, strides;
  at::Tensor packed;  // oneDNN's copy, or undefined until a call needs it
  at::Tensor panels;  // pack_panels' copy, or undefined until a call needs it
};

struct Cache {
  std::mutex mutex;
  std::unordered_map<const c10::TensorImpl*, Packed> entries;
  int64_t packs = 0;  // weights packed since the process started (repacks included)
};

Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: calls may outlive static teardown
  return *c;
}

bool current(const Packed& p, const at::Tensor& w) {
  return !p.weight.expired() && p.state.matches(w) && w.sizes().equals(p.sizes) &&
      w.strides().equals(p.strides);
}

at::Tensor reorder(const at::Tensor& w, int64_t rows) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_reorder_linear_weight", "")
                             .typed<at::Tensor(const at::Tensor&, std::optional<c10::SymInt>)>();
  return op.call(w, c10::SymInt(rows));
}

at::Tensor linear_pointwise(
    const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& b) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(
              const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
              std::string_view, c10::List<std::optional<at::Scalar>>,
              std::optional<std::string_view>)>();
  return op.call(x, packed, b, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

at::Tensor pack_panels(const at::Tensor& w) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("sizebackend::pack_panels", "")
                             .typed<at::Tensor(const at::Tensor&)>();
  return op.call(w);
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels,
                        const std::optional<at::Tensor>& b, int64_t n) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("sizebackend::panel_linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                               const std::optional<at::Tensor>&, int64_t)>();
  return op.call(x, panels, b, n);
}

// The packed copy of `w` of the kind asked (oneDNN's, or the panels with `panels`),
// packed now if there is none or `w` changed since (which drops both kinds).
at::Tensor packed_weight(const at::Tensor& w, int64_t rows, bool panels) {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  const c10::TensorImpl* key = w.unsafeGetTensorImpl();
  auto found = c.entries.find(key);
  if (found == c.entries.end() || !current(found->second, w)) {
    if (found == c.entries.end()) {  // a new weight: drop the entries of dead ones first
      for (auto it = c.entries.begin(); it != c.entries.end();) {
        it = it->second.weight.expired() ? c.entries.erase(it) : std::next(it);
      }
    }
    Packed entry{
        c10::weak_intrusive_ptr<c10::TensorImpl>(w.getIntrusivePtr()), TensorState::of(w),
        w.sizes().vec(), w.strides().vec(), at::Tensor(), at::Tensor()};
    found = c.entries.insert_or_assign(key, std::move(entry)).first;
  }
  at::Tensor& copy = panels ? found->second.panels : found->second.packed;
  if (!copy.defined()) {
    at::NoGradGuard no_grad;
    copy = panels ? pack_panels(w) : reorder(w, rows);
    ++c.packs;
  }
  return copy;
}

bool fits(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  if (x.scalar_type() != at::kFloat || w.scalar_type() != at::kFloat ||
      w.dim() != 2 || x.dim() < 1 || w.is_inference() || x.layout() != at::kStrided ||
      w.layout() != at::kStrided || x.size(-1) != w.size(1)) {
    return false;
  }
  if (b.has_value() && b->defined() &&
      (b->scalar_type() != at::kFloat || b->dim() != 1 || b->layout() != at::kStrided)) {
    return false;
  }
  return true;
}

at::Tensor packed_linear(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
    int64_t min_rows, int64_t panel_rows) {
  const int64_t rows = x.dim() >= 1 && x.size(-1) > 0 ? x.numel() / x.size(-1) : 0;
  const bool panels = rows >= 1 && rows <= panel_rows;
  const bool onednn = !panels && rows >= std::max<int64_t>(min_rows, 1) && at::hasMKLDNN();
  if (!(panels || onednn) || !fits(x, w, b)) {
    return at::linear(x, w, b);
  }
  const at::Tensor packed = packed_weight(w, rows, panels);
  if (panels) {
    return panel_linear(x, packed, b, w.size(0));
  }
  std::optional<at::Tensor> bias;
  if (b.has_value() && b->defined()) {
    bias = b->contiguous();
  }
  return linear_pointwise(x.contiguous(), packed, bias);
}

// Autograd: a caller that needs gradients gets aten's `linear`, which has them; every
// other call goes on to the kernel of its device (CPU above, the fake one when traced).
at::Tensor packed_linear_autograd(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
    int64_t min_rows, int64_t panel_rows) {
  const bool needs_grad = at::GradMode::is_enabled() &&
      (x.requires_grad() || w.requires_grad() || (b.has_value() && b->requires_grad()));
  if (needs_grad) {
    return at::linear(x, w, b);
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("sizebackend::packed_linear", "")
                             .typed<at::Tensor(
                                 const at::Tensor&, const at::Tensor&,
                                 const std::optional<at::Tensor>&, int64_t, int64_t)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(x, w, b, min_rows, panel_rows);
}

}  // namespace

// Empties the cache (`weights_updated()`); returns how many packed weights it held.
int64_t clear_packed_linears() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  const int64_t n = static_cast<int64_t>(c.entries.size());
  c.entries.clear();
  return n;
}

// (weights with packed copies held now, copies packed since the process started: a
// weight packed both ways counts twice there). A copy of a weight that died is held
// until the next weight is packed.
std::pair<int64_t, int64_t> packed_linear_counts() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return {static_cast<int64_t>(c.entries.size()), c.packs};
}

void bind_packed_linear(pybind11::module_& m) {
  m.def("clear_packed_linears", &clear_packed_linears,
        "Drop every weight sizebackend::packed_linear holds packed; returns how many.");
  m.def("packed_linear_counts", &packed_linear_counts,
        "(packed copies held now, weights packed since the process started)");
}

TORCH_LIBRARY_IMPL(sizebackend, CPU, m) {
  m.impl("packed_linear", &packed_linear);
}

TORCH_LIBRARY_IMPL(sizebackend, Autograd, m) {
  m.impl("packed_linear", &packed_linear_autograd);
}

}  // namespace sizebackend
