// weft/arena.h — planned memory for activations.
//
// An Arena hands out tensors by bumping a pointer and takes them all back at
// once with reset(). The first pass through a step discovers how much memory
// that step needs (growing block by block); reset() then replaces the blocks
// with one block of the high-water size, so every later step is served from a
// single pre-planned allocation and never calls the system allocator.
//
//   Arena arena;
//   Tensor h = arena.alloc({B, T, C});   // fp32, 64-byte aligned
//   ...
//   arena.reset();                        // every tensor from it is now dead
#pragma once

#include <weft/tensor.h>

#include <cstddef>
#include <vector>

namespace weft {

class Arena {
 public:
  explicit Arena(Device device = Device::cpu()) : device_(device) {}
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  Arena(Arena&& o) noexcept;
  Arena& operator=(Arena&& o) noexcept;

  Tensor alloc(Shape shape, DType dtype = DType::F32);
  Tensor zeros(Shape shape, DType dtype = DType::F32);
  // Frees everything handed out; keeps (and coalesces) the memory.
  void reset();

  // What alloc(shape, dtype) adds to used(): the tensor's bytes, rounded up
  // to the alignment.
  static size_t bytes_for(Shape shape, DType dtype = DType::F32);
  size_t used() const { return used_; }
  size_t high_water() const { return high_water_; }
  size_t capacity() const;
  // How many times this arena called the system allocator, ever.
  size_t system_allocations() const { return system_allocations_; }

 private:
  struct Block {
    char* data;
    size_t size;
    size_t top;
  };
  void add_block(size_t min_bytes);
  void release_blocks();

  Device device_;
  std::vector<Block> blocks_;
  size_t used_ = 0;        // bytes handed out since the last reset (with padding)
  size_t high_water_ = 0;  // the most ever handed out between two resets
  size_t system_allocations_ = 0;
};

}  // namespace weft
