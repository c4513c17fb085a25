"""The examples on real data (examples/python). Short smoke runs by default; the full
runs that check the issue's figures are marked slow (pytest --slow, or the make
targets example-fashion-mnist and example-movielens)."""
import os
import sys

import pytest

pytest.importorskip("torch")
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "python")
sys.path.insert(0, EXAMPLES)
import jobs  # noqa: E402

PY = sys.executable
FMNIST = os.path.join(EXAMPLES, "fashion_mnist.py")
MOVIELENS = os.path.join(EXAMPLES, "movielens.py")


def need(path, package):
    if not os.path.exists(path):
        pytest.skip(f"{path} missing: apt-get install {package}")


def check(rc, out):
    assert rc == 0, out[-6000:]
    return jobs.result(out)


def test_fashion_mnist_two_workers_equal_one_process():
    """Sync mode: 2 workers with half batches compute what one worker computes."""
    need("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz", "dataset-fashion-mnist")
    args = [FMNIST, "--epochs", "1", "--limit", "1536", "--batch", "64", "--hidden", "64"]
    two = check(*jobs.run(jobs.pshard_run(2, 2, "sync") + [PY] + args, 120, echo=False))
    one = check(*jobs.run([PY] + args, 120, env=jobs.clean_env(), echo=False))
    assert two["workers"] == 2 and one["workers"] == 1
    assert two["test_acc"][0] > 0.6, two
    assert abs(two["test_acc"][0] - one["test_acc"][0]) <= 0.003, (two, one)


def test_movielens_two_workers_async():
    import shutil
    if not shutil.which("Rscript") or not os.path.exists("/usr/lib/R/site-library/dslabs"):
        pytest.skip("MovieLens needs Rscript and r-cran-dslabs")
    res = check(*jobs.run(jobs.pshard_run(2, 2, "async") + [PY, MOVIELENS, "--epochs", "1", "--mode", "async"],
                          120, echo=False))
    assert res["workers"] == 2 and res["mode"] == "async"
    assert res["test_rmse"][0] < 1.0, res


def test_movielens_on_your_own_train_and_test_files(tmp_path):
    """--train a CSV with a header, --test MovieLens' tab-separated u.data format: a
    planted rating rule is learned, under pshard run with 2 workers; malformed files
    and a lone --train are refused clearly."""
    import random
    r = random.Random(1)
    rule = lambda u, i: (u % 5 + i % 5) / 2 + 0.5  # noqa: E731
    train, test = tmp_path / "train.csv", tmp_path / "u.test"
    with open(train, "w") as f:
        f.write("userId,movieId,rating\n")
        for _ in range(3000):
            u, i = r.randrange(60), r.randrange(40)
            f.write(f"{u},{i},{rule(u, i):.1f}\n")
    with open(test, "w") as f:
        for _ in range(500):
            u, i = r.randrange(60), r.randrange(40)
            f.write(f"{u}\t{i}\t{rule(u, i):.1f}\t881250949\n")
    args = [PY, MOVIELENS, "--train", str(train), "--test", str(test), "--epochs", "4", "--batch", "64",
            "--servers", "1", "--mode", "async"]
    res = check(*jobs.run(jobs.pshard_run(1, 2, "async") + args, 120, echo=False))
    assert res["workers"] == 2 and len(res["test_rmse"]) == 4
    assert res["test_rmse"][-1] < 0.5 * res["test_rmse"][0], res
    bad = tmp_path / "bad.csv"
    bad.write_text("1,2,3\n4,x,5\n")
    rc, out = jobs.run([PY, MOVIELENS, "--train", str(bad), "--test", str(test), "--epochs", "1"], 60,
                       env=jobs.clean_env(), echo=False)
    assert rc != 0 and "bad.csv: line 2" in out, out[-2000:]
    rc, out = jobs.run([PY, MOVIELENS, "--train", str(train)], 60, env=jobs.clean_env(), echo=False)
    assert rc == 2 and "--train and --test go together" in out, out[-2000:]


@pytest.mark.slow
def test_fashion_mnist_full():
    """2 workers, sync, server-side Adam: >= 87% test accuracy within 10 epochs;
    prints the single-process PyTorch figure beside it."""
    need("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz", "dataset-fashion-mnist")
    rc, out = jobs.run([PY, FMNIST, "--compare", "--workers", "2", "--epochs", "10"], 3600)
    res = jobs.result(out, "COMPARE")
    assert max(res["pshard"]["test_acc"]) >= 0.87, res
    assert rc == 0


@pytest.mark.slow
def test_movielens_full():
    """2 workers, async: final test RMSE within 2% of the same script alone."""
    rc, out = jobs.run([PY, MOVIELENS, "--compare", "--workers", "2", "--mode", "async"], 3600)
    res = jobs.result(out, "COMPARE")
    assert res["relative_difference"] <= 0.02, res
    assert rc == 0
