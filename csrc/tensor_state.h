// What "the tensor is as it was" means to the backend's C++: the storage, data pointer,
// storage offset and version counter of a tensor, recorded once and compared later.
// A replaced storage (`w.data = t`), a moved data pointer and every in-place write
// (the version counter; views share it) show as a difference. Shared by the frozen
// pieces' per-call guard (frozen_guard.cpp) and the packed-weight cache
// (packed_linear.cpp). Not for inference tensors: they have no version counter.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace sizebackend {

struct TensorState {
  const c10::StorageImpl* storage;
  const void* data;
  int64_t offset;
  uint32_t version;

  static const c10::StorageImpl* storage_of(const at::Tensor& t) {
    // unsafe_storage(): a reference, no refcount traffic on the hot path.
    return t.has_storage() ? t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl()
                           : nullptr;
  }
  static const void* data_of(const at::Tensor& t) {
    return t.has_storage() ? t.unsafeGetTensorImpl()->unsafe_storage().data() : nullptr;
  }

  static TensorState of(const at::Tensor& t) {
    return TensorState{storage_of(t), data_of(t), t.storage_offset(), t._version()};
  }

  // Whether `t` (the tensor this was recorded from) still has this state.
  bool matches(const at::Tensor& t) const {
    return t._version() == version && storage_of(t) == storage && data_of(t) == data &&
        t.unsafeGetTensorImpl()->storage_offset() == offset;
  }
};

}  // namespace sizebackend
