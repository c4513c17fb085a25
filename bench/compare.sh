#!/usr/bin/env bash
# bench/compare.sh - the same benchmark figures for two revisions, measured alternately.
#
#   bench/compare.sh OLD_REV NEW_REV
#
# Builds each revision (Release) in a temporary git worktree under /tmp, then runs R
# rounds; in each round every program runs once for each revision, the two back to back
# (old first in odd rounds, new first in even ones, so a slow drift of the machine
# falls on both alike). The figures:
#
#   bench_dense  --sizes 4K,1M,64M --paths tcp --rounds 1      (4 KiB latency; 1 and 64 MiB
#                                                              GB/s; each against raw TCP)
#   bench_sync   --floats 1M --workers 4 --layouts Kcs --runs 1 --no-mpi
#                                                             (sync round, K = 4, colocated
#                                                              servers, ps_alloc buffers)
#   bench_sparse --rows 10000000 --big-only                    (10M keys of dim 1 in one call)
#
# It prints the machine line as bench/run.sh does, then per figure the median (and the
# range) over the rounds for the old and the new revision, with units, and new/old.
# Each revision is measured with its own bench/ programs; the script says so when they
# differ between the two.
#
# Environment: ROUNDS=R (5); QUICK=1 checks the script end to end in a few minutes
# (1 round, 4 KiB / 1 MiB / 4 MiB, 256K floats, 1M keys: not the figures of
# docs/benchmarks.md); OUT=DIR keeps every program's output (default: a new directory
# under /tmp, printed at the end); JOBS=N build jobs (2); RUN_TIMEOUT=S bounds each
# program run (1200 s). The worktrees and their builds are removed on exit.
set -euo pipefail

usage() {
  echo "usage: bench/compare.sh OLD_REV NEW_REV   (env: ROUNDS, QUICK, OUT, JOBS, RUN_TIMEOUT)" >&2
  exit 2
}
[ $# -eq 2 ] || usage

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
QUICK="${QUICK:-0}"
if [ "$QUICK" = 1 ]; then ROUNDS="${ROUNDS:-1}"; else ROUNDS="${ROUNDS:-5}"; fi
JOBS="${JOBS:-2}"
RUN_TIMEOUT="${RUN_TIMEOUT:-1200}"
case "$ROUNDS" in '' | *[!0-9]* | 0) echo "compare.sh: ROUNDS must be a positive integer, not '$ROUNDS'" >&2; exit 2 ;; esac
case "$JOBS" in '' | *[!0-9]* | 0) echo "compare.sh: JOBS must be a positive integer, not '$JOBS'" >&2; exit 2 ;; esac
case "$RUN_TIMEOUT" in '' | *[!0-9]* | 0) echo "compare.sh: RUN_TIMEOUT must be a positive integer, not '$RUN_TIMEOUT'" >&2; exit 2 ;; esac

resolve() { # rev -> full commit hash, or a clear error
  git -C "$ROOT" rev-parse --verify --quiet "$1^{commit}" ||
    { echo "compare.sh: '$1' is not a commit of $ROOT" >&2; exit 2; }
}
OLD="$(resolve "$1")"
NEW="$(resolve "$2")"

OUT="${OUT:-$(mktemp -d /tmp/pshard-compare-results.XXXXXX)}"
mkdir -p "$OUT"
WT="$(mktemp -d /tmp/pshard-compare.XXXXXX)"
ADDED=()
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
  local w
  for w in "${ADDED[@]+"${ADDED[@]}"}"; do
    git -C "$ROOT" worktree remove --force "$w" >/dev/null 2>&1 || true
  done
  git -C "$ROOT" worktree prune >/dev/null 2>&1 || true
  rm -rf "$WT"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---- build both revisions
for side in old new; do
  if [ "$side" = old ]; then rev="$OLD"; else rev="$NEW"; fi
  dir="$WT/$side"
  git -C "$ROOT" worktree add --detach --quiet "$dir" "$rev"
  ADDED+=("$dir")
  echo "building $side ($(git -C "$ROOT" log -1 --format='%h %s' "$rev"))" >&2
  if ! { cmake -S "$dir" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release &&
         cmake --build "$dir/build" -j "$JOBS" --target bench_dense bench_sparse bench_sync pshard_cli; } \
       >"$OUT/build-$side.log" 2>&1; then
    echo "compare.sh: building $side ($rev) failed; the last lines of $OUT/build-$side.log:" >&2
    tail -n 20 "$OUT/build-$side.log" >&2
    exit 1
  fi
done
if ! git -C "$ROOT" diff --quiet "$OLD" "$NEW" -- bench/; then
  echo "note: bench/ differs between the two revisions; each is measured with its own programs" >&2
fi

# ---- the runs
if [ "$QUICK" = 1 ]; then
  DENSE=(--sizes "4K,1M,4M" --paths tcp --rounds 1 --reps-scale 0.2)
  SYNC=(--floats 256K --workers 4 --layouts Kcs --runs 1 --steps 5 --no-mpi)
  SPARSE=(--rows 1000000 --big-only)
else
  DENSE=(--sizes "4K,1M,64M" --paths tcp --rounds 1)
  SYNC=(--floats 1M --workers 4 --layouts Kcs --runs 1 --no-mpi)
  SPARSE=(--rows 10000000 --big-only)
fi

{
  echo "== machine"
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p') x $(nproc); memory: $(free -g | awk '/^Mem:/{print $2}') GiB;" \
    "kernel $(uname -r); load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "old: $(git -C "$ROOT" log -1 --format='%h %s' "$OLD")"
  echo "new: $(git -C "$ROOT" log -1 --format='%h %s' "$NEW")"
  echo "rounds: $ROUNDS$([ "$QUICK" = 1 ] && echo ' (QUICK=1: reduced sizes, not comparable with docs/benchmarks.md)')"
} | tee "$OUT/machine.txt"

