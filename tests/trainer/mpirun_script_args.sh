# Sourced, with no arguments, by the trainer's mpirun test scripts, so that it reads and shifts their own arguments:
#   WORKDIR RINGFLEX MPIEXEC... -- SCRIPT_ARGS...
# leaves `work` (emptied and created), `ringflex`, the launcher and its options in `launcher`, and the script's own
# arguments in "$@".
work=$1 ringflex=$2
shift 2
launcher=()
while [ "$1" != "--" ]; do launcher+=("$1"); shift; done
shift
rm -rf "$work"
mkdir -p "$work"
