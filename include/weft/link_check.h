// weft/link_check.h — every link between ranks measured, before a long job.
//
// `train_gpt --check-links` runs it on a new cluster: each pair of ranks
// exchanges small messages (latency) and large ones (bandwidth), and rank 0
// lists every link by rank and host, slowest first, so that a bad cable, a
// wrong network interface (NCCL_SOCKET_IFNAME, UCX_NET_DEVICES) or a busy node
// shows before it slows a job down.
#pragma once

#include <weft/communicator.h>

#include <cstdint>
#include <vector>

namespace weft {

struct LinkResult {
  int a = 0, b = 0;          // the two ranks, a < b
  double latency_us = 0;     // one way, half the median round trip of 8 bytes
  double gb_per_s = 0;       // one way, `bytes` over half the median round trip
};

// Collective over `world`. The N (N - 1) / 2 pairs are measured in N - 1
// rounds (N rounded up to even) in which every rank has one partner, so links
// are measured concurrently but each rank's link alone. Each pair times `reps`
// round trips of each size, the lower rank leading. Rank 0 returns every
// pair's result, ordered by (a, b); the other ranks return nothing. The
// messages are tensors on `device`: on a GPU with an NCCL world, NCCL's own
// links are measured (each round trip waited for by the host).
std::vector<LinkResult> check_links(Communicator& world, int64_t bytes, int reps,
                                    Device device = Device::cpu());

}  // namespace weft
