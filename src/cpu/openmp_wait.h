// ringflex cpu: how long the OpenMP runtime's idle threads spin before they sleep.
//
// After a parallel region libgomp's threads spin (GOMP_SPINCOUNT, 300000 pauses by default, milliseconds) before
// they sleep on a futex, so that a region following closely starts within microseconds instead of waiting for a
// sleeping thread to be woken (60-130 us on a 2-vCPU VM, measured). A training step's regions follow each other
// closely and keep that default. A decode step is the other shape: one thread reads weights in short products with
// serial work between them, and there the spinning thread slowed the whole process (100m decode at 2 threads: 28.7
// tok/s with the default spin, 51.8 with the brief one; BENCHMARKS.md, "Generation alone"). The runtime reads its
// variables once, while it loads, so a program that wants the brief spin sets it and starts itself again
// (cpu/restart.h).
#pragma once

namespace rf::cpu {

// GOMP_SPINCOUNT for a process of short parallel regions far apart (the decode step's products).
inline constexpr const char* kBriefSpinCount = "1000";

// For a program's main, first thing: when neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT is set, sets GOMP_SPINCOUNT to
// kBriefSpinCount and restarts the process (restart_self) so that the runtime reads it. The user's choice is kept,
// and the restarted process finds the variable set. Returns when there is nothing to do, or when the restart failed
// (the variable is then removed again: idle_threads_sleep_soon must say what the runtime does).
void restart_with_brief_spin(char** argv);

// Whether this process's idle OpenMP threads sleep soon after a region (OMP_WAIT_POLICY=passive, or GOMP_SPINCOUNT
// of at most 10^4): then a fork costs a wake-up, not a spinning thread beside the serial work.
bool idle_threads_sleep_soon();

}  // namespace rf::cpu
