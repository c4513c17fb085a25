"""core.py - contexts, tables and futures over the public C API.

Objects and ownership
 - Context wraps one ps_ctx. Its C handle lives in a _State shared with every request
   started on it. Tables and futures keep their Context alive (strong references), so
   reference counting always frees futures before their context.
 - The garbage collector may still finalize a context and its futures in any order
   (a reference cycle, interpreter exit). That is safe because freeing goes through
   _State and _Req, which are plain objects with flags under locks: a request is freed
   exactly once (by whoever comes first: Future.wait, Future.cancel, Future.__del__ or
   Context.close), and the context frees every outstanding request before it calls
   ps_ctx_close, so no ps_req outlives its ps_ctx.
 - Context.close waits for blocking calls running in other threads (each ends by its
   deadline), then marks the context closed: later calls raise ClosedError.

Buffers
 - float32 C-contiguous arrays (and uint64 key arrays) are handed to C as they are,
   without copies; other dtypes or layouts are converted once (a copy). Pulls write
   straight into the result array (or into `out=` when given).
 - A non-blocking call's arrays are referenced by its request until the request is
   freed, so the garbage collector cannot take them while the library still reads or
   writes them. A pull's `out` must not be read before the future is waited.

Threads: a Context may be used from several threads at once; a Future from one thread
at a time is the C rule, enforced here with a lock per request. The GIL is released
during every C call (ctypes.CDLL), so waiting never blocks other Python threads.
"""
import atexit
import ctypes
import math
import os
import threading
import weakref

import numpy as np

from . import _lib as L

_F32 = np.dtype(np.float32)
_U64 = np.dtype(np.uint64)
_INT_MAX = 2**31 - 1
_TIMEOUT = L.CODES["PS_ERR_TIMEOUT"]
_PENDING = L.CODES["PS_ERR_PENDING"]  # ps_req_wait: still running after this wait


def _ms(timeout):
    """Seconds (float) to the C API's milliseconds; None means the context default."""
    if timeout is None:
        return -1
    if timeout < 0 or math.isnan(timeout):
        raise L.error("PS_ERR_INVALID", f"timeout must be None or >= 0 seconds, not {timeout!r}")
    return min(int(math.ceil(timeout * 1000.0)), _INT_MAX)


def _lr(lr):
    if lr is None:
        return -1.0
    lr = float(lr)
    if not lr >= 0:
        raise L.error("PS_ERR_INVALID", f"lr must be None (the table's schedule) or >= 0, not {lr!r}")
    return lr


def _batch(batch):
    b = int(batch)
    if b != batch or not 0 <= b < 2**32:
        raise L.error("PS_ERR_INVALID", f"batch must be an integer in [0, 2^32), not {batch!r}")
    return b


def _keys(keys):
    """Keys as a C-contiguous uint64 array (no copy if it already is one)."""
    a = keys if isinstance(keys, np.ndarray) else np.asarray(keys)
    if a.dtype != _U64:
        if a.size == 0:
            a = a.astype(_U64)
        elif a.dtype.kind == "i":
            if a.min() < 0:
                raise L.error("PS_ERR_INVALID", "keys must be >= 0")
            a = a.astype(_U64)
        elif a.dtype.kind == "u" or a.dtype.kind == "b":
            a = a.astype(_U64)
        else:
            raise L.error("PS_ERR_INVALID", f"keys must be integers, not {a.dtype}")
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return a


def _floats(x):
    """Values as a C-contiguous float32 array (no copy if it already is one)."""
    a = x if isinstance(x, np.ndarray) else np.asarray(x)
    if a.dtype != _F32 or not a.flags.c_contiguous:
        if a.dtype.kind not in "fiub":
            raise L.error("PS_ERR_INVALID", f"values must be numbers, not {a.dtype}")
        a = np.ascontiguousarray(a, dtype=_F32)
    return a


