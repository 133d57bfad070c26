# shellcheck shell=bash
# same_checkpoint CK REF_CK: checkpoint CK equals REF_CK, the same files, each the same bytes except for the
# checkpoint's own directory in the saved config. A file equal as it is (the weights and moments, megabytes each) is
# not rewritten for the comparison. Sourced by mpirun_lib.sh (the multi-rank tests) and scripts/soak.sh.
same_checkpoint() {
  local ck=$1 ref_ck=$2 f ref
  [ "$(ls "$ck")" = "$(ls "$ref_ck")" ] || return 1
  for f in "$ck"/*; do
    ref=$ref_ck/${f##*/}
    cmp -s "$f" "$ref" || cmp -s <(sed "s#${ck%/*}#CK#g" "$f") <(sed "s#${ref_ck%/*}#CK#g" "$ref") || return 1
  done
}
