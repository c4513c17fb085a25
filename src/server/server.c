/*
 * server.c - the parameter server.
 *
 * Design. One loop thread owns all state. A server registers with the scheduler, then
 * accepts workers over TCP and (same host) AF_UNIX. Tables are row maps (store.h):
 * sparse rows keyed by row id, dense slices keyed by slice index. Every key a request
 * names must be owned by this server under the current ring (else PS_ERR_MOVED).
 *
 * Sync (BSP) rounds. A push for clock c is accumulated into round c's accumulator of
 * its table (batch-weighted: acc += b_k * g_k in mean mode, acc += g_k in sum mode);
 * the batch of a worker's first push to (table, round) is added to the round's
 * denominator. Each worker sends CLOCK c+1 to every server when it finishes clock c;
 * since frames on one connection arrive in order, all of a worker's pushes for c are
 * in once its CLOCK is. The server's version v is the number of rounds applied; round
 * v is applied when every live worker's clock exceeds v: each touched row gets
 * g = acc / denominator (mean) or acc (sum) and one optimiser step. A pull at clock c
 * is answered once v >= c (deferred, not polled). A dead worker is dropped from the
 * live set, so no round waits on it; what it pushed before dying stays in its round.
 *
 * Huge requests. A sparse pull, or a direct sgd push, of at least PAR_MIN_KEYS keys is
 * served on two threads: the loop thread and a helper (common/par.h) started on the
 * first such request, while the loop thread blocks. The threads claim units of work
 * one at a time: a pull's units are runs of positions (the map is only read); a push's
 * are classes of keys, so each row has one writer. Keys not in the map are marked and
 * created afterwards on the loop thread alone, in request order, so the map and the
 * answer are what a single thread would have produced.
 */
#include "server/server.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "common/common.h"
#include "common/config.h"
#include "common/par.h"
#include "common/ring.h"
#include "net/net.h"
#include "proto/msg.h"
#include "store/store.h"

#define ROUND_WINDOW 8   /* rounds a sync push may run ahead of the applied version */
#define MAX_TABLES 65536
#define MAX_DELAY 10000  /* async/ssp: a push more clocks behind than this is rejected */
#define STALE_BUCKETS 64 /* staleness histogram: 0..62, and >= 63 */
#define PAR_MIN_KEYS (256u * 1024u) /* sparse requests this large use the helper thread */

typedef struct pusher {
  uint32_t worker;
  int64_t clock;
} pusher;

typedef struct round_acc {
  int64_t round;     /* which round this slot holds, -1 none */
  ps__rowmap *acc;   /* key -> accumulated gradient (width floats) */
  double batch_sum;
  float lr;
  int has_lr;
  pusher *pushers;   /* (worker, clock) pairs that pushed this (table, round) */
  size_t npushers, cap;
} round_acc;

/* A dense async push that was acknowledged and is being applied a piece at a time:
 * its values, in the order of its segment list, are applied up to `done`. */
typedef struct pending_apply {
  int active;
  void *buf;              /* the push body (pooled), owned */
  size_t len;
  const uint8_t *keys;    /* in buf */
  uint32_t nkeys;
  const float *vals;      /* in buf */
  uint64_t total, done;   /* floats */
  uint32_t seg;           /* cursor: segment (pair index) and floats into it */
  uint64_t seg_off;
  float lr;
  uint64_t step;
} pending_apply;

typedef struct table {
  ps__server *srv;
  uint32_t id;
  ps__table_spec spec;
  ps__declare decl;
  ps__rowmap *params;
  uint64_t step;       /* updates applied (adam bias correction) */
  /* sync and sync:M */
  int64_t version;     /* rounds applied; round r covers clocks [r*every, (r+1)*every) */
  round_acc rounds[ROUND_WINDOW];
  /* async and ssp: buffered pushes (server-side aggregation) */
  ps__rowmap *agg;     /* key -> sum of weighted gradients (width floats) + weight sum (1 float) */
  uint32_t agg_count;
  double agg_batch;    /* sum of the buffered pushes' batches */
  float agg_lr;
  int agg_has_lr;
  uv_timer_t agg_timer;
  int agg_timer_init, agg_timer_on;
  /* counters */
  uint64_t pushes, pulls, dropped, rejected, applied;
  float last_lr;       /* learning rate of the last update */
  double last_batch;   /* global batch of the last update */
  pending_apply pend;  /* async dense push being applied (apply_some) */
  /* dense: the slices [mine_lo, mine_hi) this server owns under ring generation mine_gen */
  uint64_t mine_gen, mine_lo, mine_hi;
} table;

typedef struct worker {
  uint32_t id;
  int alive;   /* in the live set: rounds wait for its clock */
  int pending; /* seen in a frame, not (yet) in the membership: never waited for */
  int64_t clock;
} worker;

typedef struct pending_pull {
  struct pending_pull *next;
  ps__conn *conn;
  ps__frame_hdr h;
  void *buf;   /* request body (keys), pooled */
  size_t len;
  int fused_err;       /* a peer-memory write of a round's fused apply failed (apply_round_fused) */
  int fused_pid;       /* the pid its writes go to (pm_local), and its regions in this */
  uint8_t *fused_xd;   /* process where they are a shared buffer (else NULL) */
  char fused_msg[200];
} pending_pull;

struct ps__server {
  ps__server_opts o;
  uint64_t frames;   /* worker frames handled (the poll window of ps__server_run) */
  uint64_t poll_extra_ns; /* the last frame's bytes in and out, as poll time (ps__poll_extra_ns) */
  uv_loop_t loop;
  ps__pool *pool;
  float *pm_chunk;   /* PM_CHUNK floats: a streamed peer-memory push's staging (cache-sized) */
  ps__shm_cache *shm; /* workers' ps_alloc buffers mapped here (net/shared.c), or NULL */
  ps__mailbox *mail;
  ps__listener tcp, unix_l;
  ps__conn *sched;
  uint64_t ring_gen; /* from 1, incremented whenever ring is replaced (a table's dense
                      * ownership cache, mine_gen 0, is then never current before use) */
  int pid;           /* getpid(): a peer with this pid is a colocated worker */
  uv_timer_t hb_timer, connect_timer, retry_timer;
  uint32_t id, rank;
  uint64_t epoch;
  int started;
  int stopping;
  int result;
  ps__ring *ring;
  worker *workers;
  size_t nworkers, wcap;
  table **tables; /* indexed by table id */
  size_t ntables;
  pending_pull *pulls;
  char unix_path[PS_PATH_MAX];
  uv_idle_t apply_idle; /* runs while tables have a pending apply */
  size_t npending;
  uint64_t rejected_clock;
  uint64_t pm_pushes, pm_pulls, fused_pulls; /* peer-memory requests served; pulls written by a fused round */
  /* staleness of applied pushes (max worker clock - push clock) and of answered pulls
   * (pull clock - slowest live worker's clock), async and ssp tables */
  uint64_t push_stale[STALE_BUCKETS], pull_stale[STALE_BUCKETS];
  int64_t push_stale_max, pull_stale_max;
  ps__par *par;   /* helper thread for huge requests, started on the first one */
  int par_failed; /* it could not be started: stay serial */
};

/* ------------------------------------------------------------------ helpers */

static table *get_table(ps__server *s, uint32_t id) {
  return id < s->ntables ? s->tables[id] : NULL;
}

static worker *find_worker(ps__server *s, uint32_t id) {
  for (size_t i = 0; i < s->nworkers; i++)
    if (s->workers[i].id == id) return &s->workers[i];
  return NULL;
}

/* Clocks of the live workers: slowest, fastest and count. */
static size_t live_clocks(ps__server *s, int64_t *minc, int64_t *maxc) {
  size_t n = 0;
  *minc = INT64_MAX;
  *maxc = 0;
  for (size_t i = 0; i < s->nworkers; i++) {
    worker *w = &s->workers[i];
    if (!w->alive) continue;
    n++;
    if (w->clock < *minc) *minc = w->clock;
    if (w->clock > *maxc) *maxc = w->clock;
  }
  if (!n) *minc = 0;
  return n;
}

/* Only the scheduler's membership makes a worker live. An id first seen in a frame is
 * pending until the membership lists it: a stray or forged sender id (a frame from a
 * process that never registered, a worker of an earlier job) never holds a round. */
static worker *add_worker(ps__server *s, uint32_t id, int64_t clock, int live) {
  if (s->nworkers == s->wcap) {
    size_t cap = s->wcap ? s->wcap * 2 : 8;
    worker *w = ps__realloc(s->workers, cap * sizeof *w);
    if (!w) return NULL;
    s->workers = w;
    s->wcap = cap;
  }
  worker *w = &s->workers[s->nworkers++];
  w->id = id;
  w->alive = live;
  w->pending = !live;
  w->clock = clock;
  return w;
}

/* The position of the first key of keys[0 .. n) (wire bytes) this server does not own,
 * or n. A server alone in its ring owns every key, so the keys are not read then. */
static uint32_t first_foreign(ps__server *s, uint32_t tid, const uint8_t *keys, uint32_t n) {
  if (!s->ring || ps__ring_size(s->ring) <= 1) return n;
  for (uint32_t i = 0; i < n; i++)
    if (ps__ring_owner(s->ring, tid, ps__get_u64(keys + 8 * (size_t)i)) != s->id) return i;
  return n;
}

static int is_sync(const table *t) { return t->spec.mode == PS__MODE_SYNC || t->spec.mode == PS__MODE_SYNC_M; }

static void stale_record(uint64_t *hist, int64_t *max, int64_t v) {
  if (v < 0) v = 0;
  hist[v < STALE_BUCKETS - 1 ? v : STALE_BUCKETS - 1]++;
  if (v > *max) *max = v;
}

typedef struct send_done {
  ps__pool *pool;
  void *buf;
  size_t len;
} send_done;

static void release_buf(void *arg, int status) {
  send_done *d = arg;
  (void)status;
  ps__pool_put(d->pool, d->buf, d->len);
  free(d);
}

/* Send a reply whose payload is a pooled buffer (released when written). */
static void reply_pooled(ps__server *s, ps__conn *c, ps__frame_hdr *h, void *buf, size_t len) {
  send_done *d = ps__malloc(sizeof *d);
  uv_buf_t b = uv_buf_init(buf, 0);
  b.len = len;
  if (!d) {
    ps__pool_put(s->pool, buf, len);
    ps__conn_send_error(c, h, PS_ERR_NOMEM, "server out of memory");
    return;
  }
  d->pool = s->pool;
  d->buf = buf;
  d->len = len;
  if (ps__conn_send(c, h, &b, len ? 1 : 0, release_buf, d) != 0) release_buf(d, PS_ERR_CLOSED);
}

static void reply_ok(ps__conn *c, const ps__frame_hdr *req, uint8_t flags) {
  ps__frame_hdr h = {.type = (uint8_t)(req->type | PS_FRAME_REPLY), .req_id = req->req_id, .table = req->table,
                     .clock = req->clock, .flags = flags};
  ps__conn_send_ctrl(c, &h, NULL, 0);
}

