"""The Kubernetes manifests in deploy/kubernetes/, without a cluster: they parse; every
flag and PSHARD_* variable their containers use is one pshard (or the worker program)
accepts; the job secret is the Secret mounted as a file and passed by its path; the
ports of the Services, containers, probes and addresses agree; the replica counts match
the scheduler's --servers and --workers. Then each container's command and environment
is translated to a local process (Service names and pod IPs become 127.0.0.1, the ports
ephemeral, mounts temporary directories) and the job runs for real: it trains and every
process exits 0."""
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import ROOT, binary  # noqa: E402

DEPLOY = os.path.join(ROOT, "deploy", "kubernetes")
SLOW = 3 if os.environ.get("PSHARD_SANITIZED") else 1
PROGRAMS = {"pshard": "pshard", "ctr_worker": os.path.join("examples", "ctr", "ctr_worker")}
INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def load():
    objs = {}
    for f in sorted(os.listdir(DEPLOY)):
        if f.endswith(".yaml"):
            for d in yaml.safe_load_all(open(os.path.join(DEPLOY, f))):
                objs[(d["kind"], d["metadata"]["name"])] = d
    return objs


def pod(obj):
    return obj["spec"]["template"]["spec"]


def container(obj):
    cs = pod(obj)["containers"]
    assert len(cs) == 1, obj["metadata"]["name"]
    return cs[0]


def flag(cmd, name):
    """The value after `name` in an argv, or None."""
    return cmd[cmd.index(name) + 1] if name in cmd else None


def env_of(c):
    return {e["name"]: e for e in c.get("env", [])}


def help_text(*argv):
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    return p.stdout + p.stderr


def accepted_variables():
    """PSHARD_* variables pshard reads: those its commands' --help name, the library's
    configuration keys (PSHARD_<KEY>, src/common/config.c) and the secret's."""
    text = "".join(help_text(binary("pshard"), c, "--help") for c in ("scheduler", "server", "run", "exec"))
    names = set(re.findall(r"PSHARD_[A-Z_]+[A-Z]", text))
    src = open(os.path.join(ROOT, "src", "common", "config.c")).read()
    table = src[src.index("keys[] = {"):src.index("#define NKEYS")]
    names |= {"PSHARD_" + k.upper() for k in re.findall(r'\{"([a-z_]+)", K_', table)}
    return names | {"PSHARD_SECRET", "PSHARD_SECRET_FILE"}


@pytest.fixture(scope="module")
def objs():
    o = load()
    for key in [("Service", "ps-scheduler"), ("Deployment", "ps-scheduler"), ("Service", "ps-server"),
                ("StatefulSet", "ps-server"), ("Job", "ps-worker")]:
        assert key in o, f"{key} missing from {DEPLOY}"
    return o


def workloads(objs):
    return [objs[("Deployment", "ps-scheduler")], objs[("StatefulSet", "ps-server")], objs[("Job", "ps-worker")]]


def test_flags_and_variables_are_ones_pshard_accepts(objs):
    names = accepted_variables()
    for w in workloads(objs):
        c = container(w)
        cmd = c["command"] + c.get("args", [])
        prog = cmd[0]
        assert prog in PROGRAMS, f"{w['metadata']['name']}: runs {prog}, not a pshard program"
        helpargv = [binary(PROGRAMS[prog])] + ([cmd[1]] if prog == "pshard" else []) + ["--help"]
        text = help_text(*helpargv)
        for a in cmd[1:]:
            if a.startswith("--"):
                assert re.search(r"(^|\s)" + re.escape(a) + r"\b", text), f"{' '.join(helpargv)} has no {a}"
        for name in env_of(c):
            if name.startswith("PSHARD_"):
                assert name in names, f"{w['metadata']['name']}: pshard reads no {name}"
        assert pod(w).get("enableServiceLinks") is False, w["metadata"]["name"]


def test_the_secret_is_a_mounted_file(objs):
    for w in workloads(objs):
        name = w["metadata"]["name"]
        c = container(w)
        vols = {v["name"]: v for v in pod(w)["volumes"]}
        secret_vols = [n for n, v in vols.items() if v.get("secret", {}).get("secretName") == "ps-secret"]
        assert len(secret_vols) == 1, name
        assert vols[secret_vols[0]]["secret"]["defaultMode"] == 0o400, name
        mounts = [m for m in c["volumeMounts"] if m["name"] == secret_vols[0]]
        assert len(mounts) == 1 and mounts[0].get("readOnly"), name
        path = mounts[0]["mountPath"] + "/secret"
        env = env_of(c)
        assert flag(c["command"], "--secret-file") == path or env.get("PSHARD_SECRET_FILE", {}).get("value") == path, \
            f"{name}: the secret at {path} is not passed"
        assert "PSHARD_SECRET" not in env, f"{name}: the secret belongs in a file"


