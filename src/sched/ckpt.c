/*
 * ckpt.c - the scheduler's side of checkpoints (docs/checkpoint.md): taking one on a
 * CHECKPOINT request, and resuming a job from one at create.
 *
 * Taking: at most one checkpoint at a time. A request gets a new id (1 + the largest
 * ckpt-<id> in the checkpoint directory, or in the directory the request named) and
 * its directory. With clock -1 the
 * scheduler first probes every live server (CKPT with id 0) for the smallest clock it
 * can still cut at and takes the largest, plus a margin, so that workers running ahead
 * while the requests travel do not overtake it. Then every server gets CKPT {id, clock}
 * and writes its shard in the background; the scheduler collects the answers (a
 * deadline, a server's death or error fails the whole checkpoint, and the requester
 * gets that error with the server named). Then the scheduler reads the TABLE blocks
 * of the servers' files back for the rows of each sparse table (the manifest carries
 * their totals). The task state goes into the checkpoint as
 * it is when the cut is sent: a partition finished later may have pushes the servers'
 * cut does not hold, so it counts as not done. Once every server answered, the
 * scheduler writes the MANIFEST (the registry's TABLE blocks, one FILE block per
 * server, that STATE block): only then does the checkpoint exist. Older ones in the
 * job's checkpoint directory are pruned (a directory a request named is left as it
 * is), then the requester is answered. The manifest is small, so it is written on the
 * loop thread.
 *
 * Restoring: the newest complete checkpoint of the restore directory (or the
 * checkpoint the directory is) gives the table registry (ids kept), the clock the job
 * resumes at (the HELLO reply's clock) and the task state, applied at the first
 * TASK_INIT with the same counts when some epoch was left (a finished schedule, or
 * other counts, start the tasks afresh).
 *
 * Threads: the scheduler's loop thread only.
 */
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sched/sched_int.h"
#include "store/ckpt.h"

#define STATE_MAGIC 0x54535350u /* "PSST" */
#define STATE_VERSION 1u
#define STATE_MAX_PARTS (1u << 24) /* as TASK_INIT allows */

/* ------------------------------------------------------------ the STATE block */

void ps__sched_state_encode(ps__wbuf *w, int64_t clock, const ps__sched_tasks *t) {
  ps__wbuf_u32(w, STATE_MAGIC);
  ps__wbuf_u32(w, STATE_VERSION);
  ps__wbuf_u64(w, (uint64_t)clock);
  ps__wbuf_u8(w, t && t->init ? 1 : 0);
  if (!t || !t->init) return;
  ps__wbuf_u32(w, t->parts);
  ps__wbuf_u32(w, t->epochs);
  ps__wbuf_u32(w, t->epoch);
  for (uint32_t p = 0; p < t->parts; p += 8) {
    uint8_t byte = 0;
    for (uint32_t j = 0; j < 8 && p + j < t->parts; j++)
      if (t->state[p + j] == PS__TASK_DONE) byte |= (uint8_t)(1u << j);
    ps__wbuf_u8(w, byte);
  }
}

int ps__sched_state_decode(const void *buf, size_t n, int64_t *clock, ps__sched_task_restore *r) {
  ps__rbuf rb;
  memset(r, 0, sizeof *r);
  ps__rbuf_init(&rb, buf, n);
  uint32_t magic = ps__rbuf_u32(&rb), version = ps__rbuf_u32(&rb);
  int64_t c = (int64_t)ps__rbuf_u64(&rb);
  uint8_t have = ps__rbuf_u8(&rb);
  if (rb.err || magic != STATE_MAGIC) return ps__fail(PS_ERR_IO, "the scheduler state block is malformed");
  if (version != STATE_VERSION)
    return ps__fail(PS_ERR_IO, "the scheduler state block has version %u (this build reads %u)", version, STATE_VERSION);
  if (have > 1) return ps__fail(PS_ERR_IO, "the scheduler state block is malformed (tasks flag %u)", have);
  if (have) {
    r->parts = ps__rbuf_u32(&rb);
    r->epochs = ps__rbuf_u32(&rb);
    r->epoch = ps__rbuf_u32(&rb);
    if (rb.err || r->parts == 0 || r->parts > STATE_MAX_PARTS || r->epochs == 0 || r->epoch > r->epochs)
      return ps__fail(PS_ERR_IO, "the scheduler state block has bad task counts");
    if (rb.len - rb.off != (r->parts + 7u) / 8u)
      return ps__fail(PS_ERR_IO, "the scheduler state block's partition bits are %zu bytes, not %u", rb.len - rb.off,
                      (r->parts + 7u) / 8u);
    r->done = ps__calloc(r->parts, 1);
    if (!r->done) return ps__fail(PS_ERR_NOMEM, "out of memory");
    for (uint32_t p = 0; p < r->parts; p++) r->done[p] = (rb.p[rb.off + p / 8] >> (p % 8)) & 1u;
    rb.off = rb.len;
    r->have = 1;
  }
  if (rb.off != rb.len) {
    free(r->done);
    memset(r, 0, sizeof *r);
    return ps__fail(PS_ERR_IO, "the scheduler state block has %zu bytes too many", rb.len - rb.off);
  }
  *clock = c;
  return 0;
}

