#include <weft/arena.h>
#include <weft/units.h>

#include <algorithm>
#include <cstring>
#include <utility>

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
      shared_(std::exchange(o.shared_, 0)),
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
    shared_ = std::exchange(o.shared_, 0);
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
  shared_ = 0;
}

Arena::Block& Arena::add_block(size_t size) {
  if (device_.is_cpu() && size >= (size_t{64} << 20)) {
    // Blocks already taken but not yet written are not in use by the
    // system's count: they are this arena's to fill.
    const size_t unwritten = capacity() - std::min(capacity(), used_);
    const size_t sys = host_memory_available();
    const size_t avail = sys > unwritten ? sys - unwritten : 0;
    check(size <= avail,
          "out of host memory: the activations of one step need more than {} (taken so far) + "
          "{} (the next tensor), and {} are available: use a smaller micro-batch or sequence, or "
          "more pipeline or tensor-parallel ranks",
          format_bytes(double(used_)), format_bytes(double(size)), format_bytes(double(avail)));
  }
  char* p = static_cast<char*>(device_alloc(size, device_));
  ++system_allocations_;
  blocks_.push_back(Block{p, size, 0});
  return blocks_.back();
}

size_t Arena::capacity() const {
  size_t c = 0;
  for (const auto& b : blocks_) c += b.size;
  return c;
}

size_t Arena::bytes_for(Shape shape, DType dtype) {
  return round_up(static_cast<size_t>(shape.numel()) * dtype_size(dtype));
}

Tensor Arena::alloc(Shape shape, DType dtype) {
  const size_t bytes = bytes_for(shape, dtype);
  char* p = nullptr;
  if (!blocks_.empty() && blocks_[shared_].top + bytes <= blocks_[shared_].size) {
    Block& b = blocks_[shared_];
    p = b.data + b.top;
    b.top += bytes;
  } else if (bytes >= kOwnBlock) {  // a block of its own, full at once
    Block& b = add_block(bytes);
    b.top = bytes;
    p = b.data;
  } else {  // a new shared block: double the last shared one's size, up to kOwnBlock
    const size_t last = blocks_.empty() ? 0 : blocks_[shared_].size;
    Block& b = add_block(std::max({bytes, kMinBlock, std::min(2 * last, kOwnBlock)}));
    shared_ = blocks_.size() - 1;
    b.top = bytes;
    p = b.data;
  }
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
    shared_ = 0;
  }
  for (auto& b : blocks_) b.top = 0;
  used_ = 0;
}

}  // namespace weft