def test_ports_and_counts_agree(objs):
    svc, sched = objs[("Service", "ps-scheduler")], container(objs[("Deployment", "ps-scheduler")])
    sport = svc["spec"]["ports"][0]
    assert svc["spec"]["selector"] == objs[("Deployment", "ps-scheduler")]["spec"]["template"]["metadata"]["labels"]
    assert int(flag(sched["command"], "--port")) == sport["targetPort"] == sched["ports"][0]["containerPort"] \
        == sched["readinessProbe"]["tcpSocket"]["port"]
    where = f"ps-scheduler:{sport['port']}"
    server_set, worker_job = objs[("StatefulSet", "ps-server")], objs[("Job", "ps-worker")]
    srv = container(server_set)
    hsvc = objs[("Service", "ps-server")]
    assert hsvc["spec"]["clusterIP"] == "None" and server_set["spec"]["serviceName"] == "ps-server"
    assert int(flag(srv["command"], "--port")) == hsvc["spec"]["ports"][0]["targetPort"] \
        == srv["ports"][0]["containerPort"] == srv["readinessProbe"]["tcpSocket"]["port"]
    assert flag(srv["command"], "--transport") == "tcp"
    senv, wenv = env_of(srv), env_of(container(worker_job))
    assert senv["PSHARD_SCHEDULER"]["value"] == wenv["PSHARD_SCHEDULER"]["value"] == where
    assert senv["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert senv["PSHARD_HOST"]["value"] == "$(POD_IP)"
    servers, workers = int(flag(sched["command"], "--servers")), int(flag(sched["command"], "--workers"))
    assert server_set["spec"]["replicas"] == servers == int(wenv["PSHARD_SERVERS"]["value"])
    assert worker_job["spec"]["completions"] == worker_job["spec"]["parallelism"] == workers \
        == int(wenv["PSHARD_WORKERS"]["value"])
    assert worker_job["spec"]["completionMode"] == "Indexed"
    assert wenv["PSHARD_WORKER_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == INDEX_FIELD
    assert wenv["PSHARD_TRANSPORT"]["value"] == "tcp"


# ---------------------------------------------------------------- run it on loopback

def local_process(w, mounts, sched_port=None, index=0):
    """A container's argv and environment as a local process: its programs from the
    build, mounts at their local directories, Service names and pod IPs at 127.0.0.1,
    its ports 0 (any; the scheduler's is read from its output), the scheduler's address
    at its real port, the downward API's fields and $(VAR) references resolved as the
    kubelet does."""
    c = container(w)
    vols = {v["name"]: v for v in pod(w)["volumes"]}

    def local_path(s):
        for m in c.get("volumeMounts", []):
            v = vols[m["name"]]
            if "emptyDir" in v:  # one directory per pod and volume, kept over restarts
                base = os.path.join(mounts["emptyDir"], w["metadata"]["name"], m["name"])
                os.makedirs(base, exist_ok=True)
            elif "secret" in v:
                base = mounts[v["secret"]["secretName"]]
            else:
                base = mounts[v["persistentVolumeClaim"]["claimName"]]
            if s == m["mountPath"] or s.startswith(m["mountPath"] + "/"):
                return base + s[len(m["mountPath"]):]
        return s

    argv = [binary(PROGRAMS[c["command"][0]])] + [local_path(a) for a in c["command"][1:] + c.get("args", [])]
    for i, a in enumerate(argv[:-1]):
        if a == "--host":
            argv[i + 1] = "127.0.0.1"  # loopback only, in a test
        if a == "--port":
            argv[i + 1] = "0"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSHARD_")}
    for e in c.get("env", []):
        if "value" in e:
            val = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
        else:
            field = e["valueFrom"]["fieldRef"]["fieldPath"]
            val = {"status.podIP": "127.0.0.1", INDEX_FIELD: str(index)}[field]
        if e["name"] == "PSHARD_SCHEDULER":
            assert val.startswith("ps-scheduler:"), val
            val = f"127.0.0.1:{sched_port}"
        env[e["name"]] = local_path(val)
    return argv, env


def start(argv, env, log):
    return subprocess.Popen(argv, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_log(path, pattern, timeout, what):
    deadline = time.time() + timeout
    while True:
        m = re.search(pattern, open(path).read(), re.M)
        if m:
            return m
        assert time.time() < deadline, f"{what} within {timeout}s\n" + open(path).read()
        time.sleep(0.05)


@pytest.mark.parametrize("faults", [False, True], ids=["no-fault", "server-and-scheduler-restarted"])
def test_the_manifests_run_a_job_on_loopback(objs, faults):
    # With faults, a server is SIGKILLed mid-training and started again with its
    # container's command, as the kubelet restarts it (it takes the dead one's place and
    # copies its rows), then the scheduler, on its port with its state directory: the job
    # still trains on every example, and its model learned.
    rows = 200000 if faults else 20000
    d = tempfile.mkdtemp(prefix="pshard-k8s-")
    secret_dir, data = os.path.join(d, "secret"), os.path.join(d, "data")
    # As the kubelet lays out a Secret volume: the key is a symlink into ..data/.
    os.makedirs(os.path.join(secret_dir, "..data"))
    with open(os.open(os.path.join(secret_dir, "..data", "secret"), os.O_WRONLY | os.O_CREAT, 0o400), "w") as f:
        f.write(secrets.token_hex(32))
    os.symlink("..data/secret", os.path.join(secret_dir, "secret"))
    r = subprocess.run([binary(PROGRAMS["ctr_worker"].replace("ctr_worker", "ctr_gen")), "--rows", str(rows),
                        "--test-rows", "2000", "--parts", "2", "--signal-top", "100", "--out", data, "--quiet"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    mounts = {"ps-secret": secret_dir, "ps-data": data, "emptyDir": os.path.join(d, "empty")}
    procs = []

    def logs():
        return "".join(f"--- {f}\n" + open(os.path.join(d, f)).read()[-3000:] for f in sorted(os.listdir(d))
                       if f.endswith(".log"))
    try:
        argv, env = local_process(objs[("Deployment", "ps-scheduler")], mounts)
        sched_log = os.path.join(d, "scheduler.log")
        sched = start(argv, env, sched_log)
        procs.append(sched)
        deadline, port = time.time() + 10 * SLOW, None
        while port is None and time.time() < deadline and sched.poll() is None:
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", open(sched_log).read())
            port = m and int(m.group(1))
            time.sleep(0.02)
        assert port, open(sched_log).read()
        servers = []
        for i in range(objs[("StatefulSet", "ps-server")]["spec"]["replicas"]):
            argv, env = local_process(objs[("StatefulSet", "ps-server")], mounts, port)
            servers.append(start(argv, env, os.path.join(d, f"server-{i}.log")))
        procs += servers
        workers = []
        for i in range(objs[("Job", "ps-worker")]["spec"]["completions"]):
            argv, env = local_process(objs[("Job", "ps-worker")], mounts, port, index=i)
            workers.append(start(argv, env, os.path.join(d, f"worker-{i}.log")))
        procs += workers
        if faults:
            wait_log(sched_log, r"job started", 30 * SLOW, "the job starts")
            time.sleep(0.5)
            assert all(w.poll() is None for w in workers), "the workers finished before the faults\n" + logs()
            os.killpg(servers[1].pid, signal.SIGKILL)
            servers[1].wait()
            argv, env = local_process(objs[("StatefulSet", "ps-server")], mounts, port)
            servers[1] = start(argv, env, os.path.join(d, "server-1-again.log"))
            procs.append(servers[1])
            wait_log(sched_log, r"has copied its rows", 60 * SLOW, "the restarted server copies its rows")
            assert all(w.poll() is None for w in workers), "the workers finished before the scheduler's fault\n" + logs()
            os.killpg(sched.pid, signal.SIGKILL)
            sched.wait()
            argv, env = local_process(objs[("Deployment", "ps-scheduler")], mounts)
            argv[argv.index("--port") + 1] = str(port)  # its Service's port, as before
            sched_log = os.path.join(d, "scheduler-again.log")
            sched = start(argv, env, sched_log)
            procs.append(sched)
        for i, w in enumerate(workers):
            rc = w.wait(timeout=(240 if faults else 120) * SLOW)
            assert rc == 0, logs()
        wlogs = [open(os.path.join(d, f"worker-{i}.log")).read() for i in range(len(workers))]
        trained = sum(int(n) for log in wlogs for n in re.findall(r"trained on (\d+) examples", log))
        assert trained == rows, logs()
        auc = [float(a) for log in wlogs for a in re.findall(r"epoch 1: test logloss [0-9.]+\s+auc ([0-9.]+)", log)]
        assert auc and auc[0] > 0.6, wlogs  # rank 0 evaluated a model that learned
        for s in servers:
            s.send_signal(signal.SIGTERM)  # a server leaves cleanly and exits 0
        for s in servers:
            assert s.wait(timeout=30) == 0, logs()
        sched.send_signal(signal.SIGTERM)
        assert sched.wait(timeout=30) == 0, open(sched_log).read()
        log = open(sched_log).read()
        if faults:
            assert "restarted from" in log, log
        else:
            assert "job started: 2 servers, 2 workers" in log, log
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        subprocess.run(["rm", "-rf", d])
