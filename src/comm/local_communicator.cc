// LocalCommunicator: the ranks of a world are threads of one process.
//
// Everything shared lives in a World guarded by one mutex, with one condition
// variable signalled on every change a waiter could care about (a message
// sent, a member arriving at or completing a collective, a rank failing).
// Worlds are small (a handful of ranks), so one lock keeps the rules easy to
// check. Nothing spins: waits sleep on the condition variable until the
// deadline.
//
// Point-to-point: each (src, dst) pair of a group has a mailbox. isend copies
// the message into it (a buffered send, complete at once); a receive takes the
// message of its tag whose number matches the order in which the receive was
// posted, which is MPI's matching rule (per-peer FIFO among equal tags). A
// device tensor's message is a copy on its device (device to device, queued
// on the compute stream that every thread on that GPU shares, so it is
// ordered after the kernels that made the tensor and before the receiver's).
//
// Collectives: a rendezvous per collective number. Each member deposits its
// tensors; the last to arrive checks that the calls agree and computes every
// member's result in rank order (so all results are bitwise identical), then
// everyone leaves. The others' tensors stay valid meanwhile because their
// owners are blocked in the same collective. Device tensors are gathered and
// broadcast by device-to-device copies; their reductions run on host copies.
#include <weft/bf16.h>
#include <weft/local_communicator.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>

namespace weft {
namespace {

using Clock = std::chrono::steady_clock;

struct Message {
  MessageTag tag;
  uint64_t number = 0;  // among the messages of this tag in this mailbox
  Shape shape;
  DType dtype = DType::F32;
  std::vector<std::byte> bytes;  // a host tensor's bytes
  Tensor payload;                // a device tensor's copy, on its device
};

struct Mailbox {
  std::deque<Message> messages;        // sent, not yet received; oldest first
  std::map<int32_t, uint64_t> sent;    // by encoded tag: messages sent so far
  std::map<int32_t, uint64_t> posted;  // by encoded tag: receives posted so far
};

// One member's call of a collective.
struct CollectiveCall {
  enum class Kind : uint8_t { AllReduce, AllGather, ReduceScatter, Broadcast, Barrier };
  Kind kind = Kind::Barrier;
  ReduceOp op = ReduceOp::Sum;
  int root = 0;
  Tensor in;   // what this member contributes
  Tensor out;  // where its result goes (the same tensor for in-place calls)

  // What every member must agree on, apart from the element count.
  std::string label() const {
    switch (kind) {
      case Kind::AllReduce: return fmt::format("all_reduce {}", reduce_op_name(op));
      case Kind::AllGather: return "all_gather";
      case Kind::ReduceScatter: return fmt::format("reduce_scatter {}", reduce_op_name(op));
      case Kind::Broadcast: return fmt::format("broadcast from rank {}", root);
      case Kind::Barrier: return "barrier";
    }
    return "?";
  }
  // Elements per member that must agree: the slice each member owns.
  int64_t count() const { return kind == Kind::ReduceScatter ? out.numel() : in.numel(); }
};

struct Collective {
  std::vector<std::optional<CollectiveCall>> calls;  // by group rank
  int arrived = 0;
  int departed = 0;
  bool done = false;
  std::string error;  // set when the calls disagree: every member throws it
};

struct Group {
  int id = 0;
  std::vector<int> members;                    // world rank of each group rank
  std::string description;                     // "world" or "tp [0, 1]"
  std::vector<Mailbox> mailboxes;              // [src * size + dst], group ranks
  std::map<uint64_t, Collective> collectives;  // in progress, by number

  Group(int group_id, std::vector<int> world_ranks, std::string desc)
      : id(group_id),
        members(std::move(world_ranks)),
        description(std::move(desc)),
        mailboxes(members.size() * members.size()) {}
  int size() const { return static_cast<int>(members.size()); }
  Mailbox& mailbox(int src, int dst) { return mailboxes[static_cast<size_t>(src * size() + dst)]; }
};

enum class WaitResult : uint8_t { Ready, PeerFailed, TimedOut };

class World {
 public:
  std::mutex mu;
  std::condition_variable changed;

  // Sleeps until ready() holds (checked first: a completed operation is never
  // lost to a failure elsewhere), a rank has failed, or the deadline passes.
  template <typename Ready>
  WaitResult wait(std::unique_lock<std::mutex>& lock, Clock::time_point deadline, Ready ready) {
    for (;;) {
      if (ready()) return WaitResult::Ready;
      if (!failure.empty()) return WaitResult::PeerFailed;
      if (Clock::now() >= deadline) return WaitResult::TimedOut;
      changed.wait_until(lock, deadline);
    }
  }

