#!/usr/bin/python3
"""bench/modes.py - consistency models on the click-through example with a straggler.

Trains examples/ctr (sparse logistic regression, FTRL) under `pshard run` with S servers
and K workers, one of which (--slow-worker) is slowed F times (--slow-factor: it sleeps
F-1 times its own step time after every step), once per consistency mode, and reports
for each mode:

  examples/s       training examples processed by all workers / the slowest worker's
                   training time (examples whose pushes sync:M dropped are counted: they
                   were processed, not applied)
  time to target   seconds (rank 0's clock, from its start of training) until the first
                   periodic evaluation (--eval-every steps of rank 0, on --eval-rows test
                   rows) whose log-loss is <= --target
  final logloss    on the whole test set after the last epoch
  curve            the periodic evaluations: log-loss at fixed times, and how often it
                   went up from one evaluation to the next (noise)

Each figure is the median over --repeats runs; the modes are interleaved within a repeat
so that slow drifts of the machine hit every mode alike. The baseline is `sync` (BSP)
in the same run. The data set is generated once with examples/ctr/ctr_gen into --data
(default /tmp/pshard-bench/ctr-300k; not in the source tree).

Usage:  /usr/bin/python3 bench/modes.py [--build build] [--repeats 3] [--json FILE]
        (see --help for every knob; the defaults are the figures in docs/benchmarks.md)
The output ends with a Markdown section to paste into docs/benchmarks.md.
"""
import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EVAL_RE = re.compile(r"^\[worker (\d+)\] eval t=([\d.]+) examples=(\d+) logloss=([\d.]+) auc=([\d.]+)")
EPOCH_RE = re.compile(r"^\[worker (\d+)\] epoch (\d+): test logloss ([\d.]+)\s+auc ([\d.]+)")
TRAINED_RE = re.compile(r"^\[worker (\d+)\] trained on (\d+) examples in ([\d.]+) s")
FINISHED_RE = re.compile(r"^\[pshard\] all (\d+) workers finished in ([\d.]+) s")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.environ.get("PSHARD_BUILD", os.path.join(ROOT, "build")),
                    help="build directory with pshard and examples/ctr (default: build)")
    ap.add_argument("--data", default="/tmp/pshard-bench/ctr-300k", help="data set directory (generated if missing)")
    ap.add_argument("--rows", default="300k", help="train rows to generate (300k)")
    ap.add_argument("--test-rows", default="20k", help="test rows to generate (20k)")
    ap.add_argument("--parts", type=int, default=8, help="train partitions to generate (8)")
    ap.add_argument("--max-vocab", type=int, default=20000, help="ctr_gen --max-vocab (20000)")
    ap.add_argument("--servers", "-s", type=int, default=2)
    ap.add_argument("--workers", "-w", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--slow-worker", type=int, default=1, help="PSHARD_WORKER_INDEX of the slowed worker (1)")
    ap.add_argument("--slow-factor", type=float, default=3.0)
    ap.add_argument("--eval-every", type=int, default=20, help="rank 0 evaluates every N of its steps (20)")
    ap.add_argument("--eval-rows", type=int, default=5000, help="test rows per periodic evaluation (5000)")
    ap.add_argument("--target", type=float, default=0.450, help="target test log-loss (0.450)")
    ap.add_argument("--modes", default="sync,sync:3,ssp:2,ssp:8,async,async+agg",
                    help="comma list; 'async+agg' is async with server-side aggregation (needs a ctr_worker "
                         "with --table-opts; skipped otherwise)")
    ap.add_argument("--agg", default="agg_n=4 agg_ms=20", help="table options of async+agg")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run before it is killed")
    ap.add_argument("--json", help="write every run's parsed results here")
    ap.add_argument("--from-json", help="do not run: print the report of a file written by --json")
    return ap.parse_args()


def ensure_data(a):
    if os.path.exists(os.path.join(a.data, "meta.txt")):
        return
    gen = os.path.join(a.build, "examples", "ctr", "ctr_gen")
    cmd = [gen, "--rows", a.rows, "--test-rows", a.test_rows, "--parts", str(a.parts), "--max-vocab",
           str(a.max_vocab), "--format", "bin", "--out", a.data, "--quiet"]
    print("generating data:", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def worker_cmd(a, mode):
    cmd = [os.path.join(a.build, "examples", "ctr", "ctr_worker"), "--data", a.data, "--epochs", str(a.epochs),
           "--batch", str(a.batch), "--slow-worker", str(a.slow_worker), "--slow-factor", str(a.slow_factor),
           "--eval-every", str(a.eval_every), "--eval-rows", str(a.eval_rows)]
    if mode == "async+agg":
        cmd += ["--table-opts", a.agg]
    return cmd


def run_cmd(a, mode):
    job_mode = "async" if mode == "async+agg" else mode
    return [os.path.join(a.build, "pshard"), "run", "-s", str(a.servers), "-w", str(a.workers), "--replicas", "1", "--mode", job_mode,
            "--"] + worker_cmd(a, mode)


def run_once(a, mode):
    cmd = run_cmd(a, mode)
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=a.timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    wall = time.monotonic() - t0
    text = out.decode(errors="replace")
    if p.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {p.returncode}:\n{text[-3000:]}")
    r = {"mode": mode, "wall_s": wall, "evals": [], "epochs": [], "trained": {}, "finished_s": None,
         "evaluator": None}
    for line in text.splitlines():
        m = EVAL_RE.match(line)
        if m:
            r["evaluator"] = int(m.group(1))
            r["evals"].append((float(m.group(2)), int(m.group(3)), float(m.group(4)), float(m.group(5))))
            continue
        m = EPOCH_RE.match(line)
        if m:
            r["epochs"].append((int(m.group(2)), float(m.group(3)), float(m.group(4))))
            continue
        m = TRAINED_RE.match(line)
        if m:
            r["trained"][int(m.group(1))] = (int(m.group(2)), float(m.group(3)))
            continue
        m = FINISHED_RE.match(line)
        if m:
            r["finished_s"] = float(m.group(2))
    if len(r["trained"]) != a.workers or not r["evals"] or not r["epochs"]:
        raise RuntimeError(f"unexpected output of {shlex.join(cmd)}:\n{text[-3000:]}")
    examples = sum(n for n, _ in r["trained"].values())
    train_s = max(t for _, t in r["trained"].values())
    r["examples"] = examples
    r["train_s"] = train_s
    r["examples_per_s"] = examples / train_s
    r["slow_examples"] = r["trained"].get(a.slow_worker, (0, 0))[0]
    r["final_logloss"] = r["epochs"][-1][1]
    r["final_auc"] = r["epochs"][-1][2]
    hit = [t for t, _, ll, _ in r["evals"] if ll <= a.target]
    r["time_to_target_s"] = hit[0] if hit else None
    lls = [ll for _, _, ll, _ in r["evals"]]
    rises = [b - c for c, b in zip(lls, lls[1:]) if b > c]
    r["rises"] = len(rises)
    r["rise_sum"] = sum(rises)
    r["n_evals"] = len(lls)
    return r


def loss_at(r, t):
    """Log-loss of the last evaluation at or before t (None before the first)."""
    v = None
    for te, _, ll, _ in r["evals"]:
        if te <= t:
            v = ll
    return v


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec):
    return "—" if x is None else format(x, spec)


def spread(xs, spec):
    """'median (min–max)' of the values that are not None."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "—"
    m = statistics.median(xs)
    if len(xs) == 1:
        return format(m, spec)
    return f"{format(m, spec)} ({format(min(xs), spec)}–{format(max(xs), spec)})"


def main():
    a = parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.load(f)
        for k, v in saved["args"].items():
            if k not in ("from_json", "json"):
                setattr(a, k, v)
        report(a, saved["runs"], saved["load"][0], saved["load"][1], saved.get("argv", []), saved.get("date", ""))
        return
    ensure_data(a)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if "async+agg" in modes:
        helptext = subprocess.run([os.path.join(a.build, "examples", "ctr", "ctr_worker"), "--help"],
                                  capture_output=True, text=True).stdout
        if "--table-opts" not in helptext:
            print("note: ctr_worker has no --table-opts option; skipping async+agg", flush=True)
            modes.remove("async+agg")
    runs = {m: [] for m in modes}
    load0 = os.getloadavg()
    t_start = time.time()
    for rep in range(a.repeats):
        for m in modes:
            r = run_once(a, m)
            runs[m].append(r)
            print(f"repeat {rep + 1}/{a.repeats} {m:10s} {r['examples_per_s']:9.0f} examples/s  "
                  f"target {fmt(r['time_to_target_s'], '.2f')} s  final logloss {r['final_logloss']:.4f}  "
                  f"train {r['train_s']:.2f} s  evaluator worker {r['evaluator']}", flush=True)
    load1 = os.getloadavg()
    date = time.strftime("%Y-%m-%d")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "argv": sys.argv[1:], "date": date, "runs": runs, "load": [load0, load1]},
                      f, indent=1)
    report(a, runs, load0, load1, sys.argv[1:], date)
    print(f"\n(total bench time {time.time() - t_start:.0f} s)")


def report(a, runs, load0, load1, argv, date):
    modes = list(runs)
    base = med(r["examples_per_s"] for r in runs["sync"]) if "sync" in runs else None
    lines = []
    cmd = shlex.join(["/usr/bin/python3", "bench/modes.py"] + [x for x in argv if x])
    example = shlex.join([os.path.relpath(x, ROOT) if x.startswith(ROOT) else x for x in run_cmd(a, "ssp:2")])
    lines.append(f"Produced by `{cmd}` on {date}; each run is")
    lines.append(f"`{example}` with `--mode` set per row.")
    lines.append("")
    lines.append(f"Machine: {os.cpu_count()} CPUs for {1 + a.servers + a.workers} processes (oversubscribed; the "
                 f"slowed worker sleeps, which frees CPU for the others). Load average "
                 f"{load0[0]:.1f} before, {load1[0]:.1f} after. Medians over {a.repeats} runs; "
                 f"target log-loss {a.target} (on the first {a.eval_rows} test rows, rank 0's clock).")
    lines.append("")
    lines.append("| mode | examples/s, median (min–max) | vs sync | time to target (s), median (min–max) | "
                 "runs reaching it | faster to target than sync (paired repeats) | final test logloss | "
                 "slowed worker's share of examples | eval rises (count / total) |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in modes:
        rs = runs[m]
        eps = med(r["examples_per_s"] for r in rs)
        reached = sum(r["time_to_target_s"] is not None for r in rs)
        wins = "—"
        if "sync" in runs and m != "sync":
            pairs = list(zip(rs, runs["sync"]))
            n_win = sum(r["time_to_target_s"] is not None and (b["time_to_target_s"] is None or
                                                             r["time_to_target_s"] < b["time_to_target_s"])
                        for r, b in pairs)
            wins = f"{n_win}/{len(pairs)}"
        share = med(r["slow_examples"] / r["examples"] for r in rs)
        lines.append(f"| `{m}` | {spread([r['examples_per_s'] for r in rs], ',.0f')} | "
                     f"{fmt(eps / base if base else None, '.2f')}× | "
                     f"{spread([r['time_to_target_s'] for r in rs], '.2f')} | "
                     f"{reached}/{len(rs)} | {wins} | {med(r['final_logloss'] for r in rs):.4f} | {share:.1%} | "
                     f"{med(r['rises'] for r in rs):.0f} / {med(r['rise_sum'] for r in rs):.4f} |")
    lines.append("")
    horizon = max(max(e[0] for e in r["evals"]) for rs in runs.values() for r in rs)
    points = [x for x in (0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16) if x <= horizon] or [horizon]
    lines.append("Periodic test log-loss at time t (median over runs; rank 0's clock, seconds):")
    lines.append("")
    lines.append("| mode | " + " | ".join(f"t={p:g}" for p in points) + " |")
    lines.append("|---|" + "---:|" * len(points))
    for m in modes:
        lines.append(f"| `{m}` | " + " | ".join(fmt(med(loss_at(r, p) for r in runs[m]), ".4f") for p in points) + " |")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
