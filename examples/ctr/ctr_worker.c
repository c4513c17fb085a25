/*
 * ctr_worker.c - a click-through (sparse logistic regression) worker for pshard.
 *
 * Run it under `pshard run` (or any launcher that sets PSHARD_*). The weights live in a
 * sparse table of dimension 1 on the servers, updated with FTRL-proximal or Adagrad.
 * The scheduler hands out the training partitions (DIR/train-*.txt or .bin) as tasks;
 * for each mini-batch the worker pulls only the rows the batch touches, computes the
 * mean logistic-loss gradient, pushes it and advances its clock. At the end of every
 * epoch rank 0 evaluates test log-loss and AUC and prints them beside the planted
 * model's (from DIR/meta.txt when the data came from ctr_gen).
 *
 * Saving and loading the model: with --save DIR, once training ends rank 0 asks for a
 * checkpoint of the whole job into DIR (ps_checkpoint_to: DIR/ckpt-<id>, the weights
 * and the optimiser's state on every server). --load DIR goes with `pshard run
 * --restore DIR`, which is what puts the saved tables on the servers (onto any number
 * of them); the worker checks that its job did start from DIR's newest checkpoint, and
 * rank 0 evaluates the loaded model before anything else. --epochs N then trains N
 * more epochs; --epochs 0 only evaluates.
 *
 * In sync mode a round waits for every worker; a worker that has no partition to work
 * on (its epoch's partitions are all taken) takes empty steps - a pull that waits for
 * the round, then a clock - so that the others never wait on it.
 *
 * Any bad data (missing file, bad label, unparsable feature) stops the worker with the
 * reader's "FILE:LINE: what" message and exit status 1.
 */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <xxhash.h>

#include "ctr_data.h"
#include "pshard.h"

#define BIAS_KEY UINT64_MAX

typedef struct opts {
  const char *data, *test, *opt;
  const char *table_opts; /* extra options of the weight table (agg_n=4 agg_ms=20, ...) */
  int epochs, batch, quiet;
  int slow_worker;      /* PSHARD_WORKER_INDEX of a worker to slow down (-1 none) */
  double slow_factor;   /* its steps take this many times as long */
  int eval_every;       /* rank 0: evaluate on the test set every N of its steps (0 off) */
  size_t eval_rows;     /* rows of the test set used by --eval-every (all) */
  double lr, l1, l2, beta;
  const char *pred_out;
  const char *save, *load; /* --save DIR, --load DIR */
} opts;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die_ps(const char *what, int rc) {
  fprintf(stderr, "ctr_worker: %s: %s (%s)\n", what, ps_errmsg(), ps_err_name(rc));
  exit(1);
}

#define PS_CHECK(what, call)   \
  do {                         \
    int rc_ = (call);          \
    if (rc_) die_ps(what, rc_); \
  } while (0)

/* ------------------------------------------------------------------ unique ids of a batch */

typedef struct idset {
  uint64_t *keys;
  uint32_t *idx, *gen;
  uint32_t cap, cur;
  uint64_t *uniq;
  size_t n, ucap;
} idset;

static uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x;
}

static void idset_reset(idset *s, size_t need) {
  if (need * 2 > s->cap) {
    uint32_t cap = 1024;
    while (cap < need * 2) cap *= 2;
    free(s->keys);
    free(s->idx);
    free(s->gen);
    s->keys = malloc((size_t)cap * 8);
    s->idx = malloc((size_t)cap * 4);
    s->gen = calloc(cap, 4);
    s->cap = cap;
    s->cur = 0;
    if (!s->keys || !s->idx || !s->gen) {
      fprintf(stderr, "ctr_worker: out of memory\n");
      exit(1);
    }
  }
  if (need > s->ucap) {
    s->ucap = need;
    s->uniq = realloc(s->uniq, need * 8);
    if (!s->uniq) exit(1);
  }
  s->cur++;
  s->n = 0;
}

/* Index of key in the batch's unique list, adding it if new. */
static uint32_t idset_add(idset *s, uint64_t key) {
  uint32_t m = s->cap - 1, i = (uint32_t)mix(key) & m;
  for (;;) {
    if (s->gen[i] != s->cur) {
      s->gen[i] = s->cur;
      s->keys[i] = key;
      s->idx[i] = (uint32_t)s->n;
      s->uniq[s->n++] = key;
      return s->idx[i];
    }
    if (s->keys[i] == key) return s->idx[i];
    i = (i + 1) & m;
  }
}

