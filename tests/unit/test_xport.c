/*
 * test_xport.c - the worker's side of the value transports (src/net/xport.c) against
 * the server's: which transport a dense part chooses, the tail it builds, read back
 * with the server's ps__vx_parse and ps__vx_open (bytes moved through the transport the
 * server picks), what a reply means, and when the caller's buffers may be given back.
 *
 * Everything runs in this process: a connection is a ps__conn with only the fields the
 * transports read (is_unix, peer_pid, peer_uid), and the "server" opens tails whose
 * sender is this process, as itself (self) or as another process would (peer, shared).
 * The server-side translation of a shared buffer needs PROCMAP_QUERY (Linux 6.11); on an
 * older kernel the shared case checks the fallback to peer memory instead.
 *
 * Every test has the same timeout (see test_shared.c: Criterion's runner leaks a timeout
 * entry when timeouts differ).
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/common.h"
#include "net/xport.h"
#include "proto/msg.h"
#include "pshard.h"

#define OK(call)                                                                                    \
  do {                                                                                              \
    int rc_ = (call);                                                                               \
    cr_assert(eq(int, rc_, 0), "%s -> %s: %s", #call, ps_err_name(rc_), ps_errmsg());               \
  } while (0)

#define FAILS(err, call)                                                                            \
  do {                                                                                              \
    int rc_ = (call);                                                                               \
    cr_assert(eq(int, rc_, err), "%s -> %s (%s), expected %s", #call, ps_err_name(rc_),               \
              rc_ ? ps_errmsg() : "", ps_err_name(err));                                            \
  } while (0)

/* ---------------------------------------------------------------- helpers */

/* The link_pid callback of ps__vx_choose: answers *pid, counts its calls. */
typedef struct asked {
  int pid;
  unsigned calls;
} asked;

static int link_pid(void *arg) {
  asked *a = arg;
  a->calls++;
  return a->pid;
}

/* A connection as the transports see it. */
static ps__conn conn_of(int is_unix, int pid, unsigned uid) {
  ps__conn c;
  memset(&c, 0, sizeof c);
  c.is_unix = is_unix;
  c.peer_pid = pid;
  c.peer_uid = uid;
  return c;
}

static uint8_t pat(unsigned seed, size_t i) { return (uint8_t)((i + seed * 977u) * 2654435761u >> 13); }

/* A reply header as a server sends it. */
static ps__frame_hdr reply_of(uint8_t xport, uint64_t payload_len) {
  ps__frame_hdr h;
  memset(&h, 0, sizeof h);
  h.type = PS_MSG_PULL_DENSE | PS_FRAME_REPLY;
  h.xport = xport;
  h.payload_len = payload_len;
  return h;
}

/* A peer-memory part of `bytes` to server process pid, due in 30 s, as ps__vx_choose
 * makes it. */
static ps__vx_part peer_part(uint64_t bytes, int pid) {
  ps__vx_part v;
  asked a = {pid, 0};
  uint64_t now = ps__now_ms();
  /* A smaller part would go inline; what the tail holds does not depend on its size. */
  uint64_t b = bytes < PS_VX_PEER_MIN_BYTES ? PS_VX_PEER_MIN_BYTES : bytes;
  cr_assert(eq(u8, ps__vx_choose(&v, b, now + 30000, now, link_pid, &a), (uint8_t)PS_XPORT_PEER_MEM));
  v.bytes = bytes;
  return v;
}

static int have_query(void) {
  struct utsname u;
  unsigned major = 0, minor = 0;
  cr_assert(eq(int, uname(&u), 0));
  return sscanf(u.release, "%u.%u", &major, &minor) == 2 && (major > 6 || (major == 6 && minor >= 11));
}

/* Regions of 3 values: cut from buf as [0, a), [a + gap, a + gap + b), [c0, c0 + c). */
typedef struct regions {
  uv_buf_t r[3];
  size_t n;
  uint64_t total;
} regions;