def _out(out, shape, what):
    """A caller's destination array: used as is, so it must fit exactly."""
    if out is None:
        return np.empty(shape, dtype=_F32)
    if not isinstance(out, np.ndarray) or out.dtype != _F32 or not out.flags.c_contiguous or not out.flags.writeable:
        raise L.error("PS_ERR_INVALID", f"out must be a writeable C-contiguous float32 numpy array ({what})")
    n = int(np.prod(shape))
    if out.size != n:
        raise L.error("PS_ERR_SIZE", f"out has {out.size} floats, {what} needs {n}")
    return out


def _addr(a):
    return a.ctypes.data if a.size else None


# ------------------------------------------------------------------------- state

class _State:
    """The C context plus the bookkeeping that makes closing it safe."""

    def __init__(self, ptr):
        self.ptr = ptr
        self.cond = threading.Condition(threading.RLock())
        self.active = 0        # blocking calls in progress
        self.closed = False
        self.reqs = {}         # id -> _Req not yet freed

    def enter(self):
        with self.cond:
            if self.closed:
                raise L.error("PS_ERR_CLOSED", "context is closed")
            self.active += 1
            return self.ptr

    def leave(self):
        with self.cond:
            self.active -= 1
            if self.active == 0:
                self.cond.notify_all()

    def register(self, req):
        with self.cond:
            self.reqs[id(req)] = req

    def forget(self, req):
        with self.cond:
            self.reqs.pop(id(req), None)

    def close(self):
        with self.cond:
            if self.closed:
                return
            self.closed = True
            while self.active:
                self.cond.wait()
            reqs = list(self.reqs.values())
        # First record what already finished (it keeps its result), then cancel the
        # rest, which then read as "closed".
        for r in reqs:
            r.poll()
        for r in reqs:
            r.cancel(L.CODES["PS_ERR_CLOSED"], "context closed while the request was running", poll=False)
        with self.cond:
            ptr, self.ptr = self.ptr, None
        if ptr:
            L.ps_ctx_close(ptr)


class _Req:
    """One ps_req and the arrays it borrows; freed exactly once."""

    __slots__ = ("ptr", "state", "lock", "keep", "final", "__weakref__")

    def __init__(self, state, ptr, keep):
        self.ptr = ptr
        self.state = state
        self.lock = threading.RLock()
        self.keep = keep
        self.final = None      # (code, message) once known

    def _release(self):
        ptr, self.ptr = self.ptr, None
        if ptr:
            L.ps_req_free(ptr)  # cancels a running request; returns once C let go of the buffers
        self.keep = None
        self.state.forget(self)

    def _wait(self, ms):
        """(code, message) if the request finished within ms, else None (still running:
        ps_req_wait's PS_ERR_PENDING; a request that failed by its own deadline finished
        with PS_ERR_TIMEOUT)."""
        rc = L.ps_req_wait(self.ptr, ms)
        if rc == _PENDING:
            return None
        msg = L.ps_errmsg() if rc else b""
        return (rc, msg.decode("utf-8", "replace"))

    def wait(self, ms):
        """(code, message) of the finished request; raises TimeoutError if still running."""
        with self.lock:
            if self.final is None and self.ptr:
                final = self._wait(ms)
                if final is None:
                    after = f"{ms} ms" if ms >= 0 else "the context's request deadline"
                    raise L.error("PS_ERR_TIMEOUT", f"request still running after {after}")
                self.final = final
                self._release()
            return self.final

    def poll(self):
        """Record the result if the request finished; never blocks."""
        with self.lock:
            if self.final is None and self.ptr:
                self.final = self._wait(0)

    def cancel(self, code, message, poll=True):
        """Free the request; if it had not finished, its result becomes (code, message)."""
        with self.lock:
            if poll:
                self.poll()
            if self.final is None:
                self.final = (code, message)
            self._release()


