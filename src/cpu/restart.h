// ringflex cpu: a program starting itself again, for settings a shared library reads only while it loads.
//
// OpenBLAS reads OPENBLAS_CORETYPE and the OpenMP runtime GOMP_SPINCOUNT once, when they load, before main runs. A
// variable set in main reaches them only in a fresh process image: execv of the executable's own file, same pid
// (so mpirun's ranks stay its ranks), arguments and environment. It has to come first in main, before MPI or threads
// start. Setting the variable earlier, in the executable's .preinit_array, does not work: glibc's own start-up
// puts back the environment the process was given, after those functions and before the libraries' constructors.
#pragma once

namespace rf::cpu {

// Replaces the process image with a fresh copy of the executable, started with `argv` and the current environment.
// Returns only when that failed (the process then runs on with the settings the libraries already read).
void restart_self(char** argv);

}  // namespace rf::cpu
