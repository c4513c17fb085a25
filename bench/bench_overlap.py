#!/usr/bin/env python3
"""bench_overlap.py - how much communication the overlap that workers get by default
hides: the same training with and without it, in one run.

Two workloads, each under `pshard run -s S -w W --mode sync` (servers are processes):

  torch  an MLP on Fashion-MNIST-sized inputs (synthetic: 784 floats, 10 classes) kept
         by pshard.torch.ModelSync. Every worker measures, per step (median and p90 over
         --steps after --warmup):
           compute alone   forward + backward of the same model without pshard
           comm alone      the step's communication without compute: push every
                           gradient, clock, pull every parameter, one blocking call
                           after another, to tables with the steps' optimiser (Adam)
           step, overlap=False   ModelSync(overlap=False): compute, then that communication
           step, overlap=True    ModelSync(overlap=True): pushes from the gradient hooks,
                           pulls in the background, each layer waited just before it runs
         hidden share = (compute + comm - overlapped step) / comm, the part of the
         communication the overlapped step did not wait for (0: none, 1: all).
  ctr    examples/ctr's worker on generated click logs, with and without --no-prefetch.
         Its waits (pull_wait_s + push_wait_s of the worker, summed over the run) with
         --no-prefetch are the communication, every call being blocking there; hidden
         share = 1 - waits with prefetch / waits without. Step times are the training
         time over the steps.

The baseline of each line is the non-overlapped run of the same workload in the same
invocation. The torch phases take turns within a run, five timed steps each; the ctr
runs alternate (off, on, off, on, ...); --repeats times, and the median is printed. Figures on a busy machine are noise: run it on a quiet one.

usage: bench_overlap.py [--build DIR] [--workload torch,ctr] [--servers 2] [--workers 1]
                        [--hidden 1024] [--layers 2] [--batch 64] [--steps 40] [--warmup 5]
                        [--ctr-rows 200000] [--ctr-batch 1000] [--repeats 1]
"""
import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(argv, timeout, env=None):
    """argv in its own process group, killed as a group on a timeout; (rc, stdout, stderr)."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env=env)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise SystemExit(f"bench_overlap: {argv[0]} did not finish within {timeout} s")
    return p.returncode, out, err


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def hidden(compute, comm, step):
    return max(0.0, min(1.0, (compute + comm - step) / comm)) if comm > 0 else 0.0


# ------------------------------------------------------------------------- torch worker

def torch_worker(args):
    """One worker of the torch workload (run under `pshard run`); rank 0 prints RESULT."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    import pshard
    import pshard.torch as pt

    torch.set_num_threads(1)

    def make():
        torch.manual_seed(0)
        layers, d = [], 784
        for _ in range(args.layers):
            layers += [torch.nn.Linear(d, args.hidden), torch.nn.ReLU()]
            d = args.hidden
        layers.append(torch.nn.Linear(d, 10))
        return torch.nn.Sequential(*layers)

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(args.batch, 784, generator=g), torch.randint(0, 10, (args.batch,), generator=g))
            for _ in range(8)]
    ps = pshard.connect()

    # compute alone
    ref = make()

    def compute(t):
        x, y = data[t % len(data)]
        ref.zero_grad(set_to_none=True)
        F.cross_entropy(ref(x), y).backward()

    # comm alone: the blocking path's communication, with gradients of the right shapes,
    # to tables with the steps' optimiser (a sync round's pulls wait for the servers to
    # apply it: Adam over the whole model costs more than SGD)
    comm_model = make()
    comm_sync = pt.ModelSync(ps, comm_model, prefix="comm/", opt="adam", lr=1e-3, overlap=False)
    grads = [np.full(t.shape, 1e-3, np.float32) for t in comm_sync.tables]
    bufs = [np.empty(t.shape, np.float32) for t in comm_sync.tables]

    def comm(t):
        for tab, gr in zip(comm_sync.tables, grads):
            tab.push(gr, batch=args.batch)
        ps.clock()
        for tab, b in zip(comm_sync.tables, bufs):
            tab.pull(out=b)

    phases = {"compute": (compute, None), "comm": (comm, None)}
    for overlap in (False, True):
        model = make()
        sync = pt.ModelSync(ps, model, prefix=f"ov{int(overlap)}/", opt="adam", lr=1e-3, overlap=overlap)

        def step(t, model=model, sync=sync):
            x, y = data[t % len(data)]
            F.cross_entropy(model(x), y).backward()
            sync.step()
        phases[f"step_overlap_{int(overlap)}"] = (step, sync)

    # The phases take turns, a chunk of steps each (the first of a chunk untimed), so
    # that a load that comes and goes on a shared machine falls on all of them alike;
    # within a chunk an overlapped step's pulls run on into its next forward, as in
    # training, and are waited for (untimed) before the next phase's turn.
    res = {k: [] for k in phases}
    for k, (fn, _) in phases.items():
        for t in range(args.warmup):
            fn(t)
        if phases[k][1]:
            phases[k][1].wait()
    chunk, t = 5, 0
    while min(len(v) for v in res.values()) < args.steps:
        for k, (fn, sync) in phases.items():
            for c in range(chunk + 1):
                t0 = time.perf_counter()
                fn(t)
                if c:
                    res[k].append(time.perf_counter() - t0)
                t += 1
            if sync:
                sync.wait()
    for _, sync in phases.values():
        if sync:
            sync.close()
    comm_sync.close()
    ps.barrier()
    if ps.rank == 0:
        print("RESULT " + json.dumps(res), flush=True)
    ps.close()


