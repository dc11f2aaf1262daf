#include <weft/tensor.h>

#include "weft_config.h"

#if WEFT_CUDA
#include <weft/cuda/runtime.h>
#endif

#include <cstring>

namespace weft {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::I32: return 4;
    case DType::BF16: return 2;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::I32: return "I32";
    case DType::BF16: return "BF16";
  }
  return "?";
}

Shape::Shape(std::initializer_list<int64_t> d) {
  check(d.size() <= kMaxRank, "tensor rank {} exceeds the maximum of {}", d.size(), kMaxRank);
  for (int64_t x : d) dims[static_cast<size_t>(rank++)] = x;
}

Shape Shape::of(std::span<const int64_t> d) {
  check(d.size() <= kMaxRank, "tensor rank {} exceeds the maximum of {}", d.size(), kMaxRank);
  Shape s;
  for (int64_t x : d) s.dims[static_cast<size_t>(s.rank++)] = x;
  return s;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i)
    // Checked: a shape from huge flags must fail here, not wrap to a small
    // allocation that is then written past its end.
    if (__builtin_mul_overflow(n, dims[static_cast<size_t>(i)], &n))
      throw Error("shape {} has more elements than a 64-bit count holds", str());
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (rank != o.rank) return false;
  for (int i = 0; i < rank; ++i)
    if (dims[static_cast<size_t>(i)] != o.dims[static_cast<size_t>(i)]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[static_cast<size_t>(i)]);
  }
  return s + "]";
}

Storage::Storage(size_t bytes, Device device)
    : data_(device_alloc(bytes, device)), bytes_(bytes), device_(device) {}
Storage::~Storage() { device_free(data_, device_); }

Tensor::Tensor(void* data, Shape shape, DType dtype, Device device)
    : data_(data), shape_(shape), dtype_(dtype), device_(device) {}

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  for (int i = 0; i < shape.rank; ++i)
    check(shape[i] >= 0, "tensor dimension {} is negative in shape {}", i, shape.str());
  int64_t bytes = 0;
  if (__builtin_mul_overflow(shape.numel(), static_cast<int64_t>(dtype_size(dtype)), &bytes))
    throw Error("a {} tensor of shape {} has more bytes than a 64-bit count holds",
                dtype_name(dtype), shape.str());
  auto storage = std::make_shared<Storage>(static_cast<size_t>(bytes), device);
  Tensor t(storage->data(), shape, dtype, device);
  t.storage_ = std::move(storage);
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.zero_();
  return t;
}

Tensor Tensor::slice0(int64_t begin, int64_t end) const {
  check(rank() >= 1 && begin >= 0 && begin <= end && end <= shape_[0],
        "slice [{}, {}) out of range for shape {}", begin, end, shape_.str());
  Shape s = shape_;
  s[0] = end - begin;
  size_t row_bytes = shape_[0] == 0 ? 0 : nbytes() / static_cast<size_t>(shape_[0]);
  Tensor t(static_cast<char*>(data_) + static_cast<size_t>(begin) * row_bytes, s, dtype_, device_);
  t.storage_ = storage_;
  return t;
}

Tensor Tensor::view(Shape shape) const {
  check(shape.numel() == numel(), "cannot view shape {} as {}: element counts differ",
        shape_.str(), shape.str());
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

void Tensor::zero_() const {
  if (nbytes() == 0) return;
  if (device_.is_cpu()) {
    std::memset(data_, 0, nbytes());
    return;
  }
#if WEFT_CUDA
  cuda::zero(cuda::context(device_.index), data_, nbytes());
#else
  throw Error("zero_ on {}: weft was built without CUDA", device_.str());
#endif
}

void Tensor::copy_from(const Tensor& src) const {
  check(src.shape() == shape_ && src.dtype() == dtype_,
        "copy_from: source {} {} does not match destination {} {}", dtype_name(src.dtype()),
        src.shape().str(), dtype_name(dtype_), shape_.str());
  if (nbytes() == 0) return;
  if (device_.is_cpu() && src.device().is_cpu()) {
    std::memcpy(data_, src.raw(), nbytes());
    return;
  }
#if WEFT_CUDA
  // Host to device and device to device are queued on the device's compute
  // stream; device to host waits for it. Two GPUs: not yet (peer copies).
  if (src.device().is_cpu()) {
    cuda::upload(cuda::context(device_.index), data_, src.raw(), nbytes());
  } else if (device_.is_cpu()) {
    cuda::download(cuda::context(src.device().index), data_, src.raw(), nbytes());
  } else {
    check(src.device() == device_, "copy_from between {} and {} is not supported yet",
          src.device().str(), device_.str());
    cuda::copy_device(cuda::context(device_.index), data_, src.raw(), nbytes());
  }
#else
  throw Error("copy_from between {} and {}: weft was built without CUDA", src.device().str(),
              device_.str());
#endif
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device_);
  t.copy_from(*this);
  return t;
}

void check_shape(const Tensor& t, const Shape& expected, const std::string& what) {
  check(t.shape() == expected, "{}: expected shape {}, got {}", what, expected.str(),
        t.shape().str());
}

}  // namespace weft
