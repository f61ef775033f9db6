#!/usr/bin/env bash
# Runs every GPU test and every example under compute-sanitizer: memcheck (with leak check),
# initcheck, racecheck and synccheck. From the repository root:
#   tests/gpu/sanitize.sh BUILD_DIR
#   SANITIZE_TOOLS="memcheck initcheck" tests/gpu/sanitize.sh BUILD_DIR    # fewer tools
#
# Some test cases provoke CUDA errors on purpose, and say so with a Catch2 tag:
#   [expected-api-error]  a CUDA call fails on purpose (a request larger than the device...)
#   [expected-leak]       memory is left for context destruction or a device reset to free;
#                         compute-sanitizer counts that memory as leaked
# Each Catch2 test binary therefore runs in two passes:
#   pass 1  every untagged case, strict: API errors reported, --leak-check full
#   pass 2  the tagged cases, with only what their tag expects switched off (memcheck's access
#           checking always stays on):
#             [expected-api-error] only  --report-api-errors no, --leak-check full
#             [expected-leak] only       API errors reported,    --leak-check no
#             both tags                  --report-api-errors no, --leak-check no
#   [free-memory]         asserts the device's free memory (an owner gave everything back,
#                         a context's cost...). initcheck, racecheck and synccheck keep device
#                         memory of their own that moves it (seen on the H100: 34 MiB in one
#                         scope), so only memcheck, which leaves it alone, runs these cases.
#   [peer-copy]           copies pool memory (NVTX-annotated) between two GPUs with peer access
#                         on. initcheck fails inside itself there ("Internal Sanitizer Error: The
#                         Sanitizer failed to handle a hardware exception", and the copy returns
#                         cudaErrorIllegalAddress; seen on two H200s, CUDA 13.0, where memcheck,
#                         racecheck and synccheck pass the same cases, and initcheck passes the
#                         same copy of plain cudaMalloc'd buffers), so initcheck skips them.
# Whole-program tests (a main() of their own, no Catch2: tests/gpu/exit/) run once, strict,
# with no arguments.
# initcheck, racecheck and synccheck run every case but the [free-memory] ones in one pass
# (API errors are memcheck's to report; leaks are memcheck's). Examples (BUILD_DIR/examples/*) run whole under
# every tool; the ones that provoke an API error or a leak on purpose (their "raw" half shows
# the failure cudamem prevents) are listed in `example_expects` below, like the tags.
# Pools are annotated for the tools (detail/nvtx.hpp), so an access past a pooled block or
# after its free is a finding here like one in cudaMalloc'd memory.
#
# One line per pass per binary: name, pass, PASS/FAIL/SKIP, exit code, the sanitizer's and
# Catch2's summaries. A failing run's sanitizer report follows its line.
# Exit status: 1 if any run failed; else 77 if a binary skipped (no device); else 0.
# COMPUTE_SANITIZER may name the sanitizer binary.
set -uo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: tests/gpu/sanitize.sh BUILD_DIR" >&2
  exit 2
fi
build=$1
if [[ ! -d $build/tests ]]; then
  echo "sanitize.sh: $build/tests does not exist (build the GPU tests first)" >&2
  exit 2
fi