/* ------------------------------------------------------------------ model */

static float sigmoid(double z) {
  if (z > 35) z = 35;
  if (z < -35) z = -35;
  return (float)(1.0 / (1.0 + exp(-z)));
}

typedef struct model {
  ps_ctx *ctx;
  uint32_t table;
  idset ids;
  uint32_t *col;    /* per nnz: index into ids.uniq */
  size_t col_cap;
  float *w, *g;
  double *gd;
  size_t wcap;
} model;

static void ensure(model *m, size_t nnz, size_t nuniq) {
  if (nnz > m->col_cap) {
    m->col_cap = nnz;
    m->col = realloc(m->col, nnz * 4);
  }
  if (nuniq > m->wcap) {
    m->wcap = nuniq;
    m->w = realloc(m->w, nuniq * 4);
    m->g = realloc(m->g, nuniq * 4);
    m->gd = realloc(m->gd, nuniq * 8);
  }
  if (!m->col || !m->w || !m->g || !m->gd) {
    fprintf(stderr, "ctr_worker: out of memory\n");
    exit(1);
  }
}

static void model_free(model *m) {
  free(m->ids.keys);
  free(m->ids.idx);
  free(m->ids.gen);
  free(m->ids.uniq);
  free(m->col);
  free(m->w);
  free(m->g);
  free(m->gd);
}

/* Pull the batch's weights and compute probabilities into p. Returns unique count. */
static size_t predict(model *m, const ctr_batch *b, float *p) {
  idset_reset(&m->ids, b->nnz + 1);
  ensure(m, b->nnz, b->nnz + 1);
  idset_add(&m->ids, BIAS_KEY);
  for (size_t j = 0; j < b->nnz; j++) m->col[j] = idset_add(&m->ids, b->ids[j]);
  ensure(m, b->nnz, m->ids.n);
  PS_CHECK("pull", ps_pull(m->ctx, m->table, m->ids.uniq, m->ids.n, m->w, -1));
  for (size_t i = 0; i < b->rows; i++) {
    double z = m->w[0];
    for (uint64_t j = b->offsets[i]; j < b->offsets[i + 1]; j++) z += (double)m->w[m->col[j]] * b->vals[j];
    p[i] = sigmoid(z);
  }
  return m->ids.n;
}

/* One training step on a batch; returns the batch's mean log-loss before the update. */
static double train_step(model *m, const ctr_batch *b, float **pbuf, size_t *pcap) {
  if (b->rows > *pcap) {
    *pcap = b->rows;
    *pbuf = realloc(*pbuf, b->rows * 4);
    if (!*pbuf) exit(1);
  }
  float *p = *pbuf;
  size_t nu = predict(m, b, p);
  memset(m->gd, 0, nu * 8);
  for (size_t i = 0; i < b->rows; i++) {
    double e = (double)p[i] - b->labels[i];
    m->gd[0] += e;
    for (uint64_t j = b->offsets[i]; j < b->offsets[i + 1]; j++) m->gd[m->col[j]] += e * b->vals[j];
  }
  for (size_t k = 0; k < nu; k++) m->g[k] = (float)(m->gd[k] / (double)b->rows);
  PS_CHECK("push", ps_push(m->ctx, m->table, m->ids.uniq, nu, m->g, (uint32_t)b->rows, PS_LR_SCHEDULE, -1));
  PS_CHECK("clock", ps_clock(m->ctx));
  return ctr_logloss(b->labels, p, b->rows);
}

/* A step with no data: wait for the round like everyone else, then advance. */
static void empty_step(model *m) {
  uint64_t k = BIAS_KEY;
  float w;
  PS_CHECK("pull", ps_pull(m->ctx, m->table, &k, 1, &w, -1));
  PS_CHECK("clock", ps_clock(m->ctx));
  usleep(1000);
}

