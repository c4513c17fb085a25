"""pshard.torch - keep a PyTorch model's parameters on pshard servers.

ModelSync(ps, model, opt="adam", lr=1e-3) puts every dense parameter of `model` in a
dense table (one per parameter, named by prefix + parameter name) and replaces the
local optimiser:

    sync = pshard.torch.ModelSync(ps, model, opt="adam", lr=1e-3)
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)   # waits for the fresh parameters first
        loss.backward()                       # each gradient is pushed as soon as it exists
        sync.step()                           # wait for the pushes, clock, start the pulls

Overlap (overlap=True, the default), which the training loop gets without writing it:
 - Pushes: a hook on each parameter pushes its gradient (non-blocking) the moment
   autograd produces it, so communication overlaps the rest of backward. The batch
   size sent with the push (the weight of this worker's mean gradient) is the leading
   dimension of the model's first forward argument, or sync.batch if set.
 - Pulls: step() waits for the pushes, clocks, then starts a non-blocking pull of every
   parameter straight into the parameter's storage (no copy). The next forward waits
   for each pull only just before a module may read it: a forward pre-hook on each
   module waits for the parameters of that module and its children, except that
   nn.Sequential (whose forward only calls its children) waits for none but its own,
   so the pulls of later layers go on while the first layers compute. wait_at="module"
   waits per module for the module's own parameters only (right for any model whose
   forwards read only their own parameters; more overlap in custom models), and
   wait_at="forward" waits for everything at the start of the model's forward. Any pull
   still running when the model's forward returns is waited for then, so a loss that
   reads the parameters (weight decay) sees the new values. Parameters of 64 KiB and
   more are moved, at construction, into memory shared with the servers of this host
   (pshard.zeros), which then write the pulled values in place. A process forked
   afterwards (a DataLoader worker, say) shares that memory with the trainer instead of
   getting a copy of it. Do not read parameters between step() and the next forward
   without calling sync.wait().
 - overlap=False turns this off: backward only accumulates .grad as usual, and step()
   pushes every gradient, clocks and pulls every parameter, each call blocking. In sync
   mode both paths give bit-for-bit the same parameters (one backward per step; with
   several, the overlapped path pushes each and the server adds them, the other adds
   them locally first, which can differ in the last bits).
Also:
 - Two backward passes before step() push twice in the same round; the server adds
   them, which is PyTorch's gradient accumulation.
 - Initial values come from the servers. The default initialiser reproduces
   PyTorch's default distributions for Linear, Conv and Embedding layers
   (uniform(1/sqrt(fan_in)), normal(1)) and norm layers (one, zero); pass
   init="normal:0.01" or init=callable(name, param) -> str to choose.
 - Buffers (BatchNorm running statistics) stay local to each worker.
 - Only CPU float32 parameters are supported.

Embedding(ps, name, dim, opt=..., lr=...) is an nn.Module over a sparse table: forward
pulls only the rows the batch uses (each distinct id once) and backward pushes only
their gradients. ModelSync.step() also waits for the pushes of the Embedding modules
inside its model; used without a ModelSync, call emb.wait() and ps.clock() yourself.
emb.prefetch(next_ids), called once the next batch is known (any time after this
step's forward), pulls the next batch's rows while the current batch computes:
ModelSync.step() starts that pull right after its clock, so that in sync mode it sees
the round the step closes, and the next forward with those ids uses the rows.
"""
import math
import time

import numpy as np
import torch

from . import _lib as L
from . import core as _core

__all__ = ["ModelSync", "Embedding", "default_init"]

# Parameters of this many bytes or more live in shared memory (pshard.zeros): the
# client sends a same-host server the addresses of parts of 64 KiB and more.
_SHARED_MIN = 64 << 10


def _np(t):
    """A CPU float32 contiguous view of tensor t as numpy (copies only when needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype != torch.float32:
        t = t.float()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.numpy()


def default_init(module, pname, param):
    """The table initialiser that matches PyTorch's default for this parameter."""
    norms = (torch.nn.modules.batchnorm._NormBase, torch.nn.LayerNorm, torch.nn.GroupNorm)
    if isinstance(module, norms):
        return "const:1" if pname == "weight" else "zero"
    if isinstance(module, torch.nn.Embedding):
        return "normal:1"
    ref = param
    if param.dim() < 2:
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() >= 2:
            ref = w
        else:
            return "zero"
    fan_in = int(np.prod(ref.shape[1:]))
    return f"uniform:{1.0 / math.sqrt(fan_in)!r}"


