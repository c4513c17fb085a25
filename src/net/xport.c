/*
 * xport.c - the value transports (xport.h): on the worker, how a dense part's values
 * travel, the tail that names them and what a reply means; on the server, the ops
 * tables and which one a request uses. The system calls and the mappings are
 * peermem.c's and shared.c's; this file says which one a request uses and gives the
 * server and the worker one interface to them.
 */
#include "net/xport.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/common.h"
#include "proto/frame.h"
#include "proto/msg.h"

/* ---------------------------------------------------------------- this process's memory */

/* Values in this process (the frame's body, a colocated worker's buffers, a mapping of
 * a shared buffer): copied with memcpy, by ps__pm_copy's PS_PM_SELF path. */
static int local_copy(const ps__vx *x, int write, const uv_buf_t *loc, unsigned nloc, uint64_t off) {
  return ps__pm_copy(PS_PM_SELF, write, loc, nloc, x->d, x->nd, off, x->until);
}

/* y += a * v, written to vectorise (store's helpers are a layer above). */
static void axpy(float *restrict y, float a, const float *restrict v, uint64_t n) {
  for (uint64_t i = 0; i < n; i++) y[i] += a * v[i];
}

static int local_axpy(const ps__vx *x, float *y, float a, uint64_t n, uint64_t pos) {
  if (x->until && ps__now_ms() >= x->until) return ps__fail(PS_ERR_TIMEOUT, "peer-memory request expired");
  uint64_t at = pos * 4, done = 0;
  for (size_t i = 0; i < x->nd && done < n; i++) {
    uint64_t addr = ps__get_u64(x->d + 16 * i), len = ps__get_u64(x->d + 16 * i + 8);
    if (at >= len) {
      at -= len;
      continue;
    }
    uint64_t m = (len - at) / 4 < n - done ? (len - at) / 4 : n - done;
    if (m == 0) break;
    axpy(y + done, a, (const float *)(uintptr_t)(addr + at), m);
    done += m, at = 0;
  }
  return done == n ? 0 : ps__fail(PS_ERR_SIZE, "value regions shorter than the values");
}

/* A colocated worker names its own live buffers through our own library, and a shared
 * buffer's regions were checked against the sender's mappings when they were
 * translated (ps__shm_translate): nothing to check. */
static int local_check(const ps__vx *x, int write) {
  (void)x, (void)write;
  return 0;
}

const ps__vx_ops ps__vx_inline_ops = {"inline", local_copy, local_axpy, local_check};
const ps__vx_ops ps__vx_self_ops = {"self", local_copy, local_axpy, local_check};
const ps__vx_ops ps__vx_shared_ops = {"shared", local_copy, local_axpy, local_check};

/* ---------------------------------------------------------------- another process's memory */

static int peer_copy(const ps__vx *x, int write, const uv_buf_t *loc, unsigned nloc, uint64_t off) {
  return ps__pm_copy(x->pid, write, loc, nloc, x->d, x->nd, off, x->until);
}

static int peer_axpy(const ps__vx *x, float *y, float a, uint64_t n, uint64_t pos) {
  (void)x, (void)y, (void)a, (void)n, (void)pos;
  return PS_ERR_UNAVAILABLE; /* read it into a local buffer first */
}

static int peer_check(const ps__vx *x, int write) { return ps__pm_mapped(x->pid, write, x->d, x->nd); }

const ps__vx_ops ps__vx_peer_ops = {"peer", peer_copy, peer_axpy, peer_check};

/* ---------------------------------------------------------------- choosing */

int ps__vx_inline(ps__vx *x, const void *vals, uint64_t len) {
  memset(x, 0, sizeof *x);
  x->ops = &ps__vx_inline_ops;
  x->total = len;
  if (!len) return 0;
  if (!(x->xd = ps__malloc(16))) return ps__fail(PS_ERR_NOMEM, "out of memory");
  ps__put_u64(x->xd, (uint64_t)(uintptr_t)vals);
  ps__put_u64(x->xd + 8, len);
  x->d = x->xd;
  x->nd = 1;
  return 0;
}

int ps__vx_parse(ps__vx *x, const uint8_t *tail, size_t tlen) {
  memset(x, 0, sizeof *x);
  if (tlen < 16 || (tlen - 16) % 16)
    return ps__fail(PS_ERR_PROTO, "a peer-memory tail of %zu bytes is not an expiry, a hint and whole pairs", tlen);
  x->until = ps__get_u64(tail);
  x->hint = ps__get_u64(tail + 8);
  x->d = tail + 16;
  x->nd = (tlen - 16) / 16;
  return ps__pm_descs_check(x->d, x->nd, &x->total) ? PS_ERR_PROTO : 0;
}