static regions three_of(uint8_t *buf, size_t a, size_t gap, size_t b, size_t c0, size_t c) {
  regions g;
  g.r[0] = uv_buf_init((char *)buf, (unsigned)a);
  g.r[1] = uv_buf_init((char *)buf + a + gap, (unsigned)b);
  g.r[2] = uv_buf_init((char *)buf + c0, (unsigned)c);
  g.n = 3;
  g.total = a + b + c;
  return g;
}

/* Read all values through x (into one local buffer) and compare with the regions'
 * concatenation; then write a new pattern through x and compare the regions. */
static void check_moves(const ps__vx *x, const regions *g) {
  uint8_t *want = malloc(g->total), *got = malloc(g->total);
  cr_assert(want && got);
  size_t at = 0;
  for (size_t i = 0; i < g->n; at += g->r[i].len, i++) memcpy(want + at, g->r[i].base, g->r[i].len);
  memset(got, 0, g->total);
  uv_buf_t loc = uv_buf_init((char *)got, (unsigned)g->total);
  OK(x->ops->copy(x, 0, &loc, 1, 0));
  cr_assert(eq(int, memcmp(got, want, g->total), 0), "%s: the values read differ", ps__vx_name(x));
  /* From an offset, in two local regions. */
  uv_buf_t two[2] = {uv_buf_init((char *)got, 5), uv_buf_init((char *)got + 5, (unsigned)(g->total - 5 - 100))};
  memset(got, 0, g->total);
  OK(x->ops->copy(x, 0, two, 2, 100));
  cr_assert(eq(int, memcmp(got, want + 100, g->total - 100), 0), "%s: read from an offset", ps__vx_name(x));

  for (size_t i = 0; i < g->total; i++) got[i] = pat(7, i);
  OK(x->ops->copy(x, 1, &loc, 1, 0));
  at = 0;
  for (size_t i = 0; i < g->n; at += g->r[i].len, i++)
    cr_assert(eq(int, memcmp(g->r[i].base, got + at, g->r[i].len), 0), "%s: region %zu written", ps__vx_name(x), i);
  free(want);
  free(got);
}

/* ---------------------------------------------------------------- the choice */

Test(vx_choose, small_parts_go_inline_without_asking_the_link, .timeout = 120) {
  ps__vx_part v;
  memset(&v, 0xa5, sizeof v); /* whatever was there before */
  asked a = {4242, 0};
  uint64_t now = 1000000;
  cr_assert(eq(u8, ps__vx_choose(&v, PS_VX_PEER_MIN_BYTES - 1, now + 60000, now, link_pid, &a), (uint8_t)PS_XPORT_INLINE));
  cr_assert(eq(u32, a.calls, 0), "the link was asked for a part too small for peer memory");
  ps__vx_part zero;
  memset(&zero, 0, sizeof zero);
  cr_assert(eq(int, memcmp(&v, &zero, sizeof v), 0), "an inline part is all zero");
  cr_assert(eq(u8, ps__vx_choose(&v, 0, now + 60000, now, link_pid, &a), (uint8_t)PS_XPORT_INLINE));
  cr_assert(eq(u32, a.calls, 0));
}

Test(vx_choose, large_parts_go_by_peer_memory_where_the_link_allows, .timeout = 120) {
  ps__vx_part v;
  asked a = {4242, 0};
  uint64_t now = 1000000, dl = now + 10000;
  cr_assert(eq(u8, ps__vx_choose(&v, PS_VX_PEER_MIN_BYTES, dl, now, link_pid, &a), (uint8_t)PS_XPORT_PEER_MEM));
  cr_assert(eq(u32, a.calls, 1));
  cr_assert(eq(u8, v.xport, (uint8_t)PS_XPORT_PEER_MEM));
  cr_assert(eq(int, v.pid, 4242));
  cr_assert(eq(u64, v.bytes, PS_VX_PEER_MIN_BYTES));
  cr_assert(eq(u64, v.until, dl - PS_VX_SLACK_MS), "the expiry is the slack before the deadline");
  cr_assert(eq(u64, v.hint, 0));
  cr_assert(eq(int, v.answered, 0));

  /* The link does not allow it (not AF_UNIX, no capability, another user): inline. */
  a.pid = 0;
  cr_assert(eq(u8, ps__vx_choose(&v, (uint64_t)1 << 30, dl, now, link_pid, &a), (uint8_t)PS_XPORT_INLINE));
  cr_assert(eq(u32, a.calls, 2));
  cr_assert(eq(int, v.pid, 0));
  cr_assert(eq(u64, v.bytes, 0));
  a.pid = -1;
  cr_assert(eq(u8, ps__vx_choose(&v, (uint64_t)1 << 30, dl, now, link_pid, &a), (uint8_t)PS_XPORT_INLINE));
}

