/*
 * run_procs.h - the children of `pshard run` (run.c): their table, their output, their
 * signals. Used only by run.c's single thread (and its signal handler).
 */
#ifndef PS_CLI_RUN_PROCS_H
#define PS_CLI_RUN_PROCS_H

#include <signal.h>
#include <stddef.h>
#include <sys/types.h>

#define MAX_PROCS 1024
#define LINE_MAX_BYTES 8192

typedef struct proc {
  char name[32];
  int is_worker;
  pid_t pid;
  int fd;          /* read end of its output pipe, -1 once closed */
  char buf[LINE_MAX_BYTES];
  size_t len;
  int exited;
  int status;      /* exit code, or 128 + signal */
  int replaced;    /* a scheduler that died and was started again: not a failure */
} proc;

extern proc ps__procs[MAX_PROCS];
extern int ps__nprocs;
extern volatile sig_atomic_t ps__got_signal; /* SIGINT or SIGTERM received (0: none) */

/* Catch SIGINT, SIGTERM and SIGCHLD (they wake ps__procs_poll), ignore SIGPIPE. 0 or 1. */
int ps__procs_signals(void);
/* Start argv with extra environment (NAME=VALUE strings, NULL-terminated) in its own
 * process group, its output on a pipe; NULL if it cannot be started. */
proc *ps__proc_spawn(const char *name, int is_worker, char *const argv[], char *const env[]);
/* Print p's complete output lines, each prefixed with its name (final: the rest too). */
void ps__proc_drain(proc *p, int final);
/* Note the children that exited, and their statuses. */
void ps__procs_reap(void);
/* Send sig to every live child's process group. */
void ps__procs_signal(int sig);
/* Wait for every child to exit, draining output; SIGKILL after grace_ms. */
void ps__procs_stop(int grace_ms);
/* Wait up to 200 ms for output or a signal, and print the output. */
void ps__procs_poll(void);

#endif