class Future:
    """The handle of a non-blocking push or pull.

    wait(timeout=None) returns the result (the pulled array, or None for a push) or
    raises the request's error; if the request is still running after `timeout`
    seconds it raises pshard.TimeoutError and the future stays valid. None waits up to
    the context's request deadline (config key timeout_ms)."""

    def __init__(self, owner, req, result, what):
        self._owner = owner    # keeps the table, hence the context, alive
        self._req = req
        self._result = result
        self._what = what

    def wait(self, timeout=None):
        code, message = self._req.wait(_ms(timeout))
        if code:
            raise L.make_error(code, message)
        return self._result

    result = wait

    def done(self):
        """True once the request finished (successfully or not); never blocks."""
        try:
            self._req.wait(0)
        except L.ERROR_CLASSES[_TIMEOUT]:
            return False
        return True

    def cancel(self):
        """Cancel the request if it is still running and free it. A later wait()
        raises CanceledError unless the request had already finished."""
        self._req.cancel(L.CODES["PS_ERR_CANCELED"], "canceled")

    def __del__(self):
        try:
            self._req.cancel(L.CODES["PS_ERR_CANCELED"], "canceled")
        except Exception:
            pass

    def __repr__(self):
        state = "done" if self._req.final is not None else "running"
        return f"<pshard.Future {self._what} {state}>"


# ------------------------------------------------------------------------- tables

class Table:
    """A declared table; get one from Context.dense() or Context.sparse()."""

    kind = None

    def __init__(self, ctx, name, tid, options):
        self.context = ctx
        self.name = name
        self.id = tid
        self.options = options

    def _call(self, fn, *args):
        st = self.context._state
        ptr = st.enter()
        try:
            L.check(fn(ptr, self.id, *args))
        finally:
            st.leave()

    def _start(self, fn, args, keep, result, what):
        st = self.context._state
        ptr = st.enter()
        try:
            h = L.c_void_p()
            L.check(fn(ptr, self.id, *args, L.ctypes.byref(h)))
            req = _Req(st, h.value, keep)
            st.register(req)
        finally:
            st.leave()
        return Future(self, req, result, what)


class DenseTable(Table):
    """A dense parameter of a fixed shape (float32). pull() returns an array of that
    shape; push(grads) takes the worker's mean gradient over its local batch."""

    kind = "dense"

    def __init__(self, ctx, name, tid, options, shape):
        super().__init__(ctx, name, tid, options)
        self.shape = shape
        self.size = int(np.prod(shape, dtype=np.int64))

    def __repr__(self):
        return f"<pshard.DenseTable {self.name!r} id={self.id} shape={self.shape} {self.options!r}>"

    def _grads(self, grads):
        g = _floats(grads)
        if g.shape != self.shape and g.shape != (self.size,):
            raise L.error("PS_ERR_SIZE", f"grads of shape {g.shape} do not match table '{self.name}' of shape {self.shape}")
        return g

    def _range(self, offset, count):
        offset, count = int(offset), int(count)
        if offset < 0 or count < 0:
            raise L.error("PS_ERR_RANGE", f"range offset {offset} count {count}: must be >= 0")
        return offset, count

    def pull(self, out=None, timeout=None):
        """The whole table as an array of the table's shape."""
        out = _out(out, self.shape, f"table '{self.name}'")
        self._call(L.ps_pull_range, 0, self.size, _addr(out), _ms(timeout))
        return out.reshape(self.shape)

    def push(self, grads, batch=1, lr=None, timeout=None):
        """Push the gradient of the whole table (shape of the table, or flat)."""
        g = self._grads(grads)
        self._call(L.ps_push_range, 0, self.size, _addr(g), _batch(batch), _lr(lr), _ms(timeout))

    def push_pull(self, grads, batch=1, lr=None, out=None, timeout=None):
        """push(grads) then pull() in one round trip; returns the pulled array. Same
        result as the two calls (async: includes this push; sync: the current clock's
        parameters). out may be grads itself."""
        g = self._grads(grads)
        out = _out(out, self.shape, f"table '{self.name}'")
        self._call(L.ps_push_pull_range, 0, self.size, _addr(g), _batch(batch), _lr(lr), _addr(out), _ms(timeout))
        return out.reshape(self.shape)

    def pull_range(self, offset, count, out=None, timeout=None):
        """Elements [offset, offset+count) of the flattened table, as a flat array."""
        offset, count = self._range(offset, count)
        out = _out(out, (count,), f"range of {count}")
        self._call(L.ps_pull_range, offset, count, _addr(out), _ms(timeout))
        return out

    def push_range(self, offset, grads, batch=1, lr=None, timeout=None):
        """Push gradients for elements [offset, offset+grads.size) of the flattened table."""
        g = _floats(grads)
        offset, count = self._range(offset, g.size)
        self._call(L.ps_push_range, offset, count, _addr(g), _batch(batch), _lr(lr), _ms(timeout))

    def pull_async(self, out=None):
        out = _out(out, self.shape, f"table '{self.name}'")
        return self._start(L.ps_pull_range_start, (0, self.size, _addr(out)), (out,), out.reshape(self.shape),
                           f"pull {self.name}")

    def push_async(self, grads, batch=1, lr=None):
        g = self._grads(grads)
        return self._start(L.ps_push_range_start, (0, self.size, _addr(g), _batch(batch), _lr(lr)), (g,), None,
                           f"push {self.name}")

    def pull_range_async(self, offset, count, out=None):
        offset, count = self._range(offset, count)
        out = _out(out, (count,), f"range of {count}")
        return self._start(L.ps_pull_range_start, (offset, count, _addr(out)), (out,), out, f"pull {self.name}")

    def push_range_async(self, offset, grads, batch=1, lr=None):
        g = _floats(grads)
        offset, count = self._range(offset, g.size)
        return self._start(L.ps_push_range_start, (offset, count, _addr(g), _batch(batch), _lr(lr)), (g,), None,
                           f"push {self.name}")


