// weft/mpi_communicator.h — MPICH for host-memory tensors.
//
// MPICH's blocking calls busy-wait, which starves co-located ranks on an
// oversubscribed machine. Every operation here is posted non-blocking and
// waited for with MPI_Test and a short sleep between polls; the deadline of
// CommOptions lives in that loop.
//
//   int main(int argc, char** argv) {
//     return weft::mpi_main(argc, argv, [](weft::Communicator& world) { ...; return 0; });
//   }
#pragma once

#include <weft/communicator.h>

#include <functional>
#include <memory>

namespace weft {

// Initialises MPI, runs fn with the world communicator and finalises. An
// exception escaping fn prints "rank R: error: ..." on one line and aborts the
// whole job (MPI_Abort), so no other rank waits for this one. Returns fn's
// status.
int mpi_main(int argc, char** argv, const std::function<int(Communicator&)>& fn,
             CommOptions options = {});

// The world communicator (MPI must be initialised, e.g. by mpi_main).
std::unique_ptr<Communicator> mpi_world(CommOptions options = {});

}  // namespace weft