static int evaluate(model *m, const char *path, int batch, size_t max_rows, double *logloss, double *auc, double *acc,
                    size_t *rows) {
  ctr_reader *r;
  ctr_batch b;
  size_t n = 0, cap = 0;
  float *y = NULL, *p = NULL;
  if (ctr_reader_open(path, &r)) {
    fprintf(stderr, "ctr_worker: %s\n", ctr_errmsg());
    return 1;
  }
  ctr_batch_init(&b);
  for (;;) {
    if (ctr_reader_next(r, (size_t)batch, &b)) {
      fprintf(stderr, "ctr_worker: %s\n", ctr_errmsg());
      ctr_reader_close(r);
      ctr_batch_free(&b);
      free(y);
      free(p);
      return 1;
    }
    if (b.rows == 0 || (max_rows && n >= max_rows)) break;
    if (n + b.rows > cap) {
      cap = (n + b.rows) * 2;
      y = realloc(y, cap * 4);
      p = realloc(p, cap * 4);
      if (!y || !p) exit(1);
    }
    predict(m, &b, p + n);
    memcpy(y + n, b.labels, b.rows * 4);
    n += b.rows;
  }
  ctr_reader_close(r);
  ctr_batch_free(&b);
  *logloss = ctr_logloss(y, p, n);
  *acc = ctr_accuracy(y, p, n, 0.5f);
  if (ctr_auc(y, p, n, auc)) *auc = NAN;
  *rows = n;
  free(y);
  free(p);
  return 0;
}

/* ------------------------------------------------------------------ partitions */

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static char **list_partitions(const char *dir, size_t *n) {
  DIR *d = opendir(dir);
  char **v = NULL;
  size_t cnt = 0;
  struct dirent *e;
  if (!d) {
    fprintf(stderr, "ctr_worker: cannot open data directory %s\n", dir);
    exit(1);
  }
  while ((e = readdir(d))) {
    size_t len = strlen(e->d_name);
    if (strncmp(e->d_name, "train", 5) || len < 5) continue;
    if (!(len > 4 && (!strcmp(e->d_name + len - 4, ".txt") || !strcmp(e->d_name + len - 4, ".bin")))) continue;
    v = realloc(v, (cnt + 1) * sizeof *v);
    v[cnt] = malloc(strlen(dir) + len + 2);
    sprintf(v[cnt], "%s/%s", dir, e->d_name);
    cnt++;
  }
  closedir(d);
  if (!cnt) {
    fprintf(stderr, "ctr_worker: no train*.txt or train*.bin partitions in %s\n", dir);
    exit(1);
  }
  qsort(v, cnt, sizeof *v, cmp_str);
  *n = cnt;
  return v;
}

static int meta_value(const char *dir, const char *key, double *out) {
  char path[4096], line[512];
  snprintf(path, sizeof path, "%s/meta.txt", dir);
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  size_t kl = strlen(key);
  int rc = -1;
  while (fgets(line, sizeof line, f))
    if (!strncmp(line, key, kl) && line[kl] == '=') {
      *out = strtod(line + kl + 1, NULL);
      rc = 0;
    }
  fclose(f);
  return rc;
}

/* ------------------------------------------------------------------ a saved model */