/* ------------------------------------------------------------ the directory */

int ps__sched_ckpt_next_id(const char *dir, uint64_t *id) {
  DIR *d = opendir(dir);
  uint64_t best = 0;
  *id = 1;
  if (!d) {
    if (errno == ENOENT) return 0;
    return ps__fail(PS_ERR_IO, "cannot read checkpoint directory %s: %s", dir, strerror(errno));
  }
  struct dirent *e;
  while ((e = readdir(d))) {
    uint64_t v;
    if (strncmp(e->d_name, "ckpt-", 5) || ps__parse_u64(e->d_name + 5, &v)) continue;
    if (v > best) best = v;
  }
  closedir(d);
  if (best == UINT64_MAX) return ps__fail(PS_ERR_IO, "checkpoint directory %s: no checkpoint id left", dir);
  *id = best + 1;
  return 0;
}

/* ------------------------------------------------------------ answering */

static ps__sched_node *node_by_id(ps__sched *s, uint32_t id) {
  for (size_t i = 0; i < s->nnodes; i++)
    if (s->nodes[i].m.id == id) return &s->nodes[i];
  return NULL;
}

/* An error to a requester: an error frame, or a log line for a fire-and-forget one. */
static void answer_error(ps__conn *c, uint64_t req_id, int64_t clock, int status, const char *msg) {
  if (!req_id || !c) {
    ps__log(PS_LOG_WARN, "checkpoint request failed: %s", msg);
    return;
  }
  ps__frame_hdr req = {.type = PS_MSG_CHECKPOINT, .req_id = req_id, .clock = clock};
  ps__conn_send_error(c, &req, status, msg);
}

static void reset(ps__sched *s) {
  ps__sched_ckpt *k = &s->ck;
  uv_timer_stop(&k->deadline);
  free(k->parts);
  k->parts = NULL;
  free(k->state);
  k->state = NULL;
  k->state_len = 0;
  k->nparts = k->nanswered = 0;
  k->requester = NULL;
  k->requester_req = 0;
  k->phase = PS__CKPT_IDLE;
}

/* Fail the checkpoint in progress: the requester gets status and the message. */
static void fail(ps__sched *s, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void fail(ps__sched *s, int status, const char *fmt, ...) {
  ps__sched_ckpt *k = &s->ck;
  char msg[1024];
  int n = snprintf(msg, sizeof msg, "checkpoint %llu failed: ", (unsigned long long)k->id);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg + n, sizeof msg - (size_t)n, fmt, ap);
  va_end(ap);
  ps__log(PS_LOG_WARN, "%s", msg);
  k->failed++;
  if (k->requester && k->requester_req) answer_error(k->requester, k->requester_req, k->clock, status, msg);
  reset(s);
}

/* A server that neither answered nor said it progressed within the deadline fails the
 * checkpoint; else the timer waits for the earliest of their deadlines. */
static void on_deadline(uv_timer_t *t) {
  ps__sched *s = t->data;
  ps__sched_ckpt *k = &s->ck;
  uint64_t now = ps__now_ms(), next = 0;
  for (uint32_t i = 0; i < k->nparts; i++) {
    if (k->parts[i].answered) continue;
    uint64_t due = k->parts[i].word_ms + s->o.checkpoint_timeout_ms;
    if (due <= now) {
      fail(s, PS_ERR_TIMEOUT, "server rank %u did not answer within %.1f s, nor say it got on with writing",
           k->parts[i].rank, s->o.checkpoint_timeout_ms / 1000.0);
      return;
    }
    if (!next || due < next) next = due;
  }
  if (next) uv_timer_start(&k->deadline, on_deadline, next - now, 0);
}

