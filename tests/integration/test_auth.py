"""The job secret on real processes: a job whose scheduler, server and worker share a
secret, and strangers on its ports.

1. Strangers (no handshake, a wrong secret, another job's id, a replayed handshake,
   a handshake that stalls past the deadline) are refused with the one uniform answer
   (an ERROR frame, PS_ERR_AUTH, "authentication failed") and closed, on the server's
   and on the scheduler's port; a frame whose sender names another node than the one
   the handshake authenticated is refused. Meanwhile a worker of the job trains beside
   them and ends with exactly the parameters of an undisturbed run.
2. The right secret (a client written here, in Python, from docs/protocol.md) is let in
   and served.
3. A worker given another secret fails at once with a clear message; daemons refuse a
   bad secret file and a non-loopback address without a secret.
4. `pshard run` hands its job a secret in the environment (not on a command line).

The raw client's MACs are computed with Python's hmac module, independently of the C
code. Every process is started by cluster.Cluster; every wait is bounded.
"""
import hashlib
import hmac
import os
import struct
import subprocess
import time

from cluster import Cluster, binary
from test_core import (DENSE_SGD, REPLY, RUN_TIMEOUT, SCALE, SPARSE_ADAGRAD, T_CLOCK, T_HELLO, T_STATS, Raw,
                       alive, frame, load_params, run_sync, server_port, wait_for_line, worst)

SECRET = b"integration-test-secret-0123456789"
JOB = b"job-a"
T_AUTH_HELLO, T_AUTH_PROOF = 0x70, 0x71
T_ERROR = 14
E_AUTH = 23
ROLE_WORKER, ROLE_TOOL = 3, 4
DEADLINE_MS = 1000
AUTH_ENV = {"PSHARD_SECRET": SECRET.decode(), "PSHARD_JOB_ID": JOB.decode(),
            "PSHARD_AUTH_TIMEOUT_MS": str(DEADLINE_MS)}
ARGS = ["--batch", "4", "--steps", "60", "--sleep-ms", "80", "--dense-opt", DENSE_SGD, "--sparse-opt", SPARSE_ADAGRAD]


def side_mac(secret, label, job, rc, nc, nonce_c, rs, ns, nonce_s):
    """docs/protocol.md: HMAC-SHA256(secret, label NUL "pshard-auth-1" NUL len(job) job
    role_c node_c nonce_c role_s node_s nonce_s)."""
    msg = (label + b"\0" + b"pshard-auth-1\0" + bytes([len(job)]) + job + bytes([rc]) + struct.pack("<I", nc)
           + nonce_c + bytes([rs]) + struct.pack("<I", ns) + nonce_s)
    return hmac.new(secret, msg, hashlib.sha256).digest()


class Handshake:
    """A client's side of the handshake on a raw connection."""

    def __init__(self, port, secret=SECRET, job=JOB, role=ROLE_TOOL, node=0):
        self.r = Raw(port)
        self.nonce_c = os.urandom(32)
        self.hello = frame(T_AUTH_HELLO, bytes([1, role]) + struct.pack("<I", node) + self.nonce_c, req_id=1)
        self.r.send(self.hello)
        h, body = self.r.read_frame()
        assert h["type"] == T_AUTH_HELLO | REPLY and len(body) == 69, (h, body)
        rs, ns, nonce_s, mac_s = body[0], struct.unpack("<I", body[1:5])[0], body[5:37], body[37:]
        want = side_mac(secret, b"server", job, role, node, self.nonce_c, rs, ns, nonce_s)
        self.server_ok = hmac.compare_digest(want, mac_s)
        self.proof = frame(T_AUTH_PROOF, side_mac(secret, b"client", job, role, node, self.nonce_c, rs, ns, nonce_s),
                           req_id=1)
        self.r.send(self.proof)

    def accepted(self):
        h, body = self.r.read_frame()
        return h["type"] == T_AUTH_PROOF | REPLY and h["status"] == 0 and body == b""


def expect_refusal(r, what, status=E_AUTH, type_=T_ERROR):
    """The uniform refusal (or the error reply of type type_), then the close."""
    try:
        frames, how = r.read_to_close()
    finally:
        r.close()
    assert len(frames) == 1, f"{what}: got {frames} ({how})"
    h, body = frames[0]
    assert h["type"] == type_ and h["status"] == status, f"{what}: {h} {body!r}"
    return body


