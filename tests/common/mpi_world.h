// Test helper for the test executables that run under a real `mpirun -n P`: the job's world communicator, made once
// around the whole gtest run by run_mpi_tests, which such an executable's main() returns.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <memory>

#include "comm/mpi_comm.h"

namespace rf::testing {

// The world of this process's job; set while RUN_ALL_TESTS runs.
inline std::unique_ptr<comm::Communicator>& mpi_world_ptr() {
  static std::unique_ptr<comm::Communicator> world;
  return world;
}
inline comm::Communicator& mpi_world() { return *mpi_world_ptr(); }

// Starts MPI, runs every test of the executable with mpi_world() set, and shuts MPI down (the world communicator is
// freed first, as MPI_Finalize requires). Returns RUN_ALL_TESTS()'s code: a failed assertion on any rank makes
// mpirun exit non-zero.
inline int run_mpi_tests(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  mpi_world_ptr() = comm::make_mpi_world();
  const int rc = RUN_ALL_TESTS();
  mpi_world_ptr().reset();
  MPI_Finalize();
  return rc;
}

}  // namespace rf::testing
