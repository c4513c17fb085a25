"""jobs.py - run a command (`pshard run ...` or a plain script) with a deadline, echo its
output as it comes, and give it back; used by the examples' --compare modes."""
import json
import os
import signal
import subprocess
import sys
import time


def run(argv, timeout, env=None, echo=True):
    """(exit status, output). On timeout the process gets SIGTERM (pshard run then stops
    its scheduler, servers and workers), SIGKILL 5 s later, and the status is 124."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    lines = []
    deadline = time.time() + timeout
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    timed_out = False
    while True:
        left = deadline - time.time()
        if left <= 0:
            timed_out = True
            break
        if sel.select(timeout=min(left, 1.0)):
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()
    if timed_out:
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(wait)
                break
            except subprocess.TimeoutExpired:
                pass
        lines.append(f"(killed after {timeout} s)\n")
        return 124, "".join(lines)
    rest = p.stdout.read()
    if rest:
        lines.append(rest)
        if echo:
            sys.stdout.write(rest)
    return p.wait(), "".join(lines)


def result(text, tag="RESULT"):
    """The JSON after the last `tag` on any line (pshard run prefixes "[worker 0] ")."""
    found = None
    for line in text.splitlines():
        i = line.find(tag + " {")
        if i >= 0:
            found = json.loads(line[i + len(tag) + 1:])
    if found is None:
        raise RuntimeError(f"no {tag} line in the output:\n{text[-4000:]}")
    return found


def pshard_run(servers, workers, mode, extra=()):
    """The argv prefix of `pshard run` for this build (pshard.find_command())."""
    import pshard
    return [pshard.find_command(), "run", "-s", str(servers), "-w", str(workers), "--mode", mode,
            "--progress-ms", "0", *extra, "--"]


def clean_env():
    """This environment without a launcher's PSHARD_* variables (for a run alone)."""
    keep = ("PSHARD_BUILD", "PSHARD_LIB", "PSHARD_BIN", "PSHARD_DATA_DIR")
    return {k: v for k, v in os.environ.items() if not k.startswith("PSHARD_") or k in keep}