def refuse_strangers(port, name):
    # No handshake: a request, and a registration.
    for data, what in ((frame(T_STATS, req_id=7), "a request"), (frame(T_HELLO, req_id=1, payload=b"\0" * 9),
                                                                  "a hello")):
        r = Raw(port)
        r.send(data)
        assert expect_refusal(r, f"{name}: {what} without a handshake") == b"authentication failed"
    # A frame larger than a handshake's: the same answer, nothing allocated for it.
    r = Raw(port)
    r.send(frame(T_AUTH_HELLO, payload_len=1 << 30))
    assert expect_refusal(r, f"{name}: an oversized first frame") == b"authentication failed"
    # A wrong secret: the server's MAC does not check out, and our proof is refused.
    hs = Handshake(port, secret=b"not-the-secret-of-this-job-at-all")
    assert not hs.server_ok, f"{name}: a MAC under the wrong secret checked out"
    assert expect_refusal(hs.r, f"{name}: wrong secret") == b"authentication failed"
    # The right secret with another job's id.
    hs = Handshake(port, job=b"job-b")
    assert not hs.server_ok
    assert expect_refusal(hs.r, f"{name}: another job") == b"authentication failed"
    # The right secret: let in and served. Then its transcript, replayed, is refused.
    hs = Handshake(port)
    assert hs.server_ok and hs.accepted(), f"{name}: the right secret was not let in"
    hs.r.send(frame(T_STATS, req_id=42))
    h, body = hs.r.read_frame()
    assert h["type"] == T_STATS | REPLY and h["req_id"] == 42 and h["status"] == 0, (h, body)
    hs.r.close()
    r = Raw(port)
    r.send(hs.hello)
    h, body = r.read_frame()
    assert h["type"] == T_AUTH_HELLO | REPLY  # a fresh challenge...
    r.send(hs.proof)  # ...that the old proof does not answer
    assert expect_refusal(r, f"{name}: replayed handshake") == b"authentication failed"
    # Stalls: a connection that sends nothing, and one that stops after its hello.
    t0 = time.monotonic()
    silent = Raw(port)
    half = Raw(port)
    half.send(frame(T_AUTH_HELLO, bytes([1, ROLE_TOOL]) + b"\0" * 36, req_id=1))
    h, _ = half.read_frame()
    assert h["type"] == T_AUTH_HELLO | REPLY
    for r, what in ((silent, "silent"), (half, "stalled after its hello")):
        assert expect_refusal(r, f"{name}: {what}") == b"authentication failed"
    took = time.monotonic() - t0
    assert DEADLINE_MS / 1000 - 0.2 <= took <= DEADLINE_MS / 1000 + 2 * SCALE, f"{name}: closed after {took:.2f}s"


def test_strangers_are_refused_and_change_nothing(tmp_path):
    ref = run_sync(1, 1, 4, 60, str(tmp_path / "ref.txt"), DENSE_SGD, SPARSE_ADAGRAD)
    out = str(tmp_path / "out.txt")
    with Cluster(1, 1, extra_env=AUTH_ENV) as c:
        w = c.worker([binary("sync_worker"), *ARGS, "--progress", "1", "--out", out], "worker0")
        wait_for_line(c, "worker0", "step 1", RUN_TIMEOUT, [w])
        sport = server_port(c)
        cport = int(c.addr.rsplit(":", 1)[1])
        refuse_strangers(sport, "server")
        refuse_strangers(cport, "scheduler")

        # Authenticated, but naming another node as the sender: refused. On the server
        # a clock or push of a node the handshake did not authenticate...
        for data, answer in ((frame(T_CLOCK, sender=99999, clock=0), T_ERROR),
                             (frame(11, sender=1, req_id=5, table=1, batch=1, clock=0, nkeys=2,
                                    payload=struct.pack("<QQf", 0, 1, 100.0)), 11 | REPLY)):
            hs = Handshake(sport, role=ROLE_WORKER, node=77)
            assert hs.accepted()
            hs.r.send(data)
            body = expect_refusal(hs.r, "server: another sender", type_=answer)
            assert b"names node" in body, body
        # ...and on the scheduler a tool's hello that claims to be a registered node
        # coming back (sender = its id) cannot take that node's place.
        hs = Handshake(cport)
        assert hs.accepted()
        hs.r.send(frame(T_HELLO, sender=1, req_id=3, payload=b"\0" * 9))
        h, body = hs.r.read_frame()
        assert h["status"] == E_AUTH and b"names node 1" in body, (h, body)
        hs.r.close()
        assert "workers_alive 1" in stats_authenticated(cport)

        assert alive(w), "the worker finished before the strangers were done: make it slower"
        assert c.wait([w], RUN_TIMEOUT) == [0], c.log("worker0")
        assert alive(c.scheduler) and alive(c.server_procs[0]), c.log("server0") + c.log("scheduler")
        assert "authentication of" in c.log("server0"), c.log("server0")
    d, key, x, y = worst(load_params(out), ref)
    assert d == 0, f"the strangers changed training: {key} {x} vs {y}"


def stats_authenticated(port):
    hs = Handshake(port)
    assert hs.accepted()
    hs.r.send(frame(T_STATS, req_id=9))
    h, body = hs.r.read_frame()
    hs.r.close()
    assert h["status"] == 0, h
    return body.decode()