class _Prefetch:
    """A pull of a batch's distinct rows started ahead of the forward that uses them."""

    __slots__ = ("ids", "uniq", "inv", "future", "clock")

    def __init__(self, ids, uniq, inv, clock):
        self.ids, self.uniq, self.inv = ids, uniq, inv
        self.future = None     # the pull, once started
        self.clock = clock     # the context's clock when asked for, then when started

    def cancel(self):
        if self.future is not None:
            self.future.cancel()
            self.future = None


def _ids_array(ids):
    return np.asarray(ids.detach().cpu().numpy() if torch.is_tensor(ids) else ids)


class Embedding(torch.nn.Module):
    """An embedding over a sparse table of rows of `dim` floats keyed by any id >= 0.

    forward(ids) returns ids.shape + (dim,); rows are pulled per call (a blocking pull
    that releases the GIL), or taken from a prefetch() of the same ids. In training mode
    with gradients enabled, backward pushes the gradient of the distinct rows
    (non-blocking; wait() collects the results). Table options are as for
    Context.sparse (opt, lr, init, seed, ...)."""

    def __init__(self, ps, name, dim, options=None, **opts):
        super().__init__()
        self.ps = ps
        self.table = ps.sparse(name, dim, options, **opts)
        self.dim = int(dim)
        self.batch = None        # override of the batch size sent with pushes
        self._pending = []
        self._forward_batch = None
        self._pushed = False
        self._prefetch = None    # the next batch's rows (one slot: double buffering)
        self.wait_push_s = 0.0
        self.wait_pull_s = 0.0
        self.prefetch_hits = 0   # forwards served by a prefetch
        self.prefetch_misses = 0  # prefetches dropped unused (replaced, or of another clock)

    def prefetch(self, ids):
        """Start pulling the rows of `ids` for the next forward, which then uses them
        if it is called with the same ids at the same clock (otherwise it pulls as
        usual). While a training step is open (a training forward ran and wait() has
        not), the pull starts only at the end of the step, right after the clock
        (ModelSync.step() does it; without a ModelSync, call start_prefetch() after
        ps.clock()): in sync mode it then sees the round this step closes, so the model
        is exactly the one without prefetching. A new prefetch replaces the last."""
        a = _ids_array(ids)
        flat = np.array(a.reshape(-1), copy=True)
        uniq, inv = np.unique(flat, return_inverse=True)
        if self._prefetch is not None:
            self._prefetch.cancel()
            self.prefetch_misses += 1
        self._prefetch = _Prefetch(flat, uniq, inv, self.ps.clock_value)
        if self._forward_batch is None:
            self.start_prefetch()

    def start_prefetch(self):
        """Start the pull of a deferred prefetch() (at the clock it is to be used at)."""
        pf = self._prefetch
        if pf is not None and pf.future is None:
            pf.clock = self.ps.clock_value
            pf.future = self.table.pull_async(pf.uniq)

    def _take_prefetch(self, flat):
        """The (rows, uniq, inv) prefetched for these ids at this clock, else None."""
        pf = self._prefetch
        if pf is None:
            return None
        clock = self.ps.clock_value
        if pf.clock != clock:
            # Started before a clock (stale in sync mode), or deferred to a clock whose
            # step never started it: of no use now.
            self._prefetch = None
            pf.cancel()
            self.prefetch_misses += 1
            return None
        if pf.future is None:
            return None          # deferred to the end of this step
        if pf.ids.shape != flat.shape or not np.array_equal(pf.ids, flat):
            return None          # another batch (an evaluation, say): keep it for later
        self._prefetch = None
        t0 = time.perf_counter()
        try:
            rows = pf.future.wait()
        finally:
            self.wait_pull_s += time.perf_counter() - t0
        self.prefetch_hits += 1
        return rows, pf.uniq, pf.inv

    def forward(self, ids):
        ids_np = _ids_array(ids)
        flat = ids_np.reshape(-1)
        got = self._take_prefetch(flat)
        if got is not None:
            rows, uniq, inv = got
        else:
            uniq, inv = np.unique(flat, return_inverse=True)
            t0 = time.perf_counter()
            rows = self.table.pull(uniq)
            self.wait_pull_s += time.perf_counter() - t0
        leaf = torch.from_numpy(rows)
        batch = self.batch or (int(ids_np.shape[0]) if ids_np.ndim else 1)
        if self.training and torch.is_grad_enabled():
            leaf.requires_grad_(True)
            self._forward_batch = batch
            leaf.register_hook(lambda g, keys=uniq, b=batch: self._push(keys, g, b))
        out = leaf[torch.from_numpy(inv.astype(np.int64))]
        return out.view(*ids_np.shape, self.dim)

    def _push(self, keys, grad, batch):
        self._pending.append(self.table.push_async(keys, _np(grad), batch=batch))
        self._pushed = True

    def wait(self):
        """Wait for this step's pushes (raising the first error). A forward in training
        mode whose backward never ran still tells the servers its batch size (an empty
        push), as sync rounds require."""
        if self._forward_batch and not self._pushed:
            self._pending.append(self.table.push_async(np.empty(0, np.uint64), np.empty((0, self.dim), np.float32),
                                                       batch=self._forward_batch))
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        self._forward_batch, self._pushed = None, False
        try:
            for f in pending:
                f.wait()
        finally:
            self.wait_push_s += time.perf_counter() - t0

    def extra_repr(self):
        return f"table={self.table.name!r}, dim={self.dim}, options={self.table.options!r}"


