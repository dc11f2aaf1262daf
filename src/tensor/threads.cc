#include <weft/threads.h>

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

namespace weft {

namespace {
int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return 0;
  int n = std::atoi(v);
  return n > 0 ? n : 0;
}
}  // namespace

int default_threads() {
  int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int local = env_int("MPI_LOCALNRANKS");
  if (local == 0) local = env_int("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (local == 0) local = env_int("SLURM_NTASKS_PER_NODE");
  if (local == 0) local = 1;
  return std::max(1, cores / local);
}

void set_threads(int n) { omp_set_num_threads(std::max(1, n)); }

int get_threads() { return omp_get_max_threads(); }

}  // namespace weft
