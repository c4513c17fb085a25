#!/usr/bin/env bash
# run.sh - `make fuzz`: fuzz every target for a bounded time, keep what it found, report.
#
# Usage: tests/fuzz/run.sh [BUILD_DIR]   (FUZZ_SECONDS per target, default 60;
#                                         FUZZ_TARGETS to run a subset, in this order)
# For each target t: builds the libFuzzer binary (ASan, UBSan) and its coverage build,
# fuzzes for FUZZ_SECONDS from corpus/t into a scratch directory, merges what adds
# coverage into corpus/t (libFuzzer -merge=1: the committed corpus only grows by inputs
# that reach something new), writes any crash, timeout or out-of-memory input into
# crashes/t/ (replayed by ctest's fuzz.t_replay from then on), and measures line
# coverage of the target's product sources over the merged corpus (llvm-profdata,
# llvm-cov). Prints exec counts, exec/s, libFuzzer's cov/ft and the line coverage per
# target. Exit status 1 if any target found a crash.
set -u -o pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-build}
case $build in /*) ;; *) build=$root/$build ;; esac
secs=${FUZZ_SECONDS:-60}
targets=${FUZZ_TARGETS:-"frame conn config spec ckpt auth"}
work=$build/fuzz-run

# The product sources whose lines each target is meant to reach.
sources() {
  case $1 in
  frame) echo src/proto/frame.c src/proto/msg.c src/proto/auth.c ;;
  conn) echo src/net/conn.c src/proto/frame.c ;;
  config) echo src/common/config.c ;;
  spec) echo src/proto/spec.c ;;
  ckpt) echo src/store/ckpt_read.c src/store/ckpt.c ;;
  auth) echo src/proto/auth.c ;;
  esac
}

for tool in clang llvm-profdata llvm-cov; do
  if ! command -v $tool >/dev/null; then
    echo "run.sh: $tool not found (make fuzz installs clang, llvm and libclang-rt-dev)" >&2
    exit 2
  fi
done

n=0
for t in $targets; do n=$((n + 1)); done
echo "== fuzzing $n targets ($targets) for ${secs}s each: about $((n * secs / 60)) min $((n * secs % 60)) s of fuzzing, plus building, merging and coverage"

# Forget an earlier configure's verdict on clang (it may have been installed since).
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -UPSHARD_CLANG -UPSHARD_CLANG_LIBFUZZER >/dev/null || exit 2
cmake --build "$build" --target fuzzers fuzzers-cov -j 2 >/dev/null || {
  echo "run.sh: building the fuzzers failed (cmake --build $build --target fuzzers)" >&2
  exit 2
}
bin=$build/tests/fuzz
for t in $targets; do
  if [ ! -x "$bin/fuzz_$t" ] || [ ! -x "$bin/fuzz_${t}_cov" ]; then
    echo "run.sh: $bin/fuzz_$t was not built: does clang link -fsanitize=fuzzer?" >&2
    exit 2
  fi
done

start=$(date +%s)
summary=()
crashed=0
for t in $targets; do
  corpus=$here/corpus/$t
  crashes=$here/crashes/$t
  mkdir -p "$corpus" "$crashes"
  seeds=("$corpus")
  [ "$t" = conn ] && seeds+=("$here/corpus/frame")
  dict=()
  [ -f "$here/$t.dict" ] && dict=("-dict=$here/$t.dict")
  w=$work/$t
  rm -rf "$w"
  mkdir -p "$w/new" "$w/prof"
  before=$(find "$corpus" -type f ! -name '.*' | wc -l)
  ncrash_before=$(find "$crashes" -type f ! -name '.*' | wc -l)

  echo "== $t: fuzzing for ${secs}s"
  ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} "$bin/fuzz_$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$crashes/" "${dict[@]}" "$w/new" "${seeds[@]}" >"$w/fuzz.log" 2>&1
  rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$w/fuzz.log" | tail -1)
  eps=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$w/fuzz.log" | tail -1)
  last=$(grep -E '^#[0-9]+' "$w/fuzz.log" | grep ' cov: ' | tail -1)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  ncrash=$(($(find "$crashes" -type f ! -name '.*' | wc -l) - ncrash_before))
  if [ $rc -ne 0 ] || [ $ncrash -gt 0 ]; then
    crashed=1
    echo "!! $t: libFuzzer stopped with status $rc; new inputs in $crashes: $ncrash (log: $w/fuzz.log)"
    grep -E '^(==[0-9]+==ERROR|SUMMARY|fuzz_[a-z]+: property)' "$w/fuzz.log" | head -5
  fi

  # What is new and adds coverage goes into the committed corpus.
  "$bin/fuzz_$t" -merge=1 "${dict[@]}" "$corpus" "$w/new" >"$w/merge.log" 2>&1 ||
    echo "!! $t: merging failed (log: $w/merge.log)"
  after=$(find "$corpus" -type f ! -name '.*' | wc -l)

  # Line coverage over the merged corpus, by the coverage build (no sanitizers).
  LLVM_PROFILE_FILE="$w/prof/%p.profraw" "$bin/fuzz_${t}_cov" -runs=0 "$corpus" "${seeds[@]:1}" >"$w/cov.log" 2>&1
  lines=-
  if llvm-profdata merge -sparse "$w"/prof/*.profraw -o "$w/cov.profdata" 2>"$w/profdata.log"; then
    (cd "$root" && llvm-cov report "$bin/fuzz_${t}_cov" -instr-profile="$w/cov.profdata" $(sources $t)) >"$w/cov.txt" 2>&1
    # The TOTAL line: ... Lines Missed Cover ...; the line cover is the third percentage.
    lines=$(awk '/^TOTAL/ { n = 0; for (i = 2; i <= NF; i++) if ($i ~ /%$/) { n++; if (n == 3) print $(i-2) - $(i-1) "/" $(i-2) " (" $i ")" } }' "$w/cov.txt")
    # Per file: its lines, those missed, the cover.
    awk -v root="$root/" '$1 ~ /[.]c$/ || $1 == "TOTAL" { f = $1; sub(root, "", f); printf "   %-24s lines %5s  missed %5s  %s\n", f, $8, $9, $10 }' "$w/cov.txt"
  fi
  line=$(printf '%-7s %10s execs %8s exec/s  cov %5s  ft %6s  corpus %4s -> %-4s  lines %s  crashes %s' \
         "$t" "${execs:--}" "${eps:--}" "${cov:--}" "${ft:--}" "$before" "$after" "${lines:--}" "$ncrash")
  echo "$line"
  summary+=("$line")
done

echo "== fuzzing summary (${secs}s per target, $(( $(date +%s) - start ))s in all; lines: reached/total of the target's sources)"
for l in "${summary[@]}"; do echo "$l"; done
if [ $crashed -ne 0 ]; then
  echo "== crashes were found: their inputs are in tests/fuzz/crashes/<target>/; fix them and commit the inputs"
  exit 1
fi
