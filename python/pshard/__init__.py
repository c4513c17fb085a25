"""pshard - Python binding of the pshard parameter server.

    import numpy as np, pshard
    with pshard.embedded(servers=2) as ps:          # or pshard.connect() under a launcher
        w = ps.dense("w", (4, 3), opt="sgd", lr=0.1)
        w.push(np.ones((4, 3), np.float32), batch=8)
        ps.clock()                                  # sync mode: the round is applied
        print(w.pull())                             # -0.1 everywhere

The binding uses only the public C API (include/pshard.h) through ctypes; see
docs/python.md. PyTorch helpers are in pshard.torch (imported on demand);
pshard.load_checkpoint reads a checkpoint from disk in pure Python (docs/checkpoint.md).
"""
from ._lib import LIBRARY_PATH, Error, find_command, ERROR_CLASSES, LOG_DEBUG, LOG_ERROR, LOG_INFO, LOG_WARN
from .core import Context, DenseTable, Future, SparseTable, Table, connect, embedded, set_log, zeros
from .checkpoint import load_checkpoint

__version__ = "0.7.0"

# One exception class per C error code, e.g. pshard.NoTableError (PS_ERR_NO_TABLE).
for _cls in ERROR_CLASSES.values():
    globals()[_cls.__name__] = _cls
del _cls

__all__ = ["find_command", "Context", "DenseTable", "SparseTable", "Table", "Future", "Error", "connect", "embedded", "set_log", "zeros",
           "load_checkpoint",
           "LIBRARY_PATH", "LOG_ERROR", "LOG_WARN", "LOG_INFO", "LOG_DEBUG"] + [c.__name__ for c in ERROR_CLASSES.values()]