/* Send every part its CKPT (id 0 for the probe). 0, or fails the checkpoint. */
static int send_all(ps__sched *s, uint64_t id) {
  ps__sched_ckpt *k = &s->ck;
  ps__ckpt_req q;
  memset(&q, 0, sizeof q);
  q.id = id;
  q.clock = k->clock;
  q.nservers = k->nparts;
  snprintf(q.dir, sizeof q.dir, "%s", k->dir);
  q.base = k->base;
  q.track = s->o.checkpoint_full_every > 1;
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__ckpt_req_encode(&w, &q); /* the last u32 is the part: set per server below */
  if (w.oom || w.len < 4) {
    ps__wbuf_free(&w);
    fail(s, PS_ERR_NOMEM, "scheduler out of memory");
    return -1;
  }
  if (id) {
    /* The task state of the cut: what is done now has its pushes acknowledged before
     * the servers get the request. */
    ps__wbuf sb;
    ps__wbuf_init(&sb);
    ps__sched_state_encode(&sb, k->clock, &s->tk);
    if (sb.oom) {
      ps__wbuf_free(&w);
      ps__wbuf_free(&sb);
      fail(s, PS_ERR_NOMEM, "scheduler out of memory");
      return -1;
    }
    free(k->state);
    k->state = sb.data; /* taken from the buffer: freed by reset */
    k->state_len = sb.len;
  }
  k->nanswered = 0;
  for (uint32_t i = 0; i < k->nparts; i++) {
    ps__ckpt_part *p = &k->parts[i];
    ps__sched_node *n = node_by_id(s, p->node);
    p->answered = 0;
    p->word_ms = ps__now_ms();
    p->req_id = ++k->next_req;
    ps__frame_hdr h = {.type = PS_MSG_CKPT, .req_id = p->req_id, .clock = k->clock, .epoch = s->epoch};
    ps__put_u32((uint8_t *)w.data + w.len - 4, i);
    int rc = n && n->conn ? ps__conn_send_ctrl(n->conn, &h, w.data, w.len) : PS_ERR_CLOSED;
    if (rc) {
      ps__wbuf_free(&w);
      fail(s, PS_ERR_UNAVAILABLE, "cannot send the request to server rank %u: %s", p->rank, ps_strerror(rc));
      return -1;
    }
  }
  ps__wbuf_free(&w);
  return 0;
}

static uint64_t wall_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static int skip_rows(void *arg, uint32_t table, uint64_t lo, uint64_t hi) {
  (void)arg, (void)table, (void)lo, (void)hi;
  return 0;
}

/* The rows of each sparse table over the servers' files, into nrows (one per registry
 * table): a server's answer counts only its file's rows in all, and the manifest's
 * TABLE block carries the table's total. Reads the files' TABLE blocks, skipping the
 * ROWS blocks by their descriptors (a few bytes a block). 0, or an error with a
 * message naming the file. */
static int sparse_rows(ps__sched *s, uint64_t *nrows, uint8_t *seen) {
  ps__sched_ckpt *k = &s->ck;
  for (uint32_t i = 0; i < k->nparts; i++) {
    char path[PS_CKPT_DIR_MAX + 80];
    snprintf(path, sizeof path, "%s/%s", k->dir, k->parts[i].done.name);
    ps__ckpt_reader *r = NULL;
    ps__ckpt_header hd;
    int rc = ps__ckpt_reader_open(&r, path, &hd);
    while (!rc) {
      ps__ckpt_block b;
      if ((rc = ps__ckpt_next(r, &b, skip_rows, NULL)) != 0 || b.kind == PS_CKPT_B_END) break;
      if (b.kind != PS_CKPT_B_TABLE) continue;
      for (size_t t = 0; t < s->ntables; t++)
        if (s->tables[t].d.id == b.table.decl.id) {
          seen[t] = 1;
          if (b.table.decl.kind == PS_SPARSE) nrows[t] += b.table.nrows;
        }
    }
    ps__ckpt_reader_close(r);
    if (rc) return rc;
  }
  return 0;
}