static uint64_t le64(const unsigned char *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

static uint32_t le32(const unsigned char *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The manifest of DIR's newest complete checkpoint (DIR itself when it is one) into
 * path. 0, or -1 when there is none. */
static int newest_manifest(const char *dir, char *path, size_t cap) {
  snprintf(path, cap, "%s/MANIFEST", dir);
  if (!access(path, R_OK)) return 0;
  DIR *d = opendir(dir);
  if (!d) return -1;
  unsigned long long best = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    char *end, m[4096];
    if (strncmp(e->d_name, "ckpt-", 5) || e->d_name[5] < '1' || e->d_name[5] > '9') continue;
    unsigned long long id = strtoull(e->d_name + 5, &end, 10);
    snprintf(m, sizeof m, "%s/%s/MANIFEST", dir, e->d_name);
    if (!*end && id > best && !access(m, R_OK)) best = id;
  }
  closedir(d);
  if (!best) return -1;
  snprintf(path, cap, "%s/ckpt-%llu/MANIFEST", dir, best);
  return 0;
}

/* The clock of DIR's newest checkpoint, from its manifest's HEADER block
 * (docs/checkpoint.md, 3 and 4.1): -1 when its job had no sync table. 0, or 1 with the
 * reason on stderr. */
static int saved_clock(const char *dir, int64_t *clock) {
  char path[4200];
  unsigned char b[80]; /* block framing 16, HEADER payload 48 (format 1) or 56 (2), checksum 8 */
  if (newest_manifest(dir, path, sizeof path)) {
    fprintf(stderr, "ctr_worker: --load %s: no complete checkpoint there (save one with --save %s)\n", dir, dir);
    return 1;
  }
  FILE *f = fopen(path, "rb");
  size_t n = f ? fread(b, 1, sizeof b, f) : 0;
  if (f) fclose(f);
  uint64_t len = n >= 16 ? le64(b + 8) : 0;
  uint32_t format = n >= 24 ? le32(b + 20) : 0;
  if (n < 16 + len + 8 || le32(b) != 0x42435350u || (b[4] | b[5] << 8) != 1 || len != (format == 1 ? 48u : 56u) ||
      XXH64(b, 16 + len, 0) != le64(b + 16 + len) || le32(b + 16) != 0x4b435350u || le32(b + 24) != 2) {
    fprintf(stderr, "ctr_worker: --load %s: %s is not a readable checkpoint manifest\n", dir, path);
    return 1;
  }
  *clock = (int64_t)le64(b + 48);
  return 0;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: ctr_worker --data DIR [options]   (run under `pshard run`)\n"
          "  --data DIR      training partitions DIR/train*.txt|.bin (libsvm text or ctr binary)\n"
          "  --test FILE     test set (default DIR/test.txt or DIR/test.bin)\n"
          "  --epochs N      passes over the data (1); with --load, more passes (0: only evaluate)\n"
          "  --batch N       examples per mini-batch (1000)\n"
          "  --opt ftrl|adagrad  server-side optimiser (ftrl)\n"
          "  --table-opts S  more options of the weight table, e.g. 'agg_n=4 agg_ms=20' (see pshard.h)\n"
          "  --lr X --l1 X --l2 X --beta X   optimiser settings (ftrl: 0.1 0.003 0.001 0.001;\n"
          "                  adagrad: 0.1). The servers see the batch-mean gradient, so l1, l2 and\n"
          "                  beta are in its units (per-example FTRL values divided by the batch)\n"
          "  --quiet         no per-epoch lines from workers other than rank 0\n"
          "  --slow-worker I --slow-factor F   worker index I (PSHARD_WORKER_INDEX) takes F times\n"
          "                  as long per step (it sleeps (F-1) x its step time), to study stragglers\n"
          "  --eval-every N  rank 0 prints 'eval t=SECONDS examples=N logloss=X auc=Y' every N of\n"
          "                  its steps, on the first --eval-rows test rows (10000)\n"
          "  --save DIR      when training ends, checkpoint the whole job's tables into DIR/ckpt-<id>\n"
          "                  (DIR on a file system every server sees; made if missing)\n"
          "  --load DIR      start from the model saved in DIR: run the job as\n"
          "                  `pshard run --restore DIR ...` (any number of servers); rank 0 first\n"
          "                  prints 'loaded model: test logloss X  auc Y ...'\n");
}

