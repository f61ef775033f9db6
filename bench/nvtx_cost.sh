#!/usr/bin/env bash
# What the pool's NVTX annotations (detail/nvtx.hpp) cost when no tool is attached: bench_pool
# (annotations compiled in, the default) and bench_pool_nvtx_off (-DCUDAMEM_NVTX=0) run in
# turns, ROUNDS times each, on pair_1MiB and random_256B-4MiB, the pool alone; prints each
# round's ns/op and, per trace, the median of the per-round differences (on - off).
#   bench/nvtx_cost.sh BUILD_DIR [ROUNDS (default 7)] [REPS per run (default 7)]
set -euo pipefail
build=${1:?usage: bench/nvtx_cost.sh BUILD_DIR [ROUNDS] [REPS]}
rounds=${2:-7}
reps=${3:-7}
on=$build/bench/bench_pool
off=$build/bench/bench_pool_nvtx_off
[[ -x $on && -x $off ]] || { echo "nvtx_cost.sh: build bench_pool and bench_pool_nvtx_off first" >&2; exit 2; }
pool_ns() {  # BINARY TRACE -> the pool's ns/op
  "$1" --only-pool --reps "$reps" --trace "$2" | awk -v t="$2" '$1 == t { print $2 }'
}
for trace in pair_1MiB random_256B-4MiB; do
  diffs=()
  for ((r = 1; r <= rounds; ++r)); do
    a=$(pool_ns "$on" "$trace")
    b=$(pool_ns "$off" "$trace")
    if [[ -z $a || -z $b ]]; then
      echo "nvtx_cost.sh: no pool figure for $trace (no GPU?)" >&2
      exit 69
    fi
    diffs+=("$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.2f", a - b }')")
    printf '%-18s round %d: annotations on %8s ns/op, off %8s ns/op\n' "$trace" "$r" "$a" "$b"
  done
  median=$(printf '%s\n' "${diffs[@]}" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')
  printf '%-18s median of %d per-round differences: %+.2f ns per operation (%+.2f ns per allocate+free pair)\n' \
    "$trace" "$rounds" "$median" "$(awk -v m="$median" 'BEGIN { print 2 * m }')"
done
