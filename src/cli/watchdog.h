// ringflex cli: a deadline for the few MPI calls that cannot take one.
//
// Every wait inside a job polls with the --timeout deadline (comm/communicator.h). MPI_Init and MPI_Finalize
// cannot: Open MPI's start-up and shut-down exchange with every peer and block until they answer. A Watchdog
// armed around such a call ends the process with one error line if the call has not returned by the deadline;
// under mpirun the job then ends on every rank (mpirun stops the others when one exits without finalising).
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "comm/communicator.h"

namespace rf::cli {

class Watchdog {
 public:
  // `what` names the guarded call in the message, e.g. "MPI start-up".
  Watchdog(comm::Timeout limit, std::string what);
  ~Watchdog();  // disarms
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace rf::cli