FAILED=0
run_one() { # side program round args...
  local side="$1" prog="$2" round="$3"; shift 3
  local b="$WT/$side/build"
  local log="$OUT/$side-$prog-$round.txt"
  echo "round $round: $side $prog $*" >&2
  if ! PSHARD_BIN="$b/pshard" timeout --kill-after=10 "$RUN_TIMEOUT" "$b/bench/$prog" "$@" >"$log" 2>&1; then
    echo "compare.sh: $side $prog failed in round $round (see $log)" >&2
    FAILED=1
  fi
}

for ((r = 1; r <= ROUNDS; r++)); do
  if ((r % 2)); then order=(old new); else order=(new old); fi
  for prog in bench_dense bench_sync bench_sparse; do
    case "$prog" in
      bench_dense) args=("${DENSE[@]}") ;;
      bench_sync) args=("${SYNC[@]}") ;;
      bench_sparse) args=("${SPARSE[@]}") ;;
    esac
    for side in "${order[@]}"; do run_one "$side" "$prog" "$r" "${args[@]}"; done
  done
done

# ---- the summary: medians over the rounds of each figure, per revision
echo
/usr/bin/python3 - "$OUT" "$ROUNDS" "${SYNC[1]}" <<'EOF' | tee "$OUT/summary.txt"
import re
import statistics
import sys

out, rounds, sync_floats = sys.argv[1], int(sys.argv[2]), sys.argv[3]

# (key, unit, better, label), in the order printed.
figures = []
values = {}  # (side, key) -> [one value per round]


def add(side, key, unit, better, label, value):
    if (key, unit, better, label) not in figures:
        figures.append((key, unit, better, label))
    values.setdefault((side, key), []).append(value)


DENSE = re.compile(r"^tcp\s+(2 calls|push_pull)\s+(\d+)(KiB|MiB)\s+(\S+)\s+\S+\s+(\S+)\s+(\S+)\s+(\S+)")
SYNC = re.compile(r"^\s*(\d+)\s+(\d+)cs\s+[\d.]+M\s+([\d.]+)\s")
SPARSE = re.compile(r"^pshard\s+(pull|push)\s+1\s+(\d+) one call: median ([\d.]+) s")


def read(side, prog, r):
    try:
        with open(f"{out}/{side}-{prog}-{r}.txt") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        m = DENSE.match(line)
        if prog == "bench_dense" and m:
            calls, n, unit, med_us, gbps, _limit, ratio = m.groups()
            size = f"{n} {unit}"
            if unit == "KiB" and int(n) <= 4:
                add(side, ("dense", calls, size, "us"), "us", "lower",
                    f"bench_dense tcp {size} {calls}: median time", float(med_us))
                add(side, ("dense", calls, size, "rtt"), "x raw RTT", "lower",
                    f"bench_dense tcp {size} {calls}: vs raw TCP round trip", float(ratio.rstrip("x")))
            else:
                add(side, ("dense", calls, size, "gbps"), "GB/s", "higher",
                    f"bench_dense tcp {size} {calls}: throughput", float(gbps))
                add(side, ("dense", calls, size, "ratio"), "of raw TCP", "higher",
                    f"bench_dense tcp {size} {calls}: vs raw TCP stream", float(ratio))
        m = SYNC.match(line)
        if prog == "bench_sync" and m:
            k, _s, ms = m.groups()
            add(side, ("sync", k), "ms", "lower",
                f"bench_sync {sync_floats} floats K = {k} Kcs: round", float(ms))
        m = SPARSE.match(line)
        if prog == "bench_sparse" and m:
            op, n, sec = m.groups()
            keys = f"{int(n) / 1e6:g}M"
            add(side, ("sparse", op), "s", "lower",
                f"bench_sparse {keys} keys dim 1: {op}, one call", float(sec))


for prog in ("bench_dense", "bench_sync", "bench_sparse"):
    for r in range(1, rounds + 1):
        for side in ("old", "new"):
            read(side, prog, r)


def cell(v):
    if not v:
        return "n/a"
    med = statistics.median(v)
    fmt = (lambda x: f"{x:.1f}") if med >= 10 else (lambda x: f"{x:.3f}")
    return fmt(med) + (f" ({fmt(min(v))}-{fmt(max(v))})" if len(v) > 1 else "")


rows = [("figure", "unit", "old median (range)", "new median (range)", "new/old", "better")]
missing = False
for key, unit, better, label in figures:
    o, n = values.get(("old", key), []), values.get(("new", key), [])
    missing |= len(o) != rounds or len(n) != rounds
    ratio = f"{statistics.median(n) / statistics.median(o):.3f}" if o and n and statistics.median(o) else "n/a"
    rows.append((label, unit, cell(o), cell(n), ratio, better))
if not figures:
    rows.append(("(no figure found in the outputs)", "", "", "", "", ""))
    missing = True
w = [max(len(r[i]) for r in rows) for i in range(6)]
print("== figures: median over %d round%s per revision" % (rounds, "" if rounds == 1 else "s"))
for r in rows:
    print("  ".join(c.ljust(w[i]) if i in (0, 1, 5) else c.rjust(w[i]) for i, c in enumerate(r)).rstrip())
if missing:
    print("note: some rounds gave no figure (a failed run, or a program without that option)")
EOF
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "outputs: $OUT"
exit "$FAILED"