int ps__vx_open(ps__vx *x, ps__shm_cache **shm, ps__conn *c, int self_pid, int write, const uint8_t *tail,
                size_t tlen) {
  if (ps__vx_parse(x, tail, tlen)) return PS_ERR_PROTO;
  if (c->peer_pid == self_pid) {
    x->ops = &ps__vx_self_ops;
    return 0;
  }
  x->ops = &ps__vx_peer_ops;
  x->pid = c->peer_pid;
  if (!x->hint || !x->nd || x->nd > SIZE_MAX / 16) return 0;
  if (!*shm && !(*shm = ps__shm_cache_new())) return 0;
  uint8_t *out = ps__malloc(16 * x->nd);
  if (!out || ps__shm_translate(*shm, c, x->pid, x->hint, write, x->d, x->nd, out)) {
    free(out);
    return 0; /* the hint does not hold: by process_vm_readv / writev */
  }
  x->xd = out;
  x->d = out;
  x->ops = &ps__vx_shared_ops;
  return 0;
}

void ps__vx_close(ps__vx *x) {
  free(x->xd);
  x->xd = NULL;
}

/* ---------------------------------------------------------------- the worker's side */

int ps__vx_link_peer(const ps__conn *c, unsigned caps) {
  if (!c->is_unix || c->peer_pid <= 0 || !(caps & PS_CAP_PEER_MEM)) return 0;
  return c->peer_uid == (unsigned)geteuid() || c->peer_uid == 0 ? c->peer_pid : 0;
}

uint8_t ps__vx_choose(ps__vx_part *v, uint64_t bytes, uint64_t deadline_ms, uint64_t now_ms,
                      int (*link_pid)(void *arg), void *arg) {
  memset(v, 0, sizeof *v);
  if (bytes < PS_VX_PEER_MIN_BYTES || deadline_ms < now_ms + 2 * (uint64_t)PS_VX_SLACK_MS) return v->xport;
  int pid = link_pid(arg);
  if (pid <= 0) return v->xport;
  v->xport = PS_XPORT_PEER_MEM;
  v->pid = pid;
  v->bytes = bytes;
  v->until = deadline_ms - PS_VX_SLACK_MS;
  return v->xport;
}

size_t ps__vx_tail(ps__vx_part *v, uint64_t *tail, const uv_buf_t *r, size_t n) {
  if (v->xport != PS_XPORT_PEER_MEM) return 0;
  /* Native pairs first: ps__shm_hint reads them so; then every word little-endian in
   * place (nothing to do on a little-endian host). */
  for (size_t i = 0; i < n; i++) {
    tail[2 + 2 * i] = (uint64_t)(uintptr_t)r[i].base;
    tail[3 + 2 * i] = r[i].len;
  }
  tail[0] = v->until;
  tail[1] = v->hint = ps__shm_hint(tail + 2, n);
  for (size_t k = 0; k < 2 + 2 * n; k++) ps__put_u64((uint8_t *)&tail[k], tail[k]);
  return 16 + 16 * n;
}

int ps__vx_written(const ps__vx_part *v, const ps__frame_hdr *h) {
  return h->xport == PS_XPORT_PEER_MEM && v->xport == PS_XPORT_PEER_MEM && h->payload_len == 0;
}

int ps__vx_reply(const ps__vx_part *v, const ps__frame_hdr *h, uint64_t want, int *written) {
  *written = ps__vx_written(v, h);
  if (*written || h->payload_len == want) return 0;
  return ps__fail(PS_ERR_SIZE, "reply of %llu bytes where %llu were expected", (unsigned long long)h->payload_len,
                  (unsigned long long)want);
}

int ps__vx_lent(const ps__vx_part *v, int sent) { return v->xport == PS_XPORT_PEER_MEM && sent; }

/* Is process pid gone (exited, or a zombie not reaped yet)? */
static int process_gone(int pid) {
  char path[64], buf[512];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE *f = fopen(path, "r");
  if (!f) return kill(pid, 0) != 0 && errno == ESRCH;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *e = strrchr(buf, ')'); /* "pid (comm) S ...": comm may hold anything */
  return e && e[1] == ' ' && (e[2] == 'Z' || e[2] == 'X');
}

int ps__vx_must_hold(const ps__vx_part *v, int sent, uint64_t deadline_ms) {
  if (!ps__vx_lent(v, sent) || v->answered || ps__now_ms() >= deadline_ms) return 0;
  return !process_gone(v->pid);
}