  // Records the first failure ("rank 2 failed: ...") and wakes every waiter so it can give up.
  void fail(const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!failure.empty()) return;
      failure = what;
    }
    changed.notify_all();
  }

  std::string failure;  // empty while no rank has failed
  // Groups made by split(), by (parent group id, parent's split number, group index).
  std::map<std::tuple<int, uint64_t, size_t>, std::shared_ptr<Group>> groups;
  int next_group_id = 1;  // 0 is the world
};

// Reduces elements [offset, offset + n) of every member's `in`, in rank order, into acc.
template <typename T>
void reduce_slice(const std::vector<std::optional<CollectiveCall>>& calls, int64_t offset,
                  int64_t n, ReduceOp op, T* acc) {
  std::memcpy(acc, calls[0]->in.data<T>() + offset, static_cast<size_t>(n) * sizeof(T));
  for (size_t r = 1; r < calls.size(); ++r) {
    const T* x = calls[r]->in.data<T>() + offset;
    if (op == ReduceOp::Sum) {
      for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
    } else {
      for (int64_t i = 0; i < n; ++i) acc[i] = std::max(acc[i], x[i]);
    }
  }
}

// bf16 sums fold in rank order, each addition in fp32 rounded once to bf16:
// ((x0 + x1) + x2) + ..., the same bits for every member.
void reduce_slice_bf16(const std::vector<std::optional<CollectiveCall>>& calls, int64_t offset,
                       int64_t n, uint16_t* acc) {
  std::memcpy(acc, calls[0]->in.data<uint16_t>() + offset, static_cast<size_t>(n) * 2);
  for (size_t r = 1; r < calls.size(); ++r) {
    const uint16_t* x = calls[r]->in.data<uint16_t>() + offset;
    for (int64_t i = 0; i < n; ++i) acc[i] = bf16_add(acc[i], x[i]);
  }
}

// Writes the reduction of slice [offset, offset + n) into `dst`, through a
// scratch buffer so that `dst` may alias an input.
void reduce_into(const std::vector<std::optional<CollectiveCall>>& calls, int64_t offset, int64_t n,
                 ReduceOp op, void* dst) {
  if (n == 0) return;
  const DType dtype = calls[0]->in.dtype();
  std::vector<std::byte> acc(static_cast<size_t>(n) * dtype_size(dtype));
  if (dtype == DType::F32)
    reduce_slice(calls, offset, n, op, reinterpret_cast<float*>(acc.data()));
  else if (dtype == DType::I32)
    reduce_slice(calls, offset, n, op, reinterpret_cast<int32_t*>(acc.data()));
  else
    reduce_slice_bf16(calls, offset, n, reinterpret_cast<uint16_t*>(acc.data()));
  std::memcpy(dst, acc.data(), acc.size());
}

void run_host_collective(const std::vector<std::optional<CollectiveCall>>& calls);

// `t`'s elements [offset, offset + n) as a flat tensor on its device.
Tensor flat_slice(const Tensor& t, int64_t offset, int64_t n) {
  return Tensor(t.data<std::byte>() + offset * static_cast<int64_t>(dtype_size(t.dtype())),
                Shape{n}, t.dtype(), t.device());
}

// A collective with device tensors among its members. Moves (gathers,
// broadcasts) are copies between the members' tensors (device to device on
// the compute stream, which orders them after the kernels that made the
// inputs); reductions run the host code on host copies, then copy the
// results back, so every member still gets the very same bits.
void run_device_collective(const std::vector<std::optional<CollectiveCall>>& calls) {
  const CollectiveCall& first = *calls[0];
  const int64_t n = first.count();
  switch (first.kind) {
    case CollectiveCall::Kind::AllGather:
      for (const auto& c : calls)
        for (size_t m = 0; m < calls.size(); ++m) {
          const Tensor dst = flat_slice(c->out, static_cast<int64_t>(m) * n, n);
          if (n > 0 && dst.raw() != calls[m]->in.raw())  // a member's own slice is in place
            dst.copy_from(flat_slice(calls[m]->in, 0, n));
        }
      return;
    case CollectiveCall::Kind::Broadcast: {
      const Tensor& src = calls[static_cast<size_t>(first.root)]->in;
      for (const auto& c : calls)
        if (n > 0 && c->out.raw() != src.raw()) c->out.copy_from(src);
      return;
    }
    case CollectiveCall::Kind::Barrier: return;
    case CollectiveCall::Kind::AllReduce:
    case CollectiveCall::Kind::ReduceScatter: break;
  }
  std::vector<std::optional<CollectiveCall>> host(calls.size());
  for (size_t r = 0; r < calls.size(); ++r) {
    const CollectiveCall& c = *calls[r];
    Tensor in = Tensor::empty(c.in.shape(), c.in.dtype());
    in.copy_from(c.in);
    Tensor out = c.out.raw() == c.in.raw() ? in : Tensor::empty(c.out.shape(), c.out.dtype());
    host[r] = CollectiveCall{c.kind, c.op, c.root, in, out};
  }
  run_host_collective(host);
  for (size_t r = 0; r < calls.size(); ++r) calls[r]->out.copy_from(host[r]->out);
}

