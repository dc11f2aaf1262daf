// weft/communicator.h — moving tensors between ranks.
//
// One small interface under pipeline, tensor and data parallelism, with three
// transports: LocalCommunicator (ranks as threads of one process: fast,
// deterministic tests), MpiCommunicator (MPICH, host memory) and
// NcclCommunicator (device memory). All follow the same rules:
//
//  - Point-to-point messages carry a MessageTag (kind, micro-batch, chunk,
//    index). Between one pair of ranks, messages with equal tags are matched
//    in the order they were sent (per-peer FIFO); a receive only matches a
//    send with the same tag. The receiver checks the shape and dtype that
//    arrived against the tensor it posted and throws Error naming both.
//  - Collectives are called by every member in the same order.
//  - Every blocking wait has a deadline (CommOptions::timeout). Past it, the
//    wait throws CommTimeout naming the rank, the operation, the peer or
//    group, the tag and the schedule step (set_step). A failed rank ends the
//    job: the others' waits throw PeerFailed naming it instead of hanging.
//
//   auto req = comm.irecv(buf, /*peer=*/0, {MessageTag::Kind::Activation, mb});
//   ... compute ...
//   req->wait();
#pragma once

#include <weft/error.h>
#include <weft/tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace weft {

enum class ReduceOp : uint8_t { Sum, Max };
const char* reduce_op_name(ReduceOp op);

// The identity of a point-to-point message.
struct MessageTag {
  enum class Kind : uint8_t { Activation, Gradient, Tied, Data, User };
  static constexpr int32_t kMaxMicroBatch = 1 << 12;  // micro_batch in [0, 4096)
  static constexpr int32_t kMaxChunk = 1 << 6;        // chunk in [0, 64)
  static constexpr int32_t kMaxIndex = 1 << 4;        // index in [0, 16)

  Kind kind = Kind::User;
  int32_t micro_batch = 0;
  int32_t chunk = 0;  // virtual pipeline chunk
  int32_t index = 0;  // which tensor of a stage boundary that carries several

  // A non-negative integer below 2^25 (every MPI's tag range holds it);
  // throws Error naming the field that is out of range.
  int32_t encode() const;
  static MessageTag decode(int32_t code);
  std::string str() const;  // "activation mb 3 chunk 1 #0"
  bool operator==(const MessageTag& o) const = default;
};

struct CommOptions {
  // Deadline of every blocking wait (train_gpt: --comm-timeout seconds).
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

// A deadline passed: the message says what this rank was waiting for.
class CommTimeout : public Error {
 public:
  using Error::Error;
};

// Another rank failed, so this one stops rather than wait for it.
class PeerFailed : public Error {
 public:
  using Error::Error;
};

class Request {
 public:
  virtual ~Request() = default;
  // True once the operation has completed. A receive whose message does not
  // match the posted tensor throws Error naming both shapes/dtypes; one that
  // is still waiting when a peer has failed throws PeerFailed (on threads;
  // under mpiexec the launcher ends the job).
  virtual bool test() = 0;
  // Blocks (politely: polling with short sleeps) until complete; throws
  // CommTimeout past the deadline and PeerFailed when a peer has failed.
  virtual void wait() = 0;
  // Whether wait_on_device() leaves the waiting to the device: a request on
  // device tensors of a stream-ordered transport (NCCL).
  virtual bool device_ordered() const { return false; }
  // What a GPU step calls instead of wait(): the work this rank queues on
  // its device from now on runs after the operation (its tensors may then be
  // read and rewritten there), and the host goes on at once. The deadline is
  // kept by the communicator's watchdog thread, which aborts the transport
  // past it, prints what never completed, and makes the communicator's next
  // call throw CommTimeout naming it. A request that is not device_ordered()
  // waits, as wait() does.
  virtual void wait_on_device() { wait(); }
};
using RequestPtr = std::unique_ptr<Request>;

// Waits for all, in order.
void wait_all(std::vector<RequestPtr>& requests);
// wait_on_device() for all, in order.
void wait_all_on_device(std::vector<RequestPtr>& requests);

class Communicator {
 public:
  explicit Communicator(CommOptions options) : options_(options) { step_.reserve(256); }
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const = 0;  // in this group
  virtual int size() const = 0;
  // Rank in the world of member r of this group (for messages).
  virtual int world_rank(int r) const = 0;
  // "world" or the name and members given to split(): "tp [0, 1]".
  virtual std::string describe() const = 0;

