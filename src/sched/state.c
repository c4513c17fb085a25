/*
 * state.c - the scheduler's state on disk, so that a restarted scheduler takes its job
 * back (`pshard scheduler --state-dir DIR`).
 *
 * What is kept: the members (id, role, rank, address, alive), the id and rank counters,
 * the membership epoch and whether the job started, the table registry, and the task
 * state (partitions, owners, epoch). Not kept: heartbeat times (soft state), barriers
 * in progress (callers retry them), metrics, a checkpoint in progress. The file
 * DIR/scheduler.state is rewritten whole after every change (a registration, a death,
 * a declaration, a task handed out or done): temporary name, fsync, rename, fsync of the
 * directory, so it is always the last complete state. It is small (a few KB for a job
 * of tens of nodes).
 *
 * Format (little-endian, ps__wbuf): u32 magic "PSSS", u32 version (3), u32 next_id,
 * u32 server ranks, u32 worker ranks, u64 epoch, u8 started, u32 nodes, then per node:
 * u32 id, u8 role, u8 alive (bit 0; bit 1 late, bit 2 syncing), u32 rank, u32 port, str host, str unix path, str hostid,
 * u8 caps, u64 registration token (version 2 and later), u32 late: a replacement's
 * admission number (version 3; in older files a late node's number is its place among
 * the late ones); u32 tables, then per table u32 length and a declaration as CREATE carries it
 * (proto/msg.c); u8 tasks present,
 * and if so u32 parts, epochs, epoch, ndone, then per partition u8 state and u32 owner;
 * last, u64 xxh64 of everything before it.
 *
 * A restarted scheduler loads it, counts every live node as seen just now, and waits for
 * them: a node whose scheduler connection broke reconnects and sends HELLO naming its
 * id (agent/agent.h), and is taken back with the same id and rank. A node that does not
 * come back within heartbeat_timeout_ms is removed as if its heartbeats had stopped.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/fault.h"
#include "sched/sched_int.h"

#define STATE_MAGIC 0x53535350u /* "PSSS" */
#define STATE_VERSION 3u /* 1: nodes without their tokens; 2: without their admission numbers */
#define STATE_MAX (64u << 20)

static void state_path(const ps__sched *s, char *out, size_t cap, const char *suffix) {
  snprintf(out, cap, "%s/scheduler.state%s", s->o.state_dir, suffix);
}

static void encode(const ps__sched *s, ps__wbuf *w) {
  ps__wbuf_u32(w, STATE_MAGIC);
  ps__wbuf_u32(w, STATE_VERSION);
  ps__wbuf_u32(w, s->next_id);
  ps__wbuf_u32(w, s->nserver_ranks);
  ps__wbuf_u32(w, s->nworker_ranks);
  ps__wbuf_u64(w, s->epoch);
  ps__wbuf_u8(w, (uint8_t)s->started);
  ps__wbuf_u32(w, (uint32_t)s->nnodes);
  for (size_t i = 0; i < s->nnodes; i++) {
    const ps__member *m = &s->nodes[i].m;
    ps__wbuf_u32(w, m->id);
    ps__wbuf_u8(w, m->role);
    ps__wbuf_u8(w, (uint8_t)((m->alive ? 1 : 0) | (m->late ? 2 : 0) | (m->syncing ? 4 : 0)));
    ps__wbuf_u32(w, m->rank);
    ps__wbuf_u32(w, m->port);
    ps__wbuf_str(w, m->host);
    ps__wbuf_str(w, m->unix_path);
    ps__wbuf_str(w, m->hostid);
    ps__wbuf_u8(w, m->caps);
    ps__wbuf_u64(w, s->nodes[i].token);
    ps__wbuf_u32(w, m->late);
  }
  ps__wbuf_u32(w, (uint32_t)s->ntables);
  for (size_t i = 0; i < s->ntables; i++) { /* each declaration as a CREATE body, length first */
    ps__wbuf d;
    ps__wbuf_init(&d);
    ps__declare_encode(&d, &s->tables[i].d);
    ps__wbuf_u32(w, (uint32_t)d.len);
    ps__wbuf_bytes(w, d.data, d.len);
    w->oom |= d.oom;
    ps__wbuf_free(&d);
  }
  const ps__sched_tasks *t = &s->tk;
  ps__wbuf_u8(w, (uint8_t)(t->init != 0));
  if (t->init) {
    ps__wbuf_u32(w, t->parts);
    ps__wbuf_u32(w, t->epochs);
    ps__wbuf_u32(w, t->epoch);
    ps__wbuf_u32(w, t->ndone);
    for (uint32_t p = 0; p < t->parts; p++) {
      ps__wbuf_u8(w, t->state[p]);
      ps__wbuf_u32(w, t->owner[p]);
    }
  }
  ps__wbuf_u64(w, XXH64(w->data, w->len, 0));
}

