"""_lib.py - loads libpshard.so with ctypes, declares the C prototypes, maps errors.

Only functions declared in include/pshard.h are used. The library is found, in order:
the PSHARD_LIB environment variable (a path to libpshard.so), the path recorded by the
build or by `make install` in _config.py, then `<repo>/build/libpshard.so` when running
from a source checkout, then the system's library search path.

The GIL. Functions reached through ctypes.CDLL (not PyDLL) release the GIL for the
whole duration of the foreign call and take it back when it returns, so a thread
blocked in ps_pull, ps_req_wait, ps_barrier or ps_ctx_open does not stop other Python
threads (tests/test_binding.py::test_gil_released_while_waiting checks this). Log
callbacks coming from the library's I/O thread take the GIL through ctypes' callback
trampoline.

Errors. Every call that returns a ps_err is passed through check(): a non-zero code
becomes an instance of the Error subclass registered for it, carrying the symbolic
name (ps_err_name), the description (ps_strerror) and the detailed message
(ps_errmsg, read on the same thread right after the failed call, as the API requires).
"""
import builtins
import ctypes
import ctypes.util
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def find_command():
    """The `pshard` command of this build or install: $PSHARD_BIN, the path recorded in
    _config.py, $PSHARD_BUILD/pshard, <repo>/build/pshard, then $PATH."""
    import shutil
    cands = [os.environ.get("PSHARD_BIN")]
    try:
        from . import _config
        cands.append(getattr(_config, "BINARY", None))
    except ImportError:
        pass
    if os.environ.get("PSHARD_BUILD"):
        cands.append(os.path.join(os.environ["PSHARD_BUILD"], "pshard"))
    cands.append(os.path.join(os.path.dirname(os.path.dirname(_HERE)), "build", "pshard"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    found = shutil.which("pshard")
    if found:
        return found
    raise FileNotFoundError("cannot find the pshard command: build it (make build) or set PSHARD_BIN")


def _candidates():
    env = os.environ.get("PSHARD_LIB")
    if env:
        yield env
        return
    try:
        from . import _config  # written by CMake (build tree) or by `make install`
        if getattr(_config, "LIBRARY", None):
            yield _config.LIBRARY
    except ImportError:
        pass
    build = os.environ.get("PSHARD_BUILD")
    if build:
        yield os.path.join(build, "libpshard.so")
    # A source checkout: python/pshard/ -> <repo>/build/libpshard.so
    yield os.path.join(os.path.dirname(os.path.dirname(_HERE)), "build", "libpshard.so")
    found = ctypes.util.find_library("pshard")
    if found:
        yield found
    # `make install` with the default prefixes, when ldconfig has not run since
    for d in ("/usr/local/lib", "/usr/local/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib"):
        yield os.path.join(d, "libpshard.so")


def _load():
    tried = []
    for path in _candidates():
        if os.path.sep in path and not os.path.exists(path):
            tried.append(path + " (missing)")
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            tried.append(f"{path} ({e})")
    raise ImportError("pshard: cannot load libpshard.so; build it (make build) or set PSHARD_LIB. Tried: "
                      + "; ".join(tried or ["nothing"]))


lib, LIBRARY_PATH = _load()

c_int, c_uint32, c_uint64, c_int64, c_size_t = ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
c_float, c_double, c_char_p, c_void_p = ctypes.c_float, ctypes.c_double, ctypes.c_char_p, ctypes.c_void_p
P = c_void_p  # every handle and buffer crosses as a plain address

LOG_FN = ctypes.CFUNCTYPE(None, c_int, c_char_p, c_void_p)


def _proto(name, restype, *argtypes):
    f = getattr(lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)
    return f


ps_strerror = _proto("ps_strerror", c_char_p, c_int)
ps_err_name = _proto("ps_err_name", c_char_p, c_int)
ps_errmsg = _proto("ps_errmsg", c_char_p)
ps_config_new = _proto("ps_config_new", c_int, ctypes.POINTER(c_void_p))
ps_config_free = _proto("ps_config_free", None, P)
ps_config_set = _proto("ps_config_set", c_int, P, c_char_p, c_char_p)
ps_config_from_env = _proto("ps_config_from_env", c_int, P)
ps_config_get = _proto("ps_config_get", c_char_p, P, c_char_p)
ps_ctx_open = _proto("ps_ctx_open", c_int, P, ctypes.POINTER(c_void_p))
ps_ctx_close = _proto("ps_ctx_close", None, P)
ps_ctx_rank = _proto("ps_ctx_rank", c_int, P)
ps_ctx_num_workers = _proto("ps_ctx_num_workers", c_int, P)
ps_ctx_num_servers = _proto("ps_ctx_num_servers", c_int, P)
ps_ctx_clock = _proto("ps_ctx_clock", c_int64, P)
ps_ctx_epoch = _proto("ps_ctx_epoch", c_uint64, P)
ps_table_declare = _proto("ps_table_declare", c_int, P, c_char_p, c_int, c_uint64, c_char_p, ctypes.POINTER(c_uint32))
ps_pull = _proto("ps_pull", c_int, P, c_uint32, P, c_size_t, P, c_int)
ps_push = _proto("ps_push", c_int, P, c_uint32, P, c_size_t, P, c_uint32, c_float, c_int)
ps_pull_range = _proto("ps_pull_range", c_int, P, c_uint32, c_uint64, c_uint64, P, c_int)
ps_push_range = _proto("ps_push_range", c_int, P, c_uint32, c_uint64, c_uint64, P, c_uint32, c_float, c_int)
ps_push_pull = _proto("ps_push_pull", c_int, P, c_uint32, P, c_size_t, P, c_uint32, c_float, P, c_int)
ps_push_pull_range = _proto("ps_push_pull_range", c_int, P, c_uint32, c_uint64, c_uint64, P, c_uint32, c_float, P,
                            c_int)
ps_pull_start = _proto("ps_pull_start", c_int, P, c_uint32, P, c_size_t, P, ctypes.POINTER(c_void_p))
ps_push_start = _proto("ps_push_start", c_int, P, c_uint32, P, c_size_t, P, c_uint32, c_float,
                       ctypes.POINTER(c_void_p))
ps_pull_range_start = _proto("ps_pull_range_start", c_int, P, c_uint32, c_uint64, c_uint64, P,
                             ctypes.POINTER(c_void_p))
ps_push_range_start = _proto("ps_push_range_start", c_int, P, c_uint32, c_uint64, c_uint64, P, c_uint32,
                             c_float, ctypes.POINTER(c_void_p))
ps_req_wait = _proto("ps_req_wait", c_int, P, c_int)
ps_req_free = _proto("ps_req_free", None, P)
ps_req_done = _proto("ps_req_done", c_int, P)
ps_version = _proto("ps_version", c_char_p)
ps_clock = _proto("ps_clock", c_int, P)
ps_barrier = _proto("ps_barrier", c_int, P, c_int)
ps_checkpoint = _proto("ps_checkpoint", c_int, P, ctypes.POINTER(c_uint64), c_int)
ps_metric = _proto("ps_metric", c_int, P, c_char_p, c_double)
ps_set_log = _proto("ps_set_log", None, LOG_FN, c_void_p, c_int)
ps_alloc = _proto("ps_alloc", c_void_p, c_size_t)
ps_free = _proto("ps_free", None, c_void_p)


class Task(ctypes.Structure):
    _fields_ = [("partition", c_uint32), ("epoch", c_uint32)]


ps_tasks_init = _proto("ps_tasks_init", c_int, P, c_uint32, c_uint32)
ps_task_next = _proto("ps_task_next", c_int, P, ctypes.POINTER(Task), c_int)
ps_task_done = _proto("ps_task_done", c_int, P, ctypes.POINTER(Task))
ps_ctx_stat = _proto("ps_ctx_stat", c_int, P, c_char_p, ctypes.POINTER(c_double))
ps_server_stats = _proto("ps_server_stats", c_int, P, c_int, c_char_p, c_size_t, c_int)

PS_DENSE, PS_SPARSE = 1, 2
LOG_ERROR, LOG_WARN, LOG_INFO, LOG_DEBUG = 0, 1, 2, 3


# ------------------------------------------------------------------------- errors

class Error(Exception):
    """A pshard error. `code` is the ps_err value, `name` its symbolic name
    ("PS_ERR_NO_TABLE"), `description` the generic text ("unknown table") and
    `message` the detailed message of the failed call."""

    code = None

    def __init__(self, code, name, message, description=""):
        super().__init__(f"{name}: {message or description}")
        self.code = code
        self.name = name
        self.message = message
        self.description = description

    def __str__(self):
        return f"{self.name}: {self.message or self.description}"

    def __reduce__(self):
        return (self.__class__, (self.code, self.name, self.message, self.description))


Error.__module__ = "pshard"


def _err(cls_name, code, *bases, doc=""):
    cls = type(cls_name, (Error,) + bases, {"__doc__": doc, "code": code})
    cls.__module__ = "pshard"
    return cls


# Python names for the codes of PS_ERRNO_MAP in include/pshard.h. The classes are made
# from the library's own table at import (ps_err_name of 1, 2, ... until
# PS_ERR_UNKNOWN), so a code added to the C table gets a class even before it gets a
# hand-picked name here (PS_ERR_NEW_THING -> NewThingError).
_NAMES = {
    "PS_ERR_INVALID": ("InvalidArgumentError", (ValueError,)),
    "PS_ERR_NOMEM": ("OutOfMemoryError", (MemoryError,)),
    "PS_ERR_TIMEOUT": ("TimeoutError", (builtins.TimeoutError,)),
    "PS_ERR_CLOSED": ("ClosedError", ()),
    "PS_ERR_IO": ("IOFailureError", ()),
    "PS_ERR_PROTO": ("ProtocolError", ()),
    "PS_ERR_TOO_LARGE": ("TooLargeError", (ValueError,)),
    "PS_ERR_NO_TABLE": ("NoTableError", (LookupError,)),
    "PS_ERR_SIZE": ("SizeError", (ValueError,)),
    "PS_ERR_DIM": ("DimError", (ValueError,)),
    "PS_ERR_CONFLICT": ("ConflictError", ()),
    "PS_ERR_MOVED": ("MovedError", ()),
    "PS_ERR_CLOCK": ("ClockError", ()),
    "PS_ERR_CONFIG": ("ConfigError", (ValueError,)),
    "PS_ERR_UNAVAILABLE": ("UnavailableError", (ConnectionError,)),
    "PS_ERR_CANCELED": ("CanceledError", ()),
    "PS_ERR_ROLE": ("RoleError", ()),
    "PS_ERR_RANGE": ("RangeError", (ValueError,)),
    "PS_ERR_INTERNAL": ("InternalError", ()),
    "PS_ERR_DONE": ("DoneError", ()),
    "PS_ERR_PENDING": ("PendingError", ()),
    "PS_ERR_CORRUPT": ("CorruptError", (ValueError,)),
    "PS_ERR_AUTH": ("AuthError", (PermissionError,)),
}
ERRORS = {}          # code -> (C name, Python class name, extra bases)
for _code in range(1, 256):
    _cname = ps_err_name(_code).decode()
    if _cname == "PS_ERR_UNKNOWN":
        break
    _pyname, _bases = _NAMES.get(_cname) or (
        "".join(w.capitalize() for w in _cname[len("PS_ERR_"):].split("_")) + "Error", ())
    ERRORS[_code] = (_cname, _pyname, _bases)
ERROR_CLASSES = {}
for _code, (_cname, _pyname, _bases) in ERRORS.items():
    ERROR_CLASSES[_code] = _err(_pyname, _code, *_bases, doc=f"{_cname}: {ps_strerror(_code).decode()}.")
CODES = {cname: code for code, (cname, _, _) in ERRORS.items()}


def make_error(code, message=None):
    """An exception for ps_err `code`; `message` defaults to ps_errmsg() of this thread."""
    if message is None:
        message = ps_errmsg().decode("utf-8", "replace")
    name = ps_err_name(code).decode()
    desc = ps_strerror(code).decode()
    return ERROR_CLASSES.get(code, Error)(code, name, message or desc, desc)


def error(name, message):
    """An exception raised by the binding itself for a condition the C API would report
    with the same code (closed context, wrong shape, ...)."""
    return make_error(CODES[name], message)


def check(rc):
    if rc:
        raise make_error(rc)
    return rc
