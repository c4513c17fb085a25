"""The binding in one process (embedded mode): happy paths, buffers, futures,
lifetimes, threads and every error path."""
import builtins
import gc
import threading
import time

import numpy as np
import pytest

import pshard
from pshard import _lib


@pytest.fixture
def ps():
    with pshard.embedded(servers=2) as c:
        yield c


@pytest.fixture
def ps1():
    """Two servers with one copy of every key: each row and push is counted once."""
    with pshard.embedded(servers=2, replicas=1) as c:
        yield c


def expect(exc_type, name, fn, *args, match=None, **kw):
    with pytest.raises(exc_type) as ei:
        fn(*args, **kw)
    e = ei.value
    assert isinstance(e, pshard.Error)
    assert e.name == name
    assert e.code == _lib.CODES[name]
    assert str(e).startswith(name + ": ")
    if match:
        assert match in e.message, e.message
    return e


# ------------------------------------------------------------------ error table

def test_error_table_matches_the_library():
    # Every code of the library has a class (the table is read from the library) ...
    n = 1
    while _lib.ps_err_name(n).decode() != "PS_ERR_UNKNOWN":
        name = _lib.ps_err_name(n).decode()
        assert _lib.ERRORS[n][0] == name
        assert getattr(pshard, _lib.ERRORS[n][1]).code == n
        n += 1
    assert len(_lib.ERRORS) == n - 1
    # ... and every hand-picked name still names a code of the library.
    assert set(_lib._NAMES) <= set(_lib.CODES), set(_lib._NAMES) - set(_lib.CODES)
    assert issubclass(pshard.TimeoutError, builtins.TimeoutError)
    assert issubclass(pshard.SizeError, ValueError)


def test_error_pickles():
    import pickle
    e = _lib.make_error(8, "unknown table 7")
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is pshard.NoTableError and e2.message == "unknown table 7" and e2.name == "PS_ERR_NO_TABLE"


# ------------------------------------------------------------------ happy paths

def test_context_properties(ps):
    assert (ps.rank, ps.num_workers, ps.num_servers, ps.clock_value) == (0, 1, 2, 0)
    assert ps.epoch >= 1
    assert ps.clock() == 1 and ps.clock_value == 1
    ps.barrier(timeout=5)
    ps.metric("loss", 0.25)
    assert "rank=0/1" in repr(ps)
    st = ps.stats()
    assert st["clock"] == 1 and "pull_wait_s" in st and ps.stat("clock") == 1
    expect(pshard.InvalidArgumentError, "PS_ERR_INVALID", ps.stat, "colour")
    assert ps.server_stats(0)["server"] and ps.server_stats(1)
    expect(pshard.RangeError, "PS_ERR_RANGE", ps.server_stats, 7, match="no server 7")


def test_server_stats_are_numbers_and_name_every_table(ps1):
    ps = ps1
    a = ps.dense("stats_a", 10, opt="sgd", lr=1, mode="async")
    b = ps.sparse("stats_b", 4, opt="adagrad", mode="async")
    a.push(np.ones(10, dtype=np.float32))
    b.push(np.array([1, 2, 3], dtype=np.uint64), np.ones((3, 4), dtype=np.float32))
    total = {}
    for i in range(ps.num_servers):
        st = ps.server_stats(i)
        assert isinstance(st["rows"], int) and isinstance(st["payload_bytes"], int)
        assert isinstance(st["push_staleness"], list)
        assert {"stats_a", "stats_b"} <= set(st["tables"]), st["tables"]
        for name in ("stats_a", "stats_b"):
            t = st["tables"][name]
            assert isinstance(t["id"], int) and t["mode"] == "async"
            total[name] = total.get(name, 0) + t["rows"]
            assert t["pushes"] >= 0
    assert total["stats_b"] == 3  # every row counted once, on its owner
    assert pshard.core.parse_stats("x 1\ny 2.5\nz a\ntable 3 name=t rows=4 mode=sync\nh 1 2 3\n"
                                   "node 2 role=server alive=1\ntasks done=3\np_staleness 4\n") == {
        "x": 1, "y": 2.5, "z": "a", "h": [1, 2, 3], "tables": {"t": {"id": 3, "rows": 4, "mode": "sync", "name": "t"}},
        "nodes": [{"id": 2, "role": "server", "alive": 1}], "tasks": {"done": 3}, "p_staleness": [4]}


