#!/usr/bin/env python3
"""Fails when CTest skipped a test for a reason other than hardware this machine does not have.

Reads CTest's JUnit report (ctest --output-junit FILE). A skip is allowed only when its output names a hardware
feature from HARDWARE_SKIPS and this CPU's flags (/proc/cpuinfo) lack that feature: such a test cannot run here,
whatever the environment. Any other skip (a missing Python oracle, a disabled test, a test CTest could not start)
is a check that did not happen and fails the run. Allowed skips are listed by name at the end.
Standard library only: it runs before and without the test venv.
"""
import re
import sys
import xml.etree.ElementTree as ET

# (feature, pattern the skip's output must contain (any case), the cpuinfo flags whose absence makes the skip
# unavoidable). A skip that names a feature this CPU has is refused: the test could have run here.
HARDWARE_SKIPS = [
    ("AMX", r"\bamx", {"amx_tile", "amx_bf16"}),
    ("AVX512_BF16", r"avx512_?bf16", {"avx512_bf16"}),  # before AVX-512: its skips name AVX-512 too
    ("AVX-512", r"avx-?512", {"avx512f", "avx512bw", "avx512vl"}),
    ("AVX2", r"\bavx2\b", {"avx2", "fma"}),
]


def cpu_flags(cpuinfo):
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# gtest's mark of a failed test. A CTest entry that runs several gtest tests (a filter, or ranks under mpirun) is a skip
# when any of them skipped (SKIP_REGULAR_EXPRESSION), even if another failed: that is a failure, never a skip.
GTEST_FAILED = "[  FAILED  ]"


def hardware_reason(output, flags):
    """The feature that explains this skip on this machine, or None."""
    if GTEST_FAILED in output:
        return None
    for feature, pattern, needed in HARDWARE_SKIPS:
        if re.search(pattern, output, re.IGNORECASE) and not needed <= flags:
            return f"this CPU lacks {feature} ({', '.join(sorted(needed - flags))} not in its cpuinfo flags)"
    return None


def main():
    args = sys.argv[1:]
    cpuinfo = "/proc/cpuinfo"
    if len(args) == 3 and args[1] == "--cpuinfo":  # tests/check_skips_test.py feeds a made-up CPU
        cpuinfo = args[2]
    elif len(args) != 1:
        sys.exit("usage: check_skips.py CTEST_JUNIT.xml [--cpuinfo FILE]")
    try:
        root = ET.parse(args[0]).getroot()
    except (OSError, ET.ParseError) as e:
        sys.exit(f"check_skips.py: cannot read CTest's JUnit report {args[0]}: {e}")
    flags = cpu_flags(cpuinfo)
    allowed, refused = [], []
    for case in root.iter("testcase"):
        skipped = case.find("skipped")
        if skipped is None and case.get("status") not in ("notrun", "disabled"):
            continue
        output = " ".join(filter(None, [case.findtext("system-out"), skipped.get("message") if skipped is not None
                                        else None]))
        reason = hardware_reason(output, flags)
        (allowed if reason else refused).append((case.get("name"), reason))
    if allowed:
        print(f"Skipped for hardware this machine lacks ({len(allowed)}):")
        for name, reason in allowed:
            print(f"  {name}: {reason}")
    if refused:
        print(f"FAILED: {len(refused)} test(s) skipped without a hardware reason (a skip is a check that did not "
              "happen; scripts/setup.sh --test installs every test oracle):", file=sys.stderr)
        for name, _ in refused:
            print(f"  {name}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