static void reply_err(ps__conn *c, const ps__frame_hdr *req, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void reply_err(ps__conn *c, const ps__frame_hdr *req, int err, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  ps__conn_send_error(c, req, err, msg);
}

/* ------------------------------------------------------------------ tables */

static void table_free(table *t) {
  if (!t) return;
  if (t->pend.active) ps__pool_put(t->srv->pool, t->pend.buf, t->pend.len);
  ps__rowmap_free(t->params);
  ps__rowmap_free(t->agg);
  for (int i = 0; i < ROUND_WINDOW; i++) {
    ps__rowmap_free(t->rounds[i].acc);
    free(t->rounds[i].pushers);
  }
  free(t);
}

static void on_create(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const ps__body *b) {
  ps__declare d;
  ps__table_spec spec;
  char err[256];
  if (ps__declare_decode(b->buf, b->len, &d)) {
    reply_err(c, h, PS_ERR_PROTO, "%s", ps_errmsg());
    return;
  }
  if (d.id == 0 || d.id >= MAX_TABLES) {
    reply_err(c, h, PS_ERR_INVALID, "bad table id %u", d.id);
    return;
  }
  int rc = ps__table_spec_parse(&spec, d.name, d.kind, d.size, d.options, err, sizeof err);
  if (rc) {
    reply_err(c, h, rc, "%s", err);
    return;
  }
  table *t = get_table(s, d.id);
  if (t) {
    if (memcmp(&t->spec, &spec, sizeof spec) || strcmp(t->decl.name, d.name))
      reply_err(c, h, PS_ERR_CONFLICT, "table %u exists as '%s' with other options", d.id, t->decl.name);
    else
      reply_ok(c, h, 0);
    return;
  }
  if (d.id >= s->ntables) {
    size_t n = d.id + 1u;
    table **nt = ps__realloc(s->tables, n * sizeof *nt);
    if (!nt) {
      reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
      return;
    }
    memset(nt + s->ntables, 0, (n - s->ntables) * sizeof *nt);
    s->tables = nt;
    s->ntables = n;
  }
  t = ps__calloc(1, sizeof *t);
  /* Sparse rows of one float live in the index (store.h): every use of such a row
   * pointer below ends before the next insert into the table. */
  if (!t || !(t->params = spec.kind == PS_SPARSE ? ps__rowmap_new_in_index(ps__spec_row_floats(&spec))
                                                 : ps__rowmap_new(ps__spec_row_floats(&spec)))) {
    free(t);
    reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
    return;
  }
  t->srv = s;
  t->id = d.id;
  t->spec = spec;
  t->decl = d;
  for (int i = 0; i < ROUND_WINDOW; i++) t->rounds[i].round = -1;
  /* A table created after the job ran starts at the current round. */
  int64_t minc, maxc;
  live_clocks(s, &minc, &maxc);
  t->version = minc / (int64_t)spec.every;
  s->tables[d.id] = t;
  ps__log(PS_LOG_INFO, "table %u '%s' created (%s, size %llu)", d.id, d.name, d.kind == PS_DENSE ? "dense" : "sparse",
          (unsigned long long)d.size);
  reply_ok(c, h, 0);
}

/* The parameter row for key, created from the initialiser on first touch. */
static float *param_row(table *t, uint64_t key) {
  int created = 0;
  float *row = ps__rowmap_upsert(t->params, key, &created);
  if (row && created) ps__row_init(&t->spec, key, row);
  return row;
}

/* ------------------------------------------------------------------ pending applies */

#define APPLY_STEP (64u * 1024u)   /* floats per idle step of a pending apply (256 KiB) */
#define PRODUCE_STEP (256u * 1024u) /* floats per step while a reply waits on it (1 MiB) */

/* Apply up to `budget` more floats of t's pending push; release it once all are in. */
static void apply_some(table *t, uint64_t budget) {
  pending_apply *p = &t->pend;
  unsigned width = t->spec.width;
  while (p->active && budget > 0 && p->done < p->total) {
    uint64_t off = ps__get_u64(p->keys + 8 * (size_t)p->seg), cnt = ps__get_u64(p->keys + 8 * (size_t)(p->seg + 1));
    uint64_t o = off + p->seg_off, within = o % width, n = width - within;
    if (n > cnt - p->seg_off) n = cnt - p->seg_off;
    if (n > budget) n = budget;
    float *row = ps__rowmap_get(t->params, o / width);
    PS_ASSERT(row != NULL); /* created before the push was acknowledged */
    ps__optim_apply(&t->spec.opt, p->lr, p->step, row + within, row + width + within, width, p->vals + p->done, n);
    p->done += n;
    budget -= n;
    p->seg_off += n;
    if (p->seg_off == cnt) {
      p->seg += 2;
      p->seg_off = 0;
    }
  }
  if (p->active && p->done == p->total) {
    ps__server *s = t->srv;
    ps__pool_put(s->pool, p->buf, p->len);
    memset(p, 0, sizeof *p);
    if (--s->npending == 0) uv_idle_stop(&s->apply_idle);
  }
}

/* Finish t's pending apply, if any. Everything that reads or updates t's parameters
 * calls this first, except a pull of the same ranges, which finishes it while its reply
 * is sent (send_rows). */
static void apply_flush(table *t) {
  if (t->pend.active) apply_some(t, UINT64_MAX);
}

/* Between polls for I/O, a step of every pending apply. */
static void apply_idle_cb(uv_idle_t *h) {
  ps__server *s = h->data;
  for (size_t i = 0; i < s->ntables && s->npending; i++)
    if (s->tables[i] && s->tables[i]->pend.active) apply_some(s->tables[i], APPLY_STEP);
}

/* Start applying a dense push that was validated, whose rows exist and which was
 * acknowledged: take its body from the connection and apply it a step at a time (the
 * idle handler, a pull of the same ranges, or apply_flush finish it). */
static void apply_start(table *t, const ps__frame_hdr *h, ps__body *b, float lr, uint64_t step) {
  pending_apply *p = &t->pend;
  ps__server *s = t->srv;
  uint64_t total = (h->payload_len - 8u * h->nkeys) / 4u;
  PS_ASSERT(!p->active);
  if (total == 0 || !b->buf) return;
  p->active = 1;
  p->buf = b->buf;
  p->len = b->len;
  b->buf = NULL; /* taken */
  p->keys = p->buf;
  p->nkeys = h->nkeys;
  p->vals = (const float *)((const uint8_t *)p->buf + 8u * h->nkeys);
  p->total = total;
  p->lr = lr;
  p->step = step;
  if (s->npending++ == 0) uv_idle_start(&s->apply_idle, apply_idle_cb);
  /* A small push is applied at once: a pull could not overlap much of it. */
  apply_some(t, total <= PRODUCE_STEP ? total : APPLY_STEP);
}

/* Batch loops over the keys of a request: on a large table the cache misses, not the
 * work, dominate, so each iteration prefetches the index slot of the key PF_FAR ahead
 * and the row of the key PF_NEAR ahead (whose slot is in cache by then). */
#define PF_FAR 16
#define PF_NEAR 8
/* Keys per ps__rowmap_find_many call in the key loops (row pointers on the stack). */
#define FIND_BLOCK 512u


/* The pieces of a dense segment list (offset, count pairs) as slices: for each run of
 * elements inside one slice, fn(arg, slice, first element within it, count, position
 * of the run in the request's values). Stops at, and returns, fn's first non-zero. */
typedef int (*slice_fn)(void *arg, uint64_t slice, uint64_t within, uint64_t n, uint64_t pos);

static int walk_slices(const uint8_t *keys, uint32_t nkeys, unsigned width, slice_fn fn, void *arg) {
  uint64_t pos = 0;
  for (uint32_t i = 0; i + 1 < nkeys; i += 2) {
    uint64_t off = ps__get_u64(keys + 8 * (size_t)i), cnt = ps__get_u64(keys + 8 * (size_t)(i + 1));
    while (cnt > 0) {
      uint64_t within = off % width, n = width - within < cnt ? width - within : cnt;
      int rc = fn(arg, off / width, within, n, pos);
      if (rc) return rc;
      pos += n;
      off += n;
      cnt -= n;
    }
  }
  return 0;
}

/* The helper thread for a request of nkeys sparse keys, or NULL to serve it serially. */
static ps__par *huge_par(ps__server *s, uint32_t nkeys) {
  if (nkeys < PAR_MIN_KEYS || s->par_failed) return NULL;
  if (!s->par && !(s->par = ps__par_new())) {
    s->par_failed = 1;
    ps__log(PS_LOG_WARN, "cannot start a helper thread; huge requests stay on one thread");
  }
  return s->par;
}

/* The work of a huge request, shared by the two threads. Units are claimed from a
 * counter, so that when the machine is busy and the kernel deschedules one thread,
 * the other does its share instead of waiting for it. A key the map lacks is marked
 * in `left` (a byte per position, 1 = left to the loop thread). */
#define PULL_UNIT 16384u /* positions per unit of a pull */
#define PUSH_CLASS_BITS 1 /* a push's keys fall into 2 classes, one unit each */
#define PUSH_CLASSES (1u << PUSH_CLASS_BITS)

typedef struct huge_job huge_job;
struct huge_job {
  void (*unit)(huge_job *a, uint32_t u);
  table *t;
  const uint8_t *keys;
  uint32_t nkeys;
  uint8_t *left;
  atomic_uint next;      /* next unit to claim */
  uint32_t nunits;
  atomic_int mostly_new; /* a unit gave up: later ones leave all their keys */
  float *out;            /* pull: the answer */
  const float *vals;     /* push: the gradients, rate and step */
  float lr;
  uint64_t step;
};

/* A unit gives up, leaving the rest of its keys (and later units all theirs) to the
 * loop thread, once more than a quarter of the keys it looked up were missing, after
 * at least GIVE_UP_MIN: a request of mostly new keys is bound by the serial inserts,
 * and looking its keys up twice would only add cache misses. */
#define GIVE_UP_MIN 4096u
static inline int give_up(uint32_t missed, uint32_t done) { return done >= GIVE_UP_MIN && missed > done / 4; }

static void huge_work(void *arg, unsigned part) {
  huge_job *a = arg;
  (void)part;
  for (;;) {
    unsigned u = atomic_fetch_add_explicit(&a->next, 1, memory_order_relaxed);
    if (u >= a->nunits) break;
    a->unit(a, u);
  }
}

/* Run a huge job on both threads and return the `left` flags (pooled, nkeys bytes),
 * or NULL if they cannot be allocated. */
static uint8_t *huge_run(ps__server *s, ps__par *par, huge_job *a) {
  a->left = ps__pool_get(s->pool, a->nkeys);
  if (!a->left) return NULL;
  memset(a->left, 0, a->nkeys);
  atomic_init(&a->next, 0);
  atomic_init(&a->mostly_new, 0);
  ps__par_run(par, huge_work, a);
  return a->left;
}

/* The positions flagged in left (n flags), in order, into pos; returns their number.
 * The loop thread creates their rows from this list, prefetching ahead as it goes. */
static uint32_t left_positions(const uint8_t *left, uint32_t n, uint32_t *pos) {
  uint32_t k = 0;
  for (const uint8_t *p = left; (p = memchr(p, 1, (size_t)(left + n - p))); p++) pos[k++] = (uint32_t)(p - left);
  return k;
}

/* Prefetch for the keys at positions pos[0 .. n): the index slot PF_FAR ahead, the row PF_NEAR ahead. */
static inline void prefetch_ahead_at(const ps__rowmap *m, const uint8_t *keys, const uint32_t *pos, uint32_t n,
                                     uint32_t j) {
  if (j + PF_FAR < n) ps__rowmap_prefetch(m, ps__get_u64(keys + 8 * (size_t)pos[j + PF_FAR]));
  if (j + PF_NEAR < n) ps__rowmap_prefetch_row(m, ps__get_u64(keys + 8 * (size_t)pos[j + PF_NEAR]));
}

/* The class of a key in a huge push: the top bits of a multiplicative hash (balanced
 * for sequential keys as well). */
static inline unsigned key_class(uint64_t key) {
  return (unsigned)((key * 0x9e3779b97f4a7c15ull) >> (64 - PUSH_CLASS_BITS));
}

static round_acc *get_round(table *t, int64_t round) {
  round_acc *r = &t->rounds[round % ROUND_WINDOW];
  if (r->round != round) {
    PS_ASSERT(r->round < round);
    /* An idle slot's accumulator (cleared when its round was applied) is reused before a
     * new one is made: its pages are warm, where a new one faults in fresh zeroed pages
     * (2.3% of the time of 1M-float rounds while the window's eight slots filled). */
    for (int i = 0; i < ROUND_WINDOW && !r->acc; i++) {
      round_acc *o = &t->rounds[i];
      if (o->round == -1 && o->acc) r->acc = o->acc, o->acc = NULL;
    }
    if (!r->acc) {
      r->acc = ps__rowmap_new(t->spec.width);
      if (!r->acc) return NULL;
    } else {
      ps__rowmap_clear(r->acc);
    }
    r->round = round;
    r->batch_sum = 0;
    r->has_lr = 0;
    r->npushers = 0;
  }
  return r;
}

/* Record a worker's batch in the round, once per worker and clock (a round of a table
 * with every=N spans N clocks, each with its own batch). 0 or NOMEM. */
static int round_add_pusher(round_acc *r, uint32_t worker_id, int64_t clock, uint32_t batch) {
  for (size_t i = 0; i < r->npushers; i++)
    if (r->pushers[i].worker == worker_id && r->pushers[i].clock == clock) return 0;
  if (r->npushers == r->cap) {
    size_t cap = r->cap ? r->cap * 2 : 8;
    pusher *p = ps__realloc(r->pushers, cap * sizeof *p);
    if (!p) return PS_ERR_NOMEM;
    r->pushers = p;
    r->cap = cap;
  }
  r->pushers[r->npushers].worker = worker_id;
  r->pushers[r->npushers].clock = clock;
  r->npushers++;
  r->batch_sum += batch;
  return 0;
}

/* One optimiser step for every row of an accumulator. Rows hold `width` floats of
 * gradient sum, and (if per_row_denom) one more float: that row's denominator. */
/* lr < 0: the table's schedule at this step for a global batch of global_batch. */
/* Start one optimiser step of a table: its step number and learning rate (lr < 0: the
 * table's schedule at this step for a global batch of global_batch). */
static float apply_begin(table *t, float lr, double global_batch, uint64_t *step) {
  *step = ++t->step;
  if (lr < 0) lr = ps__lr_at(&t->spec, *step, global_batch);
  t->last_lr = lr;
  t->last_batch = global_batch;
  return lr;
}

/* The step for one row: gradient sum g, denominator d. 0 or PS_ERR_NOMEM (logged). */
static int apply_row(table *t, uint64_t key, float *g, double d, float lr, uint64_t step) {
  if (d <= 0) return 0;
  unsigned width = t->spec.width;
  float *w = param_row(t, key);
  if (!w) {
    ps__log(PS_LOG_ERROR, "out of memory applying table '%s'", t->decl.name);
    return PS_ERR_NOMEM;
  }
  uint32_t len = ps__spec_row_len(&t->spec, key);
  if (d != 1.0 && t->spec.opt.kind == PS__OPT_SGD) {
    /* sgd is linear in the gradient: scale the step, not the gradient (one pass less) */
    ps__optim_apply(&t->spec.opt, (float)(lr / d), step, w, w + width, width, g, len);
    return 0;
  }
  if (d != 1.0) ps__vscale(g, (float)(1.0 / d), len);
  ps__optim_apply(&t->spec.opt, lr, step, w, w + width, width, g, len);
  return 0;
}

static void apply_acc(table *t, ps__rowmap *acc, double denom, int per_row_denom, float lr, double global_batch) {
  size_t n = ps__rowmap_count(acc);
  apply_flush(t);
  if (n == 0) return;
  uint64_t step;
  lr = apply_begin(t, lr, global_batch, &step);
  unsigned width = t->spec.width;
  for (size_t i = 0; i < n; i++) {
    if (i + PF_FAR < n) ps__rowmap_prefetch(t->params, ps__rowmap_key_at(acc, i + PF_FAR));
    if (i + PF_NEAR < n) ps__rowmap_prefetch_row(t->params, ps__rowmap_key_at(acc, i + PF_NEAR));
    float *g = ps__rowmap_row_at(acc, i);
    if (apply_row(t, ps__rowmap_key_at(acc, i), g, per_row_denom ? g[width] : denom, lr, step)) return;
  }
  t->applied++;
}

/* Apply one sync round of a table. A round of every=N clocks is one step with N times the
 * batch-weighted mean over all its pushes: with equal batches, the sum of the N clocks'
 * means (as N sgd steps on parameters held for N clocks). */
static void apply_round(table *t, round_acc *r) {
  double batch = r->batch_sum / (double)t->spec.every; /* the round's global batch per clock */
  double denom = t->spec.update == PS__UPDATE_MEAN ? batch : 1.0;
  /* The round's global batch is the batches of the workers that pushed to it: it
   * shrinks when a worker leaves, and the scaled learning rate with it. */
  apply_acc(t, r->acc, denom, 0, r->has_lr ? r->lr : -1.0f, batch);
}

/* Apply the buffered async/ssp pushes: per row, the batch-weighted mean (or the sum). */
static void agg_flush(table *t) {
  if (t->agg_timer_on) {
    uv_timer_stop(&t->agg_timer);
    t->agg_timer_on = 0;
  }
  if (!t->agg || t->agg_count == 0) return;
  /* Async: the global batch is estimated as the mean buffered batch times the live
   * workers (what a sync round over the same workers would combine). */
  int64_t minc, maxc;
  size_t k = live_clocks(t->srv, &minc, &maxc);
  double gb = t->agg_count ? t->agg_batch / t->agg_count * (double)(k ? k : 1) : 0;
  apply_acc(t, t->agg, 1.0, t->spec.update == PS__UPDATE_MEAN, t->agg_has_lr ? t->agg_lr : -1.0f, gb);
  t->agg_batch = 0;
  ps__rowmap_clear(t->agg);
  t->agg_count = 0;
  t->agg_has_lr = 0;
}

static void agg_timeout(uv_timer_t *tm) {
  table *t = tm->data;
  t->agg_timer_on = 0;
  agg_flush(t);
}

/* ------------------------------------------------------------------ pulls */

static void answer_pull(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const void *body, size_t blen);
static pending_pull *take_fusable_pulls(ps__server *s, table *t);
static int apply_round_fused(table *t, round_acc *r, pending_pull *f);
static void answer_fused_pulls(ps__server *s, table *t, pending_pull *f);

/* May a pull at clock c of table t be answered now? */
static int pull_ready(ps__server *s, table *t, int64_t c) {
  int64_t minc, maxc;
  switch (t->spec.mode) {
  case PS__MODE_SYNC:
  case PS__MODE_SYNC_M:
    return t->version >= c / (int64_t)t->spec.every;
  case PS__MODE_SSP:
    if (!live_clocks(s, &minc, &maxc)) return 1;
    return minc >= c - (int64_t)t->spec.mode_param;
  default:
    return 1;
  }
}

static void answer_ready_pulls(ps__server *s) {
  pending_pull **pp = &s->pulls;
  while (*pp) {
    pending_pull *p = *pp;
    table *t = get_table(s, p->h.table);
    if (!t || pull_ready(s, t, p->h.clock)) {
      *pp = p->next;
      answer_pull(s, p->conn, &p->h, p->buf, p->len);
      ps__pool_put(s->pool, p->buf, p->len);
      free(p);
    } else {
      pp = &p->next;
    }
  }
}

static void drop_pulls_of(ps__server *s, ps__conn *c) {
  pending_pull **pp = &s->pulls;
  while (*pp) {
    pending_pull *p = *pp;
    if (p->conn == c) {
      *pp = p->next;
      ps__pool_put(s->pool, p->buf, p->len);
      free(p);
    } else {
      pp = &p->next;
    }
  }
}

/* ------------------------------------------------------------------ rounds */

/* Apply every sync round that is complete: all live workers (sync) or the first M of
 * them (sync:M) have clocks past the round's last clock. */
static void try_advance(ps__server *s) {
  if (!s->started) return;
  int64_t minc, maxc;
  size_t alive = live_clocks(s, &minc, &maxc);
  if (alive == 0) return;
  for (size_t i = 0; i < s->ntables; i++) {
    table *t = s->tables[i];
    if (!t || !is_sync(t)) continue;
    int64_t every = (int64_t)t->spec.every;
    for (;;) {
      int64_t need = (t->version + 1) * every; /* clocks past the round's last clock */
      size_t past = 0;
      for (size_t k = 0; k < s->nworkers; k++) past += s->workers[k].alive && s->workers[k].clock >= need;
      size_t quorum = alive;
      if (t->spec.mode == PS__MODE_SYNC_M && t->spec.mode_param < alive) quorum = t->spec.mode_param;
      if (past < quorum) break;
      round_acc *r = &t->rounds[t->version % ROUND_WINDOW];
      pending_pull *fused = NULL;
      if (r->round == t->version) {
        fused = take_fusable_pulls(s, t);
        if (!fused || apply_round_fused(t, r, fused)) {
          apply_round(t, r);
          for (pending_pull *p = fused; p; p = p->next) p->fused_err = PS_ERR_UNAVAILABLE; /* answered as usual */
        }
        r->round = -1;
        ps__rowmap_clear(r->acc);
      }
      t->version++;
      if (fused) answer_fused_pulls(s, t, fused);
    }
  }
  answer_ready_pulls(s);
}

/* ------------------------------------------------------------------ data requests */

/* Validate a request's table and sender; 0 or an error already answered. */
static int check_request(ps__server *s, ps__conn *c, const ps__frame_hdr *h, int kind, table **out) {
  table *t = get_table(s, h->table);
  if (!t) {
    reply_err(c, h, PS_ERR_NO_TABLE, "unknown table %u", h->table);
    return -1;
  }
  if (t->spec.kind != kind) {
    reply_err(c, h, PS_ERR_INVALID, "table '%s' is %s; use the %s calls", t->decl.name,
              t->spec.kind == PS_DENSE ? "dense" : "sparse", t->spec.kind == PS_DENSE ? "range" : "key");
    return -1;
  }
  *out = t;
  return 0;
}

/* The dense slices [*lo, *hi) of t this server owns (ring.h: one contiguous run per
 * server), cached per ring. 0, or -1 when out of memory. */
static int dense_mine(ps__server *s, table *t, uint64_t *lo, uint64_t *hi) {
  uint64_t nsl = (t->spec.size + t->spec.width - 1) / t->spec.width;
  size_t S = s->ring ? ps__ring_size(s->ring) : 0;
  if (S <= 1) {
    *lo = 0, *hi = nsl;
    return 0;
  }
  if (t->mine_gen != s->ring_gen) {
    uint32_t *order = ps__malloc(S * sizeof *order);
    if (!order || !ps__ring_dense_order(s->ring, t->id, order)) {
      free(order);
      return -1;
    }
    t->mine_lo = t->mine_hi = 0;
    for (size_t j = 0; j < S; j++) {
      if (ps__ring_server_at(s->ring, order[j]) == s->id) {
        t->mine_lo = ps__dense_run_start(j, nsl, S);
        t->mine_hi = ps__dense_run_start(j + 1, nsl, S);
        break;
      }
    }
    free(order);
    t->mine_gen = s->ring_gen;
  }
  *lo = t->mine_lo, *hi = t->mine_hi;
  return 0;
}

/* The pid to pass to ps__pm_copy for a peer-memory request on c: PS_PM_SELF for a
 * colocated worker (this process; its regions are our own library's, naming the
 * caller's live buffers, so they are copied with memcpy), else the peer's pid. */
static int pm_pid(const ps__server *s, const ps__conn *c) { return c->peer_pid == s->pid ? PS_PM_SELF : c->peer_pid; }

/* Check a dense segment list: in range, owned. Returns total elements or -1 (answered). */
static int64_t check_segments(ps__server *s, ps__conn *c, const ps__frame_hdr *h, table *t, const uint8_t *keys) {
  uint64_t total = 0, lo = 0, hi = 0;
  if (h->nkeys && dense_mine(s, t, &lo, &hi)) {
    reply_err(c, h, PS_ERR_NOMEM, "out of memory");
    return -1;
  }
  for (uint32_t i = 0; i < h->nkeys; i += 2) {
    uint64_t off = ps__get_u64(keys + 8 * i), cnt = ps__get_u64(keys + 8 * (i + 1));
    if (cnt == 0 || off >= t->spec.size || cnt > t->spec.size - off) {
      reply_err(c, h, PS_ERR_RANGE, "range [%llu, +%llu) outside table '%s' of %llu floats", (unsigned long long)off,
                (unsigned long long)cnt, t->decl.name, (unsigned long long)t->spec.size);
      return -1;
    }
    uint64_t a = off / t->spec.width, b = (off + cnt - 1) / t->spec.width;
    if (a < lo || b >= hi) {
      reply_err(c, h, PS_ERR_MOVED, "slice %llu of table '%s' is not on this server (epoch %llu)",
                (unsigned long long)(a < lo ? a : hi), t->decl.name, (unsigned long long)s->epoch);
      return -1;
    }
    total += cnt;
  }
  return (int64_t)total;
}

enum { PUSH_OK = 0, PUSH_DROP = 1, PUSH_REJECTED = -1 };

/* Check a push's clock against the table's mode. Returns PUSH_OK, PUSH_DROP (a late
 * push under sync:M: counted, acknowledged, not applied) or PUSH_REJECTED (answered). */
/* Count a push rejected for its clock and answer it with PS_ERR_CLOCK. */
static int reject_clock(ps__server *s, ps__conn *c, const ps__frame_hdr *h, table *t, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int reject_clock(ps__server *s, ps__conn *c, const ps__frame_hdr *h, table *t, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  s->rejected_clock++;
  t->rejected++;
  ps__conn_send_error(c, h, PS_ERR_CLOCK, msg);
  return PUSH_REJECTED;
}

static int check_push_clock(ps__server *s, ps__conn *c, const ps__frame_hdr *h, table *t) {
  worker *w = find_worker(s, h->sender);
  if (w && !w->alive && !w->pending) {
    reply_err(c, h, PS_ERR_UNAVAILABLE, "worker %u was removed from the job", h->sender);
    return PUSH_REJECTED;
  }
  int64_t lo, hi;
  live_clocks(s, &lo, &hi);
  if (!w && !(w = add_worker(s, h->sender, lo, 0))) {
    reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
    return PUSH_REJECTED;
  }
  /* From the future: ahead of every live worker's clock. (A worker may be ahead of its
   * own last CLOCK here: a sync:M straggler fast-forwards to the servers' round.) */
  int64_t front = w->clock > hi ? w->clock : hi;
  if (h->clock < 0 || h->clock > front)
    return reject_clock(s, c, h, t, "push for clock %lld is from the future: the fastest worker is at %lld",
                        (long long)h->clock, (long long)front);
  /* Far in the past, in every mode: more than MAX_DELAY clocks behind the fastest live
   * worker. (Under sync:M a late push would otherwise be dropped with a success reply.) */
  if (hi - h->clock > MAX_DELAY)
    return reject_clock(s, c, h, t, "push for clock %lld is more than %d clocks behind the fastest worker (%lld)",
                        (long long)h->clock, MAX_DELAY, (long long)hi);
  if (is_sync(t)) {
    int64_t round = h->clock / (int64_t)t->spec.every;
    if (round < t->version) {
      if (t->spec.mode == PS__MODE_SYNC_M) {
        t->dropped++;
        return PUSH_DROP;
      }
      return reject_clock(s, c, h, t, "push for clock %lld rejected: table '%s' already applied round %lld",
                          (long long)h->clock, t->decl.name, (long long)t->version - 1);
    }
    if (round >= t->version + ROUND_WINDOW)
      return reject_clock(s, c, h, t, "push for clock %lld rejected: table '%s' is at round %lld (window %d)",
                          (long long)h->clock, t->decl.name, (long long)t->version, ROUND_WINDOW);
    return PUSH_OK;
  }
  stale_record(s->push_stale, &s->push_stale_max, hi - h->clock);
  return PUSH_OK;
}

/* Async/ssp without server-side aggregation (agg_n unset or 1, no agg_ms) applies every
 * push at once, so the batch-weighted mean of the one push is its own gradient. Apply
 * it straight from the frame, skipping the aggregation buffer (a pass to accumulate,
 * one to zero its new rows, two lookups per key to count weights, one to scale).
 * Sparse rows repeated in a push must be summed before a non-linear optimiser steps,
 * so only sgd (where two steps are one step with the sum) applies sparse rows
 * directly; the others sum them in the buffer first. Returns 0, or an error to answer. */
/* One class of a huge sgd push: walk the whole request, and for the keys of class c,
 * in request order, apply the gradients of those in the map. Every row has one class,
 * so one writer, and gets its keys in request order. */
static void push_unit(huge_job *a, uint32_t c) {
  const ps__rowmap *m = a->t->params;
  unsigned width = a->t->spec.width;
  const uint8_t *keys = a->keys;
  uint32_t n = a->nkeys, i = 0, done = 0, missed = 0;
  uint32_t pos[FIND_BLOCK];
  uint64_t k64[FIND_BLOCK];
  float *rows[FIND_BLOCK];
  int stop = atomic_load_explicit(&a->mostly_new, memory_order_relaxed);
  while (!stop && i < n) {
    /* The next FIND_BLOCK keys of the class (no branch on the class: it is random). */
    uint32_t nb = 0;
    for (; i < n && nb < FIND_BLOCK; i++) {
      uint64_t k = ps__get_u64(keys + 8 * (size_t)i);
      pos[nb] = i;
      k64[nb] = k;
      nb += key_class(k) == c;
    }
    ps__rowmap_find_many(m, k64, nb, rows);
    for (uint32_t q = 0; q < nb; q++) {
      if (rows[q]) {
        /* Only sgd pushes come here (push_direct): its step, inlined (sgd_step). */
        float *w = rows[q];
        const float *g = a->vals + (size_t)pos[q] * width;
        for (unsigned k = 0; k < width; k++) w[k] -= a->lr * g[k];
        continue;
      }
      a->left[pos[q]] = 1;
      if (give_up(++missed, done + q + 1)) {
        atomic_store_explicit(&a->mostly_new, 1, memory_order_relaxed);
        for (q++; q < nb; q++) a->left[pos[q]] = 1;
        stop = 1;
      }
    }
    done += nb;
  }
  for (; i < n; i++)
    if (key_class(ps__get_u64(keys + 8 * (size_t)i)) == c) a->left[i] = 1;
}

/* A huge sgd push: apply on both threads, then the keys left over (new rows) in
 * request order. */
static int push_huge(ps__server *s, ps__par *par, table *t, const uint8_t *keys, const float *vals, uint32_t nkeys,
                     float lr, uint64_t step) {
  huge_job a = {.unit = push_unit, .t = t, .keys = keys, .nkeys = nkeys, .nunits = PUSH_CLASSES, .vals = vals,
                .lr = lr, .step = step};
  size_t width = t->spec.width;
  size_t plen = (size_t)nkeys * 4;
  uint32_t *pos = ps__pool_get(s->pool, plen);
  uint8_t *left = NULL;
  int rc = PS_ERR_NOMEM;
  if (!pos || !(left = huge_run(s, par, &a))) goto out;
  rc = 0;
  uint32_t nleft = left_positions(left, nkeys, pos);
  for (uint32_t j = 0; j < nleft; j++) {
    prefetch_ahead_at(t->params, keys, pos, nleft, j);
    size_t i = pos[j];
    float *row = param_row(t, ps__get_u64(keys + 8 * i));
    if (!row) {
      rc = PS_ERR_NOMEM;
      break;
    }
    ps__optim_apply(&t->spec.opt, lr, step, row, row + width, width, vals + i * width, width);
  }
out:
  ps__pool_put(s->pool, left, nkeys);
  ps__pool_put(s->pool, pos, plen);
  return rc;
}

/* Create a slice's row if it does not exist yet. */
static int touch_slice(void *arg, uint64_t slice, uint64_t within, uint64_t n, uint64_t pos) {
  (void)within, (void)n, (void)pos;
  return param_row(arg, slice) ? 0 : PS_ERR_NOMEM;
}

/* The global batch of a push applied on its own: as agg_flush estimates it. */
static double direct_batch(ps__server *s, const ps__frame_hdr *h) {
  int64_t minc, maxc;
  size_t k = live_clocks(s, &minc, &maxc);
  return (double)h->batch * (double)(k ? k : 1);
}

static int push_direct(ps__server *s, table *t, const ps__frame_hdr *h, const uint8_t *keys, const float *vals) {
  unsigned width = t->spec.width;
  if (h->nkeys == 0) return 0;
  double gb = direct_batch(s, h);
  if (t->spec.opt.kind != PS__OPT_SGD) {
    if (!t->agg && !(t->agg = ps__rowmap_new((size_t)width + 1))) return PS_ERR_NOMEM;
    int created = 0;
    for (uint32_t i = 0; i < h->nkeys; i++) {
      float *row = ps__rowmap_upsert(t->agg, ps__get_u64(keys + 8 * i), &created);
      if (!row) {
        ps__rowmap_clear(t->agg);
        return PS_ERR_NOMEM;
      }
      ps__vadd(row, vals + (size_t)i * width, width);
    }
    apply_acc(t, t->agg, 1.0, 0, h->lr >= 0 ? h->lr : -1.0f, gb);
    ps__rowmap_clear(t->agg);
    return 0;
  }
  uint64_t step = ++t->step;
  float lr = h->lr >= 0 ? h->lr : ps__lr_at(&t->spec, step, gb);
  t->last_lr = lr;
  t->last_batch = gb;
  ps__par *par;
  if ((par = huge_par(s, h->nkeys))) {
    int rc = push_huge(s, par, t, keys, vals, h->nkeys, lr, step);
    if (rc) return rc;
  } else {
    float *rows[FIND_BLOCK];
    for (uint32_t b = 0; b < h->nkeys; b += FIND_BLOCK) {
      uint32_t n = h->nkeys - b < FIND_BLOCK ? h->nkeys - b : FIND_BLOCK;
      int added = 0; /* after an insert, the block's rows may have moved (store.h) */
      ps__rowmap_find_many_le(t->params, keys + 8 * (size_t)b, n, rows);
      for (uint32_t i = 0; i < n; i++) {
        added |= !rows[i];
        float *row = rows[i] && !added ? rows[i] : param_row(t, ps__get_u64(keys + 8 * (size_t)(b + i)));
        if (!row) return PS_ERR_NOMEM;
        ps__optim_apply(&t->spec.opt, lr, step, row, row + width, width, vals + (size_t)(b + i) * width, width);
      }
    }
  }
  t->applied++;
  return 0;
}

/* Accumulate a dense push into a round's or the aggregation buffer's rows; the
 * aggregation rows (count_weight) also add the push's weight once per slice. */
typedef struct acc_arg {
  ps__rowmap *acc;
  const float *vals;
  float weight;
  unsigned width;
  int count_weight, have_last;
  uint64_t last;
} acc_arg;

/* A created accumulator row: zero but for [within, within + n), which the caller fills. */
static void acc_row_fresh(float *row, size_t row_floats, uint64_t within, uint64_t n) {
  memset(row, 0, within * 4);
  memset(row + within + n, 0, (row_floats - within - n) * 4);
}

static int acc_slice(void *arg, uint64_t slice, uint64_t within, uint64_t n, uint64_t pos) {
  acc_arg *a = arg;
  int created;
  float *row = ps__rowmap_upsert_uninit(a->acc, slice, &created);
  if (!row) return PS_ERR_NOMEM;
  if (created) { /* the first gradient of this slice: written, not added to zeros */
    acc_row_fresh(row, a->width + (size_t)a->count_weight, within, n);
    ps__vset(row + within, a->weight, a->vals + pos, n);
  } else {
    ps__axpy(row + within, a->weight, a->vals + pos, n);
  }
  if (a->count_weight && (!a->have_last || slice != a->last)) {
    row[a->width] += a->weight;
    a->last = slice;
    a->have_last = 1;
  }
  return 0;
}

/* The checks every push passes before it changes anything: its table and kind, the
 * batch of a mean-mode table, the keys or segments against its nvals values, and its
 * clock. Returns the table, or NULL when the push is answered already (an error, or a
 * late push under sync:M acknowledged as dropped). */
static table *push_admit(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const uint8_t *keys, uint64_t nvals,
                         int dense) {
  table *t;
  if (check_request(s, c, h, dense ? PS_DENSE : PS_SPARSE, &t)) return NULL;
  apply_flush(t); /* an earlier push is in before this one */
  unsigned width = t->spec.width;
  if (t->spec.update == PS__UPDATE_MEAN && h->batch == 0 && h->nkeys > 0) {
    reply_err(c, h, PS_ERR_INVALID, "push with batch size 0 to mean-mode table '%s'", t->decl.name);
    return NULL;
  }
  if (dense) {
    int64_t total = check_segments(s, c, h, t, keys);
    if (total < 0) return NULL;
    if ((uint64_t)total != nvals) {
      reply_err(c, h, PS_ERR_SIZE, "push of %llu floats for segments covering %lld", (unsigned long long)nvals,
                (long long)total);
      return NULL;
    }
  } else {
    if (nvals != (uint64_t)h->nkeys * width) {
      reply_err(c, h, PS_ERR_DIM, "push of %llu floats for %u keys of table '%s' with dim %u",
                (unsigned long long)nvals, h->nkeys, t->decl.name, width);
      return NULL;
    }
    uint32_t i = first_foreign(s, h->table, keys, h->nkeys);
    if (i < h->nkeys) {
      reply_err(c, h, PS_ERR_MOVED, "key %llu of table '%s' is not on this server (epoch %llu)",
                (unsigned long long)ps__get_u64(keys + 8 * (size_t)i), t->decl.name, (unsigned long long)s->epoch);
      return NULL;
    }
  }
  int st = check_push_clock(s, c, h, t);
  if (st == PUSH_REJECTED) return NULL;
  if (st == PUSH_DROP) {
    reply_ok(c, h, PS_FLAG_DROPPED);
    return NULL;
  }
  return t;
}

/* The accumulator of a sync push's round, with the pusher and its learning rate
 * recorded; NULL (answered) when out of memory. */
static ps__rowmap *round_acc_for(table *t, ps__conn *c, const ps__frame_hdr *h) {
  round_acc *r = get_round(t, h->clock / (int64_t)t->spec.every);
  if (!r || round_add_pusher(r, h->sender, h->clock, h->batch)) {
    reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
    return NULL;
  }
  if (h->lr >= 0) {
    r->lr = h->lr;
    r->has_lr = 1;
  }
  return r->acc;
}

static void on_push(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b, int dense) {
  const uint8_t *keys = b->buf;
  const float *vals = (const float *)((const uint8_t *)b->buf + 8u * h->nkeys);
  uint64_t nvals = (h->payload_len - 8u * h->nkeys) / 4u;
  table *t = push_admit(s, c, h, keys, nvals, dense);
  if (!t) return;
  unsigned width = t->spec.width;
  int mean = t->spec.update == PS__UPDATE_MEAN;

  if (!is_sync(t) && (t->spec.agg_n == 1 || (t->spec.agg_n == 0 && t->spec.agg_ms == 0))) {
    if (dense) {
      /* Once its rows exist the update cannot fail: acknowledge first, then apply it a
       * step at a time, so the worker's next request travels meanwhile. Whatever reads
       * or updates the table next finishes it first (apply_flush), or, a pull of the same
       * ranges, while its reply goes out (send_rows): no request sees it half done. */
      if (walk_slices(keys, h->nkeys, width, touch_slice, t)) {
        reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
        return;
      }
      t->pushes++;
      reply_ok(c, h, 0);
      double gb = direct_batch(s, h);
      uint64_t step = ++t->step;
      float lr = h->lr >= 0 ? h->lr : ps__lr_at(&t->spec, step, gb);
      t->last_lr = lr;
      t->last_batch = gb;
      t->applied++;
      apply_start(t, h, b, lr, step);
      return;
    }
    if (push_direct(s, t, h, keys, vals)) {
      reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
      return;
    }
    t->pushes++;
    reply_ok(c, h, 0);
    return;
  }

  /* Where the gradient goes: the round's accumulator (sync) or the aggregation buffer
   * (async, ssp), whose rows carry one more float, the row's weight sum. */
  ps__rowmap *acc;
  int sync = is_sync(t);
  float weight = mean ? (float)h->batch : 1.0f;
  if (sync) {
    if (!(acc = round_acc_for(t, c, h))) return;
  } else {
    if (!t->agg && !(t->agg = ps__rowmap_new((size_t)width + 1))) {
      reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
      return;
    }
    if (h->lr >= 0) {
      t->agg_lr = h->lr;
      t->agg_has_lr = 1;
    }
    acc = t->agg;
  }
  int created = 0;
  if (dense) {
    acc_arg a = {acc, vals, weight, width, !sync, 0, 0};
    if (walk_slices(keys, h->nkeys, width, acc_slice, &a)) {
      reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
      return;
    }
  } else {
    for (uint32_t i = 0; i < h->nkeys; i++) {
      float *row = ps__rowmap_upsert(acc, ps__get_u64(keys + 8 * i), &created);
      if (!row) {
        reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
        return;
      }
      ps__axpy(row, weight, vals + (size_t)i * width, width);
    }
    if (!sync) {
      /* Add this push's weight once to every row it touched, even for keys repeated in
       * the push: a first pass marks counted rows negative (weights are >= 0), a second
       * restores them. */
      for (uint32_t i = 0; i < h->nkeys; i++) {
        float *row = ps__rowmap_get(acc, ps__get_u64(keys + 8 * i));
        if (row[width] >= 0) row[width] = -(row[width] + weight) - 1.0f;
      }
      for (uint32_t i = 0; i < h->nkeys; i++) {
        float *row = ps__rowmap_get(acc, ps__get_u64(keys + 8 * i));
        if (row[width] < 0) row[width] = -(row[width] + 1.0f);
      }
    }
  }
  t->pushes++;
  if (!sync) {
    t->agg_count++;
    t->agg_batch += h->batch;
    uint32_t n = t->spec.agg_n ? t->spec.agg_n : (t->spec.agg_ms ? UINT32_MAX : 1);
    if (t->agg_count >= n) {
      agg_flush(t);
    } else if (t->spec.agg_ms && !t->agg_timer_on) {
      if (!t->agg_timer_init) {
        uv_timer_init(&s->loop, &t->agg_timer);
        t->agg_timer.data = t;
        t->agg_timer_init = 1;
      }
      uv_timer_start(&t->agg_timer, agg_timeout, t->spec.agg_ms, 0);
      t->agg_timer_on = 1;
    }
  }
  reply_ok(c, h, 0);
}

/* One run of positions of a huge pull: copy the rows that are in the map. */
static void pull_unit(huge_job *a, uint32_t u) {
  const ps__rowmap *m = a->t->params;
  unsigned width = a->t->spec.width;
  uint32_t lo = u * PULL_UNIT, n = a->nkeys - lo < PULL_UNIT ? a->nkeys - lo : PULL_UNIT, i = 0, missed = 0;
  const uint8_t *keys = a->keys + 8 * (size_t)lo;
  float *o = a->out + (size_t)lo * width;
  uint8_t *left = a->left + lo;
  float *rows[FIND_BLOCK];
  int stop = atomic_load_explicit(&a->mostly_new, memory_order_relaxed);
  while (!stop && i < n) {
    uint32_t nb = n - i < FIND_BLOCK ? n - i : FIND_BLOCK;
    ps__rowmap_find_many_le(m, keys + 8 * (size_t)i, nb, rows);
    for (uint32_t q = 0; q < nb; q++, i++, o += width) {
      const float *row = rows[q];
      if (row) {
        if (width == 1)
          *o = *row;
        else
          memcpy(o, row, (size_t)width * 4);
        continue;
      }
      left[i] = 1;
      if (give_up(++missed, i + 1)) {
        atomic_store_explicit(&a->mostly_new, 1, memory_order_relaxed);
        i++;
        stop = 1;
        break;
      }
    }
  }
  if (i < n) memset(left + i, 1, n - i);
}

/* Fill a huge pull on both threads, then the keys left over (creating their rows) in
 * request order. 0 or PS_ERR_NOMEM. */
static int pull_huge(ps__server *s, ps__par *par, table *t, const uint8_t *keys, uint32_t nkeys, float *out) {
  huge_job a = {.unit = pull_unit, .t = t, .keys = keys, .nkeys = nkeys,
                .nunits = (nkeys + PULL_UNIT - 1) / PULL_UNIT, .out = out};
  size_t width = t->spec.width;
  size_t plen = (size_t)nkeys * 4;
  uint32_t *pos = ps__pool_get(s->pool, plen);
  if (!pos) return PS_ERR_NOMEM;
  uint8_t *left = huge_run(s, par, &a);
  int rc = left ? 0 : PS_ERR_NOMEM;
  uint32_t nleft = left ? left_positions(left, nkeys, pos) : 0;
  for (uint32_t j = 0; j < nleft; j++) {
    prefetch_ahead_at(t->params, keys, pos, nleft, j);
    size_t i = pos[j];
    float *row = param_row(t, ps__get_u64(keys + 8 * i));
    if (!row) {
      rc = PS_ERR_NOMEM;
      break;
    }
    memcpy(out + i * width, row, width * 4);
  }
  ps__pool_put(s->pool, left, nkeys);
  ps__pool_put(s->pool, pos, plen);
  return rc;
}

/* The rows a dense pull reads, as regions: runs that are adjacent in memory are one
 * region (consecutive slices of an sgd table usually are). */
typedef struct regions_arg {
  table *t;
  uv_buf_t *v;
  unsigned n, cap;
  uv_buf_t small[16];
} regions_arg;

static int region_slice(void *arg, uint64_t slice, uint64_t within, uint64_t n, uint64_t pos) {
  regions_arg *a = arg;
  (void)pos;
  float *row = param_row(a->t, slice);
  if (!row) return PS_ERR_NOMEM;
  char *p = (char *)(row + within);
  if (a->n && a->v[a->n - 1].base + a->v[a->n - 1].len == p) {
    a->v[a->n - 1].len += n * 4;
    return 0;
  }
  if (a->n == a->cap) {
    unsigned cap = a->cap * 2;
    uv_buf_t *v = a->v == a->small ? ps__malloc(cap * sizeof *v) : ps__realloc(a->v, cap * sizeof *v);
    if (!v) return PS_ERR_NOMEM;
    if (a->v == a->small) memcpy(v, a->small, sizeof a->small);
    a->v = v;
    a->cap = cap;
  }
  a->v[a->n] = uv_buf_init(p, 0);
  a->v[a->n].len = n * 4;
  a->n++;
  return 0;
}

/* Send a dense pull's reply from the parameter rows themselves: ps__conn_send_now writes
 * what the socket takes at once straight from the rows and copies only the rest, so the
 * reply holds the rows as they are now, never a later push's update. 0 or NOMEM. */
static size_t produce_apply(void *arg) {
  table *t = arg;
  apply_some(t, PRODUCE_STEP);
  return t->pend.active ? (size_t)t->pend.done * 4 : SIZE_MAX;
}

/* The tail of a peer-memory request after its segments: the time (ps__now_ms) after
 * which the worker lets go of its buffers, the shared-buffer hint, then (address,
 * length) pairs (protocol.md 6.2a). The frame decoder checked that it has at least 16 bytes. */
typedef struct pm_tail {
  uint64_t until, hint; /* hint: 1 + the worker's descriptor of a shared buffer, or 0 */
  const uint8_t *d;
  size_t nd;
} pm_tail;

static pm_tail pm_tail_of(const ps__frame_hdr *h, const void *body, size_t blen) {
  size_t kbytes = 8u * (size_t)h->nkeys;
  const uint8_t *t = (const uint8_t *)body + kbytes;
  pm_tail q = {ps__get_u64(t), ps__get_u64(t + 8), t + 16, (blen - kbytes - 16) / 16};
  return q;
}

/* The pid to copy a peer-memory request's values with. Where the worker's regions lie
 * in a buffer it shares with this server (ps_alloc, net/shared.c), q->d is pointed at
 * this process's addresses of them, in *xd (the caller frees it), and the answer is
 * PS_PM_SELF: the server reads and writes them itself, within this loop callback. */
static int pm_local(ps__server *s, ps__conn *c, int write, pm_tail *q, uint8_t **xd) {
  int pid = pm_pid(s, c);
  *xd = NULL;
  if (pid == PS_PM_SELF || !q->hint || !q->nd || q->nd > SIZE_MAX / 16) return pid;
  if (!s->shm && !(s->shm = ps__shm_cache_new())) return pid;
  uint8_t *out = ps__malloc(16 * q->nd);
  if (!out || ps__shm_translate(s->shm, c, pid, q->hint, write, q->d, q->nd, out)) {
    free(out);
    return pid;
  }
  *xd = out;
  q->d = out;
  return PS_PM_SELF;
}

/* A request's tail with its regions checked and their total in *total; 0, or -1 when
 * they are malformed (answered). */
static int pm_tail_checked(ps__conn *c, const ps__frame_hdr *h, const ps__body *b, pm_tail *q, uint64_t *total) {
  *q = pm_tail_of(h, b->buf, b->len);
  if (ps__pm_descs_check(q->d, q->nd, total) == 0) return 0;
  reply_err(c, h, PS_ERR_PROTO, "%s", ps_errmsg());
  return -1;
}

/* A peer-memory pull (PS_CODEC_PEER_MEM): write the rows straight into the worker's
 * buffers named after the segment list, and answer with an empty reply. 1 if done (or
 * answered with an error), 0 if the values must go in the reply instead (this server
 * may not write that process's memory after all). */
/* A peer-memory copy of PM_PAR_MIN bytes or more runs on the server's two threads,
 * half each: one core copies at about 3.5 GB/s here, and a socket would have split the
 * work between the worker's core and the server's. Not below 4 MiB: the 2 MiB parts of
 * a 1M-float sync round with K = S = 2 come from every worker at once, the cores are
 * busy anyway, and splitting them made the round about 10% slower (median of 8
 * alternating runs: 2.25 -> 2.05 ms with server processes, 1.95 -> 1.75 colocated). */
#define PM_PAR_MIN ((size_t)4 << 20)

typedef struct pm_par_job {
  int pid, write;
  const uv_buf_t *loc;
  unsigned nloc;
  pm_tail q;
  size_t split; /* part 0 copies bytes [0, split), part 1 the rest */
  int rc[2];
  char msg[2][256];
} pm_par_job;

static void pm_par_part(void *arg, unsigned part) {
  pm_par_job *j = arg;
  uv_buf_t one[1], *sub = j->nloc > 1 ? ps__malloc(j->nloc * sizeof *sub) : one;
  if (!sub) {
    j->rc[part] = PS_ERR_NOMEM;
    snprintf(j->msg[part], sizeof j->msg[part], "out of memory");
    return;
  }
  unsigned n = 0;
  size_t at = 0; /* bytes before loc[i] */
  for (unsigned i = 0; i < j->nloc; at += j->loc[i].len, i++) {
    size_t a = at, b = at + j->loc[i].len; /* this region's bytes, cut to the part's range */
    size_t lo = part ? j->split : 0, hi = part ? SIZE_MAX : j->split;
    if (a < lo) a = lo;
    if (b > hi) b = hi;
    if (a >= b) continue;
    sub[n] = uv_buf_init(j->loc[i].base + (a - at), 0);
    sub[n++].len = b - a;
  }
  j->rc[part] = ps__pm_copy(j->pid, j->write, sub, n, j->q.d, j->q.nd, part ? j->split : 0, j->q.until);
  if (j->rc[part]) snprintf(j->msg[part], sizeof j->msg[part], "%s", ps_errmsg());
  if (sub != one) free(sub);
}

static int pm_copy_par(ps__server *s, int pid, int write, const uv_buf_t *loc, unsigned nloc, pm_tail q) {
  size_t total = 0;
  for (unsigned i = 0; i < nloc; i++) total += loc[i].len;
  ps__par *par = total >= PM_PAR_MIN ? huge_par(s, UINT32_MAX) : NULL;
  if (!par) return ps__pm_copy(pid, write, loc, nloc, q.d, q.nd, 0, q.until);
  pm_par_job j = {.pid = pid, .write = write, .loc = loc, .nloc = nloc, .q = q, .split = (total / 2) & ~(size_t)4095};
  ps__par_run(par, pm_par_part, &j);
  for (unsigned k = 0; k < 2; k++)
    if (j.rc[k]) return ps__fail(j.rc[k], "%s", j.msg[k]);
  return 0;
}

static int write_rows_to_peer(ps__conn *c, const ps__frame_hdr *h, const uint8_t *keys, size_t blen,
                              const regions_arg *a, ps__frame_hdr *r) {
  if (h->codec != PS_CODEC_PEER_MEM || !c->peer_pid) return 0;
  pm_tail q = pm_tail_of(h, keys, blen);
  uint8_t *xd;
  int pid = pm_local(c->loop->data, c, 1, &q, &xd);
  int rc = pm_copy_par(c->loop->data, pid, 1, a->v, a->n, q);
  free(xd);
  if (rc == PS_ERR_UNAVAILABLE) {
    ps__log(PS_LOG_WARN, "%s; answering with the values instead", ps_errmsg());
    return 0;
  }
  if (rc) {
    reply_err(c, h, rc, "%s", ps_errmsg());
    return 1;
  }
  r->codec = PS_CODEC_PEER_MEM;
  ps__conn_send_ctrl(c, r, NULL, 0);
  ((ps__server *)c->loop->data)->pm_pulls++;
  return 1;
}

static int send_rows(ps__conn *c, const ps__frame_hdr *h, const uint8_t *keys, size_t blen, table *t,
                     ps__frame_hdr *r) {
  regions_arg a = {.t = t, .cap = sizeof a.small / sizeof a.small[0]};
  pending_apply *p = &t->pend;
  a.v = a.small;
  if (h->codec == PS_CODEC_PEER_MEM && c->peer_pid) {
    apply_flush(t); /* one copy of the finished rows, no overlap to gain */
    int rc = walk_slices(keys, h->nkeys, t->spec.width, region_slice, &a);
    int done = !rc && write_rows_to_peer(c, h, keys, blen, &a, r);
    if (rc || done) {
      if (a.v != a.small) free(a.v);
      return rc;
    }
    a.n = 0; /* answered inline below */
  }
  /* A pull of exactly the ranges of the push being applied: the reply's values are the
   * push's in the same order, so byte i of the payload is final once p->done * 4 > i.
   * The rest of the apply then runs while the socket drains. Any other pull waits. */
  int same = p->active && p->nkeys == h->nkeys && !memcmp(p->keys, keys, 8u * (size_t)h->nkeys);
  if (!same) apply_flush(t);
  int rc = walk_slices(keys, h->nkeys, t->spec.width, region_slice, &a);
  if (!rc) {
    int st = same && p->active ? ps__conn_send_produced(c, r, a.v, a.n, (size_t)p->done * 4, produce_apply, t)
                               : ps__conn_send_now(c, r, a.v, a.n);
    if (st == PS_ERR_NOMEM) rc = PS_ERR_NOMEM;
  }
  apply_flush(t); /* a failed send may leave it unfinished */
  if (a.v != a.small) free(a.v);
  return rc;
}

/* A sparse pull reply of STREAM_MIN bytes or more is produced STREAM_CHUNK at a time
 * while the socket drains what is ready (ps__conn_send_produced). */
#define STREAM_MIN ((size_t)16 << 20)
#define STREAM_CHUNK ((size_t)256 << 10)

typedef struct rows_prod {
  table *t;
  const uint8_t *keys;
  uint32_t nkeys, done, chunk;
  float *out;
  int oom;
} rows_prod;

/* Copy the rows of keys [lo, hi) into out (row i at out + i * width), creating the
 * missing ones. A row that cannot be created is written as zeros; returns 1 if any
 * could not, else 0. */
static int copy_rows(table *t, const uint8_t *keys, uint32_t lo, uint32_t hi, float *out) {
  size_t width = t->spec.width;
  float *rows[FIND_BLOCK];
  int oom = 0;
  for (uint32_t b = lo; b < hi; b += FIND_BLOCK) {
    uint32_t n = hi - b < FIND_BLOCK ? hi - b : FIND_BLOCK;
    int added = 0; /* after an insert, the block's rows may have moved (store.h) */
    ps__rowmap_find_many_le(t->params, keys + 8 * (size_t)b, n, rows);
    for (uint32_t i = 0; i < n; i++) {
      float *o = out + (size_t)(b + i) * width;
      added |= !rows[i];
      float *row = rows[i] && !added ? rows[i] : param_row(t, ps__get_u64(keys + 8 * (size_t)(b + i)));
      if (!row) {
        memset(o, 0, width * 4);
        oom = 1;
      } else if (width == 1) {
        *o = *row;
      } else {
        memcpy(o, row, width * 4);
      }
    }
  }
  return oom;
}

/* Copy the next chunk of rows into the reply; returns the bytes final so far. */
static size_t produce_rows(void *arg) {
  rows_prod *p = arg;
  uint32_t end = p->nkeys - p->done < p->chunk ? p->nkeys : p->done + p->chunk;
  p->oom |= copy_rows(p->t, p->keys, p->done, end, p->out);
  p->done = end;
  return (size_t)p->done * p->t->spec.width * 4;
}

/* A pull's reply header. Its clock tells a worker that fell behind a sync:M job where
 * to resume. */
static ps__frame_hdr pull_reply_hdr(ps__server *s, table *t, const ps__frame_hdr *h) {
  int64_t at = is_sync(t) ? t->version * (int64_t)t->spec.every : h->clock;
  if (at > h->clock) {
    /* The worker fast-forwards to `at` on this reply (client.c): it is there now. */
    worker *w = find_worker(s, h->sender);
    if (w && w->alive && w->clock < at) w->clock = at;
  }
  ps__frame_hdr r = {.type = (uint8_t)(h->type | PS_FRAME_REPLY), .req_id = h->req_id, .table = h->table,
                     .clock = at, .epoch = s->epoch};
  return r;
}

/* Answer a pull: dense ranges straight from the rows, sparse rows copied into a pooled
 * buffer (a large one streamed as it fills). */
static void answer_pull(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const void *body, size_t blen) {
  table *t = get_table(s, h->table);
  const uint8_t *keys = body;
  if (!t) {
    reply_err(c, h, PS_ERR_NO_TABLE, "unknown table %u", h->table);
    return;
  }
  unsigned width = t->spec.width;
  int64_t minc, maxc;
  live_clocks(s, &minc, &maxc);
  if (!is_sync(t)) stale_record(s->pull_stale, &s->pull_stale_max, h->clock - minc);
  ps__frame_hdr r = pull_reply_hdr(s, t, h);
  if (t->spec.kind == PS_DENSE) {
    if (send_rows(c, h, keys, blen, t, &r)) {
      reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
      return;
    }
    t->pulls++;
    return;
  }
  size_t len = (size_t)h->nkeys * width * 4;
  float *out = len ? ps__pool_get(s->pool, len) : NULL;
  if (len && !out) {
    reply_err(c, h, PS_ERR_NOMEM, "server out of memory for a %zu-byte reply", len);
    return;
  }
  ps__par *par;
  if ((par = huge_par(s, h->nkeys))) {
    if (pull_huge(s, par, t, keys, h->nkeys, out)) goto oom;
  } else if (len >= STREAM_MIN) {
    /* A large reply goes out while its rows are still being looked up. */
    rows_prod p = {.t = t, .keys = keys, .nkeys = h->nkeys, .out = out,
                   .chunk = (uint32_t)(STREAM_CHUNK / ((size_t)width * 4) + 1)};
    size_t ready = produce_rows(&p);
    uv_buf_t b = uv_buf_init((char *)out, 0);
    b.len = len;
    int st = ps__conn_send_produced(c, &r, &b, 1, ready, produce_rows, &p);
    ps__pool_put(s->pool, out, len); /* what the socket did not take was copied */
    t->pulls++;
    if (p.oom && st == 0) {
      /* Rows that could not be created went out as zeros under status 0: end the
       * connection rather than let the worker use them. */
      ps__log(PS_LOG_ERROR, "out of memory creating rows for a pull of table '%s'; closing the connection", t->decl.name);
      ps__conn_close(c, PS_ERR_NOMEM);
    }
    return;
  } else if (copy_rows(t, keys, 0, h->nkeys, out)) {
    goto oom;
  }
  t->pulls++;
  reply_pooled(s, c, &r, out, len);
  return;
oom:
  ps__pool_put(s->pool, out, len);
  reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
}

/* ---- a sync round applied slice by slice into its waiting peer-memory pulls
 *
 * When a round of a dense table completes, the pulls parked for it would otherwise read
 * every parameter back from memory once per worker after the update wrote it. Instead
 * each slice is updated and at once written into every such pull's buffers while it is
 * in cache (one pass over the parameters instead of K + 1). The values are the same. */

/* Take the parked peer-memory pulls of table t that this round makes ready. */
static pending_pull *take_fusable_pulls(ps__server *s, table *t) {
  pending_pull *head = NULL, **tail = &head, **pp = &s->pulls;
  if (t->spec.kind != PS_DENSE) return NULL;
  while (*pp) {
    pending_pull *p = *pp;
    if (p->h.codec == PS_CODEC_PEER_MEM && p->conn->peer_pid && get_table(s, p->h.table) == t &&
        p->h.clock / (int64_t)t->spec.every == t->version + 1) {
      *pp = p->next;
      p->next = NULL;
      p->fused_err = 0;
      pm_tail q = pm_tail_of(&p->h, p->buf, p->len);
      p->fused_pid = pm_local(s, p->conn, 1, &q, &p->fused_xd);
      *tail = p;
      tail = &p->next;
    } else {
      pp = &p->next;
    }
  }
  return head;
}

/* Does pull p ask for part of slice sl? */
static int pull_covers(const table *t, const pending_pull *p, uint64_t sl) {
  uint64_t width = t->spec.width, lo = sl * width, hi = lo + width;
  const uint8_t *keys = p->buf;
  for (uint32_t i = 0; i + 1 < p->h.nkeys; i += 2) {
    uint64_t off = ps__get_u64(keys + 8 * (size_t)i), cnt = ps__get_u64(keys + 8 * (size_t)(i + 1));
    if (off < hi && off + cnt > lo) return 1;
  }
  return 0;
}

/* Write the part of slice sl (parameters w) that pull p asked for into its buffers. */
static void fused_write(table *t, pending_pull *p, uint64_t sl, const float *w) {
  uint64_t width = t->spec.width, lo = sl * width, hi = lo + width, pos = 0;
  pm_tail q = pm_tail_of(&p->h, p->buf, p->len);
  if (p->fused_xd) q.d = p->fused_xd;
  const uint8_t *keys = p->buf;
  for (uint32_t i = 0; i + 1 < p->h.nkeys && !p->fused_err; i += 2) {
    uint64_t off = ps__get_u64(keys + 8 * (size_t)i), cnt = ps__get_u64(keys + 8 * (size_t)(i + 1));
    uint64_t a = off > lo ? off : lo, b = off + cnt < hi ? off + cnt : hi;
    if (a < b) {
      uv_buf_t l = uv_buf_init((char *)(w + (a - lo)), 0);
      l.len = (size_t)(b - a) * 4;
      int rc = ps__pm_copy(p->fused_pid, 1, &l, 1, q.d, q.nd, (pos + a - off) * 4, q.until);
      if (rc) {
        p->fused_err = rc;
        snprintf(p->fused_msg, sizeof p->fused_msg, "%s", ps_errmsg());
      }
    }
    pos += cnt;
  }
}

/* Apply round r of table t, writing each updated slice into the pulls f at once.
 * 0, or -1 if nothing was done (out of memory: the caller applies it the usual way). */
static int apply_round_fused(table *t, round_acc *r, pending_pull *f) {
  uint64_t width = t->spec.width, nsl = (t->spec.size + width - 1) / width, lo = UINT64_MAX, hi = 0;
  for (pending_pull *p = f; p; p = p->next) {
    const uint8_t *keys = p->buf;
    for (uint32_t i = 0; i + 1 < p->h.nkeys; i += 2) {
      uint64_t off = ps__get_u64(keys + 8 * (size_t)i), cnt = ps__get_u64(keys + 8 * (size_t)(i + 1));
      if (off / width < lo) lo = off / width;
      if ((off + cnt - 1) / width > hi) hi = (off + cnt - 1) / width;
    }
  }
  uint8_t *done = ps__calloc(nsl ? nsl : 1, 1);
  if (!done || lo > hi) {
    free(done);
    return -1;
  }
  apply_flush(t);
  double batch = r->batch_sum / (double)t->spec.every;
  double denom = t->spec.update == PS__UPDATE_MEAN ? batch : 1.0;
  size_t n = ps__rowmap_count(r->acc);
  uint64_t step = 0;
  float lr = n ? apply_begin(t, r->has_lr ? r->lr : -1.0f, batch, &step) : 0.0f;
  int oom = 0;
  for (uint64_t sl = lo; sl <= hi && !oom; sl++) {
    int covered = 0; /* the range may span other servers' slices */
    for (pending_pull *p = f; p && !covered; p = p->next) covered = pull_covers(t, p, sl);
    if (!covered) continue;
    float *g = n ? ps__rowmap_get(r->acc, sl) : NULL;
    if (g && apply_row(t, sl, g, denom, lr, step)) oom = 1;
    done[sl] = 1;
    const float *w = oom ? NULL : param_row(t, sl);
    if (!w) oom = 1;
    for (pending_pull *p = f; p && !oom; p = p->next)
      if (!p->fused_err && pull_covers(t, p, sl)) fused_write(t, p, sl, w);
  }
  for (size_t i = 0; i < n && !oom; i++) { /* slices no pull asked for */
    uint64_t key = ps__rowmap_key_at(r->acc, i);
    if (key < nsl && done[key]) continue;
    if (apply_row(t, key, ps__rowmap_row_at(r->acc, i), denom, lr, step)) oom = 1;
  }
  if (n && !oom) t->applied++;
  for (pending_pull *p = f; p && oom; p = p->next)
    if (!p->fused_err) {
      p->fused_err = PS_ERR_NOMEM;
      snprintf(p->fused_msg, sizeof p->fused_msg, "server out of memory");
    }
  free(done);
  return 0;
}

/* Answer the pulls of a fused round (the table's version counts the round now). */
static void answer_fused_pulls(ps__server *s, table *t, pending_pull *f) {
  while (f) {
    pending_pull *p = f;
    f = p->next;
    free(p->fused_xd);
    p->fused_xd = NULL;
    if (p->fused_err == PS_ERR_UNAVAILABLE) {
      answer_pull(s, p->conn, &p->h, p->buf, p->len); /* not fused, or not permitted after all */
    } else if (p->fused_err) {
      reply_err(p->conn, &p->h, p->fused_err, "%s", p->fused_msg);
    } else {
      ps__frame_hdr r = pull_reply_hdr(s, t, &p->h);
      r.codec = PS_CODEC_PEER_MEM;
      ps__conn_send_ctrl(p->conn, &r, NULL, 0);
      t->pulls++;
      s->pm_pulls++;
      s->fused_pulls++;
    }
    ps__pool_put(s->pool, p->buf, p->len);
    free(p);
  }
}

static void on_pull(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b, int dense) {
  table *t;
  if (check_request(s, c, h, dense ? PS_DENSE : PS_SPARSE, &t)) return;
  if (h->payload_len != 8u * h->nkeys && h->codec != PS_CODEC_PEER_MEM) {
    reply_err(c, h, PS_ERR_SIZE, "pull request carries %llu bytes of values", (unsigned long long)(h->payload_len - 8u * h->nkeys));
    return;
  }
  if (dense) {
    int64_t n = check_segments(s, c, h, t, b->buf);
    if (n < 0) return;
    if (h->codec == PS_CODEC_PEER_MEM) {
      /* The worker's buffers must hold exactly the values asked for. */
      uint64_t total;
      pm_tail q;
      if (pm_tail_checked(c, h, b, &q, &total)) return;
      if (total != 4u * (uint64_t)n) {
        reply_err(c, h, PS_ERR_SIZE, "peer-memory regions of %llu bytes for %lld values", (unsigned long long)total,
                  (long long)n);
        return;
      }
    }
  } else {
    uint32_t i = first_foreign(s, h->table, b->buf, h->nkeys);
    if (i < h->nkeys) {
      reply_err(c, h, PS_ERR_MOVED, "key %llu of table '%s' is not on this server (epoch %llu)",
                (unsigned long long)ps__get_u64((const uint8_t *)b->buf + 8 * (size_t)i), t->decl.name,
                (unsigned long long)s->epoch);
      return;
    }
  }
  if (!s->started || pull_ready(s, t, h->clock)) {
    answer_pull(s, c, h, b->buf, b->len);
    return;
  }
  /* Defer until the table reaches this clock; keep the body. */
  pending_pull *p = ps__malloc(sizeof *p);
  if (!p) {
    reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
    return;
  }
  p->conn = c;
  p->h = *h;
  p->fused_xd = NULL;
  p->buf = b->buf;
  p->len = b->len;
  b->buf = NULL; /* taken */
  p->next = s->pulls;
  s->pulls = p;
}

static void on_clock(ps__server *s, const ps__frame_hdr *h) {
  worker *w = find_worker(s, h->sender);
  if (!w) w = add_worker(s, h->sender, 0, 0);
  if (!w || (!w->alive && !w->pending)) return;
  if (h->clock > w->clock) w->clock = h->clock;
  try_advance(s);
}

static void hist_line(ps__wbuf *w, const char *name, const uint64_t *hist, int64_t max) {
  char line[64];
  int n = snprintf(line, sizeof line, "%s_max %lld\n%s", name, (long long)max, name);
  ps__wbuf_bytes(w, line, (size_t)n);
  int last = STALE_BUCKETS - 1;
  while (last > 0 && !hist[last]) last--;
  for (int i = 0; i <= last; i++) {
    n = snprintf(line, sizeof line, " %llu", (unsigned long long)hist[i]);
    ps__wbuf_bytes(w, line, (size_t)n);
  }
  ps__wbuf_bytes(w, "\n", 1);
}

static void on_stats(ps__server *s, ps__conn *c, const ps__frame_hdr *h) {
  ps__wbuf w;
  char line[384];
  size_t rows = 0, bytes = 0, payload = 0;
  uint64_t dropped = 0;
  static const char *const modes[] = {"sync", "sync:M", "ssp", "async"};
  ps__wbuf_init(&w);
  for (size_t i = 0; i < s->ntables; i++) {
    table *t = s->tables[i];
    if (!t) continue;
    size_t n = ps__rowmap_count(t->params);
    rows += n;
    bytes += ps__rowmap_bytes(t->params);
    payload += n * ps__spec_row_floats(&t->spec) * 4;
    dropped += t->dropped;
    int m = snprintf(line, sizeof line,
                     "table %zu name=%s mode=%s param=%u rows=%zu bytes=%zu pushes=%llu pulls=%llu applied=%llu "
                     "step=%llu version=%lld dropped=%llu rejected=%llu lr=%.9g global_batch=%.0f\n",
                     i, t->decl.name, modes[t->spec.mode & 3], t->spec.mode_param, n, ps__rowmap_bytes(t->params),
                     (unsigned long long)t->pushes, (unsigned long long)t->pulls, (unsigned long long)t->applied,
                     (unsigned long long)t->step, (long long)t->version, (unsigned long long)t->dropped,
                     (unsigned long long)t->rejected, (double)t->last_lr, t->last_batch);
    ps__wbuf_bytes(&w, line, (size_t)m);
  }
  int64_t minc, maxc;
  live_clocks(s, &minc, &maxc);
  int m = snprintf(line, sizeof line,
                   "server %u\nrank %u\nepoch %llu\nmin_clock %lld\nmax_clock %lld\nrows %zu\nstore_bytes %zu\n"
                   "payload_bytes %zu\nrejected_clock %llu\ndropped_pushes %llu\n",
                   s->id, s->rank, (unsigned long long)s->epoch, (long long)minc, (long long)maxc, rows, bytes,
                   payload, (unsigned long long)s->rejected_clock, (unsigned long long)dropped);
  ps__wbuf_bytes(&w, line, (size_t)m);
  m = snprintf(line, sizeof line, "peer_mem_pushes %llu\npeer_mem_pulls %llu\nfused_pulls %llu\n",
               (unsigned long long)s->pm_pushes, (unsigned long long)s->pm_pulls, (unsigned long long)s->fused_pulls);
  ps__wbuf_bytes(&w, line, (size_t)m);
  uint64_t shm_req, shm_mapped, shm_held;
  ps__shm_counts(s->shm, &shm_req, &shm_mapped, &shm_held);
  m = snprintf(line, sizeof line, "shared_requests %llu\nshared_mapped %llu\nshared_held %llu\n",
               (unsigned long long)shm_req, (unsigned long long)shm_mapped, (unsigned long long)shm_held);
  ps__wbuf_bytes(&w, line, (size_t)m);
  hist_line(&w, "push_staleness", s->push_stale, s->push_stale_max);
  hist_line(&w, "pull_staleness", s->pull_stale, s->pull_stale_max);
  ps__frame_hdr r = {.type = PS_MSG_STATS | PS_FRAME_REPLY, .req_id = h->req_id};
  if (!w.oom) ps__conn_send_ctrl(c, &r, w.data, w.len);
  ps__wbuf_free(&w);
}

/* ------------------------------------------------------------------ worker connections */

static int data_on_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  (void)c;
  (void)b;
  switch (h->type) {
  case PS_MSG_CREATE: case PS_MSG_PUSH: case PS_MSG_PULL: case PS_MSG_PUSH_DENSE:
  case PS_MSG_PULL_DENSE: case PS_MSG_CLOCK: case PS_MSG_STATS:
    return 0;
  default:
    return ps__fail(PS_ERR_PROTO, "%s frame not accepted by a server", ps__frame_type_name(h->type));
  }
}

/* A streamed peer-memory push: a sync round's accumulator rows are filled from the
 * worker's buffers directly (the round's first gradient for a slice) or through a
 * cache-sized staging buffer (the others), without a copy of the whole push. */
#define PM_STREAM_MIN ((uint64_t)1 << 20)
#define PM_CHUNK ((size_t)32 << 10)

typedef struct pm_acc_arg {
  ps__server *s;
  ps__rowmap *acc;
  float weight;
  unsigned width;
  int pid;
  pm_tail q;
} pm_acc_arg;

static int pm_read(pm_acc_arg *a, float *dst, uint64_t n, uint64_t pos) {
  uv_buf_t l = uv_buf_init((char *)dst, 0);
  l.len = (size_t)n * 4;
  return ps__pm_copy(a->pid, 0, &l, 1, a->q.d, a->q.nd, pos * 4, a->q.until);
}

/* A colocated worker's gradient (PS_PM_SELF) is added straight from its buffers, which
 * are this process's own: no staging copy. Values [pos, pos + n) of the regions. */
static int pm_self_axpy(pm_acc_arg *a, float *dst, uint64_t n, uint64_t pos) {
  if (a->q.until && ps__now_ms() >= a->q.until) return ps__fail(PS_ERR_TIMEOUT, "peer-memory request expired");
  uint64_t at = pos * 4, done = 0;
  for (size_t i = 0; i < a->q.nd && done < n; i++) {
    uint64_t addr = ps__get_u64(a->q.d + 16 * i), len = ps__get_u64(a->q.d + 16 * i + 8);
    if (at >= len) {
      at -= len;
      continue;
    }
    uint64_t m = (len - at) / 4 < n - done ? (len - at) / 4 : n - done;
    if (m == 0) break;
    ps__axpy(dst + done, a->weight, (const float *)(uintptr_t)(addr + at), m);
    done += m, at = 0;
  }
  return done == n ? 0 : ps__fail(PS_ERR_SIZE, "peer-memory regions shorter than the values");
}

static int pm_acc_slice(void *arg, uint64_t slice, uint64_t within, uint64_t n, uint64_t pos) {
  pm_acc_arg *a = arg;
  int created, rc;
  float *row = ps__rowmap_upsert_uninit(a->acc, slice, &created);
  if (!row) return PS_ERR_NOMEM;
  if (created) {
    acc_row_fresh(row, a->width, within, n);
    if ((rc = pm_read(a, row + within, n, pos))) {
      memset(row + within, 0, n * 4);
      return rc;
    }
    if (a->weight != 1.0f) ps__vscale(row + within, a->weight, n);
    return 0;
  }
  if (a->pid == PS_PM_SELF) return pm_self_axpy(a, row + within, n, pos);
  for (uint64_t k = 0; k < n; k += PM_CHUNK) {
    uint64_t m = n - k < PM_CHUNK ? n - k : PM_CHUNK;
    if ((rc = pm_read(a, a->s->pm_chunk, m, pos + k))) return rc;
    ps__axpy(row + within + k, a->weight, a->s->pm_chunk, m);
  }
  return 0;
}

/* A large peer-memory push to a sync dense table. 0 if handled (answered), 1 if it
 * must be staged instead. The worker's regions are checked against its mappings first,
 * so a bad address fails before any value is added (process_vm_readv would stop part
 * way); only a mapping removed while the push runs (the worker freeing a buffer it
 * is pushing from) can then leave part of it in the round, which is logged. */
static int push_peer_streamed(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const uint8_t *keys, pm_tail q,
                              int pid, uint64_t total) {
  table *t = get_table(s, h->table);
  if (!t || t->spec.kind != PS_DENSE || !is_sync(t) || total < PM_STREAM_MIN) return 1;
  /* Close to its expiry a streamed push could expire part way: the staged path then
   * fails whole instead. */
  if (q.until && ps__now_ms() + 1000 >= q.until) return 1;
  if (!s->pm_chunk && !(s->pm_chunk = ps__malloc(PM_CHUNK * 4))) return 1;
  /* A colocated worker (our own process) names its own live buffers, and a shared
   * buffer's regions were checked when they were looked up (pm_local): nothing to check. */
  int rc = pid == PS_PM_SELF ? 0 : ps__pm_mapped(pid, 0, q.d, q.nd);
  if (rc == PS_ERR_IO) {
    reply_err(c, h, rc, "%s", ps_errmsg());
    return 0;
  }
  if (rc) return 1;
  if (!(t = push_admit(s, c, h, keys, total / 4, 1))) return 0;
  ps__rowmap *acc = round_acc_for(t, c, h);
  if (!acc) return 0;
  pm_acc_arg a = {s, acc, t->spec.update == PS__UPDATE_MEAN ? (float)h->batch : 1.0f, t->spec.width, pid, q};
  if ((rc = walk_slices(keys, h->nkeys, t->spec.width, pm_acc_slice, &a))) {
    if (rc != PS_ERR_NOMEM)
      ps__log(PS_LOG_ERROR, "a push of worker %u to table '%s' failed part way (%s): round %lld may hold part of it",
              h->sender, t->decl.name, ps_errmsg(), (long long)(h->clock / (int64_t)t->spec.every));
    reply_err(c, h, rc, "%s", rc == PS_ERR_NOMEM ? "server out of memory" : ps_errmsg());
    return 0;
  }
  t->pushes++;
  reply_ok(c, h, 0);
  return 0;
}

/* A peer-memory dense push: fetch the values from the worker's buffers into a body of
 * the usual form (segments, then values), then handle it like any push. Nothing is
 * applied unless every value was read. */
static void on_push_peer(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  size_t kbytes = 8u * (size_t)h->nkeys;
  uint64_t total;
  s->pm_pushes++; /* served, or answered with an error */
  if (!c->peer_pid || !ps__pm_usable()) {
    reply_err(c, h, PS_ERR_PROTO, "this server does not take peer-memory pushes on this connection (%s)",
              c->peer_pid ? "peer memory is not usable here" : "not a same-host AF_UNIX socket");
    return;
  }
  pm_tail q;
  if (pm_tail_checked(c, h, b, &q, &total)) return;
  if (total > c->max_payload - kbytes) {
    reply_err(c, h, PS_ERR_TOO_LARGE, "a peer-memory push of %llu bytes exceeds the frame limit",
              (unsigned long long)total);
    return;
  }
  if (total % 4) {
    reply_err(c, h, PS_ERR_SIZE, "a peer-memory push of %llu bytes is not whole floats", (unsigned long long)total);
    return;
  }
  uint8_t *xd;
  int pid = pm_local(s, c, 0, &q, &xd);
  if (!push_peer_streamed(s, c, h, b->buf, q, pid, total)) {
    free(xd);
    return;
  }
  size_t len = kbytes + (size_t)total;
  uint8_t *buf = ps__pool_get(c->pool, len);
  if (!buf) {
    free(xd);
    reply_err(c, h, PS_ERR_NOMEM, "server out of memory for a %zu-byte push", len);
    return;
  }
  memcpy(buf, b->buf, kbytes);
  uv_buf_t dst = uv_buf_init((char *)buf + kbytes, 0);
  dst.len = (size_t)total;
  int rc = pm_copy_par(s, pid, 0, &dst, 1, q);
  free(xd);
  if (rc) {
    ps__pool_put(c->pool, buf, len);
    reply_err(c, h, rc, "%s", ps_errmsg());
    return;
  }
  ps__pool_put(c->pool, b->buf, b->len);
  b->buf = buf;
  b->len = len;
  ps__frame_hdr raw = *h;
  raw.codec = PS_CODEC_RAW;
  raw.payload_len = len;
  on_push(s, c, &raw, b, 1);
}

static void data_dispatch(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b);

static void data_on_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__server *s = c->loop->data;
  if (s->stopping) return;
  s->frames++;
  uint64_t out0 = c->bytes_out + c->write_queue_bytes;
  data_dispatch(s, c, h, b);
  s->poll_extra_ns = ps__poll_extra_ns(h->payload_len + (c->bytes_out + c->write_queue_bytes - out0));
}