// Computes every member's result. All members' calls are present.
void run_collective(const std::vector<std::optional<CollectiveCall>>& calls) {
  for (const auto& c : calls)
    if (!c->in.device().is_cpu() || !c->out.device().is_cpu()) return run_device_collective(calls);
  run_host_collective(calls);
}

void run_host_collective(const std::vector<std::optional<CollectiveCall>>& calls) {
  const CollectiveCall& first = *calls[0];
  const int64_t n = first.count();
  const size_t bytes = static_cast<size_t>(n) * dtype_size(first.in.dtype());
  switch (first.kind) {
    case CollectiveCall::Kind::AllReduce:
      // Reduce once, then copy: every member gets the very same bits.
      reduce_into(calls, 0, n, first.op, first.out.raw());
      for (size_t r = 1; r < calls.size(); ++r)
        if (bytes) std::memcpy(calls[r]->out.raw(), first.out.raw(), bytes);
      break;
    case CollectiveCall::Kind::ReduceScatter:
      for (size_t r = 0; r < calls.size(); ++r)
        reduce_into(calls, static_cast<int64_t>(r) * n, n, first.op, calls[r]->out.raw());
      break;
    case CollectiveCall::Kind::AllGather:
      // memmove: a member's `in` may be its own slice of `out`.
      for (const auto& c : calls)
        for (size_t m = 0; m < calls.size(); ++m)
          if (bytes) std::memmove(c->out.data<std::byte>() + m * bytes, calls[m]->in.raw(), bytes);
      break;
    case CollectiveCall::Kind::Broadcast: {
      const Tensor& src = calls[static_cast<size_t>(first.root)]->in;
      for (const auto& c : calls)
        if (bytes && c->out.raw() != src.raw()) std::memcpy(c->out.raw(), src.raw(), bytes);
      break;
    }
    case CollectiveCall::Kind::Barrier: break;
  }
}

// "" when every member made the same call; else what differs, naming the ranks.
std::string disagreement(const std::vector<std::optional<CollectiveCall>>& calls) {
  const CollectiveCall& first = *calls[0];
  for (size_t r = 1; r < calls.size(); ++r) {
    const CollectiveCall& c = *calls[r];
    if (c.label() != first.label())
      return fmt::format("rank 0 called {} but rank {} called {}", first.label(), r, c.label());
    if (c.count() != first.count())
      return fmt::format("rank 0 passed {} elements but rank {} passed {}", first.count(), r,
                         c.count());
    if (c.in.dtype() != first.in.dtype())
      return fmt::format("rank 0 passed {} but rank {} passed {}", dtype_name(first.in.dtype()), r,
                         dtype_name(c.in.dtype()));
  }
  return "";
}

class LocalCommunicator;

// isend completes when it is posted: the bytes are already in the mailbox.
class CompletedRequest : public Request {
 public:
  bool test() override { return true; }
  void wait() override {}
};

class RecvRequest : public Request {
 public:
  RecvRequest(LocalCommunicator& comm, Tensor t, int peer, MessageTag tag, uint64_t number)
      : comm_(comm), t_(std::move(t)), peer_(peer), tag_(tag), number_(number) {}
  bool test() override;
  void wait() override;

 private:
  // The matching message, checked against t_ and removed from the mailbox.
  std::optional<Message> take_locked();
  void deliver(const Message& m);

  LocalCommunicator& comm_;
  Tensor t_;
  int peer_;
  MessageTag tag_;
  uint64_t number_;  // which message of this tag from this peer is ours
  bool done_ = false;
};