def test_stats_name_every_table_with_its_traffic(ps1):
    ps = ps1
    """stats() has every declared table by name; server_stats() every table a server holds."""
    a = ps.dense("traffic_a", 1000, opt="sgd", lr=1, mode="async")  # one slice, on one server
    b = ps.sparse("traffic_b", 4, opt="sgd", mode="async")
    for _ in range(3):
        a.push(np.ones(1000, dtype=np.float32))
        a.pull()
    keys = np.array([1, 2, 3, 4, 5], dtype=np.uint64)
    b.push(keys, np.ones((5, 4), dtype=np.float32))
    b.pull(keys)
    st = ps.stats()
    assert set(st["tables"]) == {"traffic_a", "traffic_b"}
    ta, tb = st["tables"]["traffic_a"], st["tables"]["traffic_b"]
    assert ta["id"] == a.id and tb["id"] == b.id
    assert ta["pushed_bytes"] >= 3 * 4000 and ta["pulled_bytes"] == 3 * 4000
    assert tb["pushed_bytes"] == 5 * (8 + 16) and tb["pulled_bytes"] >= 5 * 16
    # A push goes to every server (each counts the worker's batch), a pull only to the
    # server holding the slice: three frames and three answers a step.
    assert ta["sent_frames"] == ta["received_frames"] == 3 * 3
    assert tb["sent_frames"] == tb["received_frames"] >= 2
    # The tables' traffic adds up to the worker's.
    assert ta["pushed_bytes"] + tb["pushed_bytes"] == st["bytes_pushed"]
    assert ta["pulled_bytes"] + tb["pulled_bytes"] == st["bytes_pulled"]
    for i in range(ps.num_servers):
        assert {"traffic_a", "traffic_b"} <= set(ps.server_stats(i)["tables"])
    expect(pshard.NoTableError, "PS_ERR_NO_TABLE", ps.stat, "table_pushed_bytes:999")


def test_counting_off_in_one_process():
    """metrics="off": the context and its embedded servers count nothing on the request
    path; the engine's own counters and every answer remain."""
    with pshard.embedded(servers=1, metrics="off") as ps:
        t = ps.dense("quiet", 64, opt="sgd", lr=1, mode="async")
        t.push(np.ones(64, dtype=np.float32))
        assert np.all(t.pull() == -1)
        st = ps.stats()
        assert st["pushes"] == st["pulls"] == st["bytes_pushed"] == st["bytes_pulled"] == 0
        assert st["tables"]["quiet"]["pushed_bytes"] == st["tables"]["quiet"]["sent_frames"] == 0
        assert st["http_port"] == -1  # embedded servers serve no HTTP
        srv = ps.server_stats(0)
        assert srv["metrics_counting"] == 0 and srv["tables"]["quiet"]["pushes"] == 1
    with pshard.embedded(servers=1) as ps:
        assert ps.server_stats(0)["metrics_counting"] == 1
    expect(pshard.ConfigError, "PS_ERR_CONFIG", pshard.embedded, servers=1, metrics="sometimes", match="on or off")


def test_checkpoint_checks_its_timeout(ps):
    expect(pshard.InvalidArgumentError, "PS_ERR_INVALID", ps.checkpoint, timeout=-1)
    expect(pshard.InvalidArgumentError, "PS_ERR_INVALID", ps.checkpoint, timeout=float("nan"))
    assert ps.clock_value == 0  # nothing was sent: the context goes on
    assert ps.clock() == 1


def test_checkpoint_without_a_checkpoint_directory(ps):
    expect(pshard.ConfigError, "PS_ERR_CONFIG", ps.checkpoint, timeout=5, match="checkpoint")
    assert ps.clock() == 1


def test_tasks(ps):
    assert list(ps.tasks(3, 2)) == [(p, e) for e in range(2) for p in range(3)]
    assert ps.next_task(timeout=0) is None
    expect(pshard.ConflictError, "PS_ERR_CONFLICT", ps.tasks_init, 4, 2)