static void data_dispatch(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  switch (h->type) {
  case PS_MSG_CREATE: on_create(s, c, h, b); break;
  case PS_MSG_PUSH: on_push(s, c, h, b, 0); break;
  case PS_MSG_PUSH_DENSE:
    if (h->codec == PS_CODEC_PEER_MEM) on_push_peer(s, c, h, b);
    else on_push(s, c, h, b, 1);
    break;
  case PS_MSG_PULL: on_pull(s, c, h, b, 0); break;
  case PS_MSG_PULL_DENSE: on_pull(s, c, h, b, 1); break;
  case PS_MSG_CLOCK: on_clock(s, h); break;
  case PS_MSG_STATS: on_stats(s, c, h); break;
  default: break;
  }
}

static void data_on_close(ps__conn *c, int status) {
  ps__server *s = c->loop->data;
  (void)status;
  drop_pulls_of(s, c);
  ps__shm_forget(s->shm, c);
}

static const ps__conn_ops data_ops = {data_on_header, data_on_frame, data_on_close};

static void on_accept(void *arg, ps__conn *c) { (void)arg; (void)c; }

/* ------------------------------------------------------------------ scheduler link */

static void server_shutdown(ps__server *s, int result);

static void on_membership(ps__server *s, const ps__body *b) {
  ps__membership m;
  if (ps__membership_decode(b->buf, b->len, &m)) {
    ps__log(PS_LOG_ERROR, "bad membership from the scheduler: %s", ps_errmsg());
    return;
  }
  if (m.epoch < s->epoch) {
    ps__membership_clear(&m);
    return;
  }
  uint32_t *ids = ps__calloc(m.n ? m.n : 1, sizeof *ids);
  size_t nsrv = 0;
  if (!ids) {
    ps__membership_clear(&m);
    return;
  }
  uint32_t live_workers = 0;
  for (uint32_t i = 0; i < m.n; i++) {
    ps__member *x = &m.m[i];
    if (x->role == PS_ROLE_SERVER) ids[nsrv++] = x->id; /* dead ones too: their keys are lost, not ours */
    if (x->role != PS_ROLE_WORKER) continue;
    live_workers += x->alive ? 1 : 0;
    worker *w = find_worker(s, x->id);
    if (!w && x->alive) {
      int64_t minc, maxc;
      live_clocks(s, &minc, &maxc);
      w = add_worker(s, x->id, s->started ? minc : 0, 1);
    } else if (w && x->alive && w->pending) { /* the scheduler vouches for it now */
      int64_t minc, maxc;
      live_clocks(s, &minc, &maxc);
      w->pending = 0;
      w->alive = 1;
      if (s->started && w->clock < minc) w->clock = minc;
    }
    if (w && !x->alive && (w->alive || w->pending)) {
      w->pending = 0;
      w->alive = 0;
      ps__log(PS_LOG_INFO, "worker %u left the active set (epoch %llu)", x->id, (unsigned long long)m.epoch);
    }
  }
  ps__ring *ring = nsrv ? ps__ring_new(ids, nsrv, s->o.vnodes, m.epoch) : NULL;
  if (ring) {
    ps__ring_free(s->ring);
    s->ring = ring;
    s->ring_gen++;
  }
  free(ids);
  s->epoch = m.epoch;
  s->started = m.started;
  ps__membership_clear(&m);
  if (s->started == 2) { /* the scheduler finished the job */
    ps__log(PS_LOG_INFO, "the job is finished; stopping");
    server_shutdown(s, 0);
    return;
  }
  if (s->o.stop_without_workers && s->started == 1 && !live_workers) {
    ps__log(PS_LOG_INFO, "every worker has left the job; a colocated server stops");
    server_shutdown(s, 0);
    return;
  }
  try_advance(s);
}