/* Every server answered: write the manifest, prune, answer. */
static void finish(ps__sched *s) {
  ps__sched_ckpt *k = &s->ck;
  char path[PS_CKPT_DIR_MAX + 16];
  uint64_t *nrows = ps__calloc(s->ntables + 1, sizeof *nrows);
  uint8_t *seen = ps__calloc(s->ntables + 1, 1);
  if (!nrows || !seen) {
    free(nrows);
    free(seen);
    fail(s, PS_ERR_NOMEM, "scheduler out of memory");
    return;
  }
  if (sparse_rows(s, nrows, seen)) {
    char err[512];
    snprintf(err, sizeof err, "%s", ps_errmsg());
    free(nrows);
    free(seen);
    fail(s, PS_ERR_IO, "cannot read the servers' files back: %s", err);
    return;
  }
  snprintf(path, sizeof path, "%s/MANIFEST", k->dir);
  /* An increment unless every server wrote its whole shard (it could not build on the
   * base: restarted since, or its last write failed). */
  uint64_t base = 0;
  for (uint32_t i = 0; i < k->nparts; i++)
    if (k->parts[i].done.base) base = k->base;
  ps__ckpt_header hd = {.what = PS_CKPT_MANIFEST, .id = k->id, .clock = k->clock, .rank = 0,
                        .nservers = k->nparts, .created_ms = wall_ms(), .base = base};
  ps__ckpt_writer *w = NULL;
  int rc = ps__ckpt_writer_open(&w, path, &hd);
  /* The tables the servers cut: one declared while the checkpoint was asked for, and
   * created on the servers after it, is in no file and not in the manifest either. */
  for (size_t i = 0; !rc && i < s->ntables; i++) {
    if (!seen[i]) continue;
    ps__ckpt_table t;
    memset(&t, 0, sizeof t);
    t.decl = s->tables[i].d;
    const ps__table_spec *sp = &s->tables[i].spec;
    t.width = sp->width;
    t.row_floats = (uint32_t)ps__spec_row_floats(sp);
    /* A dense table is written whole: its slices, over all files; a sparse table has
     * the rows its servers wrote. Step and version are the servers' (in their files). */
    t.nrows = sp->kind == PS_DENSE ? sp->nrows : nrows[i];
    rc = ps__ckpt_write_table(w, &t);
  }
  free(nrows);
  free(seen);
  uint64_t bytes = 0, rows = 0;
  for (uint32_t i = 0; !rc && i < k->nparts; i++) {
    const ps__ckpt_done *d = &k->parts[i].done;
    ps__ckpt_file f;
    memset(&f, 0, sizeof f);
    snprintf(f.name, sizeof f.name, "%s", d->name);
    f.rank = d->rank;
    f.bytes = d->bytes;
    f.checksum = d->checksum;
    f.rows = d->rows;
    bytes += d->bytes;
    rows += d->rows;
    rc = ps__ckpt_write_file(w, &f);
  }
  if (!rc) rc = ps__ckpt_write_state(w, k->state, k->state_len);
  ps__ckpt_summary sum = {0};
  char err[512] = "";
  if (rc) snprintf(err, sizeof err, "%s", ps_errmsg());
  int crc = ps__ckpt_writer_close(w, rc == 0, &sum);
  if (!rc && crc) {
    rc = crc;
    snprintf(err, sizeof err, "%s", ps_errmsg());
  }
  if (rc) {
    fail(s, rc, "cannot write the manifest %s: %s", path, err);
    return;
  }
  bytes += sum.bytes;
  uint64_t ms = ps__now_ms() - k->started_ms;
  ps__log(PS_LOG_INFO, "checkpoint %llu complete%s: clock %lld, %u servers, %llu rows, %llu bytes, %llu ms in %s",
          (unsigned long long)k->id, base ? " (an increment)" : "", (long long)k->clock, k->nparts,
          (unsigned long long)rows, (unsigned long long)bytes, (unsigned long long)ms, k->dir);
  k->taken++;
  int in_root = !strcmp(k->into, k->root);
  if (in_root) { /* increments chain within the job's directory only */
    k->last_id = k->id;
    k->since_full = base ? k->since_full + 1 : 0;
  }
  if (in_root && ps__ckpt_prune(k->root, s->o.checkpoint_keep))
    ps__log(PS_LOG_WARN, "checkpoint %llu: cannot prune old checkpoints: %s", (unsigned long long)k->id, ps_errmsg());
  if (k->requester && k->requester_req) {
    ps__ckpt_info info;
    memset(&info, 0, sizeof info);
    info.id = k->id;
    snprintf(info.dir, sizeof info.dir, "%s", k->dir);
    ps__wbuf ib;
    ps__wbuf_init(&ib);
    ps__ckpt_info_encode(&ib, &info);
    ps__frame_hdr r = {.type = PS_MSG_CHECKPOINT | PS_FRAME_REPLY, .req_id = k->requester_req, .clock = k->clock};
    if (!ib.oom) ps__conn_send_ctrl(k->requester, &r, ib.data, ib.len);
    ps__wbuf_free(&ib);
  }
  reset(s);
}

