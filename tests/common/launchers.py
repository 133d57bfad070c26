"""The rank counts a Python oracle test checks ringflex at, from its command line.

A script that computes an expensive reference (importing torch and transformers alone takes seconds) checks
ringflex against it at every rank count it is given, instead of one CTest entry per rank count each building the
same reference again. Its arguments after RINGFLEX are either
    LAUNCHER...                   one launcher: none (P = 1, plainly, as a user runs it) or e.g. mpirun -n 2
    --ranks P... [-- MPIEXEC...]  P = 1 plainly, and `MPIEXEC -n P` for each P > 1
"""


def launchers(args):
    """The launchers (lists of words, [] for P = 1) that `args` (the words after RINGFLEX) name, in order."""
    args = list(args)
    if not args or args[0] != "--ranks":
        return [args]
    ranks, rest = [], args[1:]
    while rest and rest[0] != "--":
        ranks.append(int(rest.pop(0)))
    mpiexec = rest[1:]
    if not ranks or (max(ranks) > 1 and not mpiexec):
        raise SystemExit("--ranks needs rank counts, and `-- MPIEXEC...` for any above 1")
    return [[] if p == 1 else [*mpiexec, "-n", str(p)] for p in ranks]


def ranks_of(launcher):
    """The rank count a launcher starts: the number after -n, else 1."""
    return int(launcher[launcher.index("-n") + 1]) if "-n" in launcher else 1


def describe(runs):
    """The rank counts of `runs` (launchers) for a log line: "1, 2 through mpirun --oversubscribe -n 2"."""
    return ", ".join(f"{ranks_of(launcher)}" + (f" through {' '.join(launcher)}" if launcher else "")
                     for launcher in runs)
