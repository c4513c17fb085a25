"""datasets.py - the real data sets of the Python examples, from Debian packages.

 - Fashion-MNIST: package dataset-fashion-mnist, IDX files in
   /usr/share/datasets/fashion-mnist (override with $FASHION_MNIST_DIR).
 - MovieLens (ml-latest-small, 100,004 ratings of 9,066 movies by 671 users): package
   r-cran-dslabs ships it as an R data set; it is exported once with Rscript to a CSV
   file ($PSHARD_DATA_DIR, default <repo>/data, which git ignores).
"""
import gzip
import os
import subprocess

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FASHION_DIR = os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")
DATA_DIR = os.environ.get("PSHARD_DATA_DIR", os.path.join(ROOT, "data"))


def _idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[0:4], "big")
    ndim = magic & 0xFF
    if magic >> 8 != 0x08 or ndim < 1:  # unsigned byte data
        raise ValueError(f"{path}: not an IDX file of unsigned bytes")
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if arr.size != int(np.prod(dims)):
        raise ValueError(f"{path}: truncated ({arr.size} of {int(np.prod(dims))} bytes)")
    return arr.reshape(dims)


def fashion_mnist(directory=FASHION_DIR, limit=0):
    """(x_train, y_train, x_test, y_test): images as float32 (N, 784) standardised with
    the training set's mean and deviation, labels as int64. limit > 0 keeps only the
    first `limit` training images (the statistics still come from all of them)."""
    if not os.path.exists(os.path.join(directory, "train-images-idx3-ubyte.gz")):
        raise FileNotFoundError(f"Fashion-MNIST not found in {directory}: apt-get install dataset-fashion-mnist")

    def load(prefix):
        x = _idx(os.path.join(directory, f"{prefix}-images-idx3-ubyte.gz"))
        y = _idx(os.path.join(directory, f"{prefix}-labels-idx1-ubyte.gz"))
        return x.reshape(len(x), -1), y.astype(np.int64)
    xtr, ytr = load("train")
    xte, yte = load("t10k")
    hist = np.bincount(xtr.ravel(), minlength=256).astype(np.float64)   # exact and cheap statistics
    v = np.arange(256) / 255.0
    mean = float((hist * v).sum() / hist.sum())
    std = float(np.sqrt((hist * (v - mean) ** 2).sum() / hist.sum()))
    if limit:
        xtr, ytr = xtr[:limit], ytr[:limit]

    def norm(x):
        return ((x.astype(np.float32) / 255.0 - mean) / std).astype(np.float32)
    return norm(xtr), ytr, norm(xte), yte


def movielens_csv(directory=DATA_DIR):
    """Path of the MovieLens ratings CSV (userId,movieId,rating), exported from
    r-cran-dslabs with Rscript on first use."""
    path = os.path.join(directory, "movielens.csv")
    if os.path.exists(path):
        return path
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    script = ('suppressMessages(library(dslabs)); data(movielens); '
              f'write.csv(movielens[, c("userId", "movieId", "rating")], file = "{tmp}", row.names = FALSE)')
    try:
        subprocess.run(["Rscript", "-e", script], check=True, capture_output=True, timeout=300)
    except FileNotFoundError:
        raise FileNotFoundError("Rscript not found: apt-get install r-cran-dslabs") from None
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"exporting MovieLens with Rscript failed (is r-cran-dslabs installed?):\n"
                           f"{e.stderr.decode(errors='replace')}") from None
    os.replace(tmp, path)
    return path


def ratings_file(path):
    """A ratings file of your own: one rating a line, user, item and rating (further
    columns, such as MovieLens' timestamps, ignored), separated by commas (CSV, with or
    without a header line) or by tabs or blanks (MovieLens' u.data). Users and items are
    any integers. Returns the dict movielens() returns."""
    with open(path) as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise ValueError(f"{path}: no ratings")
    sep = "," if "," in lines[0] else None
    first = lines[0].split(sep)
    try:
        float(first[0]), float(first[2])
    except (ValueError, IndexError):
        lines = lines[1:]  # a header line
    users, items, ratings = [], [], []
    for n, ln in enumerate(lines, 1):
        f = ln.split(sep)
        if len(f) < 3:
            raise ValueError(f"{path}: line {n}: expected user, item and rating, got {ln[:80]!r}")
        try:
            users.append(int(f[0]))
            items.append(int(f[1]))
            ratings.append(float(f[2]))
        except ValueError:
            raise ValueError(f"{path}: line {n}: not integers and a number: {ln[:80]!r}") from None
    return {"user": np.array(users, dtype=np.int64), "item": np.array(items, dtype=np.int64),
            "rating": np.array(ratings, dtype=np.float32)}


def movielens(directory=DATA_DIR, test_fraction=0.2, seed=42):
    """(train, test): dicts of contiguous arrays "user", "item" (int64) and "rating"
    (float32), split 80/20 by a fixed-seed permutation of the ratings."""
    raw = np.loadtxt(movielens_csv(directory), delimiter=",", skiprows=1,
                     dtype=[("user", np.int64), ("item", np.int64), ("rating", np.float32)])
    perm = np.random.default_rng(seed).permutation(len(raw))
    ntest = int(round(len(raw) * test_fraction))
    def part(idx):
        return {f: np.ascontiguousarray(raw[f][idx]) for f in ("user", "item", "rating")}
    return part(perm[ntest:]), part(perm[:ntest])