/* ------------------------------------------------------------ requests and replies */

/* The directory a request named (its body `str dir`), made if missing (one level),
 * made absolute into out. 0, or an error code with the message in msg. */
static int named_dir(const ps__body *b, char *out, size_t cap, char *msg, size_t mcap) {
  char d[PS_CKPT_DIR_MAX], abs[PATH_MAX];
  ps__rbuf rb;
  ps__rbuf_init(&rb, b->buf, b->len);
  ps__rbuf_str(&rb, d, sizeof d);
  if (rb.err || rb.off != rb.len || !d[0]) {
    snprintf(msg, mcap, "a checkpoint request's body is one directory name (1..%d bytes)", PS_CKPT_DIR_MAX - 1);
    return PS_ERR_INVALID;
  }
  if (mkdir(d, 0755) != 0 && errno != EEXIST) {
    snprintf(msg, mcap, "cannot create checkpoint directory %s: %s", d, strerror(errno));
    return PS_ERR_IO;
  }
  struct stat st;
  if (!realpath(d, abs) || stat(abs, &st) != 0) {
    snprintf(msg, mcap, "checkpoint directory %s: %s", d, strerror(errno));
    return PS_ERR_IO;
  }
  if (!S_ISDIR(st.st_mode)) {
    snprintf(msg, mcap, "checkpoint directory %s is not a directory", d);
    return PS_ERR_IO;
  }
  /* The request to a server carries DIR/ckpt-<id>: leave room for the suffix. */
  if (strlen(abs) + 32 >= cap) {
    snprintf(msg, mcap, "checkpoint directory path too long: %.900s", abs);
    return PS_ERR_INVALID;
  }
  snprintf(out, cap, "%s", abs);
  return 0;
}