class LocalCommunicator : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<World> world, std::shared_ptr<Group> group, int rank,
                    CommOptions options)
      : Communicator(options), world_(std::move(world)), group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  int world_rank(int r) const override {
    check(r >= 0 && r < size(), "rank {} is outside {} of size {}", r, describe(), size());
    return group_->members[static_cast<size_t>(r)];
  }
  std::string describe() const override { return group_->description; }

  RequestPtr isend(const Tensor& t, int peer, MessageTag tag) override {
    check_peer(t, peer, "isend");
    const int32_t code = tag.encode();
    Message m{tag, 0, t.shape(), t.dtype(), {}, Tensor()};
    if (t.device().is_cpu()) {
      m.bytes.resize(t.nbytes());
      if (t.nbytes()) std::memcpy(m.bytes.data(), t.raw(), t.nbytes());
    } else {
      // A device-to-device copy, queued after the kernels that made `t`.
      m.payload = Tensor::empty(t.shape(), t.dtype(), t.device());
      m.payload.copy_from(t);
    }
    {
      std::lock_guard<std::mutex> lock(world_->mu);
      Mailbox& box = group_->mailbox(rank_, peer);
      m.number = box.sent[code]++;
      box.messages.push_back(std::move(m));
    }
    world_->changed.notify_all();
    return std::make_unique<CompletedRequest>();
  }

  RequestPtr irecv(const Tensor& t, int peer, MessageTag tag) override {
    check_peer(t, peer, "irecv");
    const int32_t code = tag.encode();
    // The ticket is taken now, not when the message arrives: receives of equal
    // tags match messages in posting order even when completed out of order.
    // (Like MPI, a receive must be completed: dropping one skips its message.)
    std::lock_guard<std::mutex> lock(world_->mu);
    const uint64_t number = group_->mailbox(peer, rank_).posted[code]++;
    return std::make_unique<RecvRequest>(*this, t, peer, tag, number);
  }

  void all_reduce(const Tensor& t, ReduceOp op) override {
    check_reducible(t, op, "all_reduce");
    collective({CollectiveCall::Kind::AllReduce, op, 0, t, t});
  }

  void all_gather(const Tensor& in, const Tensor& out) override {
    check_movable(in, "all_gather");
    check_movable(out, "all_gather");
    check(out.numel() == size() * in.numel() && out.dtype() == in.dtype(),
          "all_gather in {}: output {} {} must hold {} x {} {} elements", describe(),
          dtype_name(out.dtype()), out.shape().str(), size(), in.numel(), dtype_name(in.dtype()));
    collective({CollectiveCall::Kind::AllGather, ReduceOp::Sum, 0, in, out});
  }

  void reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) override {
    check_reducible(in, op, "reduce_scatter");
    check_movable(out, "reduce_scatter");
    check(in.numel() == size() * out.numel() && out.dtype() == in.dtype(),
          "reduce_scatter in {}: input {} {} must hold {} x {} {} elements", describe(),
          dtype_name(in.dtype()), in.shape().str(), size(), out.numel(), dtype_name(out.dtype()));
    collective({CollectiveCall::Kind::ReduceScatter, op, 0, in, out});
  }

  void broadcast(const Tensor& t, int root) override {
    check_movable(t, "broadcast");
    check(root >= 0 && root < size(), "broadcast root {} is outside {} of size {}", root,
          describe(), size());
    collective({CollectiveCall::Kind::Broadcast, ReduceOp::Sum, root, t, t});
  }

  void barrier() override { collective({}); }

  std::unique_ptr<Communicator> split(const std::vector<std::vector<int>>& groups,
                                      const std::string& name) override;

  // Throws what a wait that did not get ready() must throw.
  [[noreturn]] void give_up(WaitResult result, const std::string& operation) const {
    if (result == WaitResult::TimedOut) throw CommTimeout(waiting_for(operation));
    throw PeerFailed("rank {} (world rank {}) stopped waiting for {} in {}: {}", rank_,
                     world_rank(rank_), operation, describe(), world_->failure);
  }

  Clock::time_point deadline() const { return Clock::now() + options_.timeout; }
  World& world() const { return *world_; }
  Group& group() const { return *group_; }

 private:
  // Host tensors, or device tensors when weft has a device backend.
  void check_movable(const Tensor& t, const char* op) const {
    check(t.device().is_cpu() || cuda_built(),
          "{} in {}: a {} tensor, but weft was built without CUDA", op, describe(),
          t.device().str());
  }
  void check_peer(const Tensor& t, int peer, const char* op) const {
    check_movable(t, op);
    check(peer >= 0 && peer < size(), "{} peer {} is outside {} of size {}", op, peer, describe(),
          size());
  }
  void check_reducible(const Tensor& t, ReduceOp op, const char* what) const {
    check_movable(t, what);
    check(t.dtype() == DType::F32 || t.dtype() == DType::I32 ||
              (t.dtype() == DType::BF16 && op == ReduceOp::Sum),
          "{} ({}) in {} of {} tensors is not supported (F32 or I32; BF16 sums only)", what,
          reduce_op_name(op), describe(), dtype_name(t.dtype()));
  }

  // Joins collective number next_collective_ of this group and returns once
  // every member's result is written.
  void collective(CollectiveCall call);

  std::shared_ptr<World> world_;
  std::shared_ptr<Group> group_;
  int rank_;
  uint64_t next_collective_ = 0;
  uint64_t next_split_ = 0;
};

