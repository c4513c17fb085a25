"""Replicated sync rounds with real processes (cluster.Cluster: own process groups,
ephemeral ports, SIGKILLed at the end), driven by repl_sync_worker: a sync job (Adam on a
dense table, Adagrad on a sparse one, gradients that depend on the values pulled) whose
final model, printed in hex, shows any difference bit for bit.

1. The model under R = 2 is the model under R = 1 (replication changes no number).
2. S = 3, R = 2: any one server SIGKILLed mid-run, the job finishes and its model is
   the no-fault model bit for bit; the survivors caught up the rounds the dead head had
   not handed on.
3. A head stopped (SIGSTOP) past the heartbeat timeout and continued: the same.
4. Replica traffic is one combined update per round, about 1/K of the push traffic.
5. The same faults with a large dense table whose pushes go by peer memory, on the
   caller's thread (the copies kept for a failover hold their values), and whose
   rounds go down the chains by peer memory (each member reads the rows in the memory
   of the one before it).
6. A survivor a round ahead of its own table in a chain it takes over (it got the
   workers' CLOCKs late) answers the pushes of that round sent again, and applies
   none of them twice.
7. R = 3: a second server killed while the catch-up of the first death waits for the
   workers' lists: the catch-up takes the second death in; the model is unchanged.
8. Servers that hear of the job's start after the workers (R = 1 and 2): the same model.
9. A member that gets round frames naming its predecessor's memory after their expiry,
   or cannot read that memory at all, reads nothing of them and is sent the values:
   the same model.
Every wait is bounded; under ASan (PSHARD_SANITIZED=1) time limits are scaled.
"""
import os
import re
import signal
import subprocess
import time

import pytest

from cluster import Cluster, binary
from test_once import RUN, SCALE, server_stat

ROUNDS = 40


BIG = 3 * 32768  # floats: a part per server of 128 KiB, above the peer-memory minimum


def run(replicas, workers=2, kill=None, stop=None, sleep_ms=20, big=0, calls=None, victim_env=None, env=None,
        logs_out=None, survivor_env=None, then_kill=None, victim_logs=None, worker_args=(), server_env_of=None):
    """The model lines of a job, after killing (or stopping) server index kill/stop;
    with big, a large dense table too, and each worker's call counters into calls;
    victim_env: the environment of the victim alone; survivor_env: of the other
    servers; env: of every process; logs_out: a list that gets the survivors' logs;
    then_kill: (index, seconds): another server SIGKILLed that long after the first;
    victim_logs: a dict that gets the victims' logs (servers run with --verbose);
    worker_args: more options of repl_sync_worker; server_env_of: {index: environment}
    of single servers."""
    hbt = int(1000 * SCALE)
    victim = kill if kill is not None else stop
    victims = {victim} | ({then_kill[0]} if then_kill else set())
    server_env = {i: survivor_env for i in range(3) if i != victim} if survivor_env else {}
    if victim_env:
        server_env[victim] = victim_env
    server_env.update(server_env_of or {})
    with Cluster(3, workers, replicas=replicas, heartbeat_timeout_ms=hbt,
                 extra_env={"PSHARD_RETRY_MS": "300", **(env or {})},
                 server_env=server_env or None, verbose=victim_logs is not None) as c:
        extra = ["--big", str(big)] if big else []
        ps = [c.worker([binary("repl_sync_worker"), "--rounds", str(ROUNDS), "--sleep-ms", str(sleep_ms)] + extra +
                       list(worker_args),
                       f"w{i}") for i in range(workers)]
        if victim is not None:
            c.wait_started()
            time.sleep(0.5)  # not scaled: the workers must still be training
            assert all(p.poll() is None for p in ps), "the workers finished before the fault"
            proc = c.server_procs[victim]
            if kill is not None:
                os.killpg(proc.pid, signal.SIGKILL)
                if then_kill:
                    time.sleep(then_kill[1])
                    assert all(p.poll() is None for p in ps), "the workers finished before the second fault"
                    os.killpg(c.server_procs[then_kill[0]].pid, signal.SIGKILL)
            else:
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    deadline = time.time() + 10 * SCALE
                    while "removed: missed heartbeats" not in c.log("scheduler"):
                        assert time.time() < deadline, c.log("scheduler")
                        time.sleep(0.05)
                    time.sleep(0.3)
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
        codes = c.wait(ps, RUN)
        assert codes == [0] * workers, "".join(f"--- w{i}\n{c.log(f'w{i}')[-3000:]}" for i in range(workers)) + \
            c.log("scheduler")
        models = []
        for i in range(workers):
            log = c.log(f"w{i}")
            assert not re.findall(r"^fail .*$", log, re.M), log
            models.append(re.findall(r"^model .*$", log, re.M))
            assert len(models[-1]) == (3 if big else 2), log
            if calls is not None:
                m = re.search(r"^calls direct=(\d+) peer_mem=(\d+)$", log, re.M)
                assert m, log
                calls.append((int(m.group(1)), int(m.group(2))))
        assert all(m == models[0] for m in models), "the workers pulled different models"
        alive = [i for i in range(3) if i not in victims]
        if logs_out is not None:
            logs_out.extend(c.log(f"server{i}") for i in alive)
        if victim_logs is not None:
            victim_logs.update({i: c.log(f"server{i}") for i in victims})
        stats = {name: [server_stat(c, i, name) for i in alive]
                 for name in ("catchups", "forwards", "forward_bytes", "held_ahead", "peer_mem_forwards_out",
                              "peer_mem_forwards_in", "peer_mem_forwards_resent", "shared_requests",
                              "forward_buffers")}
        return models[0], stats