void ps__sched_ckpt_request(ps__sched *s, ps__conn *c, const ps__frame_hdr *h, const ps__body *b) {
  ps__sched_ckpt *k = &s->ck;
  char msg[PS_CKPT_DIR_MAX + 256], into[PS_CKPT_DIR_MAX];
  int named = b && b->buf && b->len > 0;
  if (!named && !k->root[0]) {
    answer_error(c, h->req_id, h->clock, PS_ERR_CONFIG,
                 "the job has no checkpoint directory (start the scheduler with --checkpoint-dir DIR)");
    return;
  }
  if (k->phase != PS__CKPT_IDLE) {
    snprintf(msg, sizeof msg, "a checkpoint is being taken (checkpoint %llu)", (unsigned long long)k->id);
    answer_error(c, h->req_id, h->clock, PS_ERR_UNAVAILABLE, msg);
    return;
  }
  if (h->clock < -1) {
    answer_error(c, h->req_id, h->clock, PS_ERR_INVALID, "a checkpoint clock is -1 (any) or at least 0");
    return;
  }
  size_t alive = ps__sched_count_alive(s, PS_ROLE_SERVER);
  if (alive == 0) {
    answer_error(c, h->req_id, h->clock, PS_ERR_UNAVAILABLE, "no server is alive");
    return;
  }
  if (!s->started || (alive < s->nserver_ranks && !ps__sched_every_range_live(s))) {
    /* A missing server's shard would be missing from the checkpoint (unless, replicated,
     * the live servers head all of its ranges: they write them). */
    for (size_t i = 0; i < s->nnodes; i++) {
      const ps__member *m = &s->nodes[i].m;
      if (m->role != PS_ROLE_SERVER || m->alive) continue;
      snprintf(msg, sizeof msg, "server rank %u has left the job: its shard cannot be checkpointed", m->rank);
      answer_error(c, h->req_id, h->clock, PS_ERR_UNAVAILABLE, msg);
      return;
    }
    snprintf(msg, sizeof msg, "the job has not started (%zu of %u servers registered)", alive, s->o.servers);
    answer_error(c, h->req_id, h->clock, PS_ERR_UNAVAILABLE, msg);
    return;
  }
  if (named) {
    int rc = named_dir(b, into, sizeof into, msg, sizeof msg);
    if (rc) {
      answer_error(c, h->req_id, h->clock, rc, msg);
      return;
    }
  } else {
    snprintf(into, sizeof into, "%s", k->root);
  }
  uint64_t id;
  if (ps__sched_ckpt_next_id(into, &id)) {
    answer_error(c, h->req_id, h->clock, PS_ERR_IO, ps_errmsg());
    return;
  }
  char dir[PS_CKPT_DIR_MAX];
  ps__ckpt_dir_of(into, id, dir, sizeof dir);
  if (mkdir(dir, 0755) != 0) {
    snprintf(msg, sizeof msg, "cannot create %s: %s", dir, strerror(errno));
    answer_error(c, h->req_id, h->clock, PS_ERR_IO, msg);
    return;
  }
  k->parts = ps__calloc(alive, sizeof *k->parts);
  if (!k->parts) {
    rmdir(dir);
    answer_error(c, h->req_id, h->clock, PS_ERR_NOMEM, "scheduler out of memory");
    return;
  }
  k->nparts = 0;
  for (size_t i = 0; i < s->nnodes; i++) {
    const ps__member *m = &s->nodes[i].m;
    if (m->role != PS_ROLE_SERVER || !m->alive) continue;
    k->parts[k->nparts].node = m->id;
    k->parts[k->nparts].rank = m->rank;
    k->nparts++;
  }
  k->id = id;
  snprintf(k->into, sizeof k->into, "%s", into);
  /* Whole every checkpoint_full_every, else an increment on the last one taken in the
   * job's directory (a checkpoint into a directory of the caller's is always whole). */
  k->base = s->o.checkpoint_full_every > 1 && k->last_id && k->since_full + 1 < s->o.checkpoint_full_every &&
                    !strcmp(k->into, k->root)
                ? k->last_id : 0;
  snprintf(k->dir, sizeof k->dir, "%s", dir);
  k->requester = c;
  k->requester_req = h->req_id;
  k->started_ms = ps__now_ms();
  k->clock = h->clock;
  k->phase = h->clock < 0 ? PS__CKPT_PROBING : PS__CKPT_CUTTING;
  ps__log(PS_LOG_INFO, "checkpoint %llu: %s %u servers (clock %lld)", (unsigned long long)id,
          k->phase == PS__CKPT_PROBING ? "probing" : "asking", k->nparts, (long long)h->clock);
  uv_timer_start(&k->deadline, on_deadline, s->o.checkpoint_timeout_ms, 0);
  send_all(s, k->phase == PS__CKPT_PROBING ? 0 : id);
}

void ps__sched_ckpt_reply(ps__sched *s, ps__sched_node *n, const ps__frame_hdr *h, const ps__body *b) {
  ps__sched_ckpt *k = &s->ck;
  ps__ckpt_part *p = NULL;
  for (uint32_t i = 0; k->phase != PS__CKPT_IDLE && i < k->nparts; i++)
    if (k->parts[i].node == n->m.id && k->parts[i].req_id == h->req_id && !k->parts[i].answered) p = &k->parts[i];
  if (!p) return; /* the answer to a checkpoint that already failed */
  p->word_ms = ps__now_ms();
  if (h->flags & PS_FLAG_PROGRESS) return; /* still writing, and getting on: its deadline starts again */
  if (h->status) {
    int len = b->len > 512 ? 512 : (int)b->len;
    fail(s, h->status, "server rank %u: %.*s", p->rank, len, b->buf ? (const char *)b->buf : "");
    return;
  }
  p->answered = 1;
  k->nanswered++;
  if (k->phase == PS__CKPT_PROBING) {
    p->probe_clock = h->clock;
    if (k->nanswered < k->nparts) return;
    int64_t c = 0;
    for (uint32_t i = 0; i < k->nparts; i++)
      if (k->parts[i].probe_clock > c) c = k->parts[i].probe_clock;
    k->clock = c + PS__CKPT_PROBE_MARGIN;
    k->phase = PS__CKPT_CUTTING;
    ps__log(PS_LOG_INFO, "checkpoint %llu: cutting at clock %lld", (unsigned long long)k->id, (long long)k->clock);
    send_all(s, k->id);
    return;
  }
  if (ps__ckpt_done_decode(b->buf, b->len, &p->done)) {
    fail(s, PS_ERR_PROTO, "server rank %u: %s", p->rank, ps_errmsg());
    return;
  }
  if (p->done.base && p->done.base != k->base) {
    fail(s, PS_ERR_PROTO, "server rank %u wrote an increment on checkpoint %llu, not on %llu", p->rank,
         (unsigned long long)p->done.base, (unsigned long long)k->base);
    return;
  }
  if (p->done.rank != (uint32_t)(p - k->parts) || !p->done.name[0] || strchr(p->done.name, '/')) {
    fail(s, PS_ERR_PROTO, "server rank %u answered for rank %u, file '%s'", p->rank, p->done.rank, p->done.name);
    return;
  }
  if (k->nanswered == k->nparts) finish(s);
}

