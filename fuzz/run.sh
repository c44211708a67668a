#!/usr/bin/env bash
# Runs every fuzz target for a bounded time (seconds per target, default 60).
# Exits non-zero on a finding; libFuzzer then writes the input to
# fuzz/artifacts/<target>/, which becomes a regression case once fixed:
# copy it to fuzz/corpus/<target>/regression-<name> and commit it.
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:-60}"
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked --version 0.13.2
fi
# cargo-fuzz needs nightly compiler flags; the stable toolchain accepts them so.
export RUSTC_BOOTSTRAP=1
mkdir -p target
for target in callback enqueue; do
  echo "fuzz: $target for ${secs} s"
  log="target/fuzz-$target.log"
  status=0
  cargo fuzz run -O -a "$target" "corpus/$target" -- \
    -max_total_time="$secs" -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1 || status=$?
  grep -E "^(Done|stat::number_of_executed_units|stat::peak_rss_mb)|SUMMARY|panicked|Test unit written" "$log" || true
  if [ "$status" -ne 0 ]; then
    tail -n 40 "$log"
    echo "fuzz: $target found a failing input (exit $status); see $log" >&2
    exit 1
  fi
done
