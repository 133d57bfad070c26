#!/usr/bin/env bash
# Formatting check for CI: every tracked C++ file under src/, tests/ and bench/ must be what clang-format makes
# of it with the repo's .clang-format. Lists the files that differ and exits 1; --fix rewrites them in place.
#   scripts/check_format.sh          check (CI)
#   scripts/check_format.sh --fix    format those files
# CLANG_FORMAT names the binary (default clang-format; the style was measured with clang-format 14).
set -euo pipefail
cd "$(dirname "$0")/.."
clang_format=${CLANG_FORMAT:-clang-format}
command -v "$clang_format" >/dev/null || { echo "check_format: $clang_format not found (apt-get install clang-format)" >&2; exit 2; }

mapfile -t files < <(git ls-files -- 'src/*.h' 'src/*.cpp' 'tests/*.h' 'tests/*.cpp' 'bench/*.h' 'bench/*.cpp')
if [[ ${1:-} == --fix ]]; then
  "$clang_format" -i --style=file "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$clang_format" --style=file --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if ((${#bad[@]})); then
  echo "check_format: ${#bad[@]} file(s) differ from .clang-format (fix: scripts/check_format.sh --fix):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files formatted"
