"""A worker of the 2-worker job in test_cluster.py (run under `pshard run -s 2 -w 2`).

It checks, with a real scheduler and servers in other processes: joining from the
environment (pshard.embedded() joins the launcher's job instead of starting threads),
the sync round's batch-weighted mean over workers, sparse pushes from both workers, a
pull that cannot complete until the other worker clocks (a future's wait(timeout)
raises TimeoutError and stays valid; a blocking call's timeout), the GIL released
while blocked, tasks and metrics. Prints "OK <rank> ..." on success; any failure
raises (exit status 1).
"""
import threading
import time

import numpy as np

import pshard


def main():
    ps = pshard.embedded(servers=5)       # under a launcher: joins its job
    r = ps.rank
    assert (ps.num_workers, ps.num_servers) == (2, 2), (ps.num_workers, ps.num_servers)
    w = ps.dense("w", (3, 70000), opt="sgd", lr=1.0, slice=50000)
    e = ps.sparse("e", 4, opt="sgd", lr=1.0, update="sum")

    # Round 0: batch-weighted mean of the two workers' gradients.
    w.push(np.full((3, 70000), r + 1, np.float32), batch=r + 1)
    e.push([10 + r, 99], np.ones((2, 4), np.float32))
    ps.clock()
    np.testing.assert_allclose(w.pull(), -(1 * 1 + 2 * 2) / 3, rtol=1e-6)
    rows = e.pull([10, 11, 99])
    np.testing.assert_allclose(rows, [[-1] * 4, [-1] * 4, [-2] * 4])
    ps.barrier(timeout=20)

    # Round 1: worker 1 is late; worker 0's pull at clock 2 must wait for it.
    if r == 0:
        w.push(np.ones((3, 70000), np.float32), batch=1)
        ps.clock()
        f = w.pull_async()
        t0 = time.time()
        try:
            f.wait(timeout=0.3)
            raise AssertionError("the pull finished before the round was complete")
        except pshard.TimeoutError as ex:
            assert ex.name == "PS_ERR_TIMEOUT"
        assert time.time() - t0 >= 0.25
        try:
            w.pull(timeout=0.3)
            raise AssertionError("a blocking pull returned before the round was complete")
        except pshard.TimeoutError as ex:
            assert ex.name == "PS_ERR_TIMEOUT"
        # Other Python threads run while this one is blocked in C.
        counter, stop = [0], threading.Event()

        def spin():
            while not stop.is_set():
                counter[0] += 1
        th = threading.Thread(target=spin)
        th.start()
        try:
            try:
                f.wait(timeout=0.3)
            except pshard.TimeoutError:
                pass
        finally:
            stop.set()
            th.join()
        assert counter[0] > 10000, counter[0]
        got = f.wait(timeout=20)                 # the same future, now complete
        np.testing.assert_allclose(got, -5 / 3 - (1 * 1 + 3 * 2) / 3, rtol=1e-6)
    else:
        time.sleep(1.5)
        w.push(np.full((3, 70000), 3, np.float32), batch=2)
        ps.clock()
        np.testing.assert_allclose(w.pull(timeout=20), -5 / 3 - 7 / 3, rtol=1e-6)

    ps.metric("loss", 0.5 + r)
    mine = list(ps.tasks(6, 1))
    ps.barrier(timeout=20)
    print(f"OK {r} tasks={sorted(p for p, _ in mine)}", flush=True)
    ps.close()


if __name__ == "__main__":
    main()
