#!/usr/bin/python3
"""bench/ckpt_incr.py - bytes written by incremental checkpoints against whole ones, on
the click-through workload.

Trains examples/ctr (sparse logistic regression, FTRL on the servers: a sparse table of
dim 1 with FTRL's z and n, 12 bytes a row) under `pshard run -s S -w K --mode sync` with
a checkpoint every --every clocks (PSHARD_CHECKPOINT_EVERY: rank 0 asks the scheduler,
without waiting), twice on the same data, interleaved --repeats times:

  whole        --checkpoint-full-every 1: every checkpoint holds every row
  incremental  --checkpoint-full-every --full-every: one in N whole, the others only
               the rows changed since the checkpoint before (Check-N-Run's scheme)

and reports the data bytes of each checkpoint (the servers' .psck files; the manifests
are a few hundred bytes) by its clock, the ratio whole / incremental at each clock, over
all checkpoints after the first, and over those of the epochs after the first (--epochs,
2): the steady state of a model that has seen its data once, as a production model
checkpointed every few minutes has. The data's feature ids follow the Criteo-like
field distributions of examples/ctr/ctr_gen (a few very frequent values per field and
a long tail: Zipf-like), so a step touches the head again and again and a little of the
tail. The click-through model is small here (--rows and --max-vocab set it); the figure
that carries over to a production table is the fraction of rows an interval touches.

Usage:  /usr/bin/python3 bench/ckpt_incr.py [--build build] [--rows 1M] [--every 25]
        [--full-every 8] [--servers 2] [--workers 2] [--repeats 1]
The output ends with a Markdown table to paste into docs/benchmarks.md.
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.environ.get("PSHARD_BUILD", os.path.join(ROOT, "build")))
    ap.add_argument("--data", default="/tmp/pshard-bench/ctr-incr", help="generated data (not in the tree)")
    ap.add_argument("--rows", default="1M", help="ctr_gen --rows (1M)")
    ap.add_argument("--max-vocab", type=int, default=0, help="ctr_gen --max-vocab (0: no cap)")
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--every", type=int, default=25, help="clocks between checkpoints (25)")
    ap.add_argument("--full-every", type=int, default=8, help="one whole checkpoint in N (8)")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    return ap.parse_args()


def ensure_data(a):
    if os.path.exists(os.path.join(a.data, "meta.txt")):
        return
    gen = os.path.join(a.build, "examples", "ctr", "ctr_gen")
    cmd = [gen, "--rows", a.rows, "--test-rows", "10k", "--parts", str(2 * a.workers), "--format", "bin",
           "--out", a.data, "--quiet"]
    if a.max_vocab:
        cmd += ["--max-vocab", str(a.max_vocab)]
    print("# generating data:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def header_of(ckdir):
    """(clock, base) from a manifest's HEADER (format 2: payload offsets 32 and 48)."""
    with open(os.path.join(ckdir, "MANIFEST"), "rb") as f:
        b = f.read(16 + 56)
    return (int.from_bytes(b[16 + 32:16 + 40], "little", signed=True), int.from_bytes(b[16 + 48:16 + 56], "little"))


def run(a, full_every):
    """One training run; {clock: (data bytes, an increment?)} of its checkpoints."""
    ck = tempfile.mkdtemp(prefix="pshard-bench-incr-")
    try:
        cmd = [os.path.join(a.build, "pshard"), "run", "-s", str(a.servers), "-w", str(a.workers), "--replicas", "1", "--mode", "sync",
               "--progress-ms", "0", "--checkpoint-dir", ck, "--checkpoint-every", str(a.every),
               "--checkpoint-keep", "1000000", "--checkpoint-full-every", str(full_every), "--",
               os.path.join(a.build, "examples", "ctr", "ctr_worker"), "--data", a.data, "--epochs", str(a.epochs),
               "--batch", str(a.batch), "--quiet"]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
        if p.returncode:
            sys.exit("bench/ckpt_incr.py: the job failed:\n" + p.stdout[-3000:])
        sizes = {}
        for e in os.listdir(ck):
            d = os.path.join(ck, e)
            if not re.fullmatch(r"ckpt-\d+", e) or not os.path.exists(os.path.join(d, "MANIFEST")):
                continue
            clock, base = header_of(d)
            sizes[clock] = (sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".psck")),
                            base != 0)
        return sizes
    finally:
        shutil.rmtree(ck, ignore_errors=True)


def main():
    a = parse_args()
    ensure_data(a)
    whole, incr = {}, {}
    for _ in range(a.repeats):
        for c, (b, _) in run(a, 1).items():
            whole.setdefault(c, []).append(b)
        for c, (b, inc) in run(a, a.full_every).items():
            incr.setdefault(c, []).append((b, inc))
    clocks = sorted(set(whole) & set(incr))
    if len(clocks) < 2:
        sys.exit("bench/ckpt_incr.py: fewer than two checkpoints at the same clocks (more --rows, or a smaller --every)")
    rows = float(a.rows.replace("k", "e3").replace("M", "e6").replace("G", "e9"))
    epoch = int(rows / (a.batch * a.workers))  # clocks of one epoch
    print(f"# ctr: {a.rows} rows x {a.epochs} epochs (an epoch is {epoch} clocks), batch {a.batch}, S={a.servers} "
          f"K={a.workers}, a checkpoint asked for every {a.every} clocks (one still being written when the next is "
          f"due makes that one skipped); incremental: one whole in {a.full_every}; {a.repeats} run(s) each")
    print(f"{'clock':>7} {'whole B':>12} {'incremental B':>14} {'kind':>10} {'whole/incr':>11}")
    steady, early = [], []
    for c in clocks:
        w = statistics.median(whole[c])
        n = statistics.median(b for b, _ in incr[c])
        inc = all(i for _, i in incr[c])
        print(f"{c:>7} {w:>12.0f} {n:>14.0f} {'increment' if inc else 'whole':>10} {w / n:>10.2f}x")
        if inc:
            (steady if c > epoch else early).append((w, n))
    if not steady:
        sys.exit("bench/ckpt_incr.py: no increment after the first epoch (more --epochs)")
    W = statistics.median(w for w, _ in steady)
    I = statistics.median(n for _, n in steady)
    N = a.full_every
    cycle = (W + (N - 1) * I) / N
    print(f"\nafter the first epoch ({len(steady)} increments at clocks both runs checkpointed): a whole checkpoint "
          f"{W / 1e6:.2f} MB, an increment {I / 1e6:.2f} MB (medians): {W / I:.2f}x fewer bytes per increment;")
    print(f"with one whole checkpoint in {N}: {cycle / 1e6:.2f} MB per checkpoint on average, {W / cycle:.2f}x fewer "
          f"than whole ones (Check-N-Run, NSDI'22: 6-17x on production models)")
    print(f"\n| workload (after the first epoch) | whole checkpoint | increment | per increment | "
          f"one whole in {N}, average |")
    print("|---|---|---|---|---|")
    print(f"| ctr {a.rows} rows, S={a.servers} K={a.workers}, every {a.every} clocks | {W / 1e6:.2f} MB | "
          f"{I / 1e6:.2f} MB | {W / I:.2f}x | {W / cycle:.2f}x |")


if __name__ == "__main__":
    main()
