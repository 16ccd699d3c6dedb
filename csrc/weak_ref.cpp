// Kernel of sizebackend::weak_ref (schema in library.cpp): a tensor over the same memory
// as its argument that does not keep that memory alive.
//
// The result has the argument's sizes, strides, storage offset, dtype and device, and a
// storage of the same byte size whose data pointer has no deleter and no context: the
// caching allocator's block (or the CPU allocation) is still owned by whoever owned it
// before, and freeing it there leaves the weak reference dangling. Reading or writing a
// dangling weak reference is a use after free that nothing detects.
//
// It exists for one owner: a CUDA graph memory pool. A block a capture allocated stays
// reserved for the pool after its tensors are freed, and every replay writes the same
// addresses again, so a weak reference to a captured output stays valid for as long as
// the graphs of that pool live (see dynamo_sizebackend/cudagraphs.py for when its
// contents are). Do not use it for anything else.
//
// One device-generic kernel (CompositeExplicitAutograd): it touches no data, only
// metadata, so it needs no CUDA headers and serves CPU and CUDA tensors alike.
#include <ATen/ATen.h>
#include <c10/core/Storage.h>
#include <torch/library.h>

namespace sizebackend {
namespace {

at::Tensor weak_ref(const at::Tensor& t) {
  TORCH_CHECK(
      t.layout() == at::kStrided, "sizebackend::weak_ref: only strided tensors, got ",
      t.layout());
  TORCH_CHECK(t.has_storage(), "sizebackend::weak_ref: the tensor has no storage");
  const c10::Storage& owner = t.storage();
  // No deleter: when this storage dies, nothing is freed.
  at::DataPtr borrowed(owner.mutable_data(), t.device());
  c10::Storage storage(
      c10::Storage::use_byte_size_t(), owner.nbytes(), std::move(borrowed),
      /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, t.options())
      .set_(storage, t.storage_offset(), t.sizes(), t.strides());
}

}  // namespace

TORCH_LIBRARY_IMPL(sizebackend, CompositeExplicitAutograd, m) {
  m.impl("weak_ref", &weak_ref);
}

}  // namespace sizebackend
