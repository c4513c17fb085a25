/*
 * task_ckpt_worker.c - takes data-partition tasks and counts them in a table, for the
 * test that a job restored from a checkpoint resumes its tasks mid-epoch
 * (test_task_resume.py).
 *
 * The job declares P partitions and E epochs, and an async dense table "count" of
 * P x E floats (sgd, lr 1). Processing partition p of epoch e is one push of -1 into
 * element e * P + p (acknowledged before the task is reported done), so the table
 * counts how often each (epoch, partition) was processed, and a checkpoint holds the
 * counts of the partitions done before it.
 *
 * Each worker appends "done E P" to RECORD.<rank> after each task it reports done
 * (flushed at once). With --ckpt-after K, the worker stops after K tasks done: it takes
 * one more task without processing it ("held E P" in the record, so the checkpoint has
 * a partition handed out but not done), calls ps_checkpoint, prints "checkpoint ID
 * after K tasks, holding partition P of epoch E" and sleeps until it is killed. After
 * the last epoch, rank 0 pulls the table and prints "counts" and the P x E counts.
 *
 * Usage: task_ckpt_worker --parts P --epochs E --record RECORD [--ckpt-after K]
 *        [--sleep-ms T]   (T: time a task takes)
 * Connection settings come from the environment (PSHARD_*).
 * Exit status: 0 success, 1 a pshard call failed (message on stderr), 2 bad usage.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pshard.h"

#define CHECK(call)                                                                              \
  do {                                                                                           \
    int rc_ = (call);                                                                            \
    if (rc_) {                                                                                   \
      fprintf(stderr, "task_ckpt_worker: %s failed: %s: %s\n", #call, ps_err_name(rc_), ps_errmsg()); \
      exit(1);                                                                                   \
    }                                                                                            \
  } while (0)

int main(int argc, char **argv) {
  unsigned parts = 0, epochs = 0, sleep_ms = 0;
  long ckpt_after = -1;
  const char *record = NULL;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--parts")) parts = (unsigned)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--epochs")) epochs = (unsigned)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--record")) record = argv[i + 1];
    else if (!strcmp(argv[i], "--ckpt-after")) ckpt_after = atol(argv[i + 1]);
    else if (!strcmp(argv[i], "--sleep-ms")) sleep_ms = (unsigned)atoi(argv[i + 1]);
    else {
      fprintf(stderr, "task_ckpt_worker: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (!parts || !epochs || !record || argc % 2 == 0) {
    fprintf(stderr, "usage: task_ckpt_worker --parts P --epochs E --record RECORD [--ckpt-after K] [--sleep-ms T]\n");
    return 2;
  }
  ps_ctx *ctx;
  uint32_t table;
  CHECK(ps_ctx_open_env(&ctx));
  int rank = ps_ctx_rank(ctx);
  char path[4096];
  snprintf(path, sizeof path, "%s.%d", record, rank);
  FILE *rec = fopen(path, "a");
  if (!rec) {
    fprintf(stderr, "task_ckpt_worker: cannot open %s\n", path);
    return 1;
  }
  CHECK(ps_table_declare(ctx, "count", PS_DENSE, (uint64_t)parts * epochs, "mode=async opt=sgd lr=1", &table));
  CHECK(ps_tasks_init(ctx, parts, epochs));
  long done = 0;
  for (;;) {
    ps_task t;
    int rc = ps_task_next(ctx, &t, 5000);
    if (rc == PS_ERR_DONE) break;
    if (rc == PS_ERR_TIMEOUT) continue;
    CHECK(rc);
    if (ckpt_after >= 0 && done == ckpt_after) {
      uint64_t id;
      fprintf(rec, "held %u %u\n", t.epoch, t.partition);
      fflush(rec);
      CHECK(ps_checkpoint(ctx, &id, 60000));
      printf("checkpoint %llu after %ld tasks, holding partition %u of epoch %u\n", (unsigned long long)id, done,
             t.partition, t.epoch);
      fflush(stdout);
      for (;;) pause(); /* until the test kills the job */
    }
    if (sleep_ms) usleep(sleep_ms * 1000u);
    float g = -1.0f;
    CHECK(ps_push_range(ctx, table, (uint64_t)t.epoch * parts + t.partition, 1, &g, 1, PS_LR_SCHEDULE, -1));
    CHECK(ps_task_done(ctx, &t));
    fprintf(rec, "done %u %u\n", t.epoch, t.partition);
    fflush(rec);
    done++;
  }
  if (rank == 0) {
    float *v = calloc((size_t)parts * epochs, sizeof *v);
    if (!v) return 1;
    CHECK(ps_pull_range(ctx, table, 0, (uint64_t)parts * epochs, v, -1));
    printf("counts");
    for (size_t i = 0; i < (size_t)parts * epochs; i++) printf(" %g", v[i]);
    printf("\n");
    free(v);
  }
  fclose(rec);
  ps_ctx_close(ctx);
  return 0;
}
