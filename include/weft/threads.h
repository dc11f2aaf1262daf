// weft/threads.h — how many CPU threads a process may use.
//
// Several ranks often share one machine. Each rank takes an equal share of the
// cores (at least one), so that BLAS and the element-wise kernels of N local
// ranks never ask for more threads than there are cores.
#pragma once

namespace weft {

// Cores on this machine divided by the ranks on it (MPI_LOCALNRANKS or
// OMPI_COMM_WORLD_LOCAL_SIZE or SLURM_NTASKS_PER_NODE when set), at least 1.
int default_threads();
// Sets the OpenMP (and so OpenBLAS) thread count for this process.
void set_threads(int n);
int get_threads();

}  // namespace weft
