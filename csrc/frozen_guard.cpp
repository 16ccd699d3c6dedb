// sizebackend._C.FrozenGuard: the per-call check that no tensor frozen into a sized
// program changed since it was frozen (dynamo_sizebackend/compile/freeze.py says why).
//
// A sized program compiled with constant weights holds their values of the moment they
// were recorded. Before each call of it the runner asks, for every frozen tensor:
//   1. is the argument Dynamo passes at that tensor's position the same object?
//      (a replaced parameter or buffer arrives as a new object: `m.w = nn.Parameter(..)`,
//      `load_state_dict(..., assign=True)`, `m.buf = t`)
//   2. does it still use the same storage, data pointer and offset? (`w.data = other`)
//   3. is its version counter unchanged? (every in-place write bumps it: `w.mul_(2)`,
//      `load_state_dict`, an optimizer step, a write through a view)
// A write through `w.data` is not seen: `.data` is a tensor with a version counter of
// its own. `retire()` is how the user reports such a change (`sb.weights_updated`).
//
// It is C++ because it runs on every call of a sized program: a model of 300 frozen
// tensors pays a few nanoseconds per tensor here, against about half a microsecond
// per tensor for the same three reads from Python.
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>

#include "tensor_state.h"

#include <cstdint>
#include <vector>

namespace py = pybind11;

namespace sizebackend {
namespace {

struct Recorded {
  py::object object;  // held: an id may not be reused by another object while we compare it
  at::Tensor tensor;
  TensorState state;
};

class FrozenGuard {
 public:
  // Records every tensor now: call it before the compile that reads their values, so
  // that a write during the compile is seen at the first call.
  FrozenGuard(std::vector<Py_ssize_t> positions, const py::sequence& tensors)
      : positions_(std::move(positions)) {
    TORCH_CHECK(
        static_cast<size_t>(py::len(tensors)) == positions_.size(),
        "FrozenGuard: ", positions_.size(), " positions but ", py::len(tensors), " tensors");
    recorded_.reserve(positions_.size());
    for (const py::handle& item : tensors) {
      TORCH_CHECK(THPVariable_Check(item.ptr()), "FrozenGuard: not a tensor");
      const at::Tensor& t = THPVariable_Unpack(item.ptr());
      TORCH_CHECK(!t.is_inference(), "FrozenGuard: inference tensors have no version counter");
      recorded_.push_back(
          Recorded{py::reinterpret_borrow<py::object>(item), t, TensorState::of(t)});
    }
  }

  // True when every frozen tensor is as recorded and the guard was not retired.
  bool unchanged(const py::tuple& args) const {
    if (retired_) {
      return false;
    }
    const Py_ssize_t n = PyTuple_GET_SIZE(args.ptr());
    for (size_t i = 0; i < positions_.size(); ++i) {
      if (!same(i, args.ptr(), n)) {
        return false;
      }
    }
    return true;
  }

  // Indices (into the positions given at construction) of the tensors that changed.
  std::vector<size_t> changed(const py::tuple& args) const {
    std::vector<size_t> out;
    const Py_ssize_t n = PyTuple_GET_SIZE(args.ptr());
    for (size_t i = 0; i < positions_.size(); ++i) {
      if (!same(i, args.ptr(), n)) {
        out.push_back(i);
      }
    }
    return out;
  }

  // Whether `object` is one of the frozen tensors.
  bool holds(const py::handle& object) const {
    for (const Recorded& r : recorded_) {
      if (r.object.ptr() == object.ptr()) {
        return true;
      }
    }
    return false;
  }

  void retire() { retired_ = true; }
  bool retired() const { return retired_; }
  size_t size() const { return positions_.size(); }

 private:
  bool same(size_t i, PyObject* args, Py_ssize_t n) const {
    const Py_ssize_t position = positions_[i];
    if (position >= n) {
      return false;
    }
    const Recorded& r = recorded_[i];
    if (PyTuple_GET_ITEM(args, position) != r.object.ptr()) {
      return false;
    }
    return r.state.matches(r.tensor);
  }

  std::vector<Py_ssize_t> positions_;
  std::vector<Recorded> recorded_;
  bool retired_ = false;
};

}  // namespace

void bind_frozen_guard(py::module_& m) {
  py::class_<FrozenGuard>(m, "FrozenGuard")
      .def(py::init<std::vector<Py_ssize_t>, const py::sequence&>(), py::arg("positions"),
           py::arg("tensors"))
      .def("unchanged", &FrozenGuard::unchanged, py::arg("args"))
      .def("changed", &FrozenGuard::changed, py::arg("args"))
      .def("holds", &FrozenGuard::holds, py::arg("object"))
      .def("retire", &FrozenGuard::retire)
      .def_property_readonly("retired", &FrozenGuard::retired)
      .def("__len__", &FrozenGuard::size);
}

}  // namespace sizebackend
