/*
 * repl_sync_worker.c - a sync training loop whose model says, bit for bit, whether a
 * run was disturbed: for the replicated sync tests (test_repl_sync.py).
 *
 * Two tables, mode sync (or --mode): a dense "w" of 48 floats in slices of 4 (Adam) and
 * a sparse "e" of dim 4 (Adagrad), every key of which every worker touches each round,
 * so every server takes part in every round. Each round: pull both, a gradient that
 * depends on the values pulled, the worker's rank and the round (so any difference
 * carries on), push both with batch 8 + rank, clock. After --rounds rounds: a barrier,
 * a pull of both, and one line per table with every value in hex ("%a"):
 *   model w 0x1.8p-3,...
 *   model e ...
 * --big N adds a dense table "b" of N floats (Adam, slices of 1024) pulled and pushed
 * the same way: large enough that, on one host, its parts go by peer memory. Its line
 * is a hash of its bits, and a line "calls direct=D peer_mem=P" follows, from the
 * context's counters:
 *   model b fnv=0123456789abcdef
 * --compute-ms MS sleeps between a round's pulls and its pushes (a worker computing);
 * --compute-rank R: only the worker of rank R does. --big-first pulls "b" first in each
 * round (the values are the same), so that a worker waiting for a slower one's round
 * waits in that pull.
 * --overlap starts the pushes of "w" and "e" (ps_push_range_start, ps_push_start),
 * clocks, and then waits for them, as a pipelined trainer does: the CLOCK is handed
 * over before the pushes are answered.
 * --seldom adds a sparse table "s" (dim 4, sgd) that every worker pushes to in the
 * first round only and never pulls, as a trainer's progress counters: the copies its
 * workers keep of those pushes are let go of by no later answer.
 * A failed call prints "fail ROUND CALL rc=NAME msg=..." and the worker exits 1.
 * Exit status 0 when the script ran, 2 bad usage. Connection settings from PSHARD_*.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pshard.h"

#define NW 48
#define NK 40
#define DIM 4

static int fail(int round, const char *call, int rc) {
  printf("fail %d %s rc=%s msg=%s\n", round, call, ps_err_name(rc), ps_errmsg());
  fflush(stdout);
  return 1;
}

int main(int argc, char **argv) {
  int rounds = 20, sleep_ms = 0, nbig = 0, compute_ms = 0, overlap = 0, compute_rank = -1, big_first = 0, seldom = 0;
  const char *mode = "sync";
  int bad = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--overlap")) {
      overlap = 1;
      continue;
    }
    if (!strcmp(argv[i], "--seldom")) {
      seldom = 1;
      continue;
    }
    if (!strcmp(argv[i], "--big-first")) {
      big_first = 1;
      continue;
    }
    if (i + 1 >= argc) {
      bad = 1;
      break;
    }
    if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--compute-ms")) compute_ms = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--compute-rank")) compute_rank = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--sleep-ms")) sleep_ms = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--mode")) mode = argv[i + 1];
    else if (!strcmp(argv[i], "--big")) nbig = atoi(argv[i + 1]);
    else {
      fprintf(stderr, "repl_sync_worker: unknown option %s\n", argv[i]);
      return 2;
    }
    i++;
  }
  if (bad || rounds < 1 || nbig < 0 || compute_ms < 0 || (overlap && (nbig || seldom)) || (big_first && !nbig)) {
    fprintf(stderr, "usage: repl_sync_worker [--overlap] [--rounds N] [--sleep-ms MS] [--compute-ms MS] "
                    "[--compute-rank R] [--mode MODE] [--big N [--big-first]] [--seldom]\n");
    return 2;
  }
  ps_ctx *ctx;
  int rc = ps_ctx_open_env(&ctx);
  if (rc) return fail(-1, "open", rc);
  char ow[160], oe[160];
  snprintf(ow, sizeof ow, "opt=adam lr=0.05 init=uniform:0.3 seed=7 slice=4 mode=%s", mode);
  snprintf(oe, sizeof oe, "opt=adagrad lr=0.1 init=uniform:0.2 seed=5 mode=%s", mode);
  uint32_t tw, te;
  if ((rc = ps_table_declare(ctx, "w", PS_DENSE, NW, ow, &tw))) return fail(-1, "declare w", rc);
  if ((rc = ps_table_declare(ctx, "e", PS_SPARSE, DIM, oe, &te))) return fail(-1, "declare e", rc);
  uint32_t tb = 0;
  float *b = NULL, *gb = NULL;
  if (nbig) {
    char ob[160];
    snprintf(ob, sizeof ob, "opt=adam lr=0.01 init=uniform:0.3 seed=9 slice=1024 mode=%s", mode);
    if ((rc = ps_table_declare(ctx, "b", PS_DENSE, (uint64_t)nbig, ob, &tb))) return fail(-1, "declare b", rc);
    b = malloc((size_t)nbig * sizeof *b);
    gb = malloc((size_t)nbig * sizeof *gb);
    if (!b || !gb) return fail(-1, "malloc", PS_ERR_NOMEM);
  }
  uint32_t ts = 0;
  if (seldom) {
    char os[160];
    snprintf(os, sizeof os, "opt=sgd lr=0.1 mode=%s", mode);
    if ((rc = ps_table_declare(ctx, "s", PS_SPARSE, DIM, os, &ts))) return fail(-1, "declare s", rc);
  }
  int rank = ps_ctx_rank(ctx);
  uint64_t keys[NK];
  for (int k = 0; k < NK; k++) keys[k] = (uint64_t)k * 7919u + 1;
  float w[NW], gw[NW], e[NK * DIM], ge[NK * DIM];
  for (int c = 0; c < rounds; c++) {
    if (big_first && (rc = ps_pull_range(ctx, tb, 0, (uint64_t)nbig, b, -1))) return fail(c, "pull b", rc);
    if ((rc = ps_pull_range(ctx, tw, 0, NW, w, -1))) return fail(c, "pull w", rc);
    if ((rc = ps_pull(ctx, te, keys, NK, e, -1))) return fail(c, "pull e", rc);
    for (int i = 0; i < NW; i++) gw[i] = (w[i] - 0.1f * (float)(i % 5)) * (1.0f + 0.25f * (float)rank) + 0.01f * sinf((float)(c + i));
    for (int i = 0; i < NK * DIM; i++) ge[i] = e[i] * 0.5f - 0.02f * (float)((i + c + rank) % 7);
    if (compute_ms && (compute_rank < 0 || compute_rank == rank)) {
      struct timespec ts = {compute_ms / 1000, (long)(compute_ms % 1000) * 1000000L};
      nanosleep(&ts, NULL);
    }
    if (overlap) { /* nbig is refused with --overlap */
      ps_req *rw = NULL, *re = NULL;
      if ((rc = ps_push_range_start(ctx, tw, 0, NW, gw, 8u + (uint32_t)rank, PS_LR_SCHEDULE, &rw)))
        return fail(c, "push w", rc);
      if ((rc = ps_push_start(ctx, te, keys, NK, ge, 8u + (uint32_t)rank, PS_LR_SCHEDULE, &re))) return fail(c, "push e", rc);
      if ((rc = ps_clock(ctx))) return fail(c, "clock", rc);
      if ((rc = ps_req_wait(rw, -1))) return fail(c, "push w", rc);
      if ((rc = ps_req_wait(re, -1))) return fail(c, "push e", rc);
      ps_req_free(rw);
      ps_req_free(re);
    } else {
      if ((rc = ps_push_range(ctx, tw, 0, NW, gw, 8u + (uint32_t)rank, PS_LR_SCHEDULE, -1))) return fail(c, "push w", rc);
      if ((rc = ps_push(ctx, te, keys, NK, ge, 8u + (uint32_t)rank, PS_LR_SCHEDULE, -1))) return fail(c, "push e", rc);
      if (seldom && c == 0 && (rc = ps_push(ctx, ts, keys, NK, ge, 1, PS_LR_SCHEDULE, -1))) return fail(c, "push s", rc);
      if (nbig) {
        if (!big_first && (rc = ps_pull_range(ctx, tb, 0, (uint64_t)nbig, b, -1))) return fail(c, "pull b", rc);
        for (int i = 0; i < nbig; i++) gb[i] = b[i] * (0.5f + 0.125f * (float)rank) - 0.01f * (float)((i + c) % 11);
        if ((rc = ps_push_range(ctx, tb, 0, (uint64_t)nbig, gb, 8u + (uint32_t)rank, PS_LR_SCHEDULE, -1)))
          return fail(c, "push b", rc);
      }
      if ((rc = ps_clock(ctx))) return fail(c, "clock", rc);
    }
    if (sleep_ms) {
      struct timespec ts = {sleep_ms / 1000, (long)(sleep_ms % 1000) * 1000000L};
      nanosleep(&ts, NULL);
    }
  }
  if ((rc = ps_barrier(ctx, -1))) return fail(rounds, "barrier", rc);
  if ((rc = ps_pull_range(ctx, tw, 0, NW, w, -1))) return fail(rounds, "pull w", rc);
  if ((rc = ps_pull(ctx, te, keys, NK, e, -1))) return fail(rounds, "pull e", rc);
  printf("model w");
  for (int i = 0; i < NW; i++) printf("%c%a", i ? ',' : ' ', (double)w[i]);
  printf("\nmodel e");
  for (int i = 0; i < NK * DIM; i++) printf("%c%a", i ? ',' : ' ', (double)e[i]);
  printf("\n");
  if (nbig) {
    if ((rc = ps_pull_range(ctx, tb, 0, (uint64_t)nbig, b, -1))) return fail(rounds, "pull b", rc);
    uint64_t h = 1469598103934665603ull; /* FNV-1a of the bits */
    const unsigned char *p = (const unsigned char *)b;
    for (size_t i = 0; i < (size_t)nbig * sizeof *b; i++) h = (h ^ p[i]) * 1099511628211ull;
    double dc = 0, pm = 0;
    ps_ctx_stat(ctx, "direct_calls", &dc);
    ps_ctx_stat(ctx, "peer_mem_parts", &pm);
    printf("model b fnv=%016llx\ncalls direct=%.0f peer_mem=%.0f\n", (unsigned long long)h, dc, pm);
    free(b);
    free(gb);
  }
  ps_ctx_close(ctx);
  return 0;
}