def test_dense_push_pull_sync_round(ps):
    w = ps.dense("w", (4, 3), opt="sgd", lr=0.5)
    assert w.shape == (4, 3) and w.size == 12 and w.kind == "dense" and ps.table("w") is w
    x = w.pull()
    assert x.shape == (4, 3) and x.dtype == np.float32 and not x.any()
    w.push(np.ones((4, 3), np.float32), batch=8)
    assert not w.pull().any(), "sync mode: a push is applied at the end of the round"
    ps.clock()
    np.testing.assert_allclose(w.pull(), -0.5)
    w.push(np.arange(12, dtype=np.float64), batch=2, lr=1.0)   # flat, float64 (converted), lr override
    ps.clock()
    np.testing.assert_allclose(w.pull().ravel(), -0.5 - np.arange(12), rtol=1e-6)


def test_dense_ranges_across_slices(ps):
    # slice=4: 25 floats are 7 slices spread over both servers.
    t = ps.dense("r", 25, opt="sgd", lr=1.0, update="sum", init="const:2", slice=4)
    np.testing.assert_allclose(t.pull(), 2.0)
    t.push_range(3, np.arange(10, dtype=np.float32), batch=1)
    ps.clock()
    want = np.full(25, 2.0, np.float32)
    want[3:13] -= np.arange(10)
    np.testing.assert_allclose(t.pull(), want)
    np.testing.assert_allclose(t.pull_range(5, 15), want[5:20])
    out = np.empty(4, np.float32)
    assert t.pull_range(21, 4, out=out) is out
    np.testing.assert_allclose(out, want[21:])


def test_sparse_push_pull(ps):
    e = ps.sparse("emb", 3, opt="sgd", lr=1.0, init="normal:0.1", seed=7)
    assert e.dim == 3 and e.kind == "sparse"
    first = e.pull([5, 9, 5])
    assert first.shape == (3, 3)
    np.testing.assert_array_equal(first[0], first[2])
    again = e.pull(np.array([[9, 5]], dtype=np.int64))
    assert again.shape == (1, 2, 3)
    np.testing.assert_array_equal(again[0, 0], first[1])
    # Repeated keys in one push are summed; the batch weights the mean.
    e.push(np.array([5, 5, 9], np.uint64), np.ones((3, 3), np.float32), batch=4)
    ps.clock()
    now = e.pull([5, 9])
    np.testing.assert_allclose(now[0], first[0] - 2.0, rtol=1e-6)
    np.testing.assert_allclose(now[1], first[1] - 1.0, rtol=1e-6)
    e.push([], np.zeros((0, 3)), batch=1)   # an empty push is fine (it only counts the batch)
    assert e.pull([]).shape == (0, 3)


def test_push_pull_in_one_round_trip(ps):
    d = ps.dense("w", (4, 5), opt="sgd", lr=1.0, mode="async", update="sum")
    g = np.arange(20, dtype=np.float32).reshape(4, 5)
    w = d.push_pull(g)
    np.testing.assert_array_equal(w, -g)
    w2 = d.push_pull(w, out=w)             # in place: grads and out are one array
    assert w2 is not None and np.all(w == 0)
    e = ps.sparse("e", 2, opt="sgd", lr=1.0, mode="async", update="sum")
    rows = e.push_pull([3, 8], np.ones((2, 2), np.float32))
    np.testing.assert_array_equal(rows, -np.ones((2, 2)))
    expect(pshard.Error, "PS_ERR_SIZE", d.push_pull, np.zeros(3, np.float32))
    expect(pshard.Error, "PS_ERR_DIM", e.push_pull, [1], np.zeros((1, 3), np.float32))


def test_same_rows_on_every_server_layout():
    """Rows come from a deterministic initialiser: a different server count gives the same values."""
    with pshard.embedded(servers=1) as a:
        ra = a.sparse("e", 4, init="uniform:1", seed=3).pull(np.arange(50))
    with pshard.embedded(servers=3) as b:
        rb = b.sparse("e", 4, init="uniform:1", seed=3).pull(np.arange(50))
    np.testing.assert_array_equal(ra, rb)


def test_attach_to_declared_table(ps):
    a = ps.dense("same", 5, opt="adam", lr=0.01)
    b = ps.dense("same", 5, options="opt=adam lr=0.01")
    assert a.id == b.id


# ------------------------------------------------------------------ buffers

def test_float32_contiguous_buffers_are_not_copied():
    from pshard import core
    g = np.ones((4, 3), np.float32)
    assert core._floats(g) is g
    k = np.arange(5, dtype=np.uint64)
    assert core._keys(k) is k
    assert core._floats(g.T) is not g and core._floats(g.T).flags.c_contiguous
    assert core._keys([1, 2]).dtype == np.uint64


