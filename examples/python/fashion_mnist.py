"""fashion_mnist.py - an MLP on Fashion-MNIST whose parameters live on pshard servers.

Every dense parameter is a pshard table with a server-side Adam optimiser
(pshard.torch.ModelSync); workers push gradients from backward hooks and pull fresh
values before each forward. In sync mode, K workers with a local batch of B/K are one
process with batch B: at step t the global batch is a fixed-seed permutation's slice
[tB, (t+1)B), and worker r takes its r-th part.

    # alone (embedded scheduler and servers in the process):
    python3 examples/python/fashion_mnist.py --epochs 10
    # 2 workers, 2 servers, sync mode:
    pshard run -s 2 -w 2 --mode sync -- python3 examples/python/fashion_mnist.py
    # PyTorch alone (its own Adam), the reference figure:
    python3 examples/python/fashion_mnist.py --reference
    # both, side by side (what `make example-fashion-mnist` runs):
    python3 examples/python/fashion_mnist.py --compare --workers 2 --epochs 10

Rank 0 prints one line per epoch and, at the end, a line starting with RESULT followed
by JSON (test accuracy per epoch, time).
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import datasets  # noqa: E402
import jobs  # noqa: E402


def build_model(hidden):
    layers, d = [], 784
    for h in hidden:
        layers += [torch.nn.Linear(d, h), torch.nn.ReLU()]
        d = h
    layers.append(torch.nn.Linear(d, 10))
    return torch.nn.Sequential(*layers)


def evaluate(model, x, y):
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x[i:i + 2000]).argmax(1) == y[i:i + 2000]).sum()) for i in range(0, len(x), 2000))
    model.train()
    return correct / len(x)


def train(args):
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    xtr, ytr, xte, yte = datasets.fashion_mnist(limit=args.limit)
    xtr, ytr, xte, yte = map(torch.from_numpy, (xtr, ytr, xte, yte))
    model = build_model(args.hidden)

    ps = sync = None
    rank, K = 0, 1
    if args.reference:
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    else:
        import pshard
        import pshard.torch
        ps = pshard.embedded(servers=args.servers, mode=args.mode)
        rank, K = ps.rank, ps.num_workers
        sync = pshard.torch.ModelSync(ps, model, prefix="fmnist/", options=args.table_opts or None, opt=args.opt,
                                      lr=args.lr, seed=args.seed)
    if args.batch % K:
        raise SystemExit(f"--batch {args.batch} is not a multiple of the {K} workers")
    b = args.batch // K
    steps = len(xtr) // args.batch   # full global batches per epoch (the same count on every worker)
    accs, t0 = [], time.time()
    eval_s = 0.0             # seconds spent in --eval-every evaluations (train_t leaves them out)
    for epoch in range(args.epochs):
        perm = torch.from_numpy(np.random.default_rng(args.seed + epoch).permutation(len(xtr)))
        total = 0.0
        for t in range(steps):
            if args.eval_every and rank == 0 and t and t % args.eval_every == 0:
                te = time.time()
                if sync:
                    sync.wait()
                acc = evaluate(model, xte, yte)
                print(f"eval step={epoch * steps + t} train_t={te - t0 - eval_s:.3f} acc={acc:.5f}", flush=True)
                eval_s += time.time() - te
            idx = perm[t * args.batch + rank * b: t * args.batch + (rank + 1) * b]
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            if sync:
                loss.backward()
                sync.step()
            else:
                opt.zero_grad()
                loss.backward()
                opt.step()
            total += float(loss)
        if sync:
            sync.wait()
            ps.metric("loss", total / steps)
        te = time.time()
        acc = evaluate(model, xte, yte)
        accs.append(acc)
        if rank == 0:
            if args.eval_every:
                print(f"eval step={(epoch + 1) * steps} train_t={te - t0 - eval_s:.3f} acc={acc:.5f}", flush=True)
            print(f"epoch {epoch + 1:2d}  loss {total / steps:.4f}  test accuracy {100 * acc:.2f}%  "
                  f"{time.time() - t0:6.1f} s", flush=True)
        eval_s += time.time() - te
    result = {"kind": "reference" if args.reference else "pshard", "workers": K,
              "servers": ps.num_servers if ps else 0, "mode": args.mode if ps else None, "batch": args.batch,
              "epochs": args.epochs, "test_acc": accs, "time_s": round(time.time() - t0, 2)}
    if sync:
        result.update({k: round(v, 2) if isinstance(v, float) else v for k, v in sync.stats().items()})
        # Payload bytes as sent by this worker: pushes with their values encoded (the
        # push codec's counters), pulls as they arrived.
        result["pushed_bytes"] = int(ps.stat("bytes_pushed") - ps.stat("push_raw_bytes") + ps.stat("push_wire_bytes"))
        result["pulled_bytes"] = int(ps.stat("bytes_pulled"))
        result["steps_per_epoch"] = steps
        sync.close()
        ps.barrier()
        ps.close()
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    return result


def compare(args):
    """Run the pshard job (K workers, launcher) and the PyTorch reference; print both."""
    me = [sys.executable, os.path.abspath(__file__), "--epochs", str(args.epochs), "--batch", str(args.batch),
          "--lr", str(args.lr), "--seed", str(args.seed), "--hidden", ",".join(map(str, args.hidden)),
          "--threads", str(args.threads)] + (["--limit", str(args.limit)] if args.limit else [])
    print(f"pshard: {args.workers} workers, {args.servers} servers, {args.mode} mode, server-side Adam", flush=True)
    rc, out = jobs.run(jobs.pshard_run(args.servers, args.workers, args.mode) + me, args.timeout)
    if rc:
        raise SystemExit(f"the pshard job failed with status {rc}")
    ours = jobs.result(out)
    print("reference: one process, PyTorch's Adam", flush=True)
    rc, out = jobs.run(me + ["--reference"], args.timeout, env=jobs.clean_env())
    if rc:
        raise SystemExit(f"the reference run failed with status {rc}")
    ref = jobs.result(out)
    print(f"\nFashion-MNIST MLP {args.hidden}, global batch {args.batch}, lr {args.lr}: test accuracy")
    print(f"{'epoch':>5}  {'pshard ' + str(args.workers) + 'w ' + args.mode:>16}  {'torch 1 process':>16}")
    for e, (a, r) in enumerate(zip(ours["test_acc"], ref["test_acc"])):
        print(f"{e + 1:5d}  {100 * a:15.2f}%  {100 * r:15.2f}%")
    print(f"{'time':>5}  {ours['time_s']:15.1f}s  {ref['time_s']:15.1f}s")
    best = max(ours["test_acc"])
    ok = best >= args.target
    print(f"pshard best {100 * best:.2f}% (target {100 * args.target:.0f}%): {'ok' if ok else 'MISSED'}; "
          f"torch after 5 epochs {100 * ref['test_acc'][min(4, len(ref['test_acc']) - 1)]:.2f}%")
    print("COMPARE " + json.dumps({"pshard": ours, "reference": ref}), flush=True)
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64, help="global batch (split over the workers)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--opt", default="adam", help="server-side optimiser: adam, momentum, sgd, adagrad (adam; "
                    "--reference always uses PyTorch's Adam)")
    ap.add_argument("--hidden", type=lambda s: [int(v) for v in s.split(",") if v], default=[256, 128])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0, help="use only the first N training images (smoke tests)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--mode", default="sync")
    ap.add_argument("--table-opts", default="", help="more options of every parameter's table, e.g. "
                    "'push_codec=int8 pull_codec=fp16'")
    ap.add_argument("--eval-every", type=int, default=0, help="rank 0 prints 'eval step=S train_t=SECONDS acc=A' "
                    "every N global steps and at each epoch's end; train_t leaves out the evaluations")
    ap.add_argument("--reference", action="store_true", help="train with PyTorch's Adam alone (no pshard)")
    ap.add_argument("--compare", action="store_true", help="run the pshard job and the reference; print both")
    ap.add_argument("--workers", type=int, default=2, help="workers of the --compare job")
    ap.add_argument("--target", type=float, default=0.87, help="--compare: required best test accuracy")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    if args.compare:
        return compare(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
