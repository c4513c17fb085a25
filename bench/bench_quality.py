#!/usr/bin/env python3
"""bench_quality.py - what each value codec costs in model quality and what it saves in
bytes and time, on links shaped like a cluster's (bench/netns.py: a network namespace
per node, tc tbf on every link, 1 Gbit/s by default). Needs root, or --no-shape.

Two workloads, each trained once per codec with the same data, seed and epochs, in sync
mode with 2 workers (sync rounds make a run deterministic up to the codec):
  - ctr: the click-through example (examples/ctr: ctr_worker, sparse logistic regression
    with FTRL on 1 server) on data from ctr_gen (fixed seed); quality = test AUC;
  - fmnist: the Fashion-MNIST example (examples/python/fashion_mnist.py: an MLP whose
    parameters are dense tables with server-side Adam, 2 servers); quality = test
    accuracy.
Each codec is a push codec (what the workers send; lossy ones keep what they leave out
and send it with the next push: error feedback); `int8/int8` for ctr is int8 both ways
(push_codec=int8 pull_codec=int8). Per run it records:
  - bytes per step: the payload one worker sends and receives per step (keys and values,
    pushes counted as encoded, from the client's codec counters), mean over the workers;
  - the test quality after the same epochs;
  - time to quality: the first training time (rank 0's clock without the time it spends
    evaluating) at which the test quality reaches T = (what the uncompressed run ends
    at) - margin; rank 0 evaluates on the whole test set every --evals-th part of the
    run. Margins: 0.001 AUC for ctr, 0.5 points of accuracy for fmnist.
Besides the codecs, `none,seed+1` is none with another seed (ctr: the order examples
are shuffled in, --shuffle 2 instead of 1; fmnist: initial values and batch order): how
far two uncompressed runs differ by chance.
Then it prints, per workload, a table with the ratios against none, and the quality
targets with pass/miss: int8 within 0.002 AUC (ctr) and 0.5 points (fmnist) of none,
topk:0.01 within 1 point (fmnist), fp16 indistinguishable: either way within 0.0005 AUC
and 0.2 points, or within what separates none from none,seed+1 if that is more. A codec
better than none passes the others.

The codecs run interleaved (--repeats R runs every codec R times, in a rotated order;
times are medians): the times are noisy on a shared machine (the load average is
printed), the qualities are not.

usage: bench_quality.py [--workloads ctr,fmnist] [--codecs none,fp16,bf16,int8,topk:0.01]
                        [--rate 1] [--repeats 1] [--no-shape] [--quick] [--build DIR]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FMNIST = os.path.join(ROOT, "examples", "python", "fashion_mnist.py")
WORKERS = 2

# Per workload: servers, quality name, margin of the time-to-quality target, and the
# targets (codec -> the most quality may fall below none's).
SPEC = {
    "ctr": {"servers": 1, "quality": "test AUC", "unit": "", "margin": 0.001,
            "targets": {"int8": 0.002, "int8/int8": 0.002, "fp16": 0.0005}},
    "fmnist": {"servers": 2, "quality": "test accuracy", "unit": "%", "margin": 0.005,
               "targets": {"int8": 0.005, "topk:0.01": 0.01, "fp16": 0.002}},
}

# Sizes: (default, --quick).
CTR_SIZE = ({"rows": "500k", "test_rows": "50k", "epochs": 2, "batch": 200, "lr": 0.1},
            {"rows": "60k", "test_rows": "10k", "epochs": 1, "batch": 200, "lr": 0.1})
FMNIST_SIZE = ({"epochs": 3, "limit": 0}, {"epochs": 1, "limit": 6000})

EVAL_CTR = re.compile(r"^eval t=\S+ examples=\d+ logloss=\S+ auc=(\S+) steps=(\d+) train_t=(\S+)")
EPOCH_CTR = re.compile(r"^epoch (\d+): test logloss \S+\s+auc (\S+)")
TRAFFIC_CTR = re.compile(r"^traffic: steps (\d+)\s+pushed (\d+) B\s+pulled (\d+) B")
EVAL_FM = re.compile(r"^eval step=(\d+) train_t=(\S+) acc=(\S+)")


SEED_RUN = "none,seed+1"  # none with another seed: how far two uncompressed runs differ


def table_options(codec):
    if codec in ("none", SEED_RUN):
        return ""
    if codec == "int8/int8":
        return "push_codec=int8 pull_codec=int8"
    return f"push_codec={codec}"


def strip_prefix(text):
    """Lines of a log, without `pshard run`'s "[worker i] " prefixes; grouped by worker."""
    by = {}
    for line in text.splitlines():
        m = re.match(r"^\[worker (\d+)\] (.*)$", line)
        if m:
            by.setdefault(int(m.group(1)), []).append(m.group(2))
    return by