static int sched_on_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  (void)c;
  (void)b;
  if (h->type == (PS_MSG_HELLO | PS_FRAME_REPLY) || h->type == PS_MSG_MEMBERSHIP || h->type == PS_MSG_ERROR) return 0;
  return ps__fail(PS_ERR_PROTO, "unexpected %s frame from the scheduler", ps__frame_type_name(h->type));
}

static void sched_on_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__server *s = c->loop->data;
  if (h->type == (PS_MSG_HELLO | PS_FRAME_REPLY)) {
    if (h->status) {
      ps__log(PS_LOG_ERROR, "registration refused: %s", ps_strerror(h->status));
      server_shutdown(s, h->status);
      return;
    }
    s->id = h->table;
    s->rank = h->batch;
    uv_timer_stop(&s->connect_timer);
    ps__log(PS_LOG_INFO, "registered as server %u (rank %u)", s->id, s->rank);
  } else if (h->type == PS_MSG_MEMBERSHIP) {
    on_membership(s, b);
  } else if (h->type == PS_MSG_ERROR) {
    ps__log(PS_LOG_ERROR, "scheduler: %.*s", (int)b->len, b->buf ? (const char *)b->buf : "");
  }
}

static void sched_on_close(ps__conn *c, int status) {
  ps__server *s = c->loop->data;
  s->sched = NULL;
  if (!s->stopping) {
    ps__log(PS_LOG_ERROR, "lost the scheduler (%s); stopping", ps_strerror(status));
    server_shutdown(s, PS_ERR_UNAVAILABLE);
  }
}