def test_a_worker_with_another_secret_fails_at_once(tmp_path):
    with Cluster(1, 1, extra_env=AUTH_ENV) as c:
        t0 = time.monotonic()
        w = c.worker([binary("sync_worker"), *ARGS, "--out", str(tmp_path / "x.txt")], "worker0",
                     env={"PSHARD_SECRET": "another-secret-entirely-0123"})
        codes = c.wait([w], RUN_TIMEOUT)
        assert codes[0] != 0
        assert "authentication failed" in c.log("worker0"), c.log("worker0")
        assert time.monotonic() - t0 < 10 * SCALE, "the worker retried instead of failing"
        assert alive(c.scheduler) and alive(c.server_procs[0])


def daemon(args, env_extra, timeout=10):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSHARD_")}
    env.update(env_extra)
    return subprocess.run([binary("pshard"), *args], env=env, capture_output=True, text=True,
                          timeout=timeout * SCALE)


def test_daemons_refuse_bad_secrets_and_open_addresses(tmp_path):
    sched = ["scheduler", "--servers", "1", "--workers", "1"]
    p = daemon(sched + ["--host", "0.0.0.0"], {})
    assert p.returncode != 0 and "without a job secret" in p.stderr, p.stderr
    short = tmp_path / "short"
    short.write_text("tiny\n")
    p = daemon(sched + ["--secret-file", str(short)], {})
    assert p.returncode == 2 and "16 to 1024 bytes" in p.stderr, p.stderr
    p = daemon(sched, {"PSHARD_SECRET_FILE": str(tmp_path / "missing")})
    assert p.returncode == 2 and "cannot open the secret file" in p.stderr, p.stderr
    p = daemon(sched, {"PSHARD_SECRET": SECRET.decode(), "PSHARD_SECRET_FILE": str(short)})
    assert p.returncode == 2 and "set one" in p.stderr, p.stderr
    p = daemon(["server", "--scheduler", "127.0.0.1:1", "--job-id", "a b"], {})
    assert p.returncode == 2 and "job id" in p.stderr, p.stderr


def test_a_secret_file_and_a_job_run_authenticated(tmp_path):
    """Daemons given --secret-file and a worker given PSHARD_SECRET_FILE (mode 0600)
    train together; a raw client needs that secret to be served."""
    f = tmp_path / "secret"
    f.write_bytes(SECRET + b"\n")
    os.chmod(f, 0o600)
    env = {"PSHARD_SECRET_FILE": str(f), "PSHARD_JOB_ID": JOB.decode()}
    ref = run_sync(1, 1, 4, 20, str(tmp_path / "ref.txt"), DENSE_SGD, SPARSE_ADAGRAD)
    out = str(tmp_path / "out.txt")
    with Cluster(1, 1, extra_env=env) as c:
        w = c.worker([binary("sync_worker"), "--batch", "4", "--steps", "20", "--dense-opt", DENSE_SGD,
                      "--sparse-opt", SPARSE_ADAGRAD, "--out", out], "worker0")
        assert c.wait([w], RUN_TIMEOUT) == [0], c.log("worker0")
        assert "workers_" in stats_authenticated(int(c.addr.rsplit(":", 1)[1]))
    assert worst(load_params(out), ref)[0] == 0


def test_pshard_run_gives_its_job_a_secret(tmp_path):
    """`pshard run` draws a secret and a job id for its job and passes them in the
    environment: the worker sees them, no process has them on its command line, and the
    job trains."""
    out = str(tmp_path / "out.txt")
    seen = tmp_path / "seen"
    script = (f'printf "%s %s\\n" "$PSHARD_SECRET" "$PSHARD_JOB_ID" > {seen}; '
              f'for p in /proc/[0-9]*; do tr "\\0" " " < $p/cmdline 2>/dev/null; echo; done > {tmp_path}/cmdlines; '
              f'exec {binary("sync_worker")} --batch 4 --steps 10 --out {out} --dense-opt "{DENSE_SGD}" '
              f'--sparse-opt "{SPARSE_ADAGRAD}"')
    env = {k: v for k, v in os.environ.items() if k not in ("PSHARD_SECRET", "PSHARD_SECRET_FILE", "PSHARD_JOB_ID")}
    p = subprocess.run([binary("pshard"), "run", "-s", "1", "-w", "1", "--", "sh", "-c", script], env=env,
                       capture_output=True, text=True, timeout=RUN_TIMEOUT, start_new_session=True)
    assert p.returncode == 0, p.stdout + p.stderr
    secret, job = seen.read_text().split()
    assert len(secret) == 64 and len(job) == 16, (secret, job)
    cmdlines = (tmp_path / "cmdlines").read_text()
    assert " scheduler " in cmdlines and " server " in cmdlines, cmdlines
    assert secret not in cmdlines and job not in cmdlines
    assert len(load_params(out)) > 0