class SparseTable(Table):
    """An embedding table: rows of `dim` floats keyed by any uint64 id, created on
    first touch by the table's initialiser. Optimisers step only the rows present in
    a round (lazy, as LazyAdam does)."""

    kind = "sparse"

    def __init__(self, ctx, name, tid, options, dim):
        super().__init__(ctx, name, tid, options)
        self.dim = dim
        self.shape = (None, dim)

    def __repr__(self):
        return f"<pshard.SparseTable {self.name!r} id={self.id} dim={self.dim} {self.options!r}>"

    def _grads(self, k, grads):
        g = _floats(grads)
        if g.shape != k.shape + (self.dim,) and g.shape != (k.size, self.dim):
            if g.ndim >= 1 and g.shape[-1] != self.dim:
                raise L.error("PS_ERR_DIM", f"grads rows have {g.shape[-1]} floats, table '{self.name}' has dim {self.dim}")
            raise L.error("PS_ERR_SIZE", f"grads of shape {g.shape} do not match {k.size} keys of dim {self.dim}")
        return g

    def pull(self, keys, out=None, timeout=None):
        """Rows for `keys` (any integer array; repeats allowed): shape keys.shape + (dim,)."""
        k = _keys(keys)
        out = _out(out, k.shape + (self.dim,), f"{k.size} rows of dim {self.dim}")
        self._call(L.ps_pull, _addr(k), k.size, _addr(out), _ms(timeout))
        return out.reshape(k.shape + (self.dim,))

    def push(self, keys, grads, batch=1, lr=None, timeout=None):
        """Push row gradients (shape keys.shape + (dim,)); repeated keys are summed."""
        k = _keys(keys)
        g = self._grads(k, grads)
        self._call(L.ps_push, _addr(k), k.size, _addr(g), _batch(batch), _lr(lr), _ms(timeout))

    def push_pull(self, keys, grads, batch=1, lr=None, out=None, timeout=None):
        """push(keys, grads) then pull(keys) in one round trip; returns the rows."""
        k = _keys(keys)
        g = self._grads(k, grads)
        out = _out(out, k.shape + (self.dim,), f"{k.size} rows of dim {self.dim}")
        self._call(L.ps_push_pull, _addr(k), k.size, _addr(g), _batch(batch), _lr(lr), _addr(out), _ms(timeout))
        return out.reshape(k.shape + (self.dim,))

    def pull_async(self, keys, out=None):
        k = _keys(keys)
        out = _out(out, k.shape + (self.dim,), f"{k.size} rows of dim {self.dim}")
        return self._start(L.ps_pull_start, (_addr(k), k.size, _addr(out)), (k, out),
                           out.reshape(k.shape + (self.dim,)), f"pull {self.name}")

    def push_async(self, keys, grads, batch=1, lr=None):
        k = _keys(keys)
        g = self._grads(k, grads)
        return self._start(L.ps_push_start, (_addr(k), k.size, _addr(g), _batch(batch), _lr(lr)), (k, g), None,
                           f"push {self.name}")