void ps__sched_ckpt_node_dead(ps__sched *s, ps__sched_node *n, const char *why) {
  ps__sched_ckpt *k = &s->ck;
  for (uint32_t i = 0; k->phase != PS__CKPT_IDLE && i < k->nparts; i++) {
    if (k->parts[i].node != n->m.id) continue;
    fail(s, PS_ERR_UNAVAILABLE, "server rank %u left the job during the checkpoint: %s", n->m.rank, why);
    return;
  }
}

void ps__sched_ckpt_conn_closed(ps__sched *s, ps__conn *c) {
  if (s->ck.requester == c) s->ck.requester = NULL; /* the checkpoint goes on, unanswered */
}

/* ------------------------------------------------------------ restore */

void ps__sched_ckpt_tasks_restore(ps__sched *s) {
  ps__sched_task_restore *r = &s->tk_restore;
  ps__sched_tasks *t = &s->tk;
  if (!r->have) return;
  if (r->epoch >= r->epochs) {
    /* Every epoch had ended: nothing to resume. The job trains the restored tables
     * again over the partitions it declares (a saved model trained further). */
    ps__log(PS_LOG_INFO, "the checkpoint's tasks had finished (%u epochs): starting the tasks afresh", r->epochs);
  } else if (r->parts == t->parts && r->epochs == t->epochs) {
    t->epoch = r->epoch;
    t->ndone = 0;
    for (uint32_t p = 0; p < t->parts; p++) {
      t->state[p] = r->done[p] ? PS__TASK_DONE : PS__TASK_PENDING;
      t->ndone += r->done[p];
    }
    ps__log(PS_LOG_INFO, "tasks restored: epoch %u of %u, %u of %u partitions done", t->epoch, t->epochs, t->ndone,
            t->parts);
  } else {
    ps__log(PS_LOG_WARN,
            "the checkpoint's tasks had %u partitions and %u epochs, the job declares %u and %u: starting the tasks afresh",
            r->parts, r->epochs, t->parts, t->epochs);
  }
  free(r->done);
  memset(r, 0, sizeof *r);
}

static int add_table(ps__sched *s, const ps__ckpt_table *t, const char *mpath) {
  ps__table_spec spec;
  char err[256];
  int rc = ps__table_spec_parse(&spec, t->decl.name, t->decl.kind, t->decl.size, t->decl.options, err, sizeof err);
  if (rc) return ps__fail(rc, "%s: table '%s': %s", mpath, t->decl.name, err);
  for (size_t i = 0; i < s->ntables; i++)
    if (s->tables[i].d.id == t->decl.id || !strcmp(s->tables[i].d.name, t->decl.name))
      return ps__fail(PS_ERR_IO, "%s: table '%s' (id %u) appears twice", mpath, t->decl.name, t->decl.id);
  if (t->decl.id == 0) return ps__fail(PS_ERR_IO, "%s: table '%s' has id 0", mpath, t->decl.name);
  ps__sched_table *nt = ps__realloc(s->tables, (s->ntables + 1) * sizeof *nt);
  if (!nt) return ps__fail(PS_ERR_NOMEM, "out of memory");
  s->tables = nt;
  nt[s->ntables].d = t->decl;
  nt[s->ntables].spec = spec;
  s->ntables++;
  return 0;
}