static const ps__conn_ops sched_link_ops = {sched_on_header, sched_on_frame, sched_on_close};

static void hb_tick(uv_timer_t *t) {
  ps__server *s = t->data;
  ps__shm_sweep(s->shm); /* workers' buffers they freed */
  if (!s->sched) return;
  ps__frame_hdr h = {.type = PS_MSG_HEARTBEAT, .sender = s->id};
  ps__conn_send_ctrl(s->sched, &h, NULL, 0);
}

static void connect_timeout(uv_timer_t *t) {
  ps__server *s = t->data;
  ps__log(PS_LOG_ERROR, "could not register with the scheduler at %s:%d in time", s->o.sched_host, s->o.sched_port);
  server_shutdown(s, PS_ERR_TIMEOUT);
}

static void sched_connect(ps__server *s);

static void retry_tick(uv_timer_t *t) { sched_connect(t->data); }

static void on_sched_connected(void *arg, ps__conn *c, int status) {
  ps__server *s = arg;
  if (status) {
    /* The scheduler may not listen yet (launchers start every rank at once): retry
     * until connect_timeout_ms, after which connect_timeout() gives up. */
    if (status == PS_ERR_UNAVAILABLE && !s->stopping) {
      uv_timer_start(&s->retry_timer, retry_tick, 200, 0);
      return;
    }
    ps__log(PS_LOG_ERROR, "cannot reach the scheduler at %s:%d: %s", s->o.sched_host, s->o.sched_port,
            ps_strerror(status));
    server_shutdown(s, status);
    return;
  }
  if (s->stopping) {
    ps__conn_close(c, 0);
    return;
  }
  s->sched = c;
  ps__hello hello;
  ps__wbuf w;
  memset(&hello, 0, sizeof hello);
  hello.role = PS_ROLE_SERVER;
  hello.port = (uint16_t)s->tcp.port;
  hello.pid = (uint32_t)getpid();
  snprintf(hello.host, sizeof hello.host, "%s", s->o.host);
  snprintf(hello.unix_path, sizeof hello.unix_path, "%s", s->unix_path);
  ps__hostid(hello.hostid, sizeof hello.hostid);
  if (s->unix_path[0] && ps__pm_usable()) hello.caps |= PS_CAP_PEER_MEM;
  ps__wbuf_init(&w);
  ps__hello_encode(&w, &hello);
  ps__frame_hdr h = {.type = PS_MSG_HELLO, .req_id = 1};
  if (w.oom || ps__conn_send_ctrl(c, &h, w.data, w.len)) server_shutdown(s, PS_ERR_NOMEM);
  ps__wbuf_free(&w);
  uv_timer_start(&s->hb_timer, hb_tick, s->o.heartbeat_ms, s->o.heartbeat_ms);
}