Test(vx_choose, a_near_deadline_keeps_the_values_inline, .timeout = 120) {
  ps__vx_part v;
  asked a = {77, 0};
  uint64_t now = 1000000, big = (uint64_t)8 << 20;
  /* At least twice the slack: the server has as long before the expiry as after it. */
  cr_assert(eq(u8, ps__vx_choose(&v, big, now + 2 * PS_VX_SLACK_MS, now, link_pid, &a), (uint8_t)PS_XPORT_PEER_MEM));
  cr_assert(eq(u64, v.until, now + PS_VX_SLACK_MS));
  cr_assert(eq(u8, ps__vx_choose(&v, big, now + 2 * PS_VX_SLACK_MS - 1, now, link_pid, &a), (uint8_t)PS_XPORT_INLINE));
  cr_assert(eq(u8, ps__vx_choose(&v, big, now, now, link_pid, &a), (uint8_t)PS_XPORT_INLINE));
  cr_assert(eq(u8, ps__vx_choose(&v, big, now - 5, now, link_pid, &a), (uint8_t)PS_XPORT_INLINE), "a deadline passed");
  cr_assert(eq(u32, a.calls, 1), "the link was asked only for the part that could use it");
}

Test(vx_link_peer, the_connection_and_the_servers_caps_decide, .timeout = 120) {
  unsigned me = (unsigned)geteuid(), other = me == 4321 ? 4322 : 4321;
  ps__conn c = conn_of(1, 555, me);
  cr_assert(eq(int, ps__vx_link_peer(&c, PS_CAP_PEER_MEM), 555));
  cr_assert(eq(int, ps__vx_link_peer(&c, 0), 0), "a server that does not offer it");
  c = conn_of(0, 555, me);
  cr_assert(eq(int, ps__vx_link_peer(&c, PS_CAP_PEER_MEM), 0), "TCP");
  c = conn_of(1, 0, me);
  cr_assert(eq(int, ps__vx_link_peer(&c, PS_CAP_PEER_MEM), 0), "no peer process known");
  c = conn_of(1, 555, other);
  if (me != 0) cr_assert(eq(int, ps__vx_link_peer(&c, PS_CAP_PEER_MEM), 0), "a server of another user");
  c = conn_of(1, 555, 0);
  cr_assert(eq(int, ps__vx_link_peer(&c, PS_CAP_PEER_MEM), 555), "a privileged server");
}

/* ---------------------------------------------------------------- the tail, both sides */

Test(vx_tail, inline_parts_carry_nothing, .timeout = 120) {
  ps__vx_part v;
  asked a = {0, 0};
  ps__vx_choose(&v, (uint64_t)1 << 20, ps__now_ms() + 60000, ps__now_ms(), link_pid, &a);
  uint64_t tail[8];
  memset(tail, 0x5a, sizeof tail);
  char buf[64];
  uv_buf_t r = uv_buf_init(buf, sizeof buf);
  cr_assert(eq(sz, ps__vx_tail(&v, tail, &r, 1), (size_t)0));
  for (size_t k = 0; k < 8; k++) cr_assert(eq(u64, tail[k], 0x5a5a5a5a5a5a5a5aull), "word %zu written", k);
}

