/*
 * run_procs.c - the children of `pshard run`: each started in its own process group
 * with its output on a pipe (and killed with the launcher: PR_SET_PDEATHSIG), every
 * line of it printed with the child's name, the exits reaped, and the signals that end
 * the job turned into a wake-up of the output loop (a self-pipe).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli/run_procs.h"
#include "common/common.h"

proc ps__procs[MAX_PROCS];
int ps__nprocs;
volatile sig_atomic_t ps__got_signal;
static int sig_pipe[2] = {-1, -1};

static void on_signal(int sig) {
  int saved = errno;
  if (sig != SIGCHLD) ps__got_signal = sig;
  char c = (char)sig;
  if (write(sig_pipe[1], &c, 1) < 0) { /* the loop polls anyway */ }
  errno = saved;
}

int ps__procs_signals(void) {
  if (pipe(sig_pipe) != 0) return 1;
  fcntl(sig_pipe[0], F_SETFL, O_NONBLOCK);
  fcntl(sig_pipe[1], F_SETFL, O_NONBLOCK);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGCHLD, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
  return 0;
}

static void emit_line(proc *p, const char *line, size_t n) {
  printf("[%s] %.*s\n", p->name, (int)n, line);
}

void ps__proc_drain(proc *p, int final) {
  for (;;) {
    if (p->fd < 0) break;
    ssize_t n = read(p->fd, p->buf + p->len, sizeof p->buf - p->len);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) break;
    if (n <= 0) {
      close(p->fd);
      p->fd = -1;
      break;
    }
    p->len += (size_t)n;
    size_t start = 0;
    for (size_t i = 0; i < p->len; i++) {
      if (p->buf[i] == '\n') {
        emit_line(p, p->buf + start, i - start);
        start = i + 1;
      }
    }
    memmove(p->buf, p->buf + start, p->len - start);
    p->len -= start;
    if (p->len == sizeof p->buf) { /* an over-long line: emit what we have */
      emit_line(p, p->buf, p->len);
      p->len = 0;
    }
  }
  if ((final || p->fd < 0) && p->len) {
    emit_line(p, p->buf, p->len);
    p->len = 0;
  }
  fflush(stdout);
}

/* Start argv with extra environment (NAME=VALUE strings, NULL-terminated). */
proc *ps__proc_spawn(const char *name, int is_worker, char *const argv[], char *const env[]) {
  int fds[2];
  if (ps__nprocs == MAX_PROCS || pipe(fds) != 0) return NULL;
  pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return NULL;
  }
  if (pid == 0) {
    pid_t parent = getppid();
    setpgid(0, 0);
    /* If the launcher itself is killed (SIGKILL leaves it no chance to stop anyone),
     * its children go too rather than linger as orphans. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    close(fds[0]);
    close(fds[1]);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGCHLD, SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    for (int i = 0; env && env[i]; i++) putenv(env[i]);
    execvp(argv[0], argv);
    fprintf(stderr, "cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);
  close(fds[1]);
  fcntl(fds[0], F_SETFL, O_NONBLOCK);
  fcntl(fds[0], F_SETFD, FD_CLOEXEC);
  proc *p = &ps__procs[ps__nprocs++];
  memset(p, 0, sizeof *p);
  snprintf(p->name, sizeof p->name, "%s", name);
  p->is_worker = is_worker;
  p->pid = pid;
  p->fd = fds[0];
  return p;
}

void ps__procs_reap(void) {
  int st;
  pid_t pid;
  while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
    for (int i = 0; i < ps__nprocs; i++) {
      if (ps__procs[i].pid != pid) continue;
      ps__procs[i].exited = 1;
      ps__procs[i].status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
  }
}

void ps__procs_signal(int sig) {
  for (int i = 0; i < ps__nprocs; i++)
    if (!ps__procs[i].exited) kill(-ps__procs[i].pid, sig);
}

/* Wait for every child to exit, draining output; SIGKILL after grace_ms. */
void ps__procs_stop(int grace_ms) {
  ps__procs_signal(SIGTERM);
  uint64_t deadline = ps__now_ms() + (uint64_t)grace_ms;
  int killed = 0;
  for (;;) {
    ps__procs_reap();
    int alive = 0;
    for (int i = 0; i < ps__nprocs; i++) {
      ps__proc_drain(&ps__procs[i], 0);
      alive += !ps__procs[i].exited;
    }
    if (!alive) break;
    if (!killed && ps__now_ms() >= deadline) {
      ps__procs_signal(SIGKILL);
      killed = 1;
    }
    usleep(20000);
  }
  for (int i = 0; i < ps__nprocs; i++) {
    ps__proc_drain(&ps__procs[i], 1);
    /* the process group may still hold the pipe open (grandchildren) */
    if (ps__procs[i].fd >= 0) {
      kill(-ps__procs[i].pid, SIGKILL);
      close(ps__procs[i].fd);
      ps__procs[i].fd = -1;
    }
  }
}

void ps__procs_poll(void) {
  struct pollfd pf[MAX_PROCS + 1];
  int map[MAX_PROCS + 1], n = 0;
  pf[n].fd = sig_pipe[0];
  pf[n].events = POLLIN;
  map[n++] = -1;
  for (int i = 0; i < ps__nprocs; i++) {
    if (ps__procs[i].fd < 0) continue;
    pf[n].fd = ps__procs[i].fd;
    pf[n].events = POLLIN;
    map[n++] = i;
  }
  int r = poll(pf, (nfds_t)n, 200);
  if (r <= 0) return;
  for (int i = 0; i < n; i++) {
    if (!pf[i].revents) continue;
    if (map[i] < 0) {
      char b[64];
      while (read(sig_pipe[0], b, sizeof b) > 0) {}
    } else {
      ps__proc_drain(&ps__procs[map[i]], 0);
    }
  }
}
