"""movielens.py - biased matrix factorisation on MovieLens with sparse pshard tables.

    rating(u, i) ~ mu + b_u + b_i + p_u . q_i

p, q, b_user and b_item are pshard.torch.Embedding modules over sparse tables (rows
created on first touch, server-side optimiser, lazy: only rows in a round step). Each
batch pulls only the rows of its users and movies and pushes only their gradients.
mu is the training set's mean rating. The loss is the batch's mean squared error plus
an L2 penalty on the rows the batch uses. Data: r-cran-dslabs' MovieLens (100,004
ratings), fixed-seed 80/20 split (datasets.movielens), or your own split: --train FILE
--test FILE (user,item,rating lines, CSV or MovieLens' tab-separated u.data).

The consistency mode is a parameter (--mode, PSHARD_MODE; default async). In async
mode each worker's push is applied on arrival, so 2 workers with local batch B/2 make
twice as many updates of half the batch as one worker with batch B; in sync mode they
compute exactly what one worker with batch B computes.

    # alone, embedded:
    python3 examples/python/movielens.py
    # 2 workers, 2 servers:
    pshard run -s 2 -w 2 --mode async -- python3 examples/python/movielens.py
    # both, side by side (what `make example-movielens` runs):
    python3 examples/python/movielens.py --compare --workers 2 --mode async

Rank 0 prints test RMSE per epoch and a final line RESULT {json}.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import datasets  # noqa: E402
import jobs  # noqa: E402


class MF(torch.nn.Module):
    def __init__(self, ps, dim, opt, lr, seed, init_sd):
        super().__init__()
        import pshard.torch as pt
        o = dict(opt=opt, lr=lr)
        self.p = pt.Embedding(ps, "ml/user", dim, init=f"normal:{init_sd}", seed=seed, **o)
        self.q = pt.Embedding(ps, "ml/item", dim, init=f"normal:{init_sd}", seed=seed + 1, **o)
        self.bu = pt.Embedding(ps, "ml/user_bias", 1, init="zero", **o)
        self.bi = pt.Embedding(ps, "ml/item_bias", 1, init="zero", **o)

    def forward(self, users, items):
        p, q = self.p(users), self.q(items)
        pred = (p * q).sum(1) + self.bu(users)[:, 0] + self.bi(items)[:, 0]
        return pred, p, q


def rmse(model, mu, data, rank):
    model.eval()
    with torch.no_grad():
        err = 0.0
        n = len(data["rating"])
        for i in range(0, n, 5000):
            d = {k: v[i:i + 5000] for k, v in data.items()}
            pred, _, _ = model(torch.from_numpy(d["user"]), torch.from_numpy(d["item"]))
            pred = torch.clamp(pred + mu, 0.5, 5.0)
            err += float(((pred - torch.from_numpy(d["rating"])) ** 2).sum())
    model.train()
    return (err / n) ** 0.5


def train(args):
    import pshard
    import pshard.torch
    torch.set_num_threads(1)
    if args.train:
        train_set, test_set = datasets.ratings_file(args.train), datasets.ratings_file(args.test)
    else:
        train_set, test_set = datasets.movielens(seed=args.split_seed)
    mu = float(train_set["rating"].mean())
    ps = pshard.embedded(servers=args.servers, mode=args.mode)
    rank, K = ps.rank, ps.num_workers
    if args.batch % K:
        raise SystemExit(f"--batch {args.batch} is not a multiple of the {K} workers")
    b = args.batch // K
    model = MF(ps, args.dim, args.opt, args.lr, args.seed, args.init_sd)
    sync = pshard.torch.ModelSync(ps, model)   # no dense parameters: waits for the Embedding pushes and clocks
    steps = len(train_set["rating"]) // args.batch
    t0, rmses = time.time(), []
    for epoch in range(args.epochs):
        perm = np.random.default_rng(args.seed + epoch).permutation(len(train_set["rating"]))
        total = 0.0
        for t in range(steps):
            idx = perm[t * args.batch + rank * b: t * args.batch + (rank + 1) * b]
            d = {k: v[idx] for k, v in train_set.items()}
            pred, p, q = model(torch.from_numpy(d["user"]), torch.from_numpy(d["item"]))
            mse = ((pred + mu - torch.from_numpy(d["rating"])) ** 2).mean()
            loss = mse + args.reg * ((p * p).sum(1) + (q * q).sum(1)).mean()
            loss.backward()
            sync.step()
            total += float(mse)
        r = rmse(model, mu, test_set, rank)
        rmses.append(r)
        ps.metric("train_mse", total / steps)
        if rank == 0:
            print(f"epoch {epoch + 1:2d}  train RMSE {(total / steps) ** 0.5:.4f}  test RMSE {r:.4f}  "
                  f"{time.time() - t0:6.1f} s", flush=True)
    result = {"workers": K, "servers": ps.num_servers, "mode": args.mode, "batch": args.batch,
              "epochs": args.epochs, "test_rmse": rmses, "time_s": round(time.time() - t0, 2)}
    result.update({k: round(v, 2) if isinstance(v, float) else v for k, v in sync.stats().items()})
    sync.close()
    ps.barrier()
    ps.close()
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    return result


def compare(args):
    """The K-worker job (launcher) and the same script alone in embedded mode."""
    me = [sys.executable, os.path.abspath(__file__)]
    for k in ("epochs", "batch", "dim", "opt", "lr", "reg", "seed", "split_seed", "init_sd", "servers"):
        me += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    if args.train:
        me += ["--train", os.path.abspath(args.train), "--test", os.path.abspath(args.test)]
    print(f"pshard: {args.workers} workers, {args.servers} servers, {args.mode} mode", flush=True)
    rc, out = jobs.run(jobs.pshard_run(args.servers, args.workers, args.mode) + me + ["--mode", args.mode],
                       args.timeout)
    if rc:
        raise SystemExit(f"the pshard job failed with status {rc}")
    ours = jobs.result(out)
    print(f"alone: embedded mode, {args.servers} servers, {args.alone_mode} mode", flush=True)
    rc, out = jobs.run(me + ["--mode", args.alone_mode], args.timeout, env=jobs.clean_env())
    if rc:
        raise SystemExit(f"the embedded run failed with status {rc}")
    alone = jobs.result(out)
    a, r = ours["test_rmse"][-1], alone["test_rmse"][-1]
    rel = abs(a - r) / r
    print(f"\nMovieLens biased MF, dim {args.dim}, {args.opt} lr {args.lr}, global batch {args.batch}: test RMSE")
    print(f"{'epoch':>5}  {f'{args.workers} workers {args.mode}':>16}  {'alone embedded':>16}")
    for e, (x, y) in enumerate(zip(ours["test_rmse"], alone["test_rmse"])):
        print(f"{e + 1:5d}  {x:16.4f}  {y:16.4f}")
    print(f"{'time':>5}  {ours['time_s']:15.1f}s  {alone['time_s']:15.1f}s")
    ok = rel <= args.tolerance
    print(f"final test RMSE {a:.4f} vs {r:.4f} alone: {100 * rel:.2f}% apart "
          f"(limit {100 * args.tolerance:.0f}%): {'ok' if ok else 'MISSED'}")
    print("COMPARE " + json.dumps({"cluster": ours, "alone": alone, "relative_difference": rel}), flush=True)
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch", type=int, default=256, help="global batch (split over the workers)")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--opt", default="adam")
    ap.add_argument("--lr", type=float, default=0.005)
    ap.add_argument("--reg", type=float, default=0.1)
    ap.add_argument("--init-sd", dest="init_sd", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split-seed", dest="split_seed", type=int, default=42)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--mode", default=os.environ.get("PSHARD_MODE", "async"),
                    help="consistency mode: sync, sync:M, ssp:S or async")
    ap.add_argument("--alone-mode", dest="alone_mode", default=None,
                    help="--compare: mode of the run alone (default: --mode)")
    ap.add_argument("--compare", action="store_true", help="run the K-worker job and the embedded run; print both")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=0.02, help="--compare: allowed relative RMSE difference")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--train", help="your own ratings to train on (user,item,rating per line: CSV or MovieLens' "
                                    "u.data); needs --test")
    ap.add_argument("--test", help="your own ratings to evaluate on (the same formats)")
    args = ap.parse_args()
    if bool(args.train) != bool(args.test):
        ap.error("--train and --test go together")
    if args.compare:
        args.alone_mode = args.alone_mode or args.mode
        return compare(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
