// Without the CUDA backend there is no NCCL transport; callers learn why.
#include <weft/nccl_communicator.h>

namespace weft {

bool nccl_built() { return false; }

bool nccl_ranks_as_hosts() { return false; }

std::unique_ptr<Communicator> nccl_world(Communicator&, int device, CommOptions) {
  throw Error("NCCL communicator for cuda:{} requested, but weft was built without CUDA "
              "(meson setup -Dcuda=enabled)",
              device);
}

}  // namespace weft