/* ------------------------------------------------------------------ lifecycle */

static void walk_close(uv_handle_t *h, void *arg) {
  ps__server *s = arg;
  if (uv_is_closing(h)) return;
  if (h == &s->tcp.h.handle || h == &s->unix_l.h.handle) return;
  if (h->type == UV_TCP || h->type == UV_NAMED_PIPE) {
    ps__conn_close(h->data, 0);
    return;
  }
  if (h->type == UV_ASYNC) return;
  uv_close(h, NULL);
}

static void server_shutdown(ps__server *s, int result) {
  if (s->stopping) return;
  s->stopping = 1;
  s->result = result;
  if (s->sched && result == 0) { /* a requested stop: leave the job cleanly */
    ps__frame_hdr h = {.type = PS_MSG_LEAVE, .sender = s->id};
    ps__conn_send_ctrl(s->sched, &h, NULL, 0);
    ps__conn_close_after_flush(s->sched, 0);
  }
  ps__listener_close(&s->tcp);
  if (s->unix_path[0]) ps__listener_close(&s->unix_l);
  uv_walk(&s->loop, walk_close, s);
  if (s->mail) ps__mailbox_close(s->mail);
  s->mail = NULL;
}

static void do_stop(void *arg) { server_shutdown(arg, 0); }