def bench_torch(args, build):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(build, "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    argv = [os.path.join(build, "pshard"), "run", "-s", str(args.servers), "-w", str(args.workers), "--replicas", "1", "--mode", "sync",
            "--progress-ms", "0", "--", sys.executable, os.path.abspath(__file__), "--torch-worker",
            "--hidden", str(args.hidden), "--layers", str(args.layers), "--batch", str(args.batch),
            "--steps", str(args.steps), "--warmup", str(args.warmup)]
    runs = []
    for _ in range(args.repeats):
        rc, out, err = run(argv, 600, env)
        m = re.search(r"RESULT (\{.*\})", out)
        if rc or not m:
            raise SystemExit(f"bench_overlap: the torch job failed (status {rc}):\n{out}{err}")
        runs.append(json.loads(m.group(1)))
    med = {k: statistics.median(statistics.median(r[k]) for r in runs) for k in runs[0]}
    p90 = {k: statistics.median(pct(r[k], 0.9) for r in runs) for k in runs[0]}
    nparams = sum(d * o + o for d, o in zip([784] + [args.hidden] * args.layers, [args.hidden] * args.layers + [10]))
    print(f"\ntorch: MLP 784-{'-'.join([str(args.hidden)] * args.layers)}-10 ({nparams * 4 / 2**20:.1f} MiB of "
          f"parameters), batch {args.batch}, {args.workers} worker(s), {args.servers} servers, sync; "
          f"{args.steps} steps x {args.repeats} run(s)")
    print(f"  {'':28s} {'median ms':>10s} {'p90 ms':>8s}")
    for k, label in (("compute", "compute alone"), ("comm", "comm alone"),
                     ("step_overlap_0", "step, overlap=False"), ("step_overlap_1", "step, overlap=True")):
        print(f"  {label:28s} {med[k] * 1e3:10.2f} {p90[k] * 1e3:8.2f}")
    c, m, s0, s1 = med["compute"], med["comm"], med["step_overlap_0"], med["step_overlap_1"]
    print(f"  hidden share of comm: overlap=True {100 * hidden(c, m, s1):.0f}%, overlap=False "
          f"{100 * hidden(c, m, s0):.0f}% (baseline); step time overlap=True / overlap=False = {s1 / s0:.2f}")


# ------------------------------------------------------------------------- ctr

