#!/usr/bin/env bash
# Runs every GPU test under compute-sanitizer (memcheck with leak check). Test cases tagged
# [expected-api-error] provoke a CUDA error on purpose (bad-input tests); they run in a second
# pass with API-error reporting off, so that everywhere else an API error still fails the run.
#   tests/gpu/sanitize.sh BUILD_DIR
set -uo pipefail
build=${1:-build}
failed=0
for exe in "$build"/tests/gpu_*; do
  [[ -x $exe ]] || continue
  name=$(basename "$exe")
  extra=()
  [[ $name == gpu_test_exit* ]] && extra=()  # whole-program tests run as they are
  out=$(compute-sanitizer --tool memcheck --leak-check full --error-exitcode 99 "$exe" '~[expected-api-error]' 2>&1)
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|LEAK SUMMARY" <<<"$out" | tr '\n' ' ')
  printf '%-40s rc=%s %s\n' "$name" "$rc" "$summary"
  if [[ $rc -ne 0 ]]; then failed=1; grep -B2 -A8 "=========" <<<"$out" | head -60; fi
  if "$exe" --list-test-names-only '[expected-api-error]' 2>/dev/null | grep -q .; then
    out=$(compute-sanitizer --tool memcheck --leak-check full --report-api-errors no --error-exitcode 99 "$exe" '[expected-api-error]' 2>&1)
    rc=$?
    summary=$(grep -E "ERROR SUMMARY|LEAK SUMMARY" <<<"$out" | tr '\n' ' ')
    printf '%-40s rc=%s %s\n' "$name [expected-api-error]" "$rc" "$summary"
    if [[ $rc -ne 0 ]]; then failed=1; grep -B2 -A8 "=========" <<<"$out" | head -60; fi
  fi
done
exit $failed