def ensure_ctr_data(a, pshard_build, size):
    """ctr_gen's data for this size, made once into --data-dir (fixed seed 1)."""
    d = os.path.join(a.data_dir, f"ctr-{size['rows']}-{size['test_rows']}")
    if os.path.exists(os.path.join(d, "meta.txt")):
        return d
    gen = os.path.join(pshard_build, "examples", "ctr", "ctr_gen")
    print(f"# generating click-through data in {d} ({size['rows']} train rows, {size['test_rows']} test rows)",
          flush=True)
    r = subprocess.run([gen, "--rows", size["rows"], "--test-rows", size["test_rows"], "--parts", "2", "--seed", "1",
                        "--out", d, "--quiet", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"ctr_gen failed: {r.stdout.strip()}")
    return d


def count(s):
    """ctr_gen's row counts: 500k, 1M."""
    mult = {"k": 1000, "M": 1000000}.get(s[-1:], 1)
    return int(float(s.rstrip("kM")) * mult)


def ctr_argv(a, worker, data, size, codec):
    steps = count(size["rows"]) * size["epochs"] // (WORKERS * size["batch"])
    argv = [worker, "--data", data, "--epochs", str(size["epochs"]), "--batch", str(size["batch"]), "--lr",
            str(size["lr"]), "--eval-every", str(max(1, steps // a.evals)), "--eval-rows", "0",
            "--shuffle", "2" if codec == SEED_RUN else "1"]
    opts = table_options(codec)
    return argv + (["--table-opts", opts] if opts else [])


def fmnist_argv(a, size, codec):
    steps = (60000 if not size["limit"] else size["limit"]) // 64 * size["epochs"]
    argv = [sys.executable, FMNIST, "--epochs", str(size["epochs"]), "--eval-every",
            str(max(1, steps // a.evals)), "--threads", "1", "--seed", "1" if codec == SEED_RUN else "0"]
    if size["limit"]:
        argv += ["--limit", str(size["limit"])]
    opts = table_options(codec)
    return argv + (["--table-opts", opts] if opts else [])


def parse_ctr(logs):
    """logs: one list of lines per worker -> dict(curve, final, bytes_per_step)."""
    curve, final, per_step = [], None, []
    for lines in logs:
        for line in lines:
            m = EVAL_CTR.match(line)
            if m:
                curve.append((float(m.group(3)), float(m.group(1))))
            m = EPOCH_CTR.match(line)
            if m:
                final = float(m.group(2))
            m = TRAFFIC_CTR.match(line)
            if m and int(m.group(1)):
                per_step.append((int(m.group(2)) + int(m.group(3))) / int(m.group(1)))
    if final is None or not per_step:
        raise RuntimeError("no epoch or traffic line in the workers' output:\n" + "\n".join(sum(logs, [])[-20:]))
    return {"curve": curve, "final": final, "bytes_per_step": statistics.mean(per_step),
            "train_s": curve[-1][0] if curve else float("nan")}


def parse_fmnist(logs):
    curve, res = [], None
    for lines in logs:
        for line in lines:
            m = EVAL_FM.match(line)
            if m:
                curve.append((float(m.group(2)), float(m.group(3))))
            if line.startswith("RESULT "):
                res = json.loads(line[len("RESULT "):])
    if res is None:
        raise RuntimeError("no RESULT line in the workers' output:\n" + "\n".join(sum(logs, [])[-20:]))
    steps = res["steps"] or 1
    return {"curve": curve, "final": res["test_acc"][-1],
            "bytes_per_step": (res["pushed_bytes"] + res["pulled_bytes"]) / steps,
            "train_s": curve[-1][0] if curve else float("nan")}


class Shaped:
    """Runs a job on the namespaces of one Links (the nodes of a workload reused)."""

    def __init__(self, a, pshard):
        self.net = netns.Links(rate_gbit=a.rate)
        self.pshard, self.timeout, self.nodes = pshard, a.timeout, {}

    def run(self, workload, servers, argv):
        job = netns.Job(self.net, self.pshard, servers, WORKERS, nodes=self.nodes.get(workload))
        ws = job.workers(argv)
        self.net.wait(ws, timeout=self.timeout)
        job.finish()
        self.nodes[workload] = job.nodes
        return [self.net.log(w).splitlines() for w in ws]

    def close(self):
        self.net.close()


class Local:
    """Runs a job with `pshard run` on loopback TCP (no shaping: --no-shape)."""

    def __init__(self, a, pshard):
        self.pshard, self.timeout = pshard, a.timeout

    def run(self, workload, servers, argv):
        env = dict(os.environ)
        env.update({"PSHARD_PEER_MEM": "0"})
        for k in ("PSHARD_SCHEDULER", "PSHARD_ROLE", "PSHARD_EMBEDDED", "PSHARD_COLOCATE"):
            env.pop(k, None)
        cmd = [self.pshard, "run", "-s", str(servers), "-w", str(WORKERS), "--replicas", "1", "--progress-ms", "0", "--http-port", "off",
               "--transport", "tcp", "--"] + argv
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=self.timeout,
                           env=env, start_new_session=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}")
        by = strip_prefix(r.stdout)
        return [by[k] for k in sorted(by)]

    def close(self):
        pass


def time_to(curve, target):
    for t, q in curve:
        if q >= target:
            return t
    return None


def fmt_q(workload, q):
    return f"{100 * q:.2f}%" if workload == "fmnist" else f"{q:.4f}"


def fmt_dq(workload, d):
    return f"{100 * d:+.2f}pt" if workload == "fmnist" else f"{d:+.4f}"


def report(workload, codecs, runs, a):
    spec = SPEC[workload]
    base = runs["none"]
    q0 = statistics.median(r["final"] for r in base)
    target = q0 - spec["margin"]
    t_of = {c: [time_to(r["curve"], target) for r in runs[c]] for c in codecs}

    def med_time(c):
        ts = [t for t in t_of[c] if t is not None]
        return statistics.median(ts) if len(ts) == len(t_of[c]) and ts else None

    b0, t0 = statistics.median(r["bytes_per_step"] for r in base), med_time("none")
    tr0 = statistics.median(r["train_s"] for r in base)
    print(f"\n{workload}: {spec['quality']} after the same epochs; time to quality T = none's final "
          f"{fmt_q(workload, q0)} - {fmt_dq(workload, spec['margin']).lstrip('+')} = {fmt_q(workload, target)}")
    print(f"{'codec':<12} {'KB/step':>9} {'x none':>7} {'quality':>9} {'vs none':>9} {'time_to_T_s':>11} "
          f"{'x none':>7} {'train_s':>8} {'x none':>7}  target")
    q_seed = statistics.median(r["final"] for r in runs[SEED_RUN]) if SEED_RUN in runs else None
    misses = 0
    for c in codecs:
        rs = runs[c]
        b = statistics.median(r["bytes_per_step"] for r in rs)
        q = statistics.median(r["final"] for r in rs)
        t, tr = med_time(c), statistics.median(r["train_s"] for r in rs)
        tt = f"{t:.1f}" if t is not None else "not reached"
        tx = f"{t / t0:.2f}" if t is not None and t0 else "-"
        lim = spec["targets"].get(c)
        if c == "fp16" and q_seed is not None:
            lim = max(lim, abs(q_seed - q0))  # indistinguishable: no further than another seed
        if lim is None:
            verdict = "-"
        else:
            # fp16 must be indistinguishable (either way); the others may be better
            ok = (abs(q - q0) if c == "fp16" else q0 - q) <= lim + 1e-12
            misses += not ok
            verdict = f"{'pass' if ok else 'MISS'} (within {fmt_dq(workload, lim).lstrip('+')})"
        print(f"{c:<12} {b / 1e3:>9.1f} {b / b0:>7.3f} {fmt_q(workload, q):>9} {fmt_dq(workload, q - q0):>9} "
              f"{tt:>11} {tx:>7} {tr:>8.1f} {tr / tr0:>7.2f}  {verdict}", flush=True)
    return misses


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="ctr,fmnist", help="ctr, fmnist or both (ctr,fmnist)")
    ap.add_argument("--codecs", default="fp16,bf16,int8,topk:0.01",
                    help="push codecs besides none (fp16,bf16,int8,topk:0.01); ctr also runs int8/int8")
    ap.add_argument("--no-pull-int8", action="store_true", help="ctr: leave out int8/int8 (int8 pushes and pulls)")
    ap.add_argument("--no-seed-run", action="store_true", help="leave out the run of none with another seed")
    ap.add_argument("--rate", type=float, default=1, help="link rate in Gbit/s, both ways, every node (1)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every codec, interleaved (1)")
    ap.add_argument("--evals", type=int, default=20, help="evaluations of rank 0 per run (20)")
    ap.add_argument("--no-shape", action="store_true", help="plain `pshard run` on loopback TCP: a quick check")
    ap.add_argument("--quick", action="store_true", help="small data, one epoch: a smoke test of the bench")
    ap.add_argument("--data-dir", default=os.environ.get("PSHARD_DATA_DIR", os.path.join(ROOT, "data")),
                    help="where the generated click-through data is kept (<repo>/data)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a run may take (900)")
    ap.add_argument("--build", default=os.environ.get("PSHARD_BUILD", os.path.join(ROOT, "build")))
    a = ap.parse_args()
    workloads = [w for w in a.workloads.split(",") if w]
    for w in workloads:
        if w not in SPEC:
            ap.error(f"unknown workload {w!r} (ctr, fmnist)")
    codecs = ["none"] + [c for c in a.codecs.split(",") if c and c != "none"]
    for c in codecs:
        if c not in ("fp16", "bf16", "int8", "none", "int8/int8") and not re.match(r"^topk:[0-9.eE+-]+$", c):
            ap.error(f"unknown codec {c!r}")
    if a.repeats < 1 or a.evals < 1 or a.rate <= 0:
        ap.error("need --repeats >= 1, --evals >= 1, --rate > 0")
    pshard = os.path.join(a.build, "pshard")
    worker = os.path.join(a.build, "examples", "ctr", "ctr_worker")
    pymod = os.path.join(a.build, "python")
    for p in (pshard, worker, pymod):
        if not os.path.exists(p):
            sys.exit(f"bench_quality: {p} is missing (build first, or --build DIR)")
    os.environ["PYTHONPATH"] = pymod + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    ctr_size, fm_size = CTR_SIZE[a.quick], FMNIST_SIZE[a.quick]
    extra = [] if a.no_seed_run else [SEED_RUN]
    per = {"ctr": codecs + ([] if a.no_pull_int8 or "int8" not in codecs else ["int8/int8"]) + extra,
           "fmnist": codecs + extra}
    if "ctr" in workloads:
        data = ensure_ctr_data(a, a.build, ctr_size)
    if not a.no_shape:
        try:
            netns.check_available()
        except netns.Unavailable as e:
            sys.exit(f"bench_quality: cannot shape links: {e} (--no-shape runs on loopback)")
        netns.install_sigterm()
    load0 = os.getloadavg()
    print(f"# bench_quality: sync, {WORKERS} workers; "
          + (f"every node in its own network namespace, links {a.rate:g} Gbit/s both ways (tc tbf)" if not a.no_shape
             else "loopback TCP, no shaping (--no-shape)"))
    if "ctr" in workloads:
        print(f"# ctr: {ctr_size['rows']} train / {ctr_size['test_rows']} test rows (ctr_gen seed 1), "
              f"{ctr_size['epochs']} epochs, batch {ctr_size['batch']} per worker, FTRL lr {ctr_size['lr']}, "
              f"{SPEC['ctr']['servers']} server")
    if "fmnist" in workloads:
        print(f"# fmnist: MLP 784-256-128-10, {fm_size['epochs']} epochs"
              + (f" of the first {fm_size['limit']} images" if fm_size["limit"] else "")
              + f", global batch 64, Adam lr 1e-3 on the servers, {SPEC['fmnist']['servers']} servers")
    print(f"# load average at the start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} (2 cores shared: times are noisy)",
          flush=True)
    runner = Local(a, pshard) if a.no_shape else Shaped(a, pshard)
    runs = {w: {c: [] for c in per[w]} for w in workloads}
    try:
        for rep in range(a.repeats):
            for w in workloads:
                order = per[w][rep % len(per[w]):] + per[w][:rep % len(per[w])]
                for c in order:
                    t = time.time()
                    if w == "ctr":
                        logs = runner.run(w, SPEC[w]["servers"], ctr_argv(a, worker, data, ctr_size, c))
                        r = parse_ctr(logs)
                    else:
                        logs = runner.run(w, SPEC[w]["servers"], fmnist_argv(a, fm_size, c))
                        r = parse_fmnist(logs)
                    runs[w][c].append(r)
                    print(f"  run {rep + 1}/{a.repeats} {w} {c}: {fmt_q(w, r['final'])}, "
                          f"{r['bytes_per_step'] / 1e3:.1f} KB/step, training {r['train_s']:.1f} s "
                          f"(wall {time.time() - t:.0f} s, load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        runner.close()
    misses = sum(report(w, per[w], runs[w], a) for w in workloads)
    load1 = os.getloadavg()
    print("\n# KB/step: payload one worker sends and receives per step (keys and values as encoded), mean over "
          "the workers; train_s: rank 0's training time without its evaluations")
    print(f"# load average at the end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; quality targets missed: {misses}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
