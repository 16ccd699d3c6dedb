// The `sizebackend` op library: every schema lives in this one TORCH_LIBRARY block,
// kernels live next to their implementation in one TORCH_LIBRARY_IMPL per dispatch key.
//
// The shared object is also a (deliberately empty) Python extension module, so that
// `from dynamo_sizebackend import _C` loads it and thereby runs the static registrars
// below; the ops are then reachable as torch.ops.sizebackend.*.
#include <Python.h>

#include <torch/library.h>

extern "C" {
// Python looks for PyInit_<name> when importing `_C`. The module has no methods of its
// own: importing it is only a way to get the .so loaded into the process.
PyObject* PyInit__C(void) {
  static PyModuleDef module = {
      PyModuleDef_HEAD_INIT,
      "_C",
      "Custom-op library of dynamo_sizebackend; importing it registers torch.ops.sizebackend.",
      -1,       // no per-interpreter state
      nullptr,  // methods
      nullptr,  // slots
      nullptr,  // traverse
      nullptr,  // clear
      nullptr,  // free
  };
  return PyModule_Create(&module);
}
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
}