def test_pull_into_out_without_copy(ps):
    w = ps.dense("w", (2, 5), init="const:3")
    out = np.zeros(10, np.float32)
    res = w.pull(out=out)
    assert np.shares_memory(res, out) and res.shape == (2, 5)
    np.testing.assert_allclose(out, 3.0)
    e = ps.sparse("e", 2, init="const:1")
    rows = np.zeros((3, 2), np.float32)
    assert e.pull([1, 2, 3], out=rows) is not None and np.all(rows == 1)


# ------------------------------------------------------------------ futures

def test_futures(ps):
    w = ps.dense("w", 8, opt="sgd", lr=1.0, update="sum")
    e = ps.sparse("e", 2, opt="sgd", lr=1.0, update="sum")
    f1 = w.push_async(np.ones(8, np.float32))
    f2 = e.push_async([1, 2], np.ones((2, 2), np.float32))
    assert f1.wait(timeout=10) is None and f2.wait() is None
    assert f1.done() and f1.wait() is None          # waiting again returns the same result
    ps.clock()
    out = np.empty(8, np.float32)
    f3 = w.pull_async(out=out)
    f4 = e.pull_async(np.array([2, 1, 2]))
    f5 = w.pull_range_async(2, 3)
    f6 = w.push_range_async(0, np.ones(2, np.float32))
    assert np.shares_memory(f3.wait(), out)
    np.testing.assert_allclose(out, -1.0)
    np.testing.assert_allclose(f4.result(), -1.0)
    np.testing.assert_allclose(f5.wait(), -1.0)
    f6.wait()
    assert "done" in repr(f6)


def test_future_keeps_its_arrays_alive(ps):
    e = ps.sparse("e", 64, opt="sgd", lr=1.0, update="sum", init="const:1")
    keys = np.arange(1000, dtype=np.uint64)
    futures = [e.push_async(keys.copy(), np.full((1000, 64), 0.5, np.float32)) for _ in range(4)]
    pulls = [e.pull_async(np.arange(1000)) for _ in range(4)]
    gc.collect()
    for f in futures:
        f.wait()
    for f in pulls:
        assert f.wait().shape == (1000, 64)
    ps.clock()
    np.testing.assert_allclose(e.pull([0, 999]), 1.0 - 4 * 0.5)


def test_dropped_and_canceled_futures(ps):
    w = ps.dense("w", 1000, init="const:1")
    for _ in range(50):
        w.pull_async()            # dropped at once: canceled and freed by __del__
    f = w.pull_async()
    f.cancel()
    f.cancel()
    try:
        f.wait()                  # it may have finished before the cancel
    except pshard.CanceledError as e:
        assert e.name == "PS_ERR_CANCELED"
    gc.collect()
    assert not ps._state.reqs
    np.testing.assert_allclose(w.pull(), 1.0)


def test_close_with_outstanding_requests():
    ps = pshard.embedded(servers=2)
    w = ps.dense("w", 100000, init="const:1")
    futures = [w.pull_async() for _ in range(20)]
    ps.close()
    assert not ps._state.reqs
    for f in futures:              # each either finished before the close or reports it
        try:
            np.testing.assert_allclose(f.wait(), 1.0)
        except pshard.ClosedError as e:
            assert "closed" in e.message
    del futures
    gc.collect()


def test_gc_any_order():
    """A context, its tables and futures in one reference cycle: the collector may
    finalize them in any order; nothing is freed twice or after the context."""
    for i in range(5):
        ps = pshard.embedded(servers=1)
        w = ps.dense("w", 50000, init="const:2")
        holder = {"ps": ps, "w": w, "futures": [w.pull_async() for _ in range(5)]}
        holder["self"] = holder
        ps.cycle = holder
        if i % 2:
            for f in holder["futures"]:
                f.wait()
        del ps, w, holder
        gc.collect()
    with pshard.embedded(servers=1) as ps:
        assert ps.dense("w", 3, init="const:2").pull().tolist() == [2, 2, 2]


# ------------------------------------------------------------------ threads and the GIL

