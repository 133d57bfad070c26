// ringflex comm: an in-process backend, one thread per rank, for fast deterministic multi-rank tests.
//
// Sends copy their buffers into the destination's mailbox at once (eager), so a send never waits for its
// receiver; receives block (up to their deadline) until a message with their (source, tag) arrives, taking
// messages in the order they were sent. When any rank's function throws, the world is marked failed and every
// rank blocked in a wait throws too, so a test sees the first error instead of a hang.
#pragma once

#include <functional>

#include "comm/communicator.h"

namespace rf::comm {

// Runs fn(comm) on P threads, one loopback communicator each (ranks 0..P-1), and joins them. If any rank threw,
// rethrows the error of the rank that failed first (other ranks' "peer failed" errors are secondary).
void run_ranks(int P, const std::function<void(Communicator&)>& fn);

}  // namespace rf::comm
