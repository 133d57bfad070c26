// ringflex comm: the MPI backend (Open MPI), over a private duplicate of MPI_COMM_WORLD.
//
// Point-to-point transfers post one MPI_Isend / MPI_Irecv per buffer with the caller's tag (MPI matches them in
// posting order). Waits poll MPI_Test until done or the deadline; collectives are point-to-point messages on a
// private duplicate (so they get deadlines too, and a timeout names the silent peer). MPI errors are returned, not
// fatal, and become rf::Error.
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace rf::comm {

// Requires MPI to be initialised (the CLI's main does it); the communicator must be destroyed before
// MPI_Finalize.
std::unique_ptr<Communicator> make_mpi_world();

}  // namespace rf::comm