def test_gil_released_while_waiting():
    """A thread blocked in C (here ps_ctx_open waiting for a second worker that never
    comes, until its connect deadline) lets other Python threads run."""
    counter = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(0.05)
        before = counter[0]
        t0 = time.time()
        e = expect(pshard.TimeoutError, "PS_ERR_TIMEOUT", pshard.embedded, servers=1, workers=2,
                   connect_timeout_ms=800)
        assert isinstance(e, builtins.TimeoutError)
        waited = time.time() - t0
        progressed = counter[0] - before
    finally:
        stop.set()
        t.join()
    assert waited >= 0.7
    assert progressed > 10000, f"the spinning thread advanced only {progressed} times in {waited:.2f} s"


def test_threads_share_a_context(ps):
    e = ps.sparse("e", 8, init="const:1")
    errors = []

    def work(seed):
        try:
            rng = np.random.default_rng(seed)
            for _ in range(50):
                assert np.all(e.pull(rng.integers(0, 10000, 64)) == 1)
        except Exception as ex:  # pragma: no cover - reported below
            errors.append(ex)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_close_waits_for_calls_in_other_threads():
    ps = pshard.embedded(servers=1)
    e = ps.sparse("e", 16, init="const:1")
    stop = threading.Event()
    seen = []

    def work():
        while not stop.is_set():
            try:
                e.pull(np.arange(500))
            except pshard.ClosedError:
                seen.append("closed")
                return

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    ps.close()
    stop.set()
    for t in threads:
        t.join(10)
    assert ps.closed


def test_set_log():
    got = []
    pshard.set_log(lambda level, msg: got.append((level, msg)), "debug")
    try:
        with pshard.embedded(servers=1) as ps:
            ps.dense("w", 2)
    finally:
        pshard.set_log(None)
    assert all(isinstance(m, str) for _, m in got)


# ------------------------------------------------------------------ error paths

def test_unknown_table(ps):
    expect(pshard.NoTableError, "PS_ERR_NO_TABLE", ps.table, "nope", match="nope")
    ghost = pshard.DenseTable(ps, "ghost", 4242, "", (4,))           # an id this context never declared
    e = expect(pshard.NoTableError, "PS_ERR_NO_TABLE", ghost.pull, match="unknown table 4242")
    assert isinstance(e, LookupError)
    ghost_rows = pshard.SparseTable(ps, "ghost", 4243, "", 2)
    expect(pshard.NoTableError, "PS_ERR_NO_TABLE", ghost_rows.push_async, [1], np.ones((1, 2)))


def test_wrong_shapes(ps):
    w = ps.dense("w", (4, 3))
    e = ps.sparse("e", 3)
    expect(pshard.SizeError, "PS_ERR_SIZE", w.push, np.ones((3, 4), np.float32), match="shape")
    expect(pshard.SizeError, "PS_ERR_SIZE", w.push_async, np.ones(11, np.float32))
    expect(pshard.SizeError, "PS_ERR_SIZE", w.pull, out=np.empty(5, np.float32))
    expect(pshard.InvalidArgumentError, "PS_ERR_INVALID", w.pull, out=np.empty(12, np.float64))
    expect(pshard.DimError, "PS_ERR_DIM", e.push, [1, 2], np.ones((2, 4), np.float32), match="dim 3")
    expect(pshard.SizeError, "PS_ERR_SIZE", e.push, [1, 2], np.ones((3, 3), np.float32))
    expect(pshard.SizeError, "PS_ERR_SIZE", e.pull, [1, 2], out=np.empty((3, 3), np.float32))
    # Caught by the library itself:
    expect(pshard.RangeError, "PS_ERR_RANGE", w.pull_range, 10, 5, match="outside a table of 12 floats")
    expect(pshard.RangeError, "PS_ERR_RANGE", w.pull_range, 0, 0)
    expect(pshard.InvalidArgumentError, "PS_ERR_INVALID", ps.dense, "bad", (3, 0))


def test_bad_arguments(ps):
    w = ps.dense("w", 3)
    e = ps.sparse("e", 2)
    expect(pshard.InvalidArgumentError, "PS_ERR_INVALID", e.pull, [-1])
    expect(pshard.InvalidArgumentError, "PS_ERR_INVALID", e.pull, [1.5])
    expect(pshard.InvalidArgumentError, "PS_ERR_INVALID", w.push, np.ones(3), lr=-1)
    expect(pshard.InvalidArgumentError, "PS_ERR_INVALID", w.push, np.ones(3), batch=-1)
    expect(pshard.InvalidArgumentError, "PS_ERR_INVALID", w.pull, timeout=-1)
    # From the library: a mean-mode push needs a batch size.
    expect(pshard.InvalidArgumentError, "PS_ERR_INVALID", w.push, np.ones(3), batch=0, match="batch size 0")
    expect(pshard.InvalidArgumentError, "PS_ERR_INVALID", ps.metric, "", 1.0)
    assert not hasattr(e, "pull_range")


