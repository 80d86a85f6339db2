#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each (default 30) and fails if any of them finds a
# crash: a panic, a failed property, a sanitizer report, a timeout or running out of
# memory. Prints, per target, the inputs it ran and how long it took.
#
#   bash fuzz/run.sh [SECONDS]
#
# Installs cargo-fuzz if it is missing. Builds with the nightly toolchain and
# AddressSanitizer when `cargo +nightly` works; otherwise with the pinned stable toolchain,
# RUSTC_BOOTSTRAP=1 and no sanitizer (coverage-guided fuzzing and every assertion still
# work; only memory errors in C code would go unseen, and Bulwark has no unsafe code).
set -euo pipefail
cd "$(dirname "$0")"

seconds="${1:-30}"
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 [SECONDS]  (SECONDS a whole number above 0)" >&2
  exit 2
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "--- installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

# cargo-fuzz chooses its own target folder (fuzz/target); a CARGO_TARGET_DIR meant for the
# workspace would mix the instrumented build into it.
unset CARGO_TARGET_DIR

if cargo +nightly --version >/dev/null 2>&1; then
  cargo=(cargo +nightly)
  sanitizer=address
else
  export RUSTC_BOOTSTRAP=1
  cargo=(cargo)
  sanitizer=none
fi
echo "--- $("${cargo[@]}" --version), sanitizer: $sanitizer"

targets=()
while IFS= read -r target; do
  targets+=("$target")
done < <("${cargo[@]}" fuzz list)

echo "--- building ${#targets[@]} fuzz targets"
start=$SECONDS
"${cargo[@]}" fuzz build --sanitizer "$sanitizer"
echo "built in $((SECONDS - start)) s"

failed=()
for target in "${targets[@]}"; do
  # New inputs go to a scratch corpus under target/ (not committed); the seeds in
  # corpus/TARGET are read, never written.
  scratch="target/corpus/$target"
  log="target/logs/$target.log"
  mkdir -p "$scratch" "corpus/$target" "$(dirname "$log")"
  start=$SECONDS
  status=0
  "${cargo[@]}" fuzz run --sanitizer "$sanitizer" "$target" "$scratch" "corpus/$target" -- \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    >"$log" 2>&1 || status=$?
  took=$((SECONDS - start))
  # The log holds the inputs' bytes too: read it as text, and a missing count is no error.
  runs=$(grep -aEo 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -Eo '[0-9]+$' | tail -1 || true)
  if [[ $status -eq 0 ]]; then
    echo "$target: ${runs:-?} runs in $took s"
  else
    echo "$target: FAILED after ${runs:-?} runs in $took s (exit $status); the end of $log:"
    tail -n 40 "$log" | sed 's/^/    /'
    failed+=("$target")
  fi
done

if [[ ${#failed[@]} -gt 0 ]]; then
  echo "--- fuzzing found crashes in: ${failed[*]} (inputs in fuzz/artifacts/; see fuzz/README.md)"
  exit 1
fi
echo "--- fuzzing: ${#targets[@]} targets, no crash"
