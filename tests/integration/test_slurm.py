"""pshard under a real Slurm: a one-host cluster (munged, slurmctld and slurmd, each from
a temporary directory, on ephemeral ports of loopback) is started inside the test, and
`srun -n 4` runs docs/operations.md's Slurm line: `pshard exec -s 1 --addr-file ...`
makes task 0 the scheduler, task 1 a server and tasks 2-3 workers, which train the
click-through example. Every daemon is stopped afterwards.

It skips, saying why, where Slurm cannot be started: binaries missing (Debian packages
slurmctld, slurmd, slurm-client, munge: the Makefile's APT_SLURM_PACKAGES), not root
(slurmd runs jobs as their user and must be root), or daemons that do not come up."""
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import binary  # noqa: E402

SLOW = 3 if os.environ.get("PSHARD_SANITIZED") else 1
NEEDED = ["munged", "munge", "slurmctld", "slurmd", "srun", "sinfo", "scancel"]
NODE = "pstest1"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_conf(d, host, ctld_port, d_port):
    return f"""ClusterName=pshardtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge/sock
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={NODE} NodeAddr=127.0.0.1 NodeHostname={host} CPUs=8 State=UNKNOWN
PartitionName=pshard Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""


def tail(path, n=30):
    try:
        return "".join(open(path, errors="replace").readlines()[-n:])
    except OSError:
        return f"({path}: none)"


@pytest.fixture
def slurm():
    """A running one-host Slurm: yields (dir, env with SLURM_CONF)."""
    missing = [b for b in NEEDED if not shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")]
    if missing:
        pytest.skip(f"slurm is not installed (no {', '.join(missing)}; Debian: slurmctld slurmd slurm-client munge)")
    if os.geteuid() != 0:
        pytest.skip("starting slurmd needs root (it runs job steps as their user)")
    which = lambda b: shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")  # noqa: E731
    d = tempfile.mkdtemp(prefix="pshard-slurm-")
    for sub in ("munge", "state", "spool"):
        os.makedirs(os.path.join(d, sub), mode=0o700)
    os.chmod(d, 0o755)  # munged wants its socket's directories reachable
    os.chmod(os.path.join(d, "munge"), 0o755)
    key = os.path.join(d, "munge", "key")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o400), "wb") as f:
        f.write(os.urandom(1024))
    host = socket.gethostname().split(".")[0]
    conf = os.path.join(d, "slurm.conf")
    open(conf, "w").write(slurm_conf(d, host, free_port(), free_port()))
    env = dict(os.environ, SLURM_CONF=conf)
    procs = []

    def daemon(argv, log):
        p = subprocess.Popen(argv, stdout=open(os.path.join(d, log), "w"), stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
        procs.append(p)
        return p

    try:
        m = daemon([which("munged"), "-F", "-f", f"--socket={d}/munge/sock", f"--key-file={key}",
                    f"--pid-file={d}/munge/pid", f"--seed-file={d}/munge/seed", f"--log-file={d}/munge/log"],
                   "munged.out")
        deadline = time.time() + 10
        while not os.path.exists(f"{d}/munge/sock") and time.time() < deadline and m.poll() is None:
            time.sleep(0.05)
        if not os.path.exists(f"{d}/munge/sock"):
            pytest.skip("munged did not start: " + tail(os.path.join(d, "munged.out")))
        ctld = daemon([which("slurmctld"), "-D", "-f", conf], "slurmctld.out")
        time.sleep(0.5)
        slurmd = daemon([which("slurmd"), "-D", "-f", conf, "-N", NODE], "slurmd.out")
        deadline, state = time.time() + 30, ""
        while time.time() < deadline and ctld.poll() is None and slurmd.poll() is None:
            r = subprocess.run([which("sinfo"), "-h", "-n", NODE, "-o", "%t"], env=env, capture_output=True,
                               text=True, timeout=10)
            state = r.stdout.strip()
            if state in ("idle", "mix"):
                break
            time.sleep(0.3)
        if state not in ("idle", "mix"):
            pytest.skip(f"slurm did not come up (node state '{state}'):\n"
                        + tail(os.path.join(d, "slurmctld.out")) + tail(os.path.join(d, "slurmd.out")))
        yield d, env
    finally:
        subprocess.run([which("scancel"), "--full", "-u", "root"], env=env, capture_output=True, timeout=30)
        for p in reversed(procs):  # slurmd, slurmctld, munged: each by its own pid
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        shutil.rmtree(d, ignore_errors=True)


def test_srun_runs_a_pshard_job(slurm):
    d, env = slurm
    data = os.path.join(d, "data")
    r = subprocess.run([binary(os.path.join("examples", "ctr", "ctr_gen")), "--rows", "20000", "--test-rows", "2000",
                        "--parts", "2", "--signal-top", "100", "--out", data, "--quiet"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    secret = os.path.join(d, "secret")
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(secrets.token_hex(32))
    env = dict(env, PSHARD_MODE="sync", PSHARD_TRANSPORT="auto", PSHARD_SECRET_FILE=secret,
               PSHARD_JOB_ID="slurm-test")
    env = {k: v for k, v in env.items() if not k.startswith("PSHARD_") or k in
           ("PSHARD_MODE", "PSHARD_TRANSPORT", "PSHARD_SECRET_FILE", "PSHARD_JOB_ID", "PSHARD_SANITIZED")}
    addr = os.path.join(d, "addr")
    # The line of docs/operations.md's Slurm script, on one host: --host is loopback.
    cmd = (f"exec {binary('pshard')} exec -s 1 --addr-file {addr} --host 127.0.0.1 -- "
           f"{binary(os.path.join('examples', 'ctr', 'ctr_worker'))} --data {data} --epochs 1 --batch 500")
    r = subprocess.run([shutil.which("srun"), "-n", "4", "--distribution=cyclic", "--kill-on-bad-exit=0", "--time=5",
                        "-l", "sh", "-c", cmd], env=env, capture_output=True, text=True, timeout=180 * SLOW)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out + tail(os.path.join(d, "slurmd.log"))
    trained = sum(int(n) for n in re.findall(r"trained on (\d+) examples", out))
    assert trained == 20000, out
    auc = [float(a) for a in re.findall(r"epoch 1: test logloss [0-9.]+\s+auc ([0-9.]+)", out)]
    assert auc and auc[0] > 0.6, out
    # srun -l prefixes each line with its task: the workers were tasks 2 and 3.
    assert {int(t) for t in re.findall(r"^\s*(\d+): .*trained on", out, re.M)} == {2, 3}, out
