#include <weft/link_check.h>

#include <algorithm>
#include <chrono>

namespace weft {

namespace {

// The median round trip, in seconds, of `reps` exchanges of `t` with `peer`.
// `index` tells the sizes apart: a transport may hold a tag to one shape.
double round_trip(Communicator& comm, const Tensor& t, int peer, bool lead, int reps, int index) {
  const MessageTag tag{MessageTag::Kind::User, 0, 0, index};
  std::vector<double> times;
  for (int i = 0; i < reps + 1; ++i) {  // the first exchange warms the link up
    const auto t0 = std::chrono::steady_clock::now();
    if (lead) {
      comm.send(t, peer, tag);
      comm.recv(t, peer, tag);
    } else {
      comm.recv(t, peer, tag);
      comm.send(t, peer, tag);
    }
    if (i > 0)
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(times.begin(), times.begin() + static_cast<std::ptrdiff_t>(times.size() / 2),
                   times.end());
  return times[times.size() / 2];
}

}  // namespace

std::vector<LinkResult> check_links(Communicator& world, int64_t bytes, int reps,
                                    Device device) {
  check(bytes >= 8 && bytes % 4 == 0, "a link check needs a message of 8 bytes or more, in "
        "whole floats, got {} bytes", bytes);
  check(reps > 0, "a link check needs at least one round trip per size, got {}", reps);
  const int n = world.size(), me = world.rank();
  const int slots = n + n % 2;  // the circle method: slot slots-1 stays, the others rotate
  Tensor small = Tensor::zeros({2}, DType::F32, device);
  Tensor large = Tensor::zeros({bytes / 4}, DType::F32, device);
  // Row a of the table (filled by rank a): latency and bandwidth to each b > a.
  Tensor mine = Tensor::zeros({2 * n});
  for (int round = 0; round < slots - 1; ++round) {
    int partner = -1;
    if (me == slots - 1) {
      partner = round % 2 == 0 ? round / 2 : (round + slots - 1) / 2;
    } else if ((2 * me) % (slots - 1) == round % (slots - 1)) {
      partner = slots - 1;
    } else {
      partner = ((round - me) % (slots - 1) + (slots - 1)) % (slots - 1);
    }
    if (partner < 0 || partner >= n || partner == me) continue;  // a bye, or N odd
    const bool lead = me < partner;
    const double lat = round_trip(world, small, partner, lead, reps, 0) / 2;
    const double one_way = round_trip(world, large, partner, lead, reps, 1) / 2;
    if (lead) {
      mine.data<float>()[2 * partner] = static_cast<float>(lat * 1e6);
      mine.data<float>()[2 * partner + 1] = static_cast<float>(static_cast<double>(bytes) / one_way / 1e9);
    }
  }
  Tensor all = Tensor::zeros({n * 2 * n});
  world.all_gather(mine, all);
  std::vector<LinkResult> links;
  if (me != 0) return links;
  for (int a = 0; a < n; ++a)
    for (int b = a + 1; b < n; ++b) {
      const float* row = all.data<float>() + a * 2 * n;
      links.push_back({a, b, row[2 * b], row[2 * b + 1]});
    }
  return links;
}

}  // namespace weft
