// weft/tensor.h — Tensor: a shape, a dtype, a device and a view of storage.
//
// A Tensor does not own its bytes unless it was made by Tensor::empty/zeros,
// in which case it holds a shared reference to its Storage. Tensors handed out
// by an Arena (activations) are plain views: copying one never allocates, so a
// training step can pass them around freely.
//
//   Tensor w = Tensor::zeros({768, 2304});        // owned, fp32, CPU
//   float* p = w.data<float>();                     // contiguous, row-major
//   Tensor row = w.slice0(3, 4);                    // view of rows [3, 4)
//
// Shapes have at most kMaxRank dimensions and live inline (no heap).
// All tensors are contiguous and row-major: strides are implied by the shape.
#pragma once

#include <weft/device.h>
#include <weft/error.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>

namespace weft {

enum class DType : uint8_t { F32, I32, BF16 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);  // safetensors spelling: "F32", "I32", "BF16"

// Shape: up to kMaxRank extents, stored inline.
struct Shape {
  static constexpr int kMaxRank = 4;
  std::array<int64_t, kMaxRank> dims{};
  int rank = 0;

  Shape() = default;
  Shape(std::initializer_list<int64_t> d);
  static Shape of(std::span<const int64_t> d);

  int64_t operator[](int i) const { return dims[static_cast<size_t>(i)]; }
  int64_t& operator[](int i) { return dims[static_cast<size_t>(i)]; }
  int64_t numel() const;
  // Product of all but the last dimension: the "rows" of a row-major matrix.
  int64_t rows() const { return rank == 0 ? 1 : numel() / dims[static_cast<size_t>(rank - 1)]; }
  int64_t last() const { return rank == 0 ? 1 : dims[static_cast<size_t>(rank - 1)]; }
  bool operator==(const Shape& o) const;
  bool operator!=(const Shape& o) const { return !(*this == o); }
  std::string str() const;  // "[4, 12, 64]"
};

// Bytes owned by tensors made with Tensor::empty/zeros.
class Storage {
 public:
  Storage(size_t bytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_;
};

class Tensor {
 public:
  Tensor() = default;
  // A view of memory owned elsewhere (an arena, a mapped file).
  Tensor(void* data, Shape shape, DType dtype, Device device = Device::cpu());

  static Tensor empty(Shape shape, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor zeros(Shape shape, DType dtype = DType::F32, Device device = Device::cpu());

  bool defined() const { return data_ != nullptr || shape_.numel() == 0; }
  const Shape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  int64_t dim(int i) const { return shape_[i]; }
  int rank() const { return shape_.rank; }

  void* raw() const { return data_; }
  template <typename T>
  T* data() const { return static_cast<T*>(data_); }

  // Rows [begin, end) of the first dimension, as a view.
  Tensor slice0(int64_t begin, int64_t end) const;
  // The same bytes under another shape with the same element count.
  Tensor view(Shape shape) const;

  void zero_() const;                       // fill with zeros (a GPU: queued on its stream)
  void copy_from(const Tensor& src) const;  // same shape and dtype, any devices
  Tensor clone() const;               // an owned copy

 private:
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::F32;
  Device device_ = Device::cpu();
  std::shared_ptr<Storage> storage_;  // null for views of memory owned elsewhere
};

// Throws Error naming `what`, the expected and the actual shape when they differ.
void check_shape(const Tensor& t, const Shape& expected, const std::string& what);

}  // namespace weft