def test_conflicting_declaration(ps):
    ps.dense("w", 4, opt="sgd", lr=0.1)
    expect(pshard.ConflictError, "PS_ERR_CONFLICT", ps.dense, "w", 4, opt="adam")
    expect(pshard.ConflictError, "PS_ERR_CONFLICT", ps.sparse, "w", 4)


def test_bad_options_and_config():
    with pshard.embedded(servers=1) as ps:
        expect(pshard.ConfigError, "PS_ERR_CONFIG", ps.dense, "w", 4, opt="nesterov")
        expect(pshard.ConfigError, "PS_ERR_CONFIG", ps.dense, "w", 4, init="gaussian")
        expect(pshard.ConfigError, "PS_ERR_CONFIG", ps.dense, "w", 4, opt="")
    expect(pshard.ConfigError, "PS_ERR_CONFIG", pshard.embedded, timeout_ms="soon", match="timeout_ms")
    expect(pshard.ConfigError, "PS_ERR_CONFIG", pshard.embedded, colour="blue", match="colour")
    expect(pshard.ConfigError, "PS_ERR_CONFIG", pshard.embedded, servers=0)
    expect(pshard.ConfigError, "PS_ERR_CONFIG", pshard.connect, match="scheduler")   # no job in the environment
    expect(pshard.ConfigError, "PS_ERR_CONFIG", pshard.embedded, mode="eventually")


def test_unreachable_scheduler():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()   # nobody listens there now
    expect(pshard.UnavailableError, "PS_ERR_UNAVAILABLE", pshard.connect, scheduler=f"127.0.0.1:{port}",
           connect_timeout_ms=1000)


def test_closed_context():
    ps = pshard.embedded(servers=1)
    w = ps.dense("w", 3)
    e = ps.sparse("e", 3)
    f = w.pull_async()
    ps.close()
    ps.close()                                    # idempotent
    assert ps.closed and repr(ps) == "<pshard.Context closed>"
    for call in (w.pull, lambda: w.push(np.ones(3)), lambda: e.pull([1]), w.pull_async, ps.clock, ps.barrier,
                 lambda: ps.metric("x", 1), lambda: ps.dense("v", 2), lambda: ps.rank):
        expect(pshard.ClosedError, "PS_ERR_CLOSED", call, match="closed")
    try:
        f.wait()
    except pshard.ClosedError:
        pass


def test_zero_timeout_polls_a_future():
    """wait(0) polls: TimeoutError ("still running") leaves the future valid. The
    waiting cases with two workers (a sync round that cannot complete) are in
    test_cluster.py."""
    with pshard.embedded(servers=1) as ps:
        w = ps.dense("w", 4_000_000, init="const:1")
        f = w.pull_async()
        try:
            f.wait(timeout=0)
            finished_at_once = True
        except pshard.TimeoutError as e:
            finished_at_once = False
            assert e.name == "PS_ERR_TIMEOUT" and "still running" in e.message
        assert f.wait(timeout=30)[0] == 1.0 and f.done()
        assert finished_at_once in (True, False)


def test_zeros_gives_shared_float32_arrays_that_push_and_pull_like_any():
    a = pshard.zeros((3, 5))
    assert a.shape == (3, 5) and a.dtype == np.float32 and a.flags["C_CONTIGUOUS"] and a.flags["WRITEABLE"]
    assert not a.any() and a.ctypes.data % 4096 == 0
    assert pshard.zeros(7).shape == (7,) and pshard.zeros(0).shape == (0,)
    with pytest.raises(ValueError):
        pshard.zeros((2, -1))
    row = a[1]
    del a
    gc.collect()
    row[:] = 2  # a view keeps the memory alive
    assert row.sum() == 10
    with pshard.embedded(servers=2) as ps:
        w = ps.dense("w", 100000, opt="sgd", lr=0.5)
        g = pshard.zeros(100000)
        g[:] = np.arange(100000) % 5
        out = pshard.zeros(100000)
        w.push(g)
        ps.clock()
        w.pull(out=out)
        np.testing.assert_array_equal(out, -0.5 * (np.arange(100000) % 5).astype(np.float32))
