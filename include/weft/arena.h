// weft/arena.h — planned memory for activations.
//
// An Arena hands out tensors by bumping a pointer and takes them all back at
// once with reset(). The first pass through a step discovers how much memory
// that step needs (growing block by block); reset() then replaces the blocks
// with one block of the high-water size, so every later step is served from a
// single pre-planned allocation and never calls the system allocator.
// While it grows, a tensor of kOwnBlock bytes or more that does not fit gets
// a block of exactly its size, and smaller ones share blocks that double up
// to kOwnBlock: the first pass then holds little more than it uses (at most
// the shared block's free tail), where doubling every block could leave
// nearly half of the last, largest one empty (GPT-2 124M at B 16 on a GPU:
// 1.8 GiB of 6.1).
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
  static constexpr size_t kOwnBlock = size_t{16} << 20;
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
  // Adds a block of `size` bytes (checked against the host's free memory
  // on the CPU) and returns it.
  Block& add_block(size_t size);
  void release_blocks();

  Device device_;
  std::vector<Block> blocks_;
  size_t shared_ = 0;      // blocks_[shared_] takes the next tensor, if it fits
  size_t used_ = 0;        // bytes handed out since the last reset (with padding)
  size_t high_water_ = 0;  // the most ever handed out between two resets
  size_t system_allocations_ = 0;
};

}  // namespace weft