  // Point-to-point; `t` must stay alive (and, for isend, unchanged) until done.
  virtual RequestPtr isend(const Tensor& t, int peer, MessageTag tag) = 0;
  virtual RequestPtr irecv(const Tensor& t, int peer, MessageTag tag) = 0;
  void send(const Tensor& t, int peer, MessageTag tag) { isend(t, peer, tag)->wait(); }
  void recv(const Tensor& t, int peer, MessageTag tag) { irecv(t, peer, tag)->wait(); }

  // In place, on every member.
  virtual void all_reduce(const Tensor& t, ReduceOp op) = 0;
  // out holds size() * in.numel() elements: member r's `in` at offset r * in.numel().
  virtual void all_gather(const Tensor& in, const Tensor& out) = 0;
  // in holds size() * out.numel() elements; member r gets the reduction of
  // every member's slice r.
  virtual void reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) = 0;
  virtual void broadcast(const Tensor& t, int root) = 0;
  virtual void barrier() = 0;
  // A barrier without the deadline, for a wait that the disk bounds rather
  // than the network: the ranks that wait while one of them writes a
  // checkpoint. A failed rank still ends it (PeerFailed on threads; under
  // mpiexec the launcher ends the job).
  void barrier_without_deadline();
  // A barrier with its own deadline, in place of the options' (a save's
  // --save-timeout, longer than --comm-timeout); 0 means none.
  void barrier_within(std::chrono::milliseconds timeout);

  // Non-blocking forms, for communication that overlaps compute (the
  // data-parallel gradient buckets). Members post them in the same order as
  // every other collective; the tensors must stay alive until the request
  // completes. A transport without them runs the blocking form at once and
  // returns a completed request (LocalCommunicator does: correct, no overlap).
  virtual RequestPtr iall_reduce(const Tensor& t, ReduceOp op);
  virtual RequestPtr ireduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op);
  virtual RequestPtr iall_gather(const Tensor& in, const Tensor& out);

  // Point-to-point groups: the sends and receives posted between
  // group_start() and group_end() are one step of a pipeline schedule. A
  // transport that needs it (NCCL) starts them together at group_end, so that
  // none of them waits behind another; the others start each at once and
  // ignore the group. Wait for a group's requests only after group_end. Groups
  // do not nest, and hold no collectives.
  virtual void group_start() {}
  virtual void group_end() {}

  // Collective over this communicator: `groups` partitions its ranks (every
  // member passes the same partition); each member gets a communicator for
  // the group that holds it, ranked in the order listed.
  virtual std::unique_ptr<Communicator> split(const std::vector<std::vector<int>>& groups,
                                              const std::string& name) = 0;

  const CommOptions& options() const { return options_; }
  void set_timeout(std::chrono::milliseconds t) { options_.timeout = t; }
  // The schedule step now running ("step 3, action 1F0"), named by timeouts.
  // Copies into reserved capacity: calling it per action allocates nothing.
  void set_step(std::string_view step) { step_.assign(step); }
  const std::string& step() const { return step_; }

 protected:
  // "rank 1 (world rank 5) timed out after 2000 ms waiting for recv from rank 0
  //  (world rank 4) in pp [4, 5], tag activation mb 3 chunk 0 #0, at step 3..."
  std::string waiting_for(const std::string& operation) const;

  CommOptions options_;
  std::string step_;
};

// Waits for a set-up that has no request to wait on (NCCL's non-blocking
// communicator creation): polls `ready` with growing sleeps (20 us to 1 ms)
// until it returns true. Past `timeout`, calls `abort` and throws CommTimeout:
// "rank R of a group of N: <what> did not finish within T ms (--comm-timeout);
// aborted". When `ready` throws (the set-up failed), calls `abort` and
// rethrows.
void await_setup(const std::string& what, int rank, int size, std::chrono::milliseconds timeout,
                 const std::function<bool()>& ready, const std::function<void()>& abort);

// Checks that a message described by (shape, dtype) fits the posted tensor;
// throws Error naming both, the peer and the tag.
void check_message(const Tensor& posted, const Shape& arrived_shape, DType arrived_dtype,
                   int peer, const MessageTag& tag, const Communicator& comm);

}  // namespace weft
