#include <weft/arena.h>

#include <algorithm>
#include <cstring>

namespace weft {

namespace {
constexpr size_t kAlign = 64;
constexpr size_t kMinBlock = size_t{1} << 20;
size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
}  // namespace

Arena::~Arena() { release_blocks(); }

Arena::Arena(Arena&& o) noexcept
    : device_(o.device_),
      blocks_(std::move(o.blocks_)),
      used_(o.used_),
      high_water_(o.high_water_),
      system_allocations_(o.system_allocations_) {
  o.blocks_.clear();
}

Arena& Arena::operator=(Arena&& o) noexcept {
  if (this != &o) {
    release_blocks();
    device_ = o.device_;
    blocks_ = std::move(o.blocks_);
    used_ = o.used_;
    high_water_ = o.high_water_;
    system_allocations_ = o.system_allocations_;
    o.blocks_.clear();
  }
  return *this;
}

void Arena::release_blocks() {
  for (auto& b : blocks_) device_free(b.data, device_);
  blocks_.clear();
}

void Arena::add_block(size_t min_bytes) {
  size_t size = std::max(min_bytes, std::max(kMinBlock, capacity()));
  char* p = static_cast<char*>(device_alloc(size, device_));
  ++system_allocations_;
  blocks_.push_back(Block{p, size, 0});
}

size_t Arena::capacity() const {
  size_t c = 0;
  for (const auto& b : blocks_) c += b.size;
  return c;
}

Tensor Arena::alloc(Shape shape, DType dtype) {
  size_t bytes = round_up(static_cast<size_t>(shape.numel()) * dtype_size(dtype));
  if (blocks_.empty() || blocks_.back().top + bytes > blocks_.back().size) add_block(bytes);
  Block& b = blocks_.back();
  void* p = b.data + b.top;
  b.top += bytes;
  used_ += bytes;
  high_water_ = std::max(high_water_, used_);
  return Tensor(p, shape, dtype, device_);
}

Tensor Arena::zeros(Shape shape, DType dtype) {
  Tensor t = alloc(shape, dtype);
  t.zero_();
  return t;
}

void Arena::reset() {
  if (blocks_.size() > 1) {
    // The plan: one block holding everything the busiest pass needed.
    release_blocks();
    add_block(high_water_);
  }
  for (auto& b : blocks_) b.top = 0;
  used_ = 0;
}

}  // namespace weft