# ------------------------------------------------------------------------- context

_live = weakref.WeakSet()


def _options(options, kw):
    parts = [options.strip()] if options else []
    for k, v in kw.items():
        if v is None:
            continue
        if isinstance(v, float):
            v = repr(v)
        v = str(v)
        if not v or any(c.isspace() for c in v):
            raise L.error("PS_ERR_CONFIG", f"table option {k}={v!r}: values may not be empty or contain spaces")
        parts.append(f"{k}={v}")
    return " ".join(parts)


def _shape(shape):
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    shape = tuple(int(s) for s in shape)
    if not shape or any(s <= 0 for s in shape):
        raise L.error("PS_ERR_INVALID", f"a dense table needs a shape of positive sizes, not {shape}")
    return shape


class Context:
    """A worker's connection to a job (a ps_ctx). Get one from pshard.connect() or
    pshard.embedded(); close it with close() or a `with` block."""

    def __init__(self, config=None, env=True):
        self._state = None
        self.tables = {}
        cfg = L.c_void_p()
        L.check(L.ps_config_new(L.ctypes.byref(cfg)))
        try:
            if env:
                L.check(L.ps_config_from_env(cfg))
            for k, v in (config or {}).items():
                if v is None:
                    continue
                if isinstance(v, bool):
                    v = int(v)
                L.check(L.ps_config_set(cfg, str(k).encode(), str(v).encode()))
            self.config = {k: L.ps_config_get(cfg, k.encode()).decode()
                           for k in ("role", "scheduler", "servers", "workers", "embedded", "mode", "timeout_ms",
                                     "connect_timeout_ms", "transport")
                           if L.ps_config_get(cfg, k.encode()) is not None}
            ctx = L.c_void_p()
            L.check(L.ps_ctx_open(cfg, L.ctypes.byref(ctx)))  # blocks (GIL released) until the job starts
        finally:
            L.ps_config_free(cfg)
        self._state = _State(ctx.value)
        _live.add(self)

    # -- properties
    def _get(self, fn):
        st = self._state
        ptr = st.enter()
        try:
            return fn(ptr)
        finally:
            st.leave()

    @property
    def rank(self):
        """This worker's rank in [0, num_workers)."""
        return self._get(L.ps_ctx_rank)

    @property
    def num_workers(self):
        return self._get(L.ps_ctx_num_workers)

    @property
    def num_servers(self):
        return self._get(L.ps_ctx_num_servers)

    @property
    def clock_value(self):
        """Completed iterations (calls of clock())."""
        return self._get(L.ps_ctx_clock)

    @property
    def epoch(self):
        """Membership epoch as last heard from the scheduler."""
        return self._get(L.ps_ctx_epoch)

    @property
    def closed(self):
        return self._state is None or self._state.closed

    # -- tables
    def _declare(self, name, kind, size, options):
        if not isinstance(name, str) or not name:
            raise L.error("PS_ERR_INVALID", "table name must be a non-empty string")
        st = self._state
        ptr = st.enter()
        try:
            tid = L.c_uint32()
            L.check(L.ps_table_declare(ptr, name.encode(), kind, size, options.encode(), L.ctypes.byref(tid)))
        finally:
            st.leave()
        return tid.value

    def dense(self, name, shape, options=None, **opts):
        """Declare (or attach to) a dense table of `shape` float32s.

        Options are keyword arguments or a string, as in ps_table_declare:
        opt=sgd|momentum|adagrad|adam|ftrl, lr, momentum, beta1, beta2, eps, acc0, l1,
        l2, beta, update=mean|sum, init=zero|const:V|uniform:A|normal:SD, seed, slice.
        Declaring the same name with different options raises ConflictError."""
        shape = _shape(shape)
        o = _options(options, opts)
        t = DenseTable(self, name, self._declare(name, L.PS_DENSE, int(np.prod(shape, dtype=np.int64)), o), o, shape)
        self.tables[name] = t
        return t

    def sparse(self, name, dim, options=None, **opts):
        """Declare (or attach to) a sparse table of rows of `dim` float32s (options as
        for dense())."""
        dim = int(dim)
        if dim <= 0:
            raise L.error("PS_ERR_INVALID", f"dim must be positive, not {dim}")
        o = _options(options, opts)
        t = SparseTable(self, name, self._declare(name, L.PS_SPARSE, dim, o), o, dim)
        self.tables[name] = t
        return t

    def table(self, name):
        """A table this context declared, by name (NoTableError if there is none)."""
        try:
            return self.tables[name]
        except KeyError:
            raise L.error("PS_ERR_NO_TABLE", f"no table '{name}' declared in this context") from None

    # -- clock, barrier, metrics
    def clock(self):
        """Finish the current iteration; returns the new clock. In sync mode the
        round's pushes are applied once every worker has clocked past it, and a pull
        waits until every round before its clock is applied."""
        st = self._state
        ptr = st.enter()
        try:
            L.check(L.ps_clock(ptr))
            return L.ps_ctx_clock(ptr)
        finally:
            st.leave()

    def checkpoint(self, timeout=None):
        """Take a checkpoint of the whole job, cut at this worker's clock, into the
        scheduler's checkpoint directory; returns its id once it is complete (its
        manifest written). A restored job starts at the checkpoint's clock
        (clock_value). Raises ConfigError when the job has no checkpoint directory,
        UnavailableError when another checkpoint is being taken or a server left,
        ClockError when a server was already past this clock, IOFailureError when a
        file could not be written, TimeoutError after timeout seconds (None: the
        context's timeout_ms)."""
        st = self._state
        ptr = st.enter()
        try:
            cid = L.c_uint64()
            L.check(L.ps_checkpoint(ptr, L.ctypes.byref(cid), _ms(timeout)))
        finally:
            st.leave()
        return cid.value

    def barrier(self, timeout=None):
        """Wait until every active worker reached the barrier."""
        st = self._state
        ptr = st.enter()
        try:
            L.check(L.ps_barrier(ptr, _ms(timeout)))
        finally:
            st.leave()

    def metric(self, name, value):
        """Report a named metric (e.g. "loss") to the scheduler."""
        st = self._state
        ptr = st.enter()
        try:
            L.check(L.ps_metric(ptr, str(name).encode(), float(value)))
        finally:
            st.leave()

    # -- data-partition tasks
    def tasks_init(self, partitions, epochs):
        """Declare the job's data partitions and epochs (every worker may call it; the
        first call defines them, later calls must agree: ConflictError otherwise)."""
        st = self._state
        ptr = st.enter()
        try:
            L.check(L.ps_tasks_init(ptr, int(partitions), int(epochs)))
        finally:
            st.leave()

    def next_task(self, timeout=None):
        """The next (partition, epoch) for this worker, or None once every epoch is
        finished. Raises TimeoutError if no partition came back within `timeout`."""
        st = self._state
        ptr = st.enter()
        try:
            t = L.Task()
            rc = L.ps_task_next(ptr, L.ctypes.byref(t), _ms(timeout))
            if rc == L.CODES.get("PS_ERR_DONE"):
                return None
            L.check(rc)
            return (t.partition, t.epoch)
        finally:
            st.leave()

    def task_done(self, task):
        """Report a (partition, epoch) from next_task() processed."""
        st = self._state
        ptr = st.enter()
        try:
            t = L.Task(int(task[0]), int(task[1]))
            L.check(L.ps_task_done(ptr, L.ctypes.byref(t)))
        finally:
            st.leave()

    def tasks(self, partitions, epochs, timeout=None):
        """Iterate over the (partition, epoch) pairs the scheduler hands this worker;
        each is reported done when the loop body comes back for the next one (a
        partition whose body raised is not reported, so it returns to the queue if
        this worker dies). Ends when every epoch is finished."""
        self.tasks_init(partitions, epochs)
        while True:
            try:
                task = self.next_task(timeout)
            except L.ERROR_CLASSES[_TIMEOUT]:
                continue    # partitions still running elsewhere: ask again
            if task is None:
                return
            yield task
            self.task_done(task)

    # -- statistics
    STAT_NAMES = ("uptime_s", "pull_wait_s", "push_wait_s", "other_wait_s", "compute_s", "pulls", "pushes",
                  "bytes_pushed", "bytes_pulled", "dropped_pushes", "fast_forwards", "clock", "examples",
                  "direct_calls", "peer_mem_parts", "shared_parts", "http_port")

    def stat(self, name):
        """One counter of this worker (ps_ctx_stat): pull_wait_s, push_wait_s, ..."""
        st = self._state
        ptr = st.enter()
        try:
            v = L.c_double()
            L.check(L.ps_ctx_stat(ptr, str(name).encode(), L.ctypes.byref(v)))
            return v.value
        finally:
            st.leave()

    TABLE_STAT_NAMES = ("pushed_bytes", "pulled_bytes", "sent_frames", "received_frames")

    def stats(self):
        """Every counter this worker's library knows, as a dict, and under "tables" each
        table this context declared by name: {"id", "pushed_bytes", "pulled_bytes",
        "sent_frames", "received_frames"} (ps_ctx_stat's table_*:ID)."""
        out = {}
        for n in self.STAT_NAMES:
            try:
                out[n] = self.stat(n)
            except L.ERROR_CLASSES[L.CODES["PS_ERR_INVALID"]]:
                pass
        out["tables"] = {name: dict({"id": t.id}, **{k: self.stat(f"table_{k}:{t.id}") for k in self.TABLE_STAT_NAMES})
                         for name, t in list(self.tables.items())}
        return out

    def server_stats(self, server, timeout=None):
        """The counters of server `server` (0 <= server < num_servers), as numbers:
        {counter: number, ..., "tables": {name: {"id": .., "rows": .., "pushes": .., ...}},
        histogram: [counts...]} (the STATS lines of docs/protocol.md: every table, each
        under its name; an unknown field that is not a number stays text)."""
        cap = 1 << 16
        while True:
            buf = L.ctypes.create_string_buffer(cap)
            st = self._state
            ptr = st.enter()
            try:
                L.check(L.ps_server_stats(ptr, int(server), buf, cap, _ms(timeout)))
            finally:
                st.leave()
            if len(buf.value) < cap - 1 or cap >= 1 << 24:
                break
            cap *= 4
        return parse_stats(buf.value.decode("utf-8", "replace"))

    # -- lifecycle
    def close(self):
        """Leave the job: waits for blocking calls of other threads, cancels and frees
        outstanding requests, then closes the C context. Idempotent."""
        st = self._state
        if st is not None:
            st.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        if self.closed:
            return "<pshard.Context closed>"
        return (f"<pshard.Context rank={self.rank}/{self.num_workers} servers={self.num_servers} "
                f"clock={self.clock_value}>")


