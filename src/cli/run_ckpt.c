/*
 * run_ckpt.c - the checkpoint flags of `pshard run` and `pshard exec` (run_ckpt.h).
 */
#include "cli/run_ckpt.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/common.h"
#include "common/config.h"

/* A checkpoint flag (c is its getopt code): 0 taken, 2 a bad value (said why), -1 not
 * a checkpoint flag. */
int ps__cli_ckpt_flag(int c, const char *arg, ckpt_opts *k, const char *cmd) {
  const char *flag;
  switch (c) {
  case 'D': flag = "--checkpoint-dir"; k->dir = arg; break;
  case 'R': flag = "--restore"; k->restore = arg; break;
  case 'E':
    uint64_t ms;
    if (ps__parse_every(arg, &k->every, &ms)) {
      fprintf(stderr,
              "pshard %s: bad value '%s' for --checkpoint-every (N clocks, 0 = off, or a duration: 500ms, 30s, 10m, 2h)\n",
              cmd, arg);
      return 2;
    }
    if (ms) k->every = 1; /* on: the value travels as written */
    k->every_arg = arg;
    k->every_given = 1;
    return 0;
  case 'F':
    if (ps__parse_u64(arg, &k->full_every) || k->full_every == 0 || k->full_every > 1000000u) {
      fprintf(stderr, "pshard %s: bad value '%s' for --checkpoint-full-every (1..1000000)\n", cmd, arg);
      return 2;
    }
    k->full_given = 1;
    snprintf(k->s_full, sizeof k->s_full, "%llu", (unsigned long long)k->full_every);
    return 0;
  case 'K':
    if (ps__parse_u64(arg, &k->keep) || k->keep == 0 || k->keep > 1000000u) {
      fprintf(stderr, "pshard %s: bad value '%s' for --checkpoint-keep (1..1000000)\n", cmd, arg);
      return 2;
    }
    k->keep_given = 1;
    snprintf(k->s_keep, sizeof k->s_keep, "%llu", (unsigned long long)k->keep);
    return 0;
  default: return -1;
  }
  if (!*arg || strlen(arg) >= PS_CFG_PATH_MAX) {
    fprintf(stderr, "pshard %s: bad %s directory (1..%d bytes)\n", cmd, flag, PS_CFG_PATH_MAX - 1);
    return 2;
  }
  return 0;
}

/* The flags together: -1 to go on, or 2 (said why). */
int ps__cli_ckpt_check(ckpt_opts *k, const char *cmd) {
  if (k->every_given && k->every && !k->dir) {
    fprintf(stderr, "pshard %s: --checkpoint-every needs --checkpoint-dir (where to write them)\n", cmd);
    return 2;
  }
  if (k->keep_given && !k->dir) {
    fprintf(stderr, "pshard %s: --checkpoint-keep needs --checkpoint-dir\n", cmd);
    return 2;
  }
  if (k->full_given && !k->dir) {
    fprintf(stderr, "pshard %s: --checkpoint-full-every needs --checkpoint-dir\n", cmd);
    return 2;
  }
  struct stat st;
  if (k->restore && stat(k->restore, &st) != 0) {
    fprintf(stderr, "pshard %s: --restore %s: %s\n", cmd, k->restore, strerror(errno));
    return 2;
  }
  if (k->restore && !S_ISDIR(st.st_mode)) {
    fprintf(stderr, "pshard %s: --restore %s: not a directory\n", cmd, k->restore);
    return 2;
  }
  snprintf(k->env_every, sizeof k->env_every, "PSHARD_CHECKPOINT_EVERY=%s", k->every_arg ? k->every_arg : "0");
  return -1;
}

/* The checkpoint directory exists (made if missing, one level): 0, or 1 (said why). */
int ps__cli_ckpt_make_dir(const ckpt_opts *k, const char *cmd) {
  struct stat st;
  if (!k->dir) return 0;
  if (mkdir(k->dir, 0777) != 0 && errno != EEXIST) {
    fprintf(stderr, "pshard %s: cannot create the checkpoint directory %s: %s\n", cmd, k->dir, strerror(errno));
    return 1;
  }
  if (stat(k->dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
    fprintf(stderr, "pshard %s: the checkpoint directory %s is not a directory\n", cmd, k->dir);
    return 1;
  }
  return 0;
}

/* Append the scheduler's checkpoint flags to argv at *n (room for 8 more). */
void ps__cli_ckpt_sched_args(const ckpt_opts *k, char **argv, int *n) {
  if (k->dir) {
    argv[(*n)++] = "--checkpoint-dir";
    argv[(*n)++] = (char *)k->dir;
  }
  if (k->keep_given) {
    argv[(*n)++] = "--checkpoint-keep";
    argv[(*n)++] = (char *)k->s_keep;
  }
  if (k->full_given) {
    argv[(*n)++] = "--checkpoint-full-every";
    argv[(*n)++] = (char *)k->s_full;
  }
  if (k->restore) {
    argv[(*n)++] = "--restore";
    argv[(*n)++] = (char *)k->restore;
  }
}