@pytest.fixture(scope="module")
def reference():
    return run(1)[0]


def test_a_replicated_sync_model_is_the_unreplicated_one_bit_for_bit(reference):
    model, stats = run(2)
    assert model == reference
    assert sum(stats["forwards"]) > 0


@pytest.mark.parametrize("victim", [0, 1, 2])
def test_a_server_killed_mid_run_leaves_the_sync_model_bit_for_bit_unchanged(reference, victim):
    model, stats = run(2, kill=victim)
    assert model == reference
    # The dead server headed chains of both tables: their next members took them over.
    assert sum(stats["catchups"]) >= 2, stats


def test_a_head_stopped_past_the_heartbeat_timeout_leaves_the_sync_model_unchanged(reference):
    model, stats = run(2, stop=1)
    assert model == reference
    assert sum(stats["catchups"]) >= 2, stats


@pytest.mark.parametrize("victim", [0, 1, 2])
def test_copies_kept_of_a_seldom_pushed_table_sent_again_at_a_failover_are_no_alarm(reference, victim):
    # Table "s" is pushed in the first round only: the workers keep their copies of
    # those pushes to the end, and send the dead server's again to the new heads, which
    # refuse them (their round is on every copy) without a warning.
    logs = []
    model, stats = run(2, kill=victim, logs_out=logs, worker_args=("--seldom",))
    assert model == reference
    assert sum(stats["catchups"]) >= 2, stats
    assert not any("refused at round" in log for log in logs), "".join(logs)


@pytest.mark.parametrize("victim", [0, 2])
def test_workers_hearing_of_a_death_before_the_servers_keeps_the_sync_model(reference, victim):
    # The membership that says a server died reaches the servers 1 s after the workers
    # (their second membership, after the job's start), so the workers' REPLAYED lists
    # come before the survivors know they took over chains: they are kept until then,
    # and the catch-ups end on every push listed, not at their deadline. The victim
    # hands its rounds on late, so it dies holding rounds only it applied.
    late = "delay=1000ms:type=membership:n=2+:node=server"
    logs = []
    model, stats = run(2, kill=victim, env={"PSHARD_FAULT": late}, logs_out=logs,
                       victim_env={"PSHARD_FAULT": late + ",delay=150ms:type=forward-round:n=1+:dir=out"})
    assert model == reference
    assert sum(stats["catchups"]) >= 2, stats
    assert all("delayed received membership frame #2" in log for log in logs), logs
    assert not any("ends at its deadline" in log for log in logs), logs


@pytest.mark.parametrize("victim", [0, 2])
def test_a_pipelined_worker_hearing_of_a_death_first_keeps_the_sync_model(reference, victim):
    # The workers start their pushes and clock before the pushes are answered, as the
    # click-through example does, and compute 40 ms between a round's pulls and its
    # pushes, so the kill lands there: they hear of it before they push, 1 s before the
    # servers. A push to a chain the survivor is to take over is refused by it (not
    # the head yet at its epoch) and sent again later. The worker's CLOCK for that round
    # must not reach the survivor before it: the survivor would apply the round without
    # the push, and refuse the push when it came (PS_ERR_CLOCK).
    late = "delay=1000ms:type=membership:n=2+:node=server"
    model, stats = run(2, kill=victim, env={"PSHARD_FAULT": late}, sleep_ms=0,
                       worker_args=["--overlap", "--compute-ms", "40"])
    assert model == reference
    assert sum(stats["catchups"]) >= 2, stats