/* Write all of buf to path.tmp, fsync, rename to path, fsync the directory. */
static int write_durably(const char *dir, const char *tmp, const char *path, const void *buf, size_t len) {
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ps__fail(PS_ERR_IO, "cannot write %s: %s", tmp, strerror(errno));
  size_t off = 0;
  while (off < len) {
    ssize_t n = write(fd, (const char *)buf + off, len - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int e = errno;
      close(fd);
      unlink(tmp);
      return ps__fail(PS_ERR_IO, "cannot write %s: %s", tmp, strerror(e));
    }
    off += (size_t)n;
  }
  if (fsync(fd) || close(fd)) {
    int e = errno;
    unlink(tmp);
    return ps__fail(PS_ERR_IO, "cannot sync %s: %s", tmp, strerror(e));
  }
  if (rename(tmp, path)) {
    int e = errno;
    unlink(tmp);
    return ps__fail(PS_ERR_IO, "cannot rename %s: %s", tmp, strerror(e));
  }
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  return 0;
}

void ps__sched_state_save(ps__sched *s) {
  if (!s->o.state_dir || !s->o.state_dir[0] || s->stopping) return;
  char tmp[PS_CKPT_DIR_MAX + 32], path[PS_CKPT_DIR_MAX + 32];
  state_path(s, tmp, sizeof tmp, ".tmp");
  state_path(s, path, sizeof path, "");
  if (ps__fault_on()) ps__fault_sleep_ms(ps__fault_disk("state write")); /* a slow disk, for the tests */
  ps__wbuf w;
  ps__wbuf_init(&w);
  encode(s, &w);
  int rc = w.oom ? ps__fail(PS_ERR_NOMEM, "out of memory") : write_durably(s->o.state_dir, tmp, path, w.data, w.len);
  ps__wbuf_free(&w);
  if (rc) ps__log(PS_LOG_ERROR, "the scheduler's state is not saved: %s", ps_errmsg());
}

static int decode_nodes(ps__sched *s, ps__rbuf *r, uint32_t version) {
  uint32_t n = ps__rbuf_u32(r);
  if (r->err || n > PS_MAX_MEMBERS) return -1;
  s->nodes = ps__calloc(n ? n : 1, sizeof *s->nodes);
  if (!s->nodes) return -1;
  s->cap = n ? n : 1;
  uint64_t now = ps__now_ms();
  uint32_t nlate = 0;
  for (uint32_t i = 0; i < n && !r->err; i++) {
    ps__sched_node *x = &s->nodes[s->nnodes++];
    x->m.id = ps__rbuf_u32(r);
    x->m.role = ps__rbuf_u8(r);
    uint8_t st = ps__rbuf_u8(r);
    x->m.alive = st & 1;
    x->m.late = (st >> 1) & 1;
    x->m.syncing = (st >> 2) & 1;
    x->m.rank = ps__rbuf_u32(r);
    x->m.port = (uint16_t)ps__rbuf_u32(r);
    ps__rbuf_str(r, x->m.host, sizeof x->m.host);
    ps__rbuf_str(r, x->m.unix_path, sizeof x->m.unix_path);
    ps__rbuf_str(r, x->m.hostid, sizeof x->m.hostid);
    x->m.caps = ps__rbuf_u8(r);
    if (version >= 2) x->token = ps__rbuf_u64(r);
    uint32_t late = version >= 3 ? ps__rbuf_u32(r) : x->m.late ? ++nlate : 0;
    if ((late != 0) != (x->m.late != 0)) r->err = 1; /* the bit and the number agree */
    x->m.late = late;
    x->last_seen_ms = now; /* liveness is judged afresh: it has heartbeat_timeout_ms to come back */
    x->barrier_seq = -1;
  }
  return r->err ? -1 : 0;
}