std::optional<Message> RecvRequest::take_locked() {
  std::deque<Message>& messages = comm_.group().mailbox(peer_, comm_.rank()).messages;
  for (auto it = messages.begin(); it != messages.end(); ++it) {
    if (it->tag != tag_ || it->number != number_) continue;
    check_message(t_, it->shape, it->dtype, peer_, tag_, comm_);
    Message m = std::move(*it);
    messages.erase(it);
    return m;
  }
  return std::nullopt;
}

void RecvRequest::deliver(const Message& m) {
  if (m.payload.defined()) {
    t_.copy_from(m.payload);  // device to device (or host), on the compute stream
  } else if (!m.bytes.empty()) {
    if (t_.device().is_cpu())
      std::memcpy(t_.raw(), m.bytes.data(), m.bytes.size());
    else
      t_.copy_from(Tensor(const_cast<std::byte*>(m.bytes.data()), t_.shape(), t_.dtype(),
                          Device::cpu()));
  }
  done_ = true;
}

bool RecvRequest::test() {
  if (done_) return true;
  std::unique_lock<std::mutex> lock(comm_.world().mu);
  std::optional<Message> m = take_locked();
  // A message that has not come may never come: a poller learns of a failed
  // rank here, as a waiter does in wait().
  if (!m && !comm_.world().failure.empty())
    comm_.give_up(WaitResult::PeerFailed,
                  fmt::format("recv from rank {} (world rank {}), tag {}", peer_,
                              comm_.world_rank(peer_), tag_.str()));
  lock.unlock();
  if (m) deliver(*m);
  return done_;
}

void RecvRequest::wait() {
  if (done_) return;
  const auto deadline = comm_.deadline();
  std::unique_lock<std::mutex> lock(comm_.world().mu);
  std::optional<Message> m;
  const WaitResult result =
      comm_.world().wait(lock, deadline, [&] { return (m = take_locked()).has_value(); });
  if (result != WaitResult::Ready)
    comm_.give_up(result, fmt::format("recv from rank {} (world rank {}), tag {}", peer_,
                                      comm_.world_rank(peer_), tag_.str()));
  lock.unlock();
  deliver(*m);  // outside the lock: the bytes are ours now
}

void LocalCommunicator::collective(CollectiveCall call) {
  const auto until = deadline();
  const std::string label = call.label();
  std::unique_lock<std::mutex> lock(world_->mu);
  const uint64_t number = next_collective_++;
  Collective& c = group_->collectives[number];  // std::map: the reference stays valid
  if (c.calls.empty()) c.calls.resize(static_cast<size_t>(size()));
  c.calls[static_cast<size_t>(rank_)] = std::move(call);
  if (++c.arrived == size()) {
    c.error = disagreement(c.calls);
    if (c.error.empty()) run_collective(c.calls);
    c.done = true;
    world_->changed.notify_all();
  }

  const WaitResult result = world_->wait(lock, until, [&] { return c.done; });
  if (result != WaitResult::Ready) {
    std::vector<int> missing;
    for (int r = 0; r < size(); ++r)
      if (!c.calls[static_cast<size_t>(r)]) missing.push_back(r);
    // Withdraw, so that nobody writes into our tensors after we have left.
    c.calls[static_cast<size_t>(rank_)].reset();
    if (--c.arrived == 0) group_->collectives.erase(number);
    give_up(result, fmt::format("{} #{} (ranks [{}] have not arrived)", label, number,
                                fmt::join(missing, ", ")));
  }
  const std::string error = c.error;
  if (++c.departed == size()) group_->collectives.erase(number);
  if (!error.empty()) throw Error("{} #{} in {}: {}", label, number, describe(), error);
}

