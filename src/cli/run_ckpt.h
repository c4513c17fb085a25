/*
 * run_ckpt.h - the checkpoint flags that `pshard run` and `pshard exec` share (run.c).
 */
#ifndef PS_CLI_RUN_CKPT_H
#define PS_CLI_RUN_CKPT_H

#include <getopt.h>
#include <stdint.h>

/* The checkpoint flags `pshard run` and `pshard exec` share: where the scheduler writes
 * checkpoints, how many it keeps, how often the worker of rank 0 asks for one, and the
 * checkpoint a job starts from. The scheduler gets --checkpoint-dir, --checkpoint-keep
 * and --restore, every server --restore, every worker PSHARD_CHECKPOINT_EVERY. */
typedef struct ckpt_opts {
  const char *dir;     /* --checkpoint-dir, NULL: none */
  const char *restore; /* --restore, NULL: a fresh job */
  uint64_t every, keep, full_every; /* every: clocks, or 1 when a duration was given */
  const char *every_arg;              /* --checkpoint-every as written */
  int every_given, keep_given, full_given;
  char s_keep[24];     /* --checkpoint-keep's value as passed on */
  char s_full[24];     /* --checkpoint-full-every's */
  char env_every[48];  /* "PSHARD_CHECKPOINT_EVERY=N" */
} ckpt_opts;

#define CKPT_LONG_OPTS                                                                         \
  {"checkpoint-dir", required_argument, 0, 'D'}, {"checkpoint-every", required_argument, 0, 'E'}, \
      {"checkpoint-keep", required_argument, 0, 'K'}, {"checkpoint-full-every", required_argument, 0, 'F'}, \
      { "restore", required_argument, 0, 'R' }

#define CKPT_USAGE                                                                                   \
  "      --checkpoint-dir DIR      the scheduler writes checkpoints to DIR/ckpt-<id> (created\n"       \
  "                                if missing); needed by ps_checkpoint and --checkpoint-every\n"     \
  "      --checkpoint-every N|D    the worker of rank 0 asks for a checkpoint every N clocks, or\n"   \
  "                                at its first clock D (500ms, 30s, 10m, 2h) after the last\n"      \
  "                                (PSHARD_CHECKPOINT_EVERY; 0 = off); needs --checkpoint-dir\n"     \
  "      --checkpoint-keep K       complete checkpoints kept, older ones removed (3)\n"               \
  "      --checkpoint-full-every N one checkpoint in N holds every row, the others the rows\n"       \
  "                                changed since the one before (1: all whole)\n"                   \
  "      --restore DIR             start from the newest complete checkpoint under DIR (or the\n"     \
  "                                checkpoint DIR itself); may equal --checkpoint-dir\n"

/* One of CKPT_LONG_OPTS (c: its getopt code) into k: 0, 1 if c is not one of them, or 2
 * (the message printed, as the other flag errors). */
int ps__cli_ckpt_flag(int c, const char *arg, ckpt_opts *k, const char *cmd);
/* The flags' combinations checked, their values prepared: 0 or 2. */
int ps__cli_ckpt_check(ckpt_opts *k, const char *cmd);
/* Create the checkpoint directory (one level) if it is missing: 0 or 1. */
int ps__cli_ckpt_make_dir(const ckpt_opts *k, const char *cmd);
/* The scheduler's checkpoint arguments appended to argv at *n. */
void ps__cli_ckpt_sched_args(const ckpt_opts *k, char **argv, int *n);

#endif