static int decode_rest(ps__sched *s, ps__rbuf *r) {
  uint32_t nt = ps__rbuf_u32(r);
  if (r->err || nt > 65535) return -1;
  s->tables = ps__calloc(nt ? nt : 1, sizeof *s->tables);
  if (!s->tables) return -1;
  for (uint32_t i = 0; i < nt && !r->err; i++) {
    ps__declare *d = &s->tables[i].d;
    uint32_t len = ps__rbuf_u32(r);
    char err[256];
    if (r->err || len > r->len - r->off || ps__declare_decode(r->p + r->off, len, d) ||
        ps__table_spec_parse(&s->tables[i].spec, d->name, d->kind, d->size, d->options, err, sizeof err))
      return -1;
    r->off += len;
    s->ntables++;
  }
  if (ps__rbuf_u8(r)) {
    ps__sched_tasks *t = &s->tk;
    t->parts = ps__rbuf_u32(r);
    t->epochs = ps__rbuf_u32(r);
    t->epoch = ps__rbuf_u32(r);
    t->ndone = ps__rbuf_u32(r);
    if (r->err || t->parts == 0 || t->parts > (1u << 24)) return -1;
    t->state = ps__calloc(t->parts, 1);
    t->owner = ps__calloc(t->parts, sizeof *t->owner);
    if (!t->state || !t->owner) return -1;
    for (uint32_t p = 0; p < t->parts; p++) {
      t->state[p] = ps__rbuf_u8(r);
      t->owner[p] = ps__rbuf_u32(r);
      if (t->state[p] > PS__TASK_DONE) return -1;
    }
    t->init = 1;
  }
  return r->err ? -1 : 0;
}

int ps__sched_state_load(ps__sched *s) {
  if (!s->o.state_dir || !s->o.state_dir[0]) return 0;
  if (mkdir(s->o.state_dir, 0755) && errno != EEXIST)
    return ps__fail(PS_ERR_IO, "cannot create the state directory %s: %s", s->o.state_dir, strerror(errno));
  char path[PS_CKPT_DIR_MAX + 32];
  state_path(s, path, sizeof path, "");
  FILE *f = fopen(path, "rb");
  if (!f) {
    if (errno == ENOENT) return 0; /* a new job */
    return ps__fail(PS_ERR_IO, "cannot read %s: %s", path, strerror(errno));
  }
  uint8_t *buf = ps__malloc(STATE_MAX);
  size_t n = buf ? fread(buf, 1, STATE_MAX, f) : 0;
  fclose(f);
  if (!buf) return ps__fail(PS_ERR_NOMEM, "out of memory");
  int bad = n < 12 || n == STATE_MAX || ps__get_u64(buf + n - 8) != XXH64(buf, n - 8, 0);
  ps__rbuf r;
  ps__rbuf_init(&r, buf, bad ? 0 : n - 8);
  uint32_t version = 0;
  if (!bad && ps__rbuf_u32(&r) != STATE_MAGIC) bad = 1;
  if (!bad) version = ps__rbuf_u32(&r);
  if (!bad && (version < 1 || version > STATE_VERSION)) bad = 1;
  if (!bad) {
    s->next_id = ps__rbuf_u32(&r);
    s->nserver_ranks = ps__rbuf_u32(&r);
    s->nworker_ranks = ps__rbuf_u32(&r);
    s->epoch = ps__rbuf_u64(&r);
    s->started = ps__rbuf_u8(&r);
    bad = r.err || decode_nodes(s, &r, version) || decode_rest(s, &r) || r.off != r.len;
  }
  free(buf);
  if (bad) return ps__fail(PS_ERR_CORRUPT, "%s is not a valid scheduler state (damaged or from another version)", path);
  s->epoch++; /* the membership the nodes get after this restart is newer than any before */
  ps__log(PS_LOG_WARN, "restarted from %s: %zu nodes, %zu tables, epoch %llu; waiting for the nodes to come back",
          path, s->nnodes, s->ntables, (unsigned long long)s->epoch);
  return 0;
}