std::unique_ptr<Communicator> LocalCommunicator::split(const std::vector<std::vector<int>>& groups,
                                                       const std::string& name) {
  // Every member checks the same partition, so all of them throw alike.
  std::vector<int> group_of(static_cast<size_t>(size()), -1);
  for (size_t g = 0; g < groups.size(); ++g) {
    check(!groups[g].empty(), "split '{}' of {}: group {} is empty", name, describe(), g);
    for (int r : groups[g]) {
      check(r >= 0 && r < size(), "split '{}' of {}: rank {} is outside [0, {})", name, describe(),
            r, size());
      check(group_of[static_cast<size_t>(r)] < 0,
            "split '{}' of {}: rank {} is in more than one group", name, describe(), r);
      group_of[static_cast<size_t>(r)] = static_cast<int>(g);
    }
  }
  for (int r = 0; r < size(); ++r)
    check(group_of[static_cast<size_t>(r)] >= 0, "split '{}' of {}: rank {} is in no group", name,
          describe(), r);

  const auto index = static_cast<size_t>(group_of[static_cast<size_t>(rank_)]);
  const std::vector<int>& mine = groups[index];
  std::vector<int> members;
  for (int r : mine) members.push_back(world_rank(r));
  const int my_rank = static_cast<int>(std::find(mine.begin(), mine.end(), rank_) - mine.begin());

  // Members of one group meet in the registry under the same key, because
  // they call split() on the same parent in the same order.
  std::lock_guard<std::mutex> lock(world_->mu);
  auto& group = world_->groups[{group_->id, next_split_++, index}];
  if (!group) {
    group = std::make_shared<Group>(world_->next_group_id++, members,
                                    fmt::format("{} [{}]", name, fmt::join(members, ", ")));
  }
  check(group->members == members,
        "split '{}' of {}: rank {} made group [{}] but another member made {}", name, describe(),
        rank_, fmt::join(members, ", "), group->description);
  return std::make_unique<LocalCommunicator>(world_, group, my_rank, options_);
}

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_local_world(int n, CommOptions options) {
  check(n >= 1, "a local world needs at least one rank, got {}", n);
  auto world = std::make_shared<World>();
  std::vector<int> ranks(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) ranks[static_cast<size_t>(r)] = r;
  auto group = std::make_shared<Group>(0, ranks, "world");
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < n; ++r)
    comms.push_back(std::make_unique<LocalCommunicator>(world, group, r, options));
  return comms;
}

void run_local(int n, const std::function<void(Communicator&)>& fn, CommOptions options) {
  auto comms = make_local_world(n, options);
  World& world = static_cast<LocalCommunicator&>(*comms[0]).world();

  struct Failure {
    std::string what;  // "rank 2: ..."
    bool timeout = false;
  };
  std::mutex failures_mu;
  std::vector<Failure> causes;  // failures that are not PeerFailed, in the order they happened
  std::optional<Failure> peer_failed;

  auto run_rank = [&](int r) {
    auto record = [&](const std::string& what, bool is_peer_failed, bool timeout) {
      world.fail(fmt::format("rank {} failed: {}", r, what));
      std::lock_guard<std::mutex> lock(failures_mu);
      Failure f{fmt::format("rank {}: {}", r, what), timeout};
      if (!is_peer_failed)
        causes.push_back(std::move(f));
      else if (!peer_failed)
        peer_failed = std::move(f);
    };
    try {
      fn(*comms[static_cast<size_t>(r)]);
    } catch (const PeerFailed& e) {
      record(e.what(), true, false);
    } catch (const CommTimeout& e) {
      record(e.what(), false, true);
    } catch (const std::exception& e) {
      record(e.what(), false, false);
    } catch (...) {
      record("unknown exception", false, false);
    }
  };

  {
    // jthreads join when they go out of scope, also when starting one throws;
    // the world is failed first so that the started ones stop waiting.
    std::vector<std::jthread> threads;
    try {
      for (int r = 0; r < n; ++r) threads.emplace_back(run_rank, r);
    } catch (const std::exception& e) {
      world.fail(fmt::format("could not start rank {}: {}", threads.size(), e.what()));
      throw;
    }
  }

  const Failure* first = !causes.empty() ? &causes.front() : peer_failed ? &*peer_failed : nullptr;
  if (!first) return;
  if (first->timeout) throw CommTimeout(first->what);
  throw Error(first->what);
}

}  // namespace weft