Test(vx_tail, the_server_reads_what_the_worker_wrote, .timeout = 120) {
  size_t n = 300000;
  uint8_t *buf = malloc(n);
  cr_assert(buf != NULL);
  for (size_t i = 0; i < n; i++) buf[i] = pat(1, i);
  regions g = three_of(buf, 70000, 4096, 100004, 200000, 65540);
  ps__vx_part v = peer_part(g.total, (int)getpid());
  uint64_t tail[2 + 2 * 3];
  size_t tlen = ps__vx_tail(&v, tail, g.r, g.n);
  cr_assert(eq(sz, tlen, (size_t)(16 + 16 * 3)));
  cr_assert(eq(u64, v.hint, 0), "malloc'd memory has no shared-buffer hint");

  /* The bytes, little-endian, as protocol.md 6.2a lays them out. */
  const uint8_t *t = (const uint8_t *)tail;
  cr_assert(eq(u64, ps__get_u64(t), v.until));
  cr_assert(eq(u64, ps__get_u64(t + 8), 0));
  for (size_t i = 0; i < 3; i++) {
    cr_assert(eq(u64, ps__get_u64(t + 16 + 16 * i), (uint64_t)(uintptr_t)g.r[i].base), "address %zu", i);
    cr_assert(eq(u64, ps__get_u64(t + 24 + 16 * i), (uint64_t)g.r[i].len), "length %zu", i);
  }

  /* The server's checks of a request answered later. */
  ps__vx x;
  OK(ps__vx_parse(&x, t, tlen));
  cr_assert(eq(ptr, (void *)x.ops, NULL), "parse chooses no transport");
  cr_assert(eq(u64, x.until, v.until));
  cr_assert(eq(u64, x.hint, 0));
  cr_assert(eq(sz, x.nd, (size_t)3));
  cr_assert(eq(u64, x.total, g.total));

  /* A server in this very process: memcpy. */
  ps__shm_cache *shm = NULL;
  ps__conn c = conn_of(1, (int)getpid(), (unsigned)geteuid());
  for (int write = 0; write < 2; write++) {
    OK(ps__vx_open(&x, &shm, &c, (int)getpid(), write, t, tlen));
    cr_assert(eq(str, (char *)ps__vx_name(&x), "self"));
    cr_assert(eq(u64, x.total, g.total));
    OK(x.ops->check(&x, write));
    check_moves(&x, &g);
    ps__vx_close(&x);
  }
  /* A server in another process: process_vm_readv / writev of the sender's memory. */
  if (ps__pm_usable()) {
    OK(ps__vx_open(&x, &shm, &c, -2, 0, t, tlen));
    cr_assert(eq(str, (char *)ps__vx_name(&x), "peer"), "no hint: the system calls");
    cr_assert(eq(int, x.pid, (int)getpid()));
    OK(x.ops->check(&x, 0));
    check_moves(&x, &g);
    ps__vx_close(&x);
  }
  ps__shm_cache_free(shm);
  free(buf);
}