int ps__server_create(const ps__server_opts *o, ps__server **out) {
  ps__server *s = ps__calloc(1, sizeof *s);
  int rc;
  if (!s) return ps__fail(PS_ERR_NOMEM, "out of memory");
  s->o = *o;
  s->pid = (int)getpid();
  s->ring_gen = 1;
  if (!s->o.host) s->o.host = "127.0.0.1";
  if (!s->o.heartbeat_ms) s->o.heartbeat_ms = 200;
  if (!s->o.vnodes) s->o.vnodes = 128;
  if (!s->o.max_payload) s->o.max_payload = 2048ull << 20;
  if (!s->o.connect_timeout_ms) s->o.connect_timeout_ms = 60000;
  uv_loop_init(&s->loop);
  s->loop.data = s;
  s->pool = ps__pool_new(1ull << 30);
  s->mail = ps__mailbox_new(&s->loop);
  uv_timer_init(&s->loop, &s->hb_timer);
  s->hb_timer.data = s;
  uv_idle_init(&s->loop, &s->apply_idle);
  s->apply_idle.data = s;
  uv_timer_init(&s->loop, &s->connect_timer);
  s->connect_timer.data = s;
  if (!s->pool || !s->mail) {
    rc = ps__fail(PS_ERR_NOMEM, "out of memory");
    goto fail;
  }
  rc = ps__listen_tcp(&s->tcp, &s->loop, s->o.host, s->o.port, &data_ops, on_accept, s, s->pool, s->o.max_payload);
  if (rc) goto fail;
  if (s->o.use_unix) {
    static int seq;
    snprintf(s->unix_path, sizeof s->unix_path, "/tmp/pshard-%d-%d-%d.sock", (int)getpid(), s->tcp.port,
             __atomic_fetch_add(&seq, 1, __ATOMIC_RELAXED));
    if (ps__listen_unix(&s->unix_l, &s->loop, s->unix_path, &data_ops, on_accept, s, s->pool, s->o.max_payload)) {
      ps__log(PS_LOG_WARN, "no AF_UNIX listener: %s", ps_errmsg());
      s->unix_path[0] = '\0';
    }
  }
  rc = ps__connect_tcp(&s->loop, s->o.sched_host, s->o.sched_port, &sched_link_ops, s, s->pool, 1u << 24,
                       on_sched_connected, s);
  if (rc) goto fail;
  uv_timer_init(&s->loop, &s->retry_timer);
  s->retry_timer.data = s;
  uv_timer_start(&s->connect_timer, connect_timeout, s->o.connect_timeout_ms, 0);
  *out = s;
  return 0;
fail: {
  char msg[512];
  snprintf(msg, sizeof msg, "%s", ps_errmsg());
  server_shutdown(s, rc);
  ps__server_destroy(s);
  return ps__fail(rc, "%s", msg);
}
}

