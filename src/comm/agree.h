// ringflex comm: making every rank fail together.
//
// Under `mpirun -n P`, a step that fails on one rank (a file it cannot read, a bad tensor, a batch the trainer
// cannot load) must not leave the other ranks waiting in the next collective forever. Steps that can fail on some
// ranks run inside `agree`: afterwards every rank knows whether any rank failed, and all of them throw the same
// AgreedError (the message of the lowest failing rank, "rank R: " before it when some ranks did not fail), so each
// prints one identical line and exits non-zero. A step inside `agree` must not run collectives itself: a rank that
// failed before one would leave the others waiting in it.
// The CLI's main.cpp finalises MPI normally after an AgreedError and aborts the job after any other error, which
// the other ranks may not know of.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/error.h"

namespace rf::comm {

class AgreedError : public rf::Error {
 public:
  using rf::Error::Error;
};

// Runs `step` on this rank, then agrees with all ranks of `comm` (a collective call: every rank must make it).
// Throws AgreedError on every rank if `step` threw on any rank (rf::Error or any std::exception): the lowest failing
// rank's message, prefixed "rank R: " unless every rank failed. A rank waits `timeout` for the others to finish
// their step (longer than the default where one rank's step is known to take long, e.g. a checkpoint write).
void agree(Communicator& comm, const std::function<void()>& step, Timeout timeout = default_timeout());

// Checks that every rank holds the same `values` (a collective call); throws AgreedError on every rank naming
// `what` if they differ, e.g. when ranks read different input files.
void agree_equal(Communicator& comm, std::span<const int64_t> values, const std::string& what);

// Checks that every rank was started with the same command line (`args`: the arguments after the program name),
// a collective call. Every option is part of the agreement: an option given on one rank only would otherwise
// make the ranks run different jobs (different collectives, buffers of different sizes). Throws AgreedError on
// every rank quoting the first rank whose command line differs from rank 0's, and rank 0's.
void agree_command_line(Communicator& comm, const std::vector<std::string>& args);

}  // namespace rf::comm