Test(vx_tail, a_ps_alloc_buffer_carries_its_hint_and_is_mapped_by_the_server, .timeout = 120) {
  size_t n = (size_t)1 << 20;
  uint8_t *buf = ps_alloc(n);
  cr_assert(buf != NULL, "%s", ps_errmsg());
  for (size_t i = 0; i < n; i++) buf[i] = pat(2, i);
  regions g = three_of(buf, 100000, 3, 200001, 600000, 65536);
  ps__vx_part v = peer_part(g.total, (int)getpid());
  uint64_t tail[2 + 2 * 3];
  size_t tlen = ps__vx_tail(&v, tail, g.r, g.n);
  cr_assert(not(eq(u64, v.hint, 0)), "regions in one ps_alloc buffer have a hint");
  cr_assert(eq(u64, v.hint, ps__shm_hint((uint64_t[]){(uint64_t)(uintptr_t)buf, 1}, 1)), "the buffer's own hint");
  cr_assert(eq(u64, ps__get_u64((const uint8_t *)tail + 8), v.hint), "the tail's second word");

  ps__vx x;
  OK(ps__vx_parse(&x, (const uint8_t *)tail, tlen));
  cr_assert(eq(u64, x.hint, v.hint));
  if (ps__pm_usable()) {
    ps__shm_cache *shm = NULL;
    ps__conn c = conn_of(1, (int)getpid(), (unsigned)geteuid());
    for (int write = 0; write < 2; write++) {
      OK(ps__vx_open(&x, &shm, &c, -2, write, (const uint8_t *)tail, tlen));
      cr_assert(eq(str, (char *)ps__vx_name(&x), have_query() ? "shared" : "peer"),
                "a server of another process (write %d)", write);
      check_moves(&x, &g);
      ps__vx_close(&x);
    }
    ps__shm_cache_free(shm);
  }
  /* A region outside the buffer: no hint, whatever the others are. */
  uint8_t *m = malloc(70000);
  cr_assert(m != NULL);
  g.r[1] = uv_buf_init((char *)m, 70000);
  v = peer_part(g.total, (int)getpid());
  ps__vx_tail(&v, tail, g.r, g.n);
  cr_assert(eq(u64, v.hint, 0));
  cr_assert(eq(u64, ps__get_u64((const uint8_t *)tail + 8), 0));
  free(m);
  ps_free(buf);
}

Test(vx_tail, the_server_starts_no_copy_after_the_expiry, .timeout = 120) {
  uint8_t buf[4096];
  memset(buf, 1, sizeof buf);
  uv_buf_t r = uv_buf_init((char *)buf, sizeof buf);
  ps__vx_part v = peer_part(sizeof buf, (int)getpid());
  v.until = ps__now_ms() - 1; /* the worker let go of its buffers already */
  uint64_t tail[4];
  size_t tlen = ps__vx_tail(&v, tail, &r, 1);
  ps__vx x;
  ps__shm_cache *shm = NULL;
  ps__conn c = conn_of(1, (int)getpid(), (unsigned)geteuid());
  OK(ps__vx_open(&x, &shm, &c, (int)getpid(), 0, (const uint8_t *)tail, tlen));
  uint8_t got[4096];
  uv_buf_t loc = uv_buf_init((char *)got, sizeof got);
  FAILS(PS_ERR_TIMEOUT, x.ops->copy(&x, 0, &loc, 1, 0));
  float y[4] = {0};
  FAILS(PS_ERR_TIMEOUT, x.ops->axpy(&x, y, 1.0f, 4, 0));
  ps__vx_close(&x);
  ps__shm_cache_free(shm);
}

/* Bad tails, as a broken or hostile sender would write them, are refused with a
 * message by both of the server's readers; none crashes. */