static int restore(ps__sched *s) {
  const char *rdir = s->o.restore_dir;
  char dir[PS_CKPT_DIR_MAX], mpath[PS_CKPT_DIR_MAX + 16];
  if (strlen(rdir) >= sizeof dir - 32) return ps__fail(PS_ERR_CONFIG, "restore directory path too long: %s", rdir);
  snprintf(mpath, sizeof mpath, "%s/MANIFEST", rdir);
  uint64_t id = 0;
  if (access(mpath, F_OK) == 0) {
    snprintf(dir, sizeof dir, "%s", rdir);
  } else {
    int rc = ps__ckpt_latest(rdir, &id, dir, sizeof dir);
    if (rc) return rc;
    snprintf(mpath, sizeof mpath, "%s/MANIFEST", dir);
  }
  ps__ckpt_reader *r = NULL;
  ps__ckpt_header hd;
  int rc = ps__ckpt_reader_open(&r, mpath, &hd);
  if (rc) return rc;
  if (hd.what != PS_CKPT_MANIFEST) {
    ps__ckpt_reader_close(r);
    return ps__fail(PS_ERR_IO, "%s is not a checkpoint manifest", mpath);
  }
  int have_state = 0;
  int64_t state_clock = 0;
  uint32_t nfiles = 0;
  for (;;) {
    ps__ckpt_block b;
    rc = ps__ckpt_next(r, &b, NULL, NULL);
    if (rc || b.kind == PS_CKPT_B_END) break;
    if (b.kind == PS_CKPT_B_TABLE) {
      rc = add_table(s, &b.table, mpath);
    } else if (b.kind == PS_CKPT_B_FILE) {
      nfiles++;
    } else if (b.kind == PS_CKPT_B_STATE) {
      if (have_state) {
        rc = ps__fail(PS_ERR_IO, "%s: two scheduler state blocks", mpath);
      } else if ((rc = ps__sched_state_decode(b.state, b.state_len, &state_clock, &s->tk_restore)) != 0) {
        char m[512];
        snprintf(m, sizeof m, "%s", ps_errmsg());
        rc = ps__fail(rc, "%s: %s", mpath, m);
      }
      have_state = 1;
    }
    if (rc) break;
  }
  ps__ckpt_reader_close(r);
  if (rc) return rc;
  if (!have_state) return ps__fail(PS_ERR_IO, "%s has no scheduler state block", mpath);
  if (nfiles != hd.nservers)
    return ps__fail(PS_ERR_IO, "%s lists %u data files for %u servers", mpath, nfiles, hd.nservers);
  /* The header's clock is the cut; a job without sync tables has none there. */
  s->start_clock = hd.clock >= 0 ? hd.clock : (state_clock > 0 ? state_clock : 0);
  ps__log(PS_LOG_INFO, "restored checkpoint %llu from %s: clock %lld, %zu tables, %u servers then%s",
          (unsigned long long)hd.id, dir, (long long)s->start_clock, s->ntables, hd.nservers,
          s->tk_restore.have ? ", tasks" : "");
  return 0;
}

/* ------------------------------------------------------------ life cycle */

int ps__sched_ckpt_init(ps__sched *s) {
  ps__sched_ckpt *k = &s->ck;
  uv_timer_init(&s->loop, &k->deadline);
  k->deadline.data = s;
  if (s->o.checkpoint_dir && s->o.checkpoint_dir[0]) {
    const char *d = s->o.checkpoint_dir;
    if (mkdir(d, 0755) != 0 && errno != EEXIST)
      return ps__fail(PS_ERR_IO, "cannot create checkpoint directory %s: %s", d, strerror(errno));
    char abs[PATH_MAX];
    if (!realpath(d, abs)) return ps__fail(PS_ERR_IO, "checkpoint directory %s: %s", d, strerror(errno));
    struct stat st;
    if (stat(abs, &st) != 0 || !S_ISDIR(st.st_mode))
      return ps__fail(PS_ERR_CONFIG, "checkpoint directory %s is not a directory", d);
    /* The request to a server carries DIR/ckpt-<id>: leave room for the suffix. */
    if (strlen(abs) + 32 >= sizeof k->root)
      return ps__fail(PS_ERR_CONFIG, "checkpoint directory path too long: %s", abs);
    snprintf(k->root, sizeof k->root, "%s", abs);
  }
  if (s->o.restore_dir && s->o.restore_dir[0]) return restore(s);
  return 0;
}

void ps__sched_ckpt_free(ps__sched *s) {
  free(s->ck.parts);
  s->ck.parts = NULL;
  free(s->tk_restore.done);
  s->tk_restore.done = NULL;
}
