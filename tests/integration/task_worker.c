/*
 * task_worker.c - takes data-partition tasks from the scheduler and records them, for
 * the task tests. Usage: task_worker PARTITIONS EPOCHS RECORD_FILE [SLEEP_MS]
 * Appends "start E P" before and "done E P" after each task (flushed at once), so a
 * test that kills a worker can tell finished partitions from interrupted ones. A call
 * in flight when the scheduler's connection closes (PS_ERR_UNAVAILABLE) is made again,
 * every 100 ms for up to 30 s: a restarted scheduler answers it. A done that was kept
 * before the scheduler died, unanswered, is refused when sent again (the partition is
 * not assigned any more): it counts as done.
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "pshard.h"

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: task_worker PARTITIONS EPOCHS RECORD_FILE [SLEEP_MS]\n");
    return 2;
  }
  unsigned parts = (unsigned)atoi(argv[1]), epochs = (unsigned)atoi(argv[2]);
  int sleep_ms = argc > 4 ? atoi(argv[4]) : 0;
  FILE *rec = fopen(argv[3], "a");
  ps_ctx *ctx;
  int rc;
  if (!rec) return 1;
  if ((rc = ps_ctx_open_env(&ctx)) || (rc = ps_tasks_init(ctx, parts, epochs))) {
    fprintf(stderr, "task_worker: %s: %s\n", ps_err_name(rc), ps_errmsg());
    return 1;
  }
  int away = 0; /* calls made again while the scheduler was away */
  for (;;) {
    ps_task t;
    rc = ps_task_next(ctx, &t, 5000);
    if (rc == PS_ERR_DONE) break;
    if (rc == PS_ERR_TIMEOUT) continue;
    if (rc == PS_ERR_UNAVAILABLE && away++ < 300) {
      usleep(100000);
      continue;
    }
    if (rc) {
      fprintf(stderr, "task_worker: next: %s: %s\n", ps_err_name(rc), ps_errmsg());
      return 1;
    }
    fprintf(rec, "start %u %u\n", t.epoch, t.partition);
    fflush(rec);
    printf("start %u %u\n", t.epoch, t.partition);
    fflush(stdout);
    if (sleep_ms) usleep((useconds_t)sleep_ms * 1000);
    int again = 0;
    while ((rc = ps_task_done(ctx, &t)) == PS_ERR_UNAVAILABLE && away++ < 300) {
      usleep(100000);
      again = 1;
    }
    if (rc && !(again && rc == PS_ERR_INVALID)) {
      fprintf(stderr, "task_worker: done: %s: %s\n", ps_err_name(rc), ps_errmsg());
      return 1;
    }
    fprintf(rec, "done %u %u\n", t.epoch, t.partition);
    fflush(rec);
  }
  /* A second call after the end keeps answering DONE. */
  ps_task t;
  rc = ps_task_next(ctx, &t, 0);
  if (rc != PS_ERR_DONE) {
    fprintf(stderr, "task_worker: expected PS_ERR_DONE after the last epoch, got %s\n", ps_err_name(rc));
    return 1;
  }
  fclose(rec);
  ps_ctx_close(ctx);
  return 0;
}