Test(vx_tail, bad_tails_are_refused, .timeout = 120) {
  uint8_t buf[256];
  uv_buf_t r[2] = {uv_buf_init((char *)buf, 100), uv_buf_init((char *)buf + 128, 128)};
  ps__vx_part v = peer_part(228, (int)getpid());
  uint64_t good[6];
  size_t tlen = ps__vx_tail(&v, good, r, 2);
  cr_assert(eq(sz, tlen, (size_t)48));
  ps__conn c = conn_of(1, (int)getpid(), (unsigned)geteuid());
  ps__shm_cache *shm = NULL;
  ps__vx x;

  /* Lengths that are not an expiry, a hint and whole pairs. */
  static const size_t lens[] = {0, 1, 8, 15, 17, 24, 31, 47};
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    FAILS(PS_ERR_PROTO, ps__vx_parse(&x, (const uint8_t *)good, lens[i]));
    cr_assert(not(eq(str, (char *)ps_errmsg(), "")));
    FAILS(PS_ERR_PROTO, ps__vx_open(&x, &shm, &c, -2, 0, (const uint8_t *)good, lens[i]));
  }
  /* Bad pairs: an empty region, address 0, a region that wraps around. */
  struct {
    uint64_t addr, len;
    const char *what;
  } bad[] = {{(uint64_t)(uintptr_t)buf, 0, "an empty region"},
             {0, 100, "address 0"},
             {UINT64_MAX - 10, 100, "a region that wraps"},
             {1, UINT64_MAX, "a region that wraps from 1"},
             {4096, (uint64_t)SSIZE_MAX + 1, "a region longer than one system call can name"}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    uint8_t t[48];
    memcpy(t, good, sizeof t);
    ps__put_u64(t + 32, bad[i].addr);
    ps__put_u64(t + 40, bad[i].len);
    FAILS(PS_ERR_PROTO, ps__vx_parse(&x, t, sizeof t));
    cr_assert(not(eq(str, (char *)ps_errmsg(), "")), "%s: no message", bad[i].what);
    for (int write = 0; write < 2; write++) {
      FAILS(PS_ERR_PROTO, ps__vx_open(&x, &shm, &c, (int)getpid(), write, t, sizeof t));
      FAILS(PS_ERR_PROTO, ps__vx_open(&x, &shm, &c, -2, write, t, sizeof t));
    }
  }
  /* Regions whose total overflows 64 bits. */
  uint8_t big[64];
  memcpy(big, good, 16);
  for (size_t i = 0; i < 3; i++) {
    ps__put_u64(big + 16 + 16 * i, 4096);
    ps__put_u64(big + 24 + 16 * i, (uint64_t)SSIZE_MAX);
  }
  FAILS(PS_ERR_PROTO, ps__vx_parse(&x, big, sizeof big));
  FAILS(PS_ERR_PROTO, ps__vx_open(&x, &shm, &c, -2, 1, big, sizeof big));
  uint8_t t[48];
  /* A hint that does not hold is ignored: the request goes by the system calls. */
  memcpy(t, good, sizeof t);
  ps__put_u64(t + 8, 1 + 1000000);
  OK(ps__vx_parse(&x, t, sizeof t));
  cr_assert(eq(u64, x.hint, 1000001));
  OK(ps__vx_open(&x, &shm, &c, -2, 0, t, sizeof t));
  cr_assert(eq(str, (char *)ps__vx_name(&x), "peer"));
  ps__vx_close(&x);
  ps__shm_cache_free(shm);
}

/* ---------------------------------------------------------------- replies */

Test(vx_reply, a_peer_memory_pull_takes_either_answer, .timeout = 120) {
  ps__vx_part v = peer_part(1 << 20, 99);
  int written = -1;
  ps__frame_hdr h = reply_of(PS_XPORT_PEER_MEM, 0);
  OK(ps__vx_reply(&v, &h, 1 << 20, &written));
  cr_assert(eq(int, written, 1), "an empty peer-memory reply: the server wrote the values");
  cr_assert(eq(int, ps__vx_written(&v, &h), 1));

  h = reply_of(PS_XPORT_INLINE, 1 << 20);
  OK(ps__vx_reply(&v, &h, 1 << 20, &written));
  cr_assert(eq(int, written, 0), "a server that could not write sends the values inline");
  cr_assert(eq(int, ps__vx_written(&v, &h), 0));

  h = reply_of(PS_XPORT_PEER_MEM, 1 << 20);
  OK(ps__vx_reply(&v, &h, 1 << 20, &written));
  cr_assert(eq(int, written, 0), "a body is values, whatever the reply's transport bits");

  h = reply_of(PS_XPORT_INLINE, 0);
  FAILS(PS_ERR_SIZE, ps__vx_reply(&v, &h, 1 << 20, &written));
  cr_assert(eq(int, written, 0));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "reply of 0 bytes where 1048576 were expected"), NULL)), "%s",
            ps_errmsg());
  h = reply_of(PS_XPORT_INLINE, (1 << 20) - 4);
  FAILS(PS_ERR_SIZE, ps__vx_reply(&v, &h, 1 << 20, &written));
  h = reply_of(PS_XPORT_PEER_MEM, 4);
  FAILS(PS_ERR_SIZE, ps__vx_reply(&v, &h, 1 << 20, &written));
}