def connect(**config):
    """Join the job this process was started in: the roles, scheduler address and
    expected counts come from the PSHARD_* environment (as set by `pshard run`);
    keyword arguments override configuration keys (timeout_ms=..., mode=...)."""
    return Context(config, env=True)


def embedded(servers=1, workers=1, join_env=True, **config):
    """Run a scheduler and `servers` servers as threads in this process and join them
    as a worker; `workers` is the number of workers the job waits for (other workers
    cannot reach an embedded scheduler through the public API, so keep it 1 unless you
    know better).

    When the environment names a scheduler (PSHARD_SCHEDULER, set by a launcher) and
    join_env is true, the call joins that job instead, like connect(): so the same
    script runs alone or in a cluster unchanged."""
    if join_env and os.environ.get("PSHARD_SCHEDULER") and not os.environ.get("PSHARD_EMBEDDED"):
        return Context(config, env=True)
    cfg = {"embedded": int(servers), "workers": int(workers)}
    cfg.update(config)
    if int(servers) <= 0:
        raise L.error("PS_ERR_CONFIG", f"embedded mode needs at least one server, not {servers}")
    return Context(cfg, env=True)


@atexit.register
def _close_all():
    for c in list(_live):
        try:
            c.close()
        except Exception:
            pass


# ------------------------------------------------------------------------- logging

