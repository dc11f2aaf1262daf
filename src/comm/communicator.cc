#include <weft/communicator.h>

#include <algorithm>
#include <thread>

namespace weft {

const char* reduce_op_name(ReduceOp op) { return op == ReduceOp::Sum ? "sum" : "max"; }

namespace {
const char* kind_name(MessageTag::Kind k) {
  switch (k) {
    case MessageTag::Kind::Activation: return "activation";
    case MessageTag::Kind::Gradient: return "gradient";
    case MessageTag::Kind::Tied: return "tied";
    case MessageTag::Kind::Data: return "data";
    case MessageTag::Kind::User: return "user";
  }
  return "?";
}
}  // namespace

// bits: kind 3 | micro_batch 12 | chunk 6 | index 4
int32_t MessageTag::encode() const {
  check(micro_batch >= 0 && micro_batch < kMaxMicroBatch,
        "message micro-batch {} is outside [0, {})", micro_batch, kMaxMicroBatch);
  check(chunk >= 0 && chunk < kMaxChunk, "message chunk {} is outside [0, {})", chunk, kMaxChunk);
  check(index >= 0 && index < kMaxIndex, "message tensor index {} is outside [0, {})", index,
        kMaxIndex);
  return (static_cast<int32_t>(kind) << 22) | (micro_batch << 10) | (chunk << 4) | index;
}

MessageTag MessageTag::decode(int32_t code) {
  MessageTag t;
  t.kind = static_cast<Kind>((code >> 22) & 0x7);
  t.micro_batch = (code >> 10) & (kMaxMicroBatch - 1);
  t.chunk = (code >> 4) & (kMaxChunk - 1);
  t.index = code & (kMaxIndex - 1);
  return t;
}

std::string MessageTag::str() const {
  return fmt::format("{} mb {} chunk {} #{}", kind_name(kind), micro_batch, chunk, index);
}

namespace {
class DoneRequest final : public Request {
 public:
  bool test() override { return true; }
  void wait() override {}
};
}  // namespace

RequestPtr Communicator::iall_reduce(const Tensor& t, ReduceOp op) {
  all_reduce(t, op);
  return std::make_unique<DoneRequest>();
}

RequestPtr Communicator::ireduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) {
  reduce_scatter(in, out, op);
  return std::make_unique<DoneRequest>();
}

RequestPtr Communicator::iall_gather(const Tensor& in, const Tensor& out) {
  all_gather(in, out);
  return std::make_unique<DoneRequest>();
}

void wait_all(std::vector<RequestPtr>& requests) {
  for (auto& r : requests)
    if (r) r->wait();
}

void wait_all_on_device(std::vector<RequestPtr>& requests) {
  for (auto& r : requests)
    if (r) r->wait_on_device();
}

void Communicator::barrier_without_deadline() { barrier_within(std::chrono::milliseconds(0)); }

void Communicator::barrier_within(std::chrono::milliseconds within) {
  // None: a century, far enough never to pass, near enough that every
  // transport's `now + timeout` stays within its clock's range.
  constexpr std::chrono::milliseconds kCentury = std::chrono::hours(24 * 365 * 100);
  const std::chrono::milliseconds timeout = options_.timeout;
  options_.timeout = within.count() > 0 ? within : kCentury;
  try {
    barrier();
  } catch (...) {
    options_.timeout = timeout;
    throw;
  }
  options_.timeout = timeout;
}

std::string Communicator::waiting_for(const std::string& operation) const {
  std::string s = fmt::format("rank {} (world rank {}) timed out after {} ms waiting for {} in {}",
                              rank(), world_rank(rank()), options_.timeout.count(), operation,
                              describe());
  if (!step_.empty()) s += fmt::format(", at {}", step_);
  return s;
}

void await_setup(const std::string& what, int rank, int size, std::chrono::milliseconds timeout,
                 const std::function<bool()>& ready, const std::function<void()>& abort) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(20);
  bool done = false;
  try {
    while (!(done = ready()) && std::chrono::steady_clock::now() <= deadline) {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  } catch (...) {
    abort();
    throw;
  }
  if (done) return;
  abort();
  throw CommTimeout(
      "rank {} of a group of {}: {} did not finish within {} ms (--comm-timeout); aborted", rank,
      size, what, timeout.count());
}


void check_message(const Tensor& posted, const Shape& arrived_shape, DType arrived_dtype,
                   int peer, const MessageTag& tag, const Communicator& comm) {
  check(posted.shape() == arrived_shape && posted.dtype() == arrived_dtype,
        "rank {} (world rank {}) received {} {} from rank {} (world rank {}) with tag {} in {}, "
        "but posted a receive for {} {}",
        comm.rank(), comm.world_rank(comm.rank()), dtype_name(arrived_dtype), arrived_shape.str(),
        peer, comm.world_rank(peer), tag.str(), comm.describe(), dtype_name(posted.dtype()),
        posted.shape().str());
}

}  // namespace weft
