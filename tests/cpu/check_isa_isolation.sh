#!/usr/bin/env bash
# Guards the one-binary-for-every-CPU promise (src/cpu/isa_target.h): in the object files of one ISA's kernels,
# only functions in that ISA's namespace rf::cpu::<isa>:: may contain AVX instructions (VEX/EVEX-encoded: a
# mnemonic starting with v, or ymm/zmm/opmask registers). Any other function there - an inline function or
# template instantiation from the standard library or src/core - is a weak definition the linker may keep for
# the whole program, and an AVX-512 copy of it would crash the binary on an AVX2-only CPU.
# Usage: check_isa_isolation.sh OBJDUMP ISA OBJECT...
# RF_ISA_NAMESPACE (default rf::cpu) names the layer whose per-ISA namespaces are checked (src/model's elementwise
# kernels live in rf::model::<isa>::).
set -euo pipefail
objdump=$1 isa=$2
shift 2
layer=${RF_ISA_NAMESPACE:-rf::cpu}
status=0
for obj in "$@"; do
  bad=$("$objdump" -d --no-show-raw-insn -C "$obj" | awk -v ns="${layer}::${isa}::" '
    /^[0-9a-f]+ <.*>:$/ { fn = $0; inside = index(fn, ns) > 0; next }
    !inside && (/:\tv[a-z]/ || /ymm|zmm|%k[0-7]/) { print fn }' | sort -u)
  if [[ -n "$bad" ]]; then
    echo "$obj: AVX instructions outside ${layer}::${isa}:: in:"
    echo "$bad"
    status=1
  fi
done
[[ $status -eq 0 ]] && echo "ok: $# object files of the $isa kernels keep their ISA inside ${layer}::${isa}::"
exit $status