@pytest.mark.parametrize("victim", [0, 1])
def test_a_member_a_round_ahead_of_its_table_takes_over_without_applying_that_round_twice(reference, victim):
    # The survivors get the workers' CLOCKs 150 ms late, so each applies the round the
    # victim forwarded before its own table has passed that round: at the kill, a chain
    # taken over is a round ahead of the new head's table. The pushes of that round the
    # workers send again are held by the chain already; applied again, they would change
    # the model.
    logs = []
    # (scaled under ASan: the failover must come while the survivors still wait)
    late = f"delay={int(150 * SCALE)}ms:type=clock:n=1+:dir=in"
    model, stats = run(2, kill=victim, logs_out=logs, survivor_env={"PSHARD_FAULT": late})
    assert model == reference
    assert sum(stats["catchups"]) >= 2, stats
    assert all("delayed received clock frame" in log for log in logs), logs
    assert sum(stats["held_ahead"]) > 0, stats  # the case this is about came to pass


def test_a_second_death_during_a_catch_up_keeps_the_sync_model(reference):
    # R = 3: server 0 dies, and server 1 half a second later, while the catch-ups of
    # server 0's chains (on servers 1 and 2) wait for the workers' lists: the workers
    # hear of each death 1.5 s late. Every server hands its rounds on 150 ms late, so
    # the dead hold rounds only they applied. Server 2 takes over the chains of both:
    # its catch-up takes in the second death and waits for the lists about both, and
    # server 1's catch-ups, which died with it, are redone from the pushes the workers
    # list again.
    logs, victims = [], {}
    late = {"PSHARD_FAULT": "delay=1500ms:type=membership:n=2+:node=worker,delay=150ms:type=forward-round:n=1+:dir=out"}
    model, stats = run(3, kill=0, then_kill=(1, 0.5), logs_out=logs, env=late, victim_logs=victims)
    assert model == reference
    assert sum(stats["catchups"]) >= 2, stats
    assert "more chain" in logs[0], logs[0]  # the catch-up took the second death in
    assert "taking over" in victims[1], victims[1]  # the second victim ran catch-ups
    assert not any("ends at its deadline" in log for log in logs), logs


@pytest.mark.parametrize("replicas", [1, 2])
def test_servers_hearing_of_the_start_late_keep_the_sync_model(reference, replicas):
    # Every membership reaches the servers 600 ms late, the job's start among them: the
    # workers start first. A server that has not heard of the start holds a sync pull
    # until the rounds before its clock are applied (it answered at once, with no round
    # applied, and the workers ran 8 clocks ahead until their pushes were refused).
    model, _ = run(replicas, survivor_env={"PSHARD_FAULT": "delay=600ms:type=membership:n=1+:node=server"})
    assert model == reference


def test_replica_traffic_is_one_update_per_round_not_one_per_push():
    # Each of K workers pushes the whole model every round (48 dense floats with their
    # segments, 40 sparse rows of 4 floats with their keys): the push traffic grows with
    # K, the replica traffic (a round's combined update, plus the frames' prefixes and
    # chain lists) does not.
    fwd = {}
    for workers in (2, 4):
        _, stats = run(2, workers=workers, sleep_ms=0)
        fwd[workers] = sum(stats["forward_bytes"])
    pushed4 = ROUNDS * 4 * (48 * 4 + 3 * 16 + 40 * (8 + 16))
    assert fwd[4] <= 1.05 * fwd[2], fwd
    assert fwd[4] < 0.5 * pushed4, (fwd, pushed4)


@pytest.fixture(scope="module")
def big_reference():
    return run(1, big=BIG)[0]


def test_a_large_table_s_pushes_are_read_from_the_workers_kept_copies(big_reference):
    # Each worker keeps a copy of its pushes for a failover, in a shared buffer, and the
    # push names that copy: the heads read it through a mapping (the workers' own
    # buffers are plain memory), 3 parts a round from each worker, beside the rounds
    # the members read from their heads' shared buffers.
    model, stats = run(2, big=BIG, sleep_ms=0)
    assert model == big_reference
    assert sum(stats["shared_requests"]) >= 2 * 3 * ROUNDS + ROUNDS, stats
    assert sum(stats["peer_mem_forwards_in"]) >= ROUNDS, stats


def test_round_rows_in_ordinary_memory_are_read_with_process_vm_readv(big_reference):
    # PSHARD_FORWARD_BUFFERS=0: a head builds its round frames in pooled memory, which
    # the members read with process_vm_readv (no mapping): the same model.
    model, stats = run(2, big=BIG, env={"PSHARD_FORWARD_BUFFERS": "0"})
    assert model == big_reference
    assert stats["forward_buffers"] == [0, 0, 0], stats
    assert sum(stats["peer_mem_forwards_in"]) >= ROUNDS, stats