static void sched_connect(ps__server *s) {
  if (s->stopping) return;
  if (ps__connect_tcp(&s->loop, s->o.sched_host, s->o.sched_port, &sched_link_ops, s, s->pool, 1u << 24,
                      on_sched_connected, s)) {
    ps__log(PS_LOG_ERROR, "cannot connect to the scheduler: %s", ps_errmsg());
    server_shutdown(s, PS_ERR_UNAVAILABLE);
  }
}

int ps__server_port(const ps__server *s) { return s->tcp.port; }

/* With poll_us, the loop does not sleep for poll_us after a worker's frame: it polls
 * (epoll with no wait). A worker's next request usually follows within that (the other
 * half of a push and pull, the next batch), and a server asleep on an idle virtual CPU
 * pays the hypervisor's wake-up for it: tens of microseconds, several loopback round
 * trips. A frame that brought or answered with many bytes over the socket extends the
 * window by the time the worker needs for them (ps__poll_extra_ns: 0.5 ms per MiB, at
 * most 1 ms): a worker reading a 1 MiB reply sends its next request only after that.
 * A busy server never sleeps anyway; an idle one polls once per burst. */
int ps__server_run(ps__server *s) {
  ps__block_sigpipe();
  uint64_t poll_ns = (uint64_t)s->o.poll_us * 1000u;
  if (poll_ns == 0 || sysconf(_SC_NPROCESSORS_ONLN) < 2) {
    uv_run(&s->loop, UV_RUN_DEFAULT);
    return s->result;
  }
  uint64_t seen = s->frames, last = 0;
  for (;;) {
    int more = uv_run(&s->loop, ps__now_ns() - last < poll_ns + s->poll_extra_ns ? UV_RUN_NOWAIT : UV_RUN_ONCE);
    if (!more) break;
    if (s->frames != seen) {
      seen = s->frames;
      last = ps__now_ns();
    }
  }
  return s->result;
}

void ps__server_stop(ps__server *s) {
  if (s && s->mail) ps__mailbox_post(s->mail, do_stop, s);
}

void ps__server_destroy(ps__server *s) {
  if (!s) return;
  server_shutdown(s, s->result);
  uv_run(&s->loop, UV_RUN_DEFAULT);
  uv_loop_close(&s->loop);
  while (s->pulls) {
    pending_pull *p = s->pulls;
    s->pulls = p->next;
    ps__pool_put(s->pool, p->buf, p->len);
    free(p);
  }
  for (size_t i = 0; i < s->ntables; i++) table_free(s->tables[i]);
  free(s->tables);
  free(s->workers);
  ps__ring_free(s->ring);
  ps__pool_free(s->pool);
  ps__par_free(s->par);
  free(s->pm_chunk);
  ps__shm_cache_free(s->shm);
  free(s);
}
