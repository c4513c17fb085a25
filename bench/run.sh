#!/usr/bin/env bash
# bench/run.sh - run every pshard benchmark and print a summary.
#
#   bench/run.sh [BUILD_DIR]        (default: build; configure and build it first)
#
# Environment: QUICK=1 runs reduced sizes (a smoke run of a few minutes, not the
# figures of docs/benchmarks.md); OUT=DIR keeps each benchmark's full output (default
# a temporary directory, printed at the end); ONLY="dense sparse" runs a subset of
# dense sparse sparse_unix memory sync ctr (the default), or adds ckpt (bench_ckpt: about
# 2.5 minutes and up to 5 GB of disk at 1 GB of state, so it runs only when named).
# Needs: redis-server (bench_sparse's peer), openmpi-bin + libopenmpi-dev (bench_sync's
# peer); both are in the Makefile's package list.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
OUT="${OUT:-$(mktemp -d /tmp/pshard-bench-results.XXXXXX)}"
ONLY="${ONLY:-dense sparse sparse_unix memory sync ctr}"
mkdir -p "$OUT"

cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j "$(nproc)" --target bench_dense bench_sparse bench_memory bench_sync bench_ckpt pshard_cli >/dev/null
# Optional: the MPI peer (needs libopenmpi-dev) and the click-through programs.
cmake --build "$BUILD" -j "$(nproc)" --target bench_mpi_allreduce >/dev/null 2>&1 ||
  echo "note: bench_mpi_allreduce not built (no MPI compiler): bench_sync prints no MPI figures" >&2
cmake --build "$BUILD" -j "$(nproc)" --target bench_ctr ctr_gen ctr_worker >/dev/null 2>&1 ||
  ONLY="${ONLY/ctr/}"

B="$BUILD/bench"
export PSHARD_BIN="$BUILD/pshard"

echo "== machine"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p') x $(nproc); memory: $(free -g | awk '/^Mem:/{print $2}') GiB;" \
  "kernel $(uname -r); load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "git: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo none)$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' (modified tree)')"

run() { # name command...
  local name="$1"; shift
  case " $ONLY " in *" $name "*) ;; *) return 0 ;; esac
  echo
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT/$name.txt"
  echo "($name took $((SECONDS - t0)) s)"
}

if [ "${QUICK:-0}" = 1 ]; then
  run dense  "$B/bench_dense" --sizes 4K,1M,64M --reps-scale 0.2
  run sparse "$B/bench_sparse" --rows 1000000 --dims 1,32 --batches 1000,100000 --seconds 0.5
  run sparse_unix "$B/bench_sparse" --rows 1000000 --dims 1 --batches 1000 --seconds 0.5 --transport auto
  run memory "$B/bench_memory" --rows 1000000
  run sync   "$B/bench_sync" --floats 1M --workers 2 --steps 5
  run ctr    "$B/bench_ctr" --rows 400000 --workers 1,2 --servers 1 --data "$OUT/ctr-data"
  run ckpt   "$B/bench_ckpt" --gb 0.1 --rounds 1
else
  # Five repeats (rather than the programs' default three) for the two whose ratios move
  # most from run to run on a small VM: 1 MiB over TCP, and 1M-float sync rounds.
  run dense  "$B/bench_dense" --rounds 5
  run sparse "$B/bench_sparse"
  # The same-host pairing: pshard over AF_UNIX (its default there), Redis on a unix socket.
  run sparse_unix "$B/bench_sparse" --dims 1,8,128 --batches 1000,10000 --transport auto
  run memory "$B/bench_memory"
  run sync   "$B/bench_sync" --runs 5
  run ctr    "$B/bench_ctr"
  run ckpt   "$B/bench_ckpt" --gb 1 --rounds 3
fi

echo
echo "== summary (rows with a target; full output in $OUT)"
for f in dense sparse sparse_unix memory sync ckpt; do
  [ -f "$OUT/$f.txt" ] || continue
  grep -E 'target|<=|>=' "$OUT/$f.txt" | grep -v '^#' | sed "s/^/$f: /" || true
done
if [ -f "$OUT/ctr.txt" ]; then sed -n '/examples\/s/,$p' "$OUT/ctr.txt" | sed 's/^/ctr: /'; fi
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