int main(int argc, char **argv) {
  opts o = {.epochs = 1, .batch = 1000, .opt = "ftrl", .lr = -1, .l1 = 0.003, .l2 = 0.001, .beta = 0.001,
            .slow_worker = -1, .slow_factor = 1, .eval_rows = 10000};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(stdout);
      return 0;
    }
    if (!strcmp(a, "--quiet")) {
      o.quiet = 1;
      continue;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "ctr_worker: option %s needs a value\n", a);
      usage(stderr);
      return 2;
    }
    const char *v = argv[++i];
    char *end = NULL;
    if (!strcmp(a, "--data")) o.data = v;
    else if (!strcmp(a, "--test")) o.test = v;
    else if (!strcmp(a, "--opt")) o.opt = v;
    else if (!strcmp(a, "--table-opts")) o.table_opts = v;
    else if (!strcmp(a, "--epochs")) o.epochs = (int)strtol(v, &end, 10);
    else if (!strcmp(a, "--batch")) o.batch = (int)strtol(v, &end, 10);
    else if (!strcmp(a, "--lr")) o.lr = strtod(v, &end);
    else if (!strcmp(a, "--l1")) o.l1 = strtod(v, &end);
    else if (!strcmp(a, "--l2")) o.l2 = strtod(v, &end);
    else if (!strcmp(a, "--beta")) o.beta = strtod(v, &end);
    else if (!strcmp(a, "--slow-worker")) o.slow_worker = (int)strtol(v, &end, 10);
    else if (!strcmp(a, "--slow-factor")) o.slow_factor = strtod(v, &end);
    else if (!strcmp(a, "--eval-every")) o.eval_every = (int)strtol(v, &end, 10);
    else if (!strcmp(a, "--eval-rows")) o.eval_rows = (size_t)strtoull(v, &end, 10);
    else if (!strcmp(a, "--save")) o.save = v;
    else if (!strcmp(a, "--load")) o.load = v;
    else {
      fprintf(stderr, "ctr_worker: unknown option %s\n", a);
      usage(stderr);
      return 2;
    }
    if (end && *end) {
      fprintf(stderr, "ctr_worker: bad value '%s' for %s\n", v, a);
      return 2;
    }
  }
  if (!o.data || o.epochs < 0 || o.batch < 1 || (strcmp(o.opt, "ftrl") && strcmp(o.opt, "adagrad")) ||
      o.slow_factor < 1 || o.eval_every < 0) {
    fprintf(stderr, "ctr_worker: need --data, epochs >= 0, batch >= 1, --opt ftrl or adagrad\n");
    usage(stderr);
    return 2;
  }
  if (o.epochs == 0 && !o.load) {
    fprintf(stderr, "ctr_worker: --epochs 0 only evaluates a loaded model: it needs --load DIR\n");
    return 2;
  }
  if ((o.save && !*o.save) || (o.load && !*o.load)) {
    fprintf(stderr, "ctr_worker: --save and --load need a directory\n");
    return 2;
  }
  if (o.lr < 0) o.lr = 0.1;
  char test_path[4096];
  if (!o.test) {
    snprintf(test_path, sizeof test_path, "%s/test.bin", o.data);
    if (access(test_path, R_OK)) snprintf(test_path, sizeof test_path, "%s/test.txt", o.data);
    o.test = test_path;
  }
  size_t nparts;
  char **parts = list_partitions(o.data, &nparts);

  model m;
  memset(&m, 0, sizeof m);
  PS_CHECK("connect", ps_ctx_open_env(&m.ctx));
  int rank = ps_ctx_rank(m.ctx);
  const char *idx_env = getenv("PSHARD_WORKER_INDEX");
  int slow = o.slow_worker >= 0 && idx_env && atoi(idx_env) == o.slow_worker && o.slow_factor > 1;
  uint64_t steps = 0;
  char topts[256];
  if (!strcmp(o.opt, "ftrl"))
    snprintf(topts, sizeof topts, "opt=ftrl lr=%g l1=%g l2=%g beta=%g", o.lr, o.l1, o.l2, o.beta);
  else
    snprintf(topts, sizeof topts, "opt=adagrad lr=%g acc0=0.1", o.lr);
  if (o.table_opts && *o.table_opts) {
    size_t used = strlen(topts);
    if ((size_t)snprintf(topts + used, sizeof topts - used, " %s", o.table_opts) >= sizeof topts - used) {
      fprintf(stderr, "ctr_worker: --table-opts too long\n");
      return 2;
    }
  }
  if (o.load) {
    /* The servers hold the saved tables only if the job was restored from DIR. */
    int64_t want, have = ps_ctx_clock(m.ctx);
    if (saved_clock(o.load, &want)) return 1;
    if (want >= 0 ? have != want : have <= 0) {
      fprintf(stderr,
              "ctr_worker: --load %s: this job did not start from that checkpoint (its clock is %lld, the job's "
              "%lld): run it as `pshard run --restore %s ...`\n",
              o.load, (long long)want, (long long)have, o.load);
      return 1;
    }
  }
  PS_CHECK("declare table", ps_table_declare(m.ctx, "ctr_weights", PS_SPARSE, 1, topts, &m.table));
  double t0 = now_s();
  if (o.load && rank == 0) {
    double ll, auc, acc;
    size_t n;
    if (evaluate(&m, o.test, 10000, 0, &ll, &auc, &acc, &n)) return 1;
    printf("loaded model: test logloss %.4f  auc %.4f  accuracy %.4f  (%zu examples, %.1f s)\n", ll, auc, acc, n,
           now_s() - t0);
    fflush(stdout);
  }
  if (o.epochs > 0) PS_CHECK("declare tasks", ps_tasks_init(m.ctx, (uint32_t)nparts, (uint32_t)o.epochs));

  ctr_batch b;
  ctr_batch_init(&b);
  float *pbuf = NULL;
  size_t pcap = 0;
  double last_report = t0, loss_acc = 0;
  uint64_t examples = 0, ex_since = 0, loss_n = 0;
  int cur_epoch = 0;
  while (o.epochs > 0) {
    ps_task task;
    int rc = ps_task_next(m.ctx, &task, 0);
    if (rc == PS_ERR_TIMEOUT) {
      empty_step(&m);
      continue;
    }
    int finished_epoch = rc == PS_ERR_DONE ? o.epochs : (int)task.epoch;
    if (rc && rc != PS_ERR_DONE) die_ps("next task", rc);
    /* The last evaluation (and a --save) must see every worker's last round: in sync
     * mode the pulls of a worker at clock c see the rounds before c, and another worker
     * may have pushed in round c. One more step waits for that round. */
    if (rc == PS_ERR_DONE && rank == 0) empty_step(&m);
    while (cur_epoch < finished_epoch) {
      /* Every partition of cur_epoch is done: rank 0 evaluates. */
      if (rank == 0) {
        double ll, auc, acc;
        size_t n;
        if (evaluate(&m, o.test, 10000, 0, &ll, &auc, &acc, &n)) return 1;
        printf("epoch %d: test logloss %.4f  auc %.4f  accuracy %.4f  (%zu examples, %.1f s)\n", cur_epoch + 1, ll,
               auc, acc, n, now_s() - t0);
        fflush(stdout);
        ps_metric(m.ctx, "test_auc", auc);
        ps_metric(m.ctx, "test_logloss", ll);
      }
      cur_epoch++;
    }
    if (rc == PS_ERR_DONE) break;
    ctr_reader *r;
    if (ctr_reader_open(parts[task.partition], &r)) {
      fprintf(stderr, "ctr_worker: %s\n", ctr_errmsg());
      return 1;
    }
    for (;;) {
      if (ctr_reader_next(r, (size_t)o.batch, &b)) {
        fprintf(stderr, "ctr_worker: %s\n", ctr_errmsg());
        return 1;
      }
      if (b.rows == 0) break;
      double ts = now_s();
      loss_acc += train_step(&m, &b, &pbuf, &pcap);
      steps++;
      if (slow) usleep((useconds_t)((now_s() - ts) * (o.slow_factor - 1) * 1e6));
      if (rank == 0 && o.eval_every && steps % (uint64_t)o.eval_every == 0) {
        double ll, auc, acc;
        size_t n;
        if (evaluate(&m, o.test, 10000, o.eval_rows, &ll, &auc, &acc, &n)) return 1;
        printf("eval t=%.3f examples=%llu logloss=%.5f auc=%.5f\n", now_s() - t0, (unsigned long long)examples, ll, auc);
        fflush(stdout);
      }
      loss_n++;
      examples += b.rows;
      ex_since += b.rows;
      double t = now_s();
      if (t - last_report >= 0.5) {
        ps_metric(m.ctx, "loss", loss_acc / (double)loss_n);
        ps_metric(m.ctx, "examples_per_s", (double)ex_since / (t - last_report));
        loss_acc = 0;
        loss_n = 0;
        ex_since = 0;
        last_report = t;
      }
    }
    ctr_reader_close(r);
    PS_CHECK("task done", ps_task_done(m.ctx, &task));
  }
  double dt = now_s() - t0;
  if (o.epochs > 0 && (!o.quiet || rank == 0))
    printf("trained on %llu examples in %.1f s (%.0f examples/s)\n", (unsigned long long)examples, dt,
           (double)examples / dt);
  if (o.save && rank == 0) {
    /* The whole job's tables, cut at this clock: every worker's pushes are in it. */
    uint64_t id;
    PS_CHECK("save", ps_checkpoint_to(m.ctx, o.save, &id, 130000));
    printf("saved the model: checkpoint %llu in %s (clock %lld)\n", (unsigned long long)id, o.save,
           (long long)ps_ctx_clock(m.ctx));
    fflush(stdout);
  }
  if (rank == 0 && o.epochs > 0) {
    double pll, pauc;
    if (!meta_value(o.data, "planted_test_logloss", &pll) && !meta_value(o.data, "planted_test_auc", &pauc))
      printf("planted model (the best achievable): test logloss %.4f  auc %.4f\n", pll, pauc);
  }
  ctr_batch_free(&b);
  free(pbuf);
  for (size_t i = 0; i < nparts; i++) free(parts[i]);
  free(parts);
  ps_ctx_close(m.ctx);
  model_free(&m);
  return 0;
}