sanitizer=${COMPUTE_SANITIZER:-compute-sanitizer}
if ! command -v "$sanitizer" >/dev/null 2>&1; then
  if [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
    sanitizer=/usr/local/cuda/bin/compute-sanitizer
  else
    echo "sanitize.sh: compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
    exit 2
  fi
fi

# Catch2 2.13 test specs: `~[a]~[b]` is "not a and not b", `[a][b]` is "a and b".
readonly strict_filter='~[expected-api-error]~[expected-leak]'
readonly error_only_filter='[expected-api-error]~[expected-leak]'
readonly leak_only_filter='[expected-leak]~[expected-api-error]'
readonly both_filter='[expected-api-error][expected-leak]'
readonly not_free_memory='~[free-memory]'
readonly not_free_memory_or_peer_copy='~[free-memory]~[peer-copy]'

failed=0
skipped=0
ran=0
tools=${SANITIZE_TOOLS:-memcheck initcheck racecheck synccheck}
has_tool() { [[ " $tools " == *" $1 "* ]]; }

# line NAME PASS VERDICT DETAILS: one summary line.
line() {
  printf '%-34s %-28s %-4s %s\n' "$1" "$2" "$3" "$4"
}

# run_pass NAME PASS SANITIZER_OPTION... -- COMMAND...
# Runs COMMAND under memcheck with the given options and prints its summary line.
run_pass() {
  local name=$1 pass=$2
  shift 2
  local options=()
  while [[ $1 != -- ]]; do
    options+=("$1")
    shift
  done
  shift
  local out rc
  out=$("$sanitizer" --error-exitcode 99 "${options[@]}" "$@" 2>&1)
  rc=$?
  ran=$((ran + 1))
  local summary
  summary=$(grep -E '(ERROR|LEAK) SUMMARY|^All tests passed|^test cases:' <<<"$out" |
            sed -e 's/^========= //' | tr '\n' ' ')
  if { [[ $rc -eq 77 ]] && grep -q '^SKIPPED' <<<"$out"; } ||
     { [[ $rc -eq 69 ]] && grep -q 'no usable CUDA device' <<<"$out"; }; then
    skipped=1
    line "$name" "$pass" SKIP "rc=$rc $(grep -m1 '^SKIPPED' <<<"$out")"
    return
  fi
  # Whole-program tests also fail on the output ctest rejects (see tests/gpu/exit/).
  if [[ $rc -eq 0 && $pass == whole-program* ]] &&
     grep -qE 'cudamem:|terminate called|Segmentation fault|Aborted' <<<"$out"; then
    rc=1
  fi
  if [[ $rc -eq 0 ]]; then
    line "$name" "$pass" PASS "rc=0 $summary"
    return
  fi
  failed=1
  line "$name" "$pass" FAIL "rc=$rc $summary"
  if [[ $rc -eq 99 ]]; then
    grep -E '^=========' <<<"$out" | head -80 | sed -e 's/^/    /'
  else
    tail -n 40 <<<"$out" | sed -e 's/^/    /'
  fi
}

# cases EXE FILTER: the names of EXE's test cases that FILTER selects, one per line.
# Catch2's listing exits with the number of names, so its status means nothing here.
cases() {
  { "$1" --list-test-names-only "$2" 2>/dev/null || true; } | grep -v '^SKIPPED' | grep .
}

shopt -s nullglob

# --- Catch2 test binaries ----------------------------------------------------------------------
# The C API's GPU test lives beside its library (capi/tests).
for exe in "$build"/tests/gpu_* "$build"/capi/tests/capi_gpu_*; do
  [[ -f $exe && -x $exe ]] || continue
  name=$(basename "$exe")
  listing=$("$exe" --list-test-names-only 2>&1)
  if grep -q '^SKIPPED' <<<"$listing"; then  # no usable device: gpu_main exits 77
    skipped=1
    line "$name" "-" SKIP "$(grep -m1 '^SKIPPED' <<<"$listing")"
    continue
  fi

  if ! has_tool memcheck; then
    :
  elif cases "$exe" "$strict_filter" >/dev/null; then
    run_pass "$name" "pass 1 (strict)" --tool memcheck --leak-check full -- "$exe" "$strict_filter"
  else
    line "$name" "pass 1 (strict)" "-" "no untagged test cases"
  fi

  tagged=0
  if has_tool memcheck && cases "$exe" "$error_only_filter" >/dev/null; then
    tagged=1
    run_pass "$name" "pass 2 [expected-api-error]" --tool memcheck --leak-check full \
      --report-api-errors no -- "$exe" "$error_only_filter"
  fi
  if has_tool memcheck && cases "$exe" "$leak_only_filter" >/dev/null; then
    tagged=1
    run_pass "$name" "pass 2 [expected-leak]" --tool memcheck --leak-check no \
      -- "$exe" "$leak_only_filter"
  fi
  if has_tool memcheck && cases "$exe" "$both_filter" >/dev/null; then
    tagged=1
    run_pass "$name" "pass 2 [both tags]" --tool memcheck --leak-check no \
      --report-api-errors no -- "$exe" "$both_filter"
  fi
  if has_tool memcheck && [[ $tagged -eq 0 ]]; then
    line "$name" "pass 2" "-" "no tagged test cases"
  fi
  for tool in initcheck racecheck synccheck; do
    if has_tool "$tool"; then
      filter=$not_free_memory
      [[ $tool == initcheck ]] && filter=$not_free_memory_or_peer_copy
      run_pass "$name" "$tool" --tool "$tool" --report-api-errors no -- "$exe" "$filter"
    fi
  done
done

# --- whole-program tests: their own main(), run as they are -------------------------------------
# The exit test keeps owners in static objects on purpose: those destroyed after the CUDA runtime
# has begun to unload cannot free (the driver reclaims the memory with the process), and that is
# exactly the situation under test. So memcheck checks its accesses and API errors, not leaks.
for exe in "$build"/tests/gpu/exit/gpu_*; do
  [[ -f $exe && -x $exe ]] || continue
  for tool in $tools; do
    run_pass "$(basename "$exe")" "whole-program $tool" --tool "$tool" --leak-check no -- "$exe"
  done
done

# --- examples: each a whole program; their raw halves fail on purpose -----------------------------
# example_expects NAME: what the example provokes on purpose (api-error, leak, both or none).
example_expects() {
  case $1 in
    leak_on_exception | leaked_context) echo leak ;;   # the raw way leaks device memory
    fragmentation | explain_oom) echo api-error ;;      # raw cudaMalloc / a pool run out
    in_kernel_heap) echo api-error ;;  # restoring a heap size CUDA has fixed: refused, on purpose
    nccl_allreduce) echo api-error ;;  # ncclMemAlloc tries fabric handles first: refused without IMEX
    *) echo none ;;
  esac
}
# memcheck_only NAME: examples whose demonstration the other tools change, like [free-memory]:
# two measure the device's free memory; stream_ordered shows a race between streams, which
# initcheck's serialised kernels never let happen (its raw half then proves nothing and fails).
# nccl_allreduce: its kernels are NCCL's (ranks synchronise through flags in memory), not
# cudamem's; memcheck checks what the example and its pools do with memory.
memcheck_only() {
  case $1 in
    leak_on_exception | leaked_context | stream_ordered | nccl_allreduce) return 0 ;;
    *) return 1 ;;
  esac
}
# no_initcheck NAME: examples that copy pool memory between GPUs with peer access on, which
# initcheck cannot run (see [peer-copy] above). Skipped whatever the number of GPUs (with one,
# multi_gpu makes no such copy, and initcheck passed it on the H100 before this rule).
no_initcheck() {
  [[ $1 == multi_gpu ]]
}
for exe in "$build"/examples/*; do
  [[ -f $exe && -x $exe ]] || continue
  name=example.$(basename "$exe")
  expects=$(example_expects "$(basename "$exe")")
  for tool in $tools; do
    if [[ $tool != memcheck ]] && memcheck_only "$(basename "$exe")"; then
      line "$name" "$tool ($expects)" "-" "memcheck only: the demonstration measures the device"
      continue
    fi
    if [[ $tool == initcheck ]] && no_initcheck "$(basename "$exe")"; then
      line "$name" "$tool ($expects)" "-" "not under initcheck: peer copies of pool memory"
      continue
    fi
    options=(--tool "$tool")
    if [[ $tool == memcheck ]]; then
      if [[ $expects == leak || $expects == both ]]; then
        options+=(--leak-check no)
      else
        options+=(--leak-check full)
      fi
    fi
    if [[ $tool != memcheck || $expects == api-error || $expects == both ]]; then
      options+=(--report-api-errors no)
    fi
    run_pass "$name" "$tool ($expects)" "${options[@]}" -- "$exe"
  done
done

if [[ $ran -eq 0 && $skipped -eq 0 ]]; then
  echo "sanitize.sh: no GPU test binaries under $build/tests" >&2
  exit 2
fi
if [[ $failed -ne 0 ]]; then
  exit 1
fi
if [[ $skipped -ne 0 ]]; then
  exit 77
fi
exit 0
