"""Fails if any CTest case can pass whatever its exit code: PASS_REGULAR_EXPRESSION (a matching output passes even
after a crash) or WILL_FAIL (inverts it). Such a test uses tests/cli/expect_ok.sh or expect_error.sh, which check the
exit code and the output together. (SKIP_REGULAR_EXPRESSION, which gtest_discover_tests sets, only turns a test into
a skip, and scripts/check_skips.py fails the suite on those.)

    check_exit_codes.py CTEST BUILD_DIR     reads `CTEST --show-only=json-v1` in BUILD_DIR
"""

import json
import subprocess
import sys

# Test properties under which CTest stops requiring the exit code it would otherwise require.
IGNORING = ("PASS_REGULAR_EXPRESSION",)


def offenders(info):
    """(test, property) pairs of the tests in a json-v1 document that ignore their exit code."""
    bad = []
    for test in info.get("tests", []):
        for prop in test.get("properties", []):
            name = prop.get("name")
            if name in IGNORING or (name == "WILL_FAIL" and prop.get("value") in (True, "ON", "TRUE", "1")):
                bad.append((test.get("name", "?"), name))
    return bad


def self_check():
    """The check itself finds a made-up offender and passes a made-up clean test."""
    made_up = {"tests": [{"name": "ok", "properties": [{"name": "TIMEOUT", "value": 60}]},
                         {"name": "regex", "properties": [{"name": "PASS_REGULAR_EXPRESSION", "value": ["x"]}]},
                         {"name": "inverted", "properties": [{"name": "WILL_FAIL", "value": True}]}]}
    assert offenders(made_up) == [("regex", "PASS_REGULAR_EXPRESSION"), ("inverted", "WILL_FAIL")], offenders(made_up)


def main():
    ctest, build_dir = sys.argv[1], sys.argv[2]
    self_check()
    out = subprocess.run([ctest, "--show-only=json-v1"], cwd=build_dir, check=True, capture_output=True, text=True)
    info = json.loads(out.stdout)
    tests = info.get("tests", [])
    if not tests:
        sys.exit("check_exit_codes: ctest listed no tests in " + build_dir)
    bad = offenders(info)
    for test, prop in bad:
        print(f"check_exit_codes: {test} uses {prop}: it can pass whatever its exit code "
              "(use tests/cli/expect_ok.sh)", file=sys.stderr)
    print(f"check_exit_codes: {len(tests)} tests, {len(bad)} ignore their exit code")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