def _only_calls_children(module):
    """True for containers whose forward reads no parameter of their children."""
    return type(module).forward is torch.nn.Sequential.forward


class ModelSync:
    """Keeps `model`'s dense parameters on the servers of context `ps` (see module doc).

    ps       a pshard.Context
    model    a torch.nn.Module with CPU float32 parameters
    prefix   table name prefix (default "": several models in one job need distinct ones)
    init     None (PyTorch-like defaults), a table init string for all, or a callable
             (name, param) -> init string
    seed     base initialiser seed; parameter i uses seed + i
    overlap  True (default): push from gradient hooks during backward, pull in the
             background after step(); False: step() pushes, clocks and pulls, blocking
    wait_at  where the next forward waits for the pulls (overlap=True): "auto" (each
             module before it runs, for itself and its children; nn.Sequential for its
             own parameters only), "module" (each module for its own parameters only),
             "forward" (everything at the start of the model's forward)
    options / **opts   table options for every parameter (opt, lr, beta1, ...)
    """

    WAIT_AT = ("auto", "module", "forward")

    def __init__(self, ps, model, prefix="", init=None, seed=0, overlap=True, wait_at="auto", options=None,
                 **opts):
        if wait_at not in self.WAIT_AT:
            raise L.error("PS_ERR_INVALID", f"wait_at must be one of {', '.join(self.WAIT_AT)}, not {wait_at!r}")
        self.ps = ps
        self.model = model
        self.overlap = bool(overlap)
        self.wait_at = wait_at
        self.batch = None
        self.lr = None           # per-push learning-rate override (None: the table's)
        self.tables = []
        self._params = []
        self._bufs = []
        self._flat = []          # flat views of self._bufs, what pulls write into
        self._hooks = []
        self._pushes = []
        self._pulls = {}         # parameter index -> pull Future not yet waited
        self._pushed = set()
        self._zero_grads = {}    # parameter index -> zeros pushed for it when unused
        self._fwd_batch = None
        self.wait_push_s = 0.0
        self.wait_pull_s = 0.0
        self.steps = 0
        owners = {}
        for mname, mod in model.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                owners[id(p)] = (mod, pname)
        self.embeddings = [m for m in model.modules() if isinstance(m, Embedding)]
        index = {}               # id(parameter) -> its index in self._params
        for i, (name, p) in enumerate(model.named_parameters()):
            if not p.requires_grad:
                continue
            if p.device.type != "cpu" or p.dtype != torch.float32 or not p.data.is_contiguous():
                raise L.error("PS_ERR_INVALID", f"parameter {name}: only contiguous CPU float32 parameters are supported")
            mod, pname = owners[id(p)]
            if init is None:
                ini = default_init(mod, pname, p)
            elif callable(init):
                ini = init(name, p)
            else:
                ini = init
            shape = tuple(p.shape) or (1,)
            table = ps.dense(prefix + name, shape, options, init=ini, seed=seed + i, **opts)
            self.tables.append(table)
            index[id(p)] = len(self._params)
            self._params.append(p)
            if p.numel() * 4 >= _SHARED_MIN:
                # Large parameters move into memory shared with the servers of this
                # host (pshard.zeros): their pulls are then written in place.
                buf = _core.zeros(p.shape)
                buf[...] = p.data.numpy()
                p.data = torch.from_numpy(buf)
            self._bufs.append(p.data.numpy())
            self._flat.append(self._bufs[-1].reshape(-1))
            if self.overlap:
                self._hooks.append(p.register_hook(lambda g, k=len(self._params) - 1: self._on_grad(k, g)))
        self._hooks.append(model.register_forward_pre_hook(self._before_forward))
        if self.overlap:
            self._hooks.append(model.register_forward_hook(self._after_forward))
            if wait_at != "forward":
                for mod in model.modules():
                    mine = mod.parameters(recurse=wait_at == "auto" and not _only_calls_children(mod))
                    ks = sorted({index[id(p)] for p in mine if id(p) in index})
                    if ks:
                        self._hooks.append(mod.register_forward_pre_hook(
                            lambda m, args, ks=tuple(ks): self._wait_pulls(ks)))
        self._start_pulls()
        self.wait()

    # -- hooks
    def _before_forward(self, module, args):
        if not self.overlap or self.wait_at == "forward":
            self.wait()
        if args and torch.is_tensor(args[0]) and args[0].dim() > 0:
            self._fwd_batch = int(args[0].shape[0])

    def _after_forward(self, module, args, out):
        self.wait()              # parameters the forward did not read (or read directly)
        return None

    def _on_grad(self, k, grad):
        b = self.batch or self._fwd_batch or 1
        # Autograd may keep this very tensor as .grad and add the next backward's
        # gradient into it in place while the push still reads it: drop .grad first,
        # so that accumulation starts from a fresh tensor.
        self._params[k].grad = None
        self._pushes.append(self.tables[k].push_async(_np(grad), batch=b, lr=self.lr))
        self._pushed.add(k)
        return None

    def _start_pulls(self):
        self.wait()              # a pull still writing a buffer must end before the next
        self._pulls = {k: t.pull_async(out=buf) for k, (t, buf) in enumerate(zip(self.tables, self._flat))}

    def _wait_pulls(self, ks):
        if not self._pulls:
            return
        t0 = time.perf_counter()
        try:
            for k in ks:
                f = self._pulls.pop(k, None)
                if f is not None:
                    f.wait()
        finally:
            self.wait_pull_s += time.perf_counter() - t0

    # -- public
    def pending_pulls(self):
        """Indices (into self.tables) of the parameters whose pull is not waited yet."""
        return sorted(self._pulls)

    def wait(self):
        """Wait for outstanding pulls: afterwards the parameters hold the servers' values."""
        self._wait_pulls(sorted(self._pulls))

    def step(self):
        """End the iteration: wait for every push of this step (dense and Embedding),
        advance the clock, and start pulling the next values (overlap=False: push,
        clock and pull, each blocking)."""
        if not self.overlap:
            self._step_blocking()
            return
        b = self.batch or self._fwd_batch or 1
        if self._pushed:
            # A parameter without a gradient this step (unused) contributes zero with
            # this worker's batch, so that every server counts the batch in its round.
            for k, t in enumerate(self.tables):
                if k not in self._pushed:
                    self._pushes.append(t.push_async(self._zeros(k), batch=b, lr=self.lr))
        pushes, self._pushes = self._pushes, []
        self._pushed = set()
        t0 = time.perf_counter()
        try:
            for f in pushes:
                f.wait()
        finally:
            self.wait_push_s += time.perf_counter() - t0
        self._end_step()
        self._start_pulls()

    def _zeros(self, k):
        """A zero gradient for parameter k (unused this step), kept for later steps."""
        z = self._zero_grads.get(k)
        if z is None:
            z = self._zero_grads[k] = np.zeros(self.tables[k].shape, np.float32)
            z.flags.writeable = False
        return z

    def _step_blocking(self):
        # One blocking call after another: each runs on this thread (no hand-over to
        # the I/O thread and back), which measured faster here than starting every push
        # (then every pull) and waiting for them together.
        self.wait()
        b = self.batch or self._fwd_batch or 1
        if any(p.grad is not None for p in self._params):
            t0 = time.perf_counter()
            try:
                for k, (t, p) in enumerate(zip(self.tables, self._params)):
                    t.push(self._zeros(k) if p.grad is None else _np(p.grad), batch=b, lr=self.lr)
            finally:
                self.wait_push_s += time.perf_counter() - t0
        self._end_step()
        t0 = time.perf_counter()
        try:
            for t, buf in zip(self.tables, self._flat):
                t.pull(out=buf)
        finally:
            self.wait_pull_s += time.perf_counter() - t0

    def _end_step(self):
        """Embedding pushes, clear the gradients, clock, start the deferred prefetches."""
        for e in self.embeddings:
            e.wait()
        for p in self._params:
            p.grad = None
        self.ps.clock()
        self.steps += 1
        for e in self.embeddings:
            e.start_prefetch()

    def stats(self):
        """Seconds spent waiting for pulls and pushes (including Embedding modules), and
        the Embedding modules' prefetches used and dropped."""
        return {"steps": self.steps,
                "wait_pull_s": self.wait_pull_s + sum(e.wait_pull_s for e in self.embeddings),
                "wait_push_s": self.wait_push_s + sum(e.wait_push_s for e in self.embeddings),
                "prefetch_hits": sum(e.prefetch_hits for e in self.embeddings),
                "prefetch_misses": sum(e.prefetch_misses for e in self.embeddings)}

    def close(self):
        """Remove the hooks (the tables stay on the servers)."""
        self.wait()
        for h in self._hooks:
            h.remove()
        self._hooks = []
