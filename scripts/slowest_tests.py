#!/usr/bin/env python3
"""Prints the slowest tests of a CTest run, slowest first, with the run's total, from its JUnit report.

scripts/test.sh calls it after CTest (ctest --output-junit FILE), so every run shows where the suite's time goes
and a test that grew slow is seen where it lands; DEVELOPERS.md, "Test suite: what runs where", keeps the budget.
Standard library only.

Usage: slowest_tests.py JUNIT_XML [COUNT]   (COUNT: 20 unless given)
"""
import sys
import xml.etree.ElementTree as ET


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    count = int(sys.argv[2]) if len(sys.argv) == 3 else 20
    root = ET.parse(sys.argv[1]).getroot()
    cases = [(float(case.get("time") or 0.0), case.get("name")) for case in root.iter("testcase")]
    cases.sort(key=lambda c: -c[0])
    total = sum(t for t, _ in cases)
    print(f"The {min(count, len(cases))} slowest of {len(cases)} tests (their times sum to {total:.0f} s; "
          f"CTest ran them side by side):")
    for seconds, name in cases[:count]:
        print(f"  {seconds:8.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
