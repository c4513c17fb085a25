"""pshard.torch - keep a PyTorch model's parameters on pshard servers.

ModelSync(ps, model, opt="adam", lr=1e-3) puts every dense parameter of `model` in a
dense table (one per parameter, named by prefix + parameter name) and replaces the
local optimiser:

    sync = pshard.torch.ModelSync(ps, model, opt="adam", lr=1e-3)
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)   # waits for the fresh parameters first
        loss.backward()                       # each gradient is pushed as soon as it exists
        sync.step()                           # wait for the pushes, clock, start the pulls

 - Pushes: a hook on each parameter pushes its gradient (non-blocking) the moment
   autograd produces it, so communication overlaps the rest of backward. The batch
   size sent with the push (the weight of this worker's mean gradient) is the leading
   dimension of the model's first forward argument, or sync.batch if set.
 - Pulls: step() starts a non-blocking pull of every parameter straight into the
   parameter's storage (no copy); a forward pre-hook waits for them before the next
   forward. Parameters of 64 KiB and more are moved, at construction, into memory
   shared with the servers of this host (pshard.zeros), which then write the pulled
   values in place. A process forked afterwards (a DataLoader worker, say) shares
   that memory with the trainer instead of getting a copy of it. Do not read parameters between step() and the next forward without
   calling sync.wait().
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


class Embedding(torch.nn.Module):
    """An embedding over a sparse table of rows of `dim` floats keyed by any id >= 0.

    forward(ids) returns ids.shape + (dim,); rows are pulled per call (a blocking pull
    that releases the GIL). In training mode with gradients enabled, backward pushes
    the gradient of the distinct rows (non-blocking; wait() collects the results).
    Table options are as for Context.sparse (opt, lr, init, seed, ...)."""

    def __init__(self, ps, name, dim, options=None, **opts):
        super().__init__()
        self.ps = ps
        self.table = ps.sparse(name, dim, options, **opts)
        self.dim = int(dim)
        self.batch = None        # override of the batch size sent with pushes
        self._pending = []
        self._forward_batch = None
        self._pushed = False
        self.wait_push_s = 0.0
        self.wait_pull_s = 0.0

    def forward(self, ids):
        ids_np = np.asarray(ids.detach().cpu().numpy() if torch.is_tensor(ids) else ids)
        flat = ids_np.reshape(-1)
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


class ModelSync:
    """Keeps `model`'s dense parameters on the servers of context `ps` (see module doc).

    ps       a pshard.Context
    model    a torch.nn.Module with CPU float32 parameters
    prefix   table name prefix (default "": several models in one job need distinct ones)
    init     None (PyTorch-like defaults), a table init string for all, or a callable
             (name, param) -> init string
    seed     base initialiser seed; parameter i uses seed + i
    options / **opts   table options for every parameter (opt, lr, beta1, ...)
    """

    def __init__(self, ps, model, prefix="", init=None, seed=0, options=None, **opts):
        self.ps = ps
        self.model = model
        self.batch = None
        self.lr = None           # per-push learning-rate override (None: the table's)
        self.tables = []
        self._params = []
        self._bufs = []
        self._hooks = []
        self._pushes = []
        self._pulls = []
        self._pushed = set()
        self._fwd_batch = None
        self.wait_push_s = 0.0
        self.wait_pull_s = 0.0
        self.steps = 0
        owners = {}
        for mname, mod in model.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                owners[id(p)] = (mod, pname)
        self.embeddings = [m for m in model.modules() if isinstance(m, Embedding)]
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
            self._params.append(p)
            if p.numel() * 4 >= _SHARED_MIN:
                # Large parameters move into memory shared with the servers of this
                # host (pshard.zeros): their pulls are then written in place.
                buf = _core.zeros(p.shape)
                buf[...] = p.data.numpy()
                p.data = torch.from_numpy(buf)
            self._bufs.append(p.data.numpy())
            self._hooks.append(p.register_hook(lambda g, k=len(self._params) - 1: self._on_grad(k, g)))
        self._hooks.append(model.register_forward_pre_hook(self._before_forward))
        self._start_pulls()
        self.wait()

    # -- hooks
    def _before_forward(self, module, args):
        self.wait()
        if args and torch.is_tensor(args[0]) and args[0].dim() > 0:
            self._fwd_batch = int(args[0].shape[0])

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
        self._pulls = [t.pull_async(out=buf.reshape(-1)) for t, buf in zip(self.tables, self._bufs)]

    # -- public
    def wait(self):
        """Wait for outstanding pulls: afterwards the parameters hold the servers' values."""
        pulls, self._pulls = self._pulls, []
        t0 = time.perf_counter()
        try:
            for f in pulls:
                f.wait()
        finally:
            self.wait_pull_s += time.perf_counter() - t0

    def step(self):
        """End the iteration: wait for every push of this step (dense and Embedding),
        advance the clock, and start pulling the next values."""
        b = self.batch or self._fwd_batch or 1
        if self._pushed:
            # A parameter without a gradient this step (unused) contributes zero with
            # this worker's batch, so that every server counts the batch in its round.
            for k, t in enumerate(self.tables):
                if k not in self._pushed:
                    self._pushes.append(t.push_async(np.zeros(t.shape, np.float32), batch=b, lr=self.lr))
        pushes, self._pushes = self._pushes, []
        self._pushed = set()
        t0 = time.perf_counter()
        try:
            for f in pushes:
                f.wait()
        finally:
            self.wait_push_s += time.perf_counter() - t0
        for e in self.embeddings:
            e.wait()
        for p in self._params:
            p.grad = None
        self.ps.clock()
        self.steps += 1
        self._start_pulls()

    def stats(self):
        """Seconds spent waiting for pulls and pushes (including Embedding modules)."""
        return {"steps": self.steps,
                "wait_pull_s": self.wait_pull_s + sum(e.wait_pull_s for e in self.embeddings),
                "wait_push_s": self.wait_push_s + sum(e.wait_push_s for e in self.embeddings)}

    def close(self):
        """Remove the hooks (the tables stay on the servers)."""
        self.wait()
        for h in self._hooks:
            h.remove()
        self._hooks = []