@pytest.mark.parametrize("fault", ["kill-0", "kill-1", "stop-2"])
def test_a_large_table_by_peer_memory_keeps_the_sync_model_through_a_failover(big_reference, fault):
    # Its pushes and pulls go by peer memory, on the callers' threads, while the workers
    # keep copies with the values for the new heads; a zombie head is given up on at
    # once (a pull it held goes to the new head once it may no longer write).
    # The victim hands its rounds on late, so it dies holding rounds only it applied:
    # the new heads rebuild them from the copies the workers send again.
    how, victim = fault.split("-")
    calls = []
    kw = {"kill": int(victim)} if how == "kill" else {"stop": int(victim)}
    late = {"PSHARD_FAULT": "delay=150ms:type=forward-round:n=1+:dir=out"}
    model, stats = run(2, big=BIG, calls=calls, victim_env=late, **kw)
    assert model == big_reference
    assert sum(stats["catchups"]) >= 2, stats
    # More parts by peer memory than the pushes have (3 a round): the pulls' too.
    assert all(d > ROUNDS and pm > 3 * (ROUNDS + 1) for d, pm in calls), calls
    # The large table's rounds went down the chains by peer memory too: each member
    # read them in its predecessor's memory.
    assert sum(stats["peer_mem_forwards_in"]) > ROUNDS, stats


def test_a_member_that_cannot_read_its_predecessor_s_memory_is_sent_the_round_rows(big_reference):
    # Server 1 has peer memory off: it answers the first round frame naming the memory
    # of the server before it that it cannot read it, and is sent the values from then
    # on; the others read each other's.
    model, stats = run(2, big=BIG, server_env_of={1: {"PSHARD_PEER_MEM": "0"}})
    assert model == big_reference
    assert stats["peer_mem_forwards_in"][1] == 0, stats
    # of the three links down the chains, the one between the other two servers
    assert sum(stats["peer_mem_forwards_in"]) >= ROUNDS, stats
    assert 1 <= sum(stats["peer_mem_forwards_resent"]) <= 4, stats


def test_round_rows_named_in_memory_and_read_after_their_expiry_are_sent_with_their_values(big_reference):
    # Server 1 holds some of the round frames it receives 1.5 s, past their expiry
    # (1 s): it reads nothing of those, answers so, and is sent the values instead.
    # Only the large table's frames name their values in memory, one of the four frames
    # server 1 gets each round, in no fixed place among them; a round's frames go out
    # together, before any frame of the next round. So four frames in a row are held:
    # a round's large frame is among them, or queued behind one of them (read late too).
    held = {"PSHARD_FAULT": ",".join(f"delay=1500ms:type=forward-round:n={n}:dir=in" for n in (21, 22, 23, 24))}
    model, stats = run(2, big=BIG, server_env_of={1: held})
    assert model == big_reference
    assert sum(stats["peer_mem_forwards_in"]) > ROUNDS, stats
    assert sum(stats["peer_mem_forwards_resent"]) >= 1, stats


# Worker 1 computes 300 ms a round, so worker 0 spends most of each round waiting in its
# pull of the large table, by peer memory, at all three heads.
WAITING = ("--rounds", "12", "--big-first", "--compute-ms", "300", "--compute-rank", "1")


@pytest.fixture(scope="module")
def waiting_reference():
    return run(1, big=BIG, worker_args=WAITING)[0]


@pytest.mark.parametrize("fault", ["kill-0", "kill-1", "stop-0"])
def test_a_large_pull_waiting_at_a_head_that_dies_goes_to_the_next_copy(waiting_reference, fault):
    # The victim's part goes to the next copy once the victim can no longer write into
    # the worker's buffer (at once when it was killed; a stopped one after the part's
    # expiry), inline. The call gives the other heads' links back to the loop for the
    # failover, and their parts take the answers those heads send when the round is on
    # both copies (or go again inline after their expiry).
    how, victim = fault.split("-")
    kw = {"kill": int(victim)} if how == "kill" else {"stop": int(victim)}
    calls = []
    model, stats = run(2, big=BIG, calls=calls, worker_args=WAITING, **kw)
    assert model == waiting_reference
    assert all(pm > 3 * 12 for _, pm in calls), calls


def test_two_copies_train_the_model_of_one_when_a_worker_misses_a_head(tmp_path):
    # ckpt_worker pushes 6 random keys of each sparse table a step (mean mode, adam and
    # adagrad): in some rounds all of one worker's keys lie in chains the other server
    # heads. That worker still counts in the round's denominator at every head (an empty
    # push goes to each chain), as every server counts it under R = 1, so R = 2 trains
    # the same model bit for bit.
    models = {}
    for replicas in (1, 2):
        out = str(tmp_path / f"model-r{replicas}")
        r = subprocess.run([binary("pshard"), "run", "-s", "2", "-w", "2", "--replicas", str(replicas), "--mode", "sync",
                            "--progress-ms", "0", "--", binary("ckpt_worker"), "--steps", "300", "--out", out],
                           capture_output=True, text=True, timeout=RUN)
        assert r.returncode == 0, r.stdout + r.stderr
        with open(out) as f:
            models[replicas] = f.read().splitlines()
    assert len(models[1]) == 544
    assert models[2] == models[1]
