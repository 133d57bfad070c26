#!/usr/bin/env python3
"""scripts/check_skips.py on made-up CTest reports: which skips fail a run under scripts/test.sh and CI.

A skip naming AMX (or AVX2, AVX-512) passes on a CPU without that feature and fails on one with it (there the
test could have run); a skip for a missing Python package, a configuration, or CTest's own "Not Run" always fails;
passed and failed tests are not its business.
Standard library only, like the script it checks.
"""
import os
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "check_skips.py")
AMX_SKIP = ("AmxScoreTileIsExact", 'status="notrun"', '<skipped message="SKIP_REGULAR_EXPRESSION_MATCHED"/>',
            "[  SKIPPED ] AMX path inactive (CPU lacks AMX-TILE/AMX-BF16)")
PY_SKIP = ("io_python_crosscheck", 'status="notrun"', '<skipped message="SKIP_RETURN_CODE=77"/>',
           "skipped: No module named 'safetensors'")
AVX2_SKIP = ("CpuAttention.ForcedPath.avx2", 'status="notrun"', '<skipped message="SKIP_REGULAR_EXPRESSION_MATCHED"/>',
             "[  SKIPPED ] RINGFLEX_ISA=avx2: this CPU has no AVX2")
UNFORCED_SKIP = ("CpuAttention.ForcedPathIsTaken", 'status="notrun"', '<skipped message="SKIP_REGULAR_EXPRESSION_MATCHED"/>',
                 "[  SKIPPED ] RINGFLEX_ISA unset: the best path runs (avx512)")
BF16_SKIP = ("CpuAttention.MaskByMetadata.avx512-dpbf16", 'status="notrun"',
             '<skipped message="SKIP_REGULAR_EXPRESSION_MATCHED"/>',
             "[  SKIPPED ] RINGFLEX_ISA=avx512-dpbf16 but this CPU or OS lacks AVX-512 F/DQ/BW/VL with AVX512_BF16")
WIDEN_SKIP = ("ModelBf16.KernelPath.avx512-widen", 'status="notrun"', '<skipped message="SKIP_REGULAR_EXPRESSION_MATCHED"/>',
              "[  SKIPPED ] RINGFLEX_ISA=avx512-widen but this CPU or OS lacks AVX-512 F/DQ/BW/VL")
TILE_MODEL_SKIP = ("CpuAttention.LongRows.amx-model", 'status="notrun"',
                   '<skipped message="SKIP_REGULAR_EXPRESSION_MATCHED"/>',
                   "[  SKIPPED ] the tile model runs the AVX-512 kernels' tile path, which rounds with AVX512_BF16; "
                   "this CPU lacks it")
# One entry running several gtest tests: one skipped for hardware, another failed.
SKIP_BESIDE_FAILURE = ("model_cp_mpi_bf16_P2.avx512-widen", 'status="notrun"',
                       '<skipped message="SKIP_REGULAR_EXPRESSION_MATCHED"/>',
                       "[  SKIPPED ] RINGFLEX_ISA=avx512-widen but this CPU or OS lacks AVX-512 F/DQ/BW/VL\n"
                       "[  FAILED  ] ModelCp.Bf16StepNearFloat32OneRank")
NOT_RUN = ("cp_mpi_P8", 'status="notrun"', "", "Could not find executable")
PASSED = ("core_mask", 'status="run"', "", "[  PASSED  ] 1 test")
NO_AMX = "flags\t\t: fpu avx2 fma avx512f avx512bw avx512vl avx512_bf16\n"
SKYLAKE = "flags\t\t: fpu avx2 fma avx512f avx512bw avx512vl\n"
ZEN3 = "flags\t\t: fpu avx avx2 fma\n"  # AVX2-only: no AVX-512, no bf16 units
WITH_AMX = "flags\t\t: fpu avx2 fma avx512f avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile amx_int8\n"


def report(cases):
    body = "".join(f'<testcase name="{n}" classname="{n}" time="0.1" {status}>{skipped}'
                   f"<system-out>{out}</system-out></testcase>" for n, status, skipped, out in cases)
    return f'<?xml version="1.0" encoding="UTF-8"?><testsuite name="x" tests="{len(cases)}">{body}</testsuite>'


def run(cases, cpuinfo):
    with tempfile.TemporaryDirectory() as d:
        xml, cpu = os.path.join(d, "r.xml"), os.path.join(d, "cpuinfo")
        with open(xml, "w") as f:
            f.write(report(cases))
        with open(cpu, "w") as f:
            f.write(cpuinfo)
        r = subprocess.run([sys.executable, SCRIPT, xml, "--cpuinfo", cpu], capture_output=True, text=True)
        return r.returncode, r.stdout + r.stderr


def main():
    expectations = [  # (cases, cpuinfo, exit code, text the output must contain)
        ([PASSED, AMX_SKIP], NO_AMX, 0, "AmxScoreTileIsExact: this CPU lacks AMX"),
        ([PASSED, BF16_SKIP], SKYLAKE, 0, "this CPU lacks AVX512_BF16"),
        ([PASSED, BF16_SKIP], NO_AMX, 1, "avx512-dpbf16"),
        ([PASSED, AMX_SKIP], WITH_AMX, 1, "AmxScoreTileIsExact"),
        ([PASSED, PY_SKIP], NO_AMX, 1, "io_python_crosscheck"),
        ([NOT_RUN], NO_AMX, 1, "cp_mpi_P8"),
        ([PASSED], WITH_AMX, 0, ""),
        ([AVX2_SKIP], "flags\t\t: fpu sse4_2\n", 0, "this CPU lacks AVX2"),
        ([AVX2_SKIP], NO_AMX, 1, "ForcedPath.avx2"),
        ([UNFORCED_SKIP], NO_AMX, 1, "ForcedPathIsTaken"),  # names AVX-512, which this CPU has
        # An AVX2-only CPU: every path above AVX2 skips, naming what it lacks; AVX2's own skips do not.
        ([PASSED, AMX_SKIP, BF16_SKIP, WIDEN_SKIP, TILE_MODEL_SKIP], ZEN3, 0, "this CPU lacks AVX-512"),
        ([AVX2_SKIP], ZEN3, 1, "ForcedPath.avx2"),
        ([SKIP_BESIDE_FAILURE], ZEN3, 1, "model_cp_mpi_bf16_P2.avx512-widen"),
    ]
    failures = 0
    for cases, cpuinfo, code, text in expectations:
        got, out = run(cases, cpuinfo)
        names = [c[0] for c in cases]
        if got != code or text not in out:
            failures += 1
            print(f"FAILED: {names} on {'an AMX' if 'amx' in cpuinfo else 'a non-AMX'} CPU: exit {got} "
                  f"(expected {code}), output:\n{out}", file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