def bench_ctr(args, build):
    gen = os.path.join(build, "examples", "ctr", "ctr_gen")
    worker = os.path.join(build, "examples", "ctr", "ctr_worker")
    for b in (gen, worker):
        if not os.path.exists(b):
            raise SystemExit(f"bench_overlap: {b} is missing: build the examples first")
    d = tempfile.mkdtemp(prefix="pshard-bench-overlap-")
    try:
        rc, _, err = run([gen, "--rows", str(args.ctr_rows), "--test-rows", "10000", "--parts",
                          str(max(2, args.workers)), "--out", d, "--quiet"], 600)
        if rc:
            raise SystemExit(f"bench_overlap: ctr_gen failed: {err}")
        res = {0: [], 1: []}
        for _ in range(args.repeats):
            for prefetch in (0, 1):
                argv = [os.path.join(build, "pshard"), "run", "-s", str(args.servers), "-w", str(args.workers), "--replicas", "1",
                        "--mode", "sync", "--progress-ms", "0", "--", worker, "--data", d, "--batch",
                        str(args.ctr_batch), "--epochs", "1", "--quiet"] + ([] if prefetch else ["--no-prefetch"])
                rc, out, err = run(argv, 900)
                tr = re.findall(r"trained on (\d+) examples in ([0-9.]+) s", out)
                wt = re.findall(r"waits: pull ([0-9.]+) s\s+push ([0-9.]+) s\s+compute ([0-9.]+) s\s+"
                                r"training ([0-9.]+) s", out)
                if rc or not tr or not wt:
                    raise SystemExit(f"bench_overlap: the ctr job failed (status {rc}):\n{out}{err}")
                ex = int(tr[0][0])
                steps = max(1, -(-ex // args.ctr_batch))
                pull, push, comp, secs = (float(x) for x in wt[0])
                res[prefetch].append({"step": secs / steps, "waits": (pull + push) / steps, "pull": pull / steps,
                                      "compute": comp / steps})
        med = {p: {k: statistics.median(r[k] for r in res[p]) for k in res[p][0]} for p in res}
        print(f"\nctr: {args.ctr_rows} examples, batch {args.ctr_batch}, {args.workers} worker(s), "
              f"{args.servers} servers, sync; rank 0's figures, {args.repeats} run(s) each")
        print(f"  {'':22s} {'step ms':>9s} {'waits ms':>9s} {'pull ms':>9s} {'compute ms':>11s}")
        for p, label in ((0, "--no-prefetch"), (1, "prefetch (default)")):
            r = med[p]
            print(f"  {label:22s} {r['step'] * 1e3:9.3f} {r['waits'] * 1e3:9.3f} {r['pull'] * 1e3:9.3f} "
                  f"{r['compute'] * 1e3:11.3f}")
        w0, w1 = med[0]["waits"], med[1]["waits"]
        share = max(0.0, 1 - w1 / w0) if w0 > 0 else 0.0
        print(f"  hidden share of comm (1 - waits / waits with --no-prefetch): {100 * share:.0f}%; "
              f"step time prefetch / --no-prefetch = {med[1]['step'] / med[0]['step']:.2f}")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.environ.get("PSHARD_BUILD", os.path.join(ROOT, "build")))
    ap.add_argument("--workload", default="torch,ctr", help="comma-separated: torch, ctr")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ctr-rows", type=int, default=200000)
    ap.add_argument("--ctr-batch", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for k in ("servers", "workers", "hidden", "layers", "batch", "steps", "ctr_rows", "ctr_batch", "repeats"):
        if getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if args.torch_worker:
        torch_worker(args)
        return
    build = os.path.abspath(args.build)
    if not os.path.exists(os.path.join(build, "pshard")):
        raise SystemExit(f"bench_overlap: {build}/pshard is missing: build first (make build) or pass --build")
    work = [w.strip() for w in args.workload.split(",") if w.strip()]
    bad = [w for w in work if w not in ("torch", "ctr")]
    if bad or not work:
        ap.error(f"--workload: unknown {', '.join(bad) or '(none)'}; choose from torch, ctr")
    print(f"bench_overlap: {time.strftime('%Y-%m-%d %H:%M:%S')}, build {build}")
    if "torch" in work:
        bench_torch(args, build)
    if "ctr" in work:
        bench_ctr(args, build)


if __name__ == "__main__":
    main()