Test(vx_reply, an_inline_pull_wants_its_values_in_the_body, .timeout = 120) {
  ps__vx_part v;
  memset(&v, 0, sizeof v);
  int written = -1;
  ps__frame_hdr h = reply_of(PS_XPORT_INLINE, 400);
  OK(ps__vx_reply(&v, &h, 400, &written));
  cr_assert(eq(int, written, 0));
  /* The worker lent no buffers: an empty "written" reply cannot have filled them. */
  h = reply_of(PS_XPORT_PEER_MEM, 0);
  cr_assert(eq(int, ps__vx_written(&v, &h), 0));
  FAILS(PS_ERR_SIZE, ps__vx_reply(&v, &h, 400, &written));
  h = reply_of(PS_XPORT_INLINE, 401);
  FAILS(PS_ERR_SIZE, ps__vx_reply(&v, &h, 400, &written));
  h = reply_of(PS_XPORT_INLINE, 0);
  OK(ps__vx_reply(&v, &h, 0, &written)); /* nothing expected, nothing sent */
  cr_assert(eq(int, written, 0));
}

/* ---------------------------------------------------------------- giving the buffers back */

Test(vx_hold, only_an_unanswered_peer_memory_part_keeps_the_buffers, .timeout = 120) {
  uint64_t far = ps__now_ms() + 60000;
  ps__vx_part in;
  memset(&in, 0, sizeof in);
  cr_assert(eq(int, ps__vx_lent(&in, 1), 0), "inline values travel in the frame");
  cr_assert(eq(int, ps__vx_must_hold(&in, 1, far), 0));

  ps__vx_part v = peer_part(1 << 20, (int)getpid()); /* a server that lives */
  cr_assert(eq(int, ps__vx_lent(&v, 0), 0), "not sent: nothing lent yet");
  cr_assert(eq(int, ps__vx_must_hold(&v, 0, far), 0));
  cr_assert(eq(int, ps__vx_lent(&v, 1), 1));
  cr_assert(eq(int, ps__vx_must_hold(&v, 1, far), 1), "sent, unanswered, before its deadline");
  cr_assert(eq(int, ps__vx_must_hold(&v, 1, ps__now_ms()), 0), "at its deadline");
  v.answered = 1;
  cr_assert(eq(int, ps__vx_must_hold(&v, 1, far), 0), "answered");
  cr_assert(eq(int, ps__vx_lent(&v, 1), 1), "a cancel still waits for the part to end");
}

/* A wait of at most ms for pid to become a zombie (unreaped). */
static int zombie_within(pid_t pid, int ms) {
  for (int i = 0; i < ms; i++) {
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *e = strrchr(buf, ')');
    if (e && e[1] == ' ' && e[2] == 'Z') return 1;
    usleep(1000);
  }
  return 0;
}

Test(vx_hold, a_server_process_that_is_gone_writes_nowhere, .timeout = 120) {
  uint64_t far = ps__now_ms() + 60000;
  pid_t kid = fork();
  cr_assert(kid >= 0);
  if (kid == 0) {
    alarm(60); /* never outlives the test */
    pause();
    _exit(0);
  }
  ps__vx_part v = peer_part(1 << 20, (int)kid);
  cr_assert(eq(int, ps__vx_must_hold(&v, 1, far), 1), "a live server");
  cr_assert(eq(int, kill(kid, SIGKILL), 0));
  cr_assert(zombie_within(kid, 10000), "the child did not die");
  cr_assert(eq(int, ps__vx_must_hold(&v, 1, far), 0), "a killed server, not reaped yet");
  int st;
  cr_assert(eq(int, (int)waitpid(kid, &st, 0), (int)kid));
  cr_assert(eq(int, ps__vx_must_hold(&v, 1, far), 0), "a killed server, reaped");
}
