#!/usr/bin/env python3
"""bench_links.py - step time against workers and link rate, with and without each value
codec, on links shaped like a cluster's (bench/netns.py: a network namespace per node,
tc tbf on every link). Needs root.

For each link rate R (Gbit/s) and worker count K (S servers), a sync job of links_worker
trains a dense model of --mb MiB of floats: each step every worker pulls the model,
sleeps its share of the compute (--compute-ms / K: strong scaling, the batch split
over the workers), pushes its gradient, and clocks. Each codec runs as push_codec and
pull_codec (topk as push_codec only: pulls have no top-k). It prints:
  - per rate, the link measured in the same run: a bulk pull through one shaped link
    (Gbit/s of payload), against the rate tbf was given;
  - per (rate, K, codec), the median and p90 step time (ms), `pshard plan`'s predicted
    step time for the same set-up (no overlap: the worker pulls, computes, pushes) and
    the bytes one worker moved per step;
  - per rate, where adding workers stops helping: the measured K with the lowest step
    time against plan's "communication dominates for K >" bound;
  - per codec, its cost per step (measured step time minus what its smaller messages
    should save at the measured link rate, median over the runs) and the link rate
    above which it stops paying for itself (where the time saved falls below that cost).
Figures on a busy machine are noise: run it on a quiet one.

usage: bench_links.py [--rates 1,10,25] [--workers 1,2,4] [--servers 2] [--codecs fp16,int8,topk:0.01]
                      [--mb 8] [--steps 8] [--compute-ms 40] [--build DIR]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_list(s, conv):
    return [conv(x) for x in s.split(",") if x.strip()]


def codec_bytes(codec, n, servers):
    """(push, pull) bytes of values one worker moves per step for n floats split over
    `servers` servers (proto/codec.h's sizes)."""
    part = -(-n // servers)
    if codec == "none":
        return 4 * n, 4 * n
    if codec in ("fp16", "bf16"):
        return 2 * n, 2 * n
    if codec == "int8":
        b = servers * (part + 4 * -(-part // 256))
        return b, b
    if codec.startswith("topk:"):
        f = float(codec[5:])
        k = min(part, int(f) if f >= 1 else max(1, -(-int(f * part * 1e6) // 1000000)))
        return servers * 8 * k, 4 * n
    raise ValueError(f"unknown codec {codec!r}")


def table_options(codec):
    if codec == "none":
        return ""
    if codec.startswith("topk:"):
        return f"push_codec={codec}"
    return f"push_codec={codec} pull_codec={codec}"


def plan(pshard, grad_bytes, servers, workers, rate_gbit, compute_ms):
    r = subprocess.run([pshard, "plan", "--gradient", str(int(grad_bytes)), "--servers", str(servers), "--workers",
                        str(workers), "--link", f"{rate_gbit:g}Gbit/s", "--step-time", f"{compute_ms:g}ms", "--json"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"pshard plan: {r.stderr.strip()}")
    return json.loads(r.stdout)


def lines_of(text):
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if parts:
            out[parts[0]] = parts[1:]
    return out


def measure_link(net, a, pshard, worker, mb):
    """Payload Gbit/s of a bulk pull through one shaped link (1 server, 1 worker)."""
    job = netns.Job(net, pshard, 1, 1)
    ws = job.workers([worker, "--mb", str(mb), "--steps", "3", "--pull-only"])
    net.wait(ws, timeout=a.timeout)
    job.finish()
    return float(lines_of(net.log(ws[0]))["pull_gbps"][0])


def run_job(net, a, pshard, worker, k, codec, nodes):
    job = netns.Job(net, pshard, a.servers, k, nodes=nodes)
    argv = [worker, "--mb", str(a.mb), "--steps", str(a.steps), "--warmup", str(min(2, a.steps - 1)),
            "--compute-ms", f"{a.compute_ms / k:g}", "--options", table_options(codec)]
    ws = job.workers(argv)
    net.wait(ws, timeout=a.timeout)
    job.finish()
    out = {}
    for w in ws:  # rank 0 prints, whichever node it is
        out.update(lines_of(net.log(w)))
    med, p90 = float(out["step_ms"][0]), float(out["step_ms"][1])
    l0, l1 = float(out["loss"][0]), float(out["loss"][1])
    return job.nodes, med, p90, (l0, l1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="1,10,25", help="link rates in Gbit/s (1,10,25)")
    ap.add_argument("--workers", default="1,2,4", help="worker counts K (1,2,4)")
    ap.add_argument("--servers", type=int, default=2, help="servers S (2)")
    ap.add_argument("--codecs", default="fp16,int8,topk:0.01", help="codecs besides none (fp16,int8,topk:0.01)")
    ap.add_argument("--mb", type=float, default=8, help="model size in MiB of f32 (8)")
    ap.add_argument("--steps", type=int, default=8, help="steps per run, the first 2 untimed (8)")
    ap.add_argument("--compute-ms", type=float, default=40, help="one worker's compute per step, split over K (40)")
    ap.add_argument("--link-mb", type=float, default=32, help="size of the bulk pull measuring a link (32)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a run may take (300)")
    ap.add_argument("--build", default=os.environ.get("PSHARD_BUILD", os.path.join(ROOT, "build")))
    a = ap.parse_args()
    rates, ks = parse_list(a.rates, float), parse_list(a.workers, int)
    codecs = ["none"] + [c for c in parse_list(a.codecs, str) if c != "none"]
    if a.steps < 3 or a.servers < 1 or not ks or not rates or min(ks) < 1 or min(rates) <= 0 or a.mb <= 0:
        ap.error("need --steps >= 3, --servers >= 1, worker counts >= 1, rates > 0, --mb > 0")
    for c in codecs:
        codec_bytes(c, 1, 1)  # a bad codec name fails here, before any namespace exists
    pshard, worker = os.path.join(a.build, "pshard"), os.path.join(a.build, "bench", "links_worker")
    for p in (pshard, worker):
        if not os.path.exists(p):
            sys.exit(f"bench_links: {p} is missing (build first, or --build DIR)")
    try:
        netns.check_available()
    except netns.Unavailable as e:
        sys.exit(f"bench_links: skipped: {e}")
    netns.install_sigterm()

    n = max(1, int(a.mb * 262144))
    print(f"# bench_links: sync dense model of {a.mb:g} MiB f32, S = {a.servers}, one worker's compute "
          f"{a.compute_ms:g} ms per step split over K; {a.steps} steps per run, medians of the last {a.steps - 2}")
    print("# every node in its own network namespace, each link shaped both ways by tc tbf; "
          "plan = `pshard plan --gradient (push+pull)/2 --link R --step-time T` step, no overlap")
    results = {}  # (rate, k, codec) -> (median ms, plan ms, comm saved ms at measured rate)
    measured = {}
    for rate in rates:
        with netns.Links(rate_gbit=rate) as net:
            measured[rate] = measure_link(net, a, pshard, worker, a.link_mb)
            print(f"\nlink {rate:g} Gbit/s (tbf): a bulk pull of {a.link_mb:g} MiB moves {measured[rate]:.3f} Gbit/s")
            print(f"{'K':>3} {'codec':<11} {'step_ms':>9} {'p90_ms':>9} {'plan_ms':>9} {'meas/plan':>9} "
                  f"{'MB/step':>8} {'loss':>17}")
            for k in ks:
                nodes = None
                for codec in codecs:
                    nodes, med, p90, loss = run_job(net, a, pshard, worker, k, codec, nodes)
                    push, pull = codec_bytes(codec, n, a.servers)
                    pl = plan(pshard, (push + pull) / 2, a.servers, k, rate, a.compute_ms)
                    pms = pl["step_no_overlap_s"] * 1e3
                    # plan's communication at the link rate measured, for the codec's cost
                    comm_meas = pl["comm_time_per_step_s"] * rate / measured[rate] * 1e3
                    results[(rate, k, codec)] = (med, pms, comm_meas, pl["comm_dominates_above_k"])
                    print(f"{k:>3} {codec:<11} {med:>9.1f} {p90:>9.1f} {pms:>9.1f} {med / pms:>9.2f} "
                          f"{(push + pull) / 1e6:>8.2f} {loss[0]:>8.3g}>{loss[1]:<8.3g}", flush=True)
            best = min(ks, key=lambda k: results[(rate, k, "none")][0])
            bound = results[(rate, ks[0], "none")][3]
            print(f"  adding workers: lowest measured step (no codec) at K = {best} of {ks}; plan: communication "
                  f"dominates for K > {bound:.3g}")

    print("\ncodec cost per step = measured step - step without codec + communication it saves (plan's model at "
          "the measured link rate); it stops paying above the link rate where the saving falls below its cost")
    print(f"{'codec':<11} {'cost_ms':>9} {'stops paying above':>20}   slower than none at")
    for codec in codecs[1:]:
        costs, per_gbit = [], []
        slower = []
        for rate in rates:
            for k in ks:
                med, _, comm, _ = results[(rate, k, codec)]
                med0, _, comm0, _ = results[(rate, k, "none")]
                saved = comm0 - comm  # ms saved per step at the measured rate
                costs.append(med - med0 + saved)
                per_gbit.append(saved * measured[rate])  # saved ms x Gbit/s: saved at 1 Gbit/s
                if med > med0:
                    slower.append(f"{rate:g}G/K={k}")
        cost = statistics.median(costs)
        save1 = statistics.median(per_gbit)
        if cost <= 0:
            above = "pays at every rate"
        else:
            above = f"{save1 / cost:.3g} Gbit/s"
        print(f"{codec:<11} {cost:>9.2f} {above:>20}   {', '.join(slower) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