_log_callbacks = []  # kept forever: the library may call a replaced hook one last time
_LEVELS = {"error": L.LOG_ERROR, "warn": L.LOG_WARN, "warning": L.LOG_WARN, "info": L.LOG_INFO, "debug": L.LOG_DEBUG}


def zeros(shape):
    """A zeroed float32 array in memory shared with the servers of this host
    (ps_alloc): a same-host server adds a push from it, and writes a pull into it, in
    place, where for other arrays the kernel copies the values between the processes.
    Use it for large dense gradients and pull buffers (`out=`); results are the same as
    with any array. The memory is freed with the last array that refers to it. At
    most 256 such buffers are shared at once (each holds a file descriptor); beyond
    that they are ordinary memory."""
    shape = (int(shape),) if np.isscalar(shape) else tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in {shape}")
    n = math.prod(shape)
    p = L.ps_alloc(max(n, 1) * 4)
    if not p:
        raise MemoryError(L.ps_errmsg().decode("utf-8", "replace"))
    buf = (ctypes.c_float * max(n, 1)).from_address(p)
    weakref.finalize(buf, L.ps_free, p)
    return np.frombuffer(buf, dtype=_F32, count=n).reshape(shape)


def _number(v):
    """int, else float, else the text itself."""
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


def parse_stats(text):
    """STATS text (a server's or the scheduler's) -> a dict of numbers: "key value" lines
    as key: number; "table ID name=.. k=v ..." lines under "tables" by name (with "id");
    lines of several numbers (histograms) as lists."""
    out = {"tables": {}}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        keyed = len(parts) > 2 and "=" not in parts[1] and "=" in parts[2]
        if keyed or (len(parts) > 1 and "=" in parts[1]):
            fields = {k: _number(v) for k, v in (p.split("=", 1) for p in parts[1 + keyed:] if "=" in p)}
            if keyed:
                fields["id"] = _number(parts[1])
            if parts[0] == "table" and keyed:  # tables by name
                out["tables"][str(fields.get("name", parts[1]))] = fields
            elif keyed or parts[0] in ("metric",):  # "node ID ...", "metric ...": lists
                out.setdefault(parts[0] + "s", []).append(fields)
            else:  # "tasks partitions=..": one object
                out[parts[0]] = fields
        elif len(parts) == 2 and not parts[0].endswith("_staleness"):
            out[parts[0]] = _number(parts[1])
        elif len(parts) >= 2:  # a histogram (its counts by bucket), even of one bucket
            out[parts[0]] = [_number(x) for x in parts[1:]]
        else:
            out[parts[0]] = None
    return out


def set_log(fn, level="info"):
    """Route the library's log messages to fn(level: int, message: str), process-wide;
    fn=None turns logging off (the default). Levels: 0 error, 1 warn, 2 info, 3 debug.
    fn may be called from the library's I/O threads."""
    lvl = _LEVELS.get(level, level) if isinstance(level, str) else int(level)
    if fn is None:
        L.ps_set_log(L.LOG_FN(), None, -1)
        return

    def trampoline(lv, msg, arg):
        try:
            fn(lv, msg.decode("utf-8", "replace"))
        except Exception:
            pass

    cb = L.LOG_FN(trampoline)
    _log_callbacks.append(cb)
    L.ps_set_log(cb, None, lvl)


@atexit.register
def _log_off():
    try:
        L.ps_set_log(L.LOG_FN(), None, -1)
    except Exception:
        pass
