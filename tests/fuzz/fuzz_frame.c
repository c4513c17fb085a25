/*
 * fuzz_frame.c - fuzz target for the frame header decoder and the control-body decoders.
 *
 * An input is one frame as it would arrive on a connection: a 64-byte header and its
 * body (inputs shorter than a header are fed to the body decoders only). Besides "does
 * not crash or read out of bounds", the target checks properties of the codec:
 *  - a header that decodes re-encodes to the same 64 bytes, and satisfies every rule
 *    the decoder promises (type, status, codec, limits, key array, float values);
 *  - a decoded header is rejected with PS_ERR_TOO_LARGE under a limit one byte smaller
 *    than its payload, and accepted again under exactly its payload length;
 *  - a body that decodes as hello, membership, declare or a checkpoint body re-encodes to a body that
 *    decodes to the same values (fields compared, strings up to their NUL); a stall
 *    report re-encodes to the same bytes;
 *  - failed membership decodes leave no member array behind;
 *  - the handshake (proto/auth.c) takes every body as a hello, a challenge and a
 *    proof: a step either fails with PS_ERR_AUTH and leaves the handshake failed, or
 *    goes on with a frame of the documented length; a challenge or proof made of
 *    fuzzer bytes never authenticates.
 * A violated property aborts with a message, which libFuzzer and the replay driver
 * report as a crash.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "proto/auth.h"
#include "proto/frame.h"
#include "proto/msg.h"

#define FUZZ_MAX_PAYLOAD (2048ull << 20) /* the daemons' default max_frame_mb */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      fprintf(stderr, "fuzz_frame: property violated at %s:%d: %s\n", __FILE__,      \
              __LINE__, #cond);                                                     \
      abort();                                                                      \
    }                                                                               \
  } while (0)

/* Property checks on a header the decoder accepted. */
static void check_header(const uint8_t *in, const ps__frame_hdr *h, uint64_t max_payload) {
  uint8_t again[PS_FRAME_HDR_SIZE];
  ps__frame_hdr h2;
  ps__frame_encode(h, again);
  CHECK(memcmp(again, in, PS_FRAME_HDR_SIZE) == 0);

  uint8_t t = h->type & (uint8_t)~PS_FRAME_REPLY;
  CHECK((t > 0 && t < PS_MSG__MAX) || ps__frame_is_auth(t));
  CHECK(strcmp(ps__frame_type_name(h->type), "unknown") != 0);
  CHECK(h->status >= 0 && h->status < PS_ERR__COUNT);
  CHECK(h->codec == PS_CODEC_RAW);
  CHECK(h->xport == PS_XPORT_INLINE || h->xport == PS_XPORT_PEER_MEM);
  CHECK((h->flags & ~PS_FLAG_MASK) == 0);
  CHECK(h->payload_len <= max_payload);
  if (ps__frame_is_data(h->type) && h->status == 0) {
    uint64_t kbytes = (uint64_t)h->nkeys * 8u;
    CHECK(kbytes <= h->payload_len);
    CHECK((h->payload_len - kbytes) % 4u == 0);
    if (h->type & PS_FRAME_REPLY) CHECK(h->nkeys == 0);
    else if (t == PS_MSG_PUSH_DENSE || t == PS_MSG_PULL_DENSE) CHECK(h->nkeys % 2u == 0);
    if (h->xport == PS_XPORT_PEER_MEM) {
      /* Dense requests with (address, length) pairs, or an empty dense pull reply. */
      CHECK(t == PS_MSG_PUSH_DENSE || t == PS_MSG_PULL_DENSE);
      if (h->type & PS_FRAME_REPLY) CHECK(t == PS_MSG_PULL_DENSE && h->payload_len == 0);
      else CHECK((h->payload_len - kbytes) % 16u == 0);
    }
  } else {
    CHECK(h->xport == PS_XPORT_INLINE || h->status != 0);
    CHECK(h->payload_len <= PS_CTRL_MAX_BODY);
    CHECK(h->nkeys == 0);
  }

  /* The limit is inclusive and checked on its own. */
  CHECK(ps__frame_decode(in, h->payload_len, &h2) == 0);
  CHECK(memcmp(&h2, h, sizeof h2) == 0); /* both zeroed by the decoder, padding included */
  if (h->payload_len > 0) CHECK(ps__frame_decode(in, h->payload_len - 1, &h2) == PS_ERR_TOO_LARGE);
}

static void check_hello(const uint8_t *p, size_t n) {
  ps__hello a, b;
  if (ps__hello_decode(p, n, &a) != 0) return;
  CHECK(a.role == PS_ROLE_SERVER || a.role == PS_ROLE_WORKER);
  CHECK(memchr(a.host, 0, sizeof a.host) && memchr(a.unix_path, 0, sizeof a.unix_path) &&
        memchr(a.hostid, 0, sizeof a.hostid));
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__hello_encode(&w, &a);
  CHECK(!w.oom);
  CHECK(w.len <= n); /* strings end at their first NUL, so re-encoding never grows */
  CHECK(ps__hello_decode(w.data, w.len, &b) == 0);
  CHECK(a.role == b.role && a.port == b.port && a.pid == b.pid);
  CHECK(!strcmp(a.host, b.host) && !strcmp(a.unix_path, b.unix_path) && !strcmp(a.hostid, b.hostid));
  ps__wbuf_free(&w);
}

static void check_membership(const uint8_t *p, size_t n) {
  ps__membership a, b;
  if (ps__membership_decode(p, n, &a) != 0) {
    CHECK(a.m == NULL && a.n == 0);
    return;
  }
  CHECK(a.n <= PS_MAX_MEMBERS);
  CHECK(a.m != NULL);
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__membership_encode(&w, &a);
  CHECK(!w.oom);
  CHECK(w.len <= n);
  CHECK(ps__membership_decode(w.data, w.len, &b) == 0);
  CHECK(a.epoch == b.epoch && a.servers_expected == b.servers_expected &&
        a.workers_expected == b.workers_expected && a.started == b.started && a.n == b.n);
  for (uint32_t i = 0; i < a.n; i++) {
    const ps__member *x = &a.m[i], *y = &b.m[i];
    CHECK(x->id == y->id && x->role == y->role && x->alive == y->alive && x->rank == y->rank &&
          x->port == y->port);
    CHECK(!strcmp(x->host, y->host) && !strcmp(x->unix_path, y->unix_path) && !strcmp(x->hostid, y->hostid));
  }
  ps__membership_clear(&b);
  ps__membership_clear(&a);
  CHECK(a.m == NULL && a.n == 0);
  ps__wbuf_free(&w);
}

static void check_declare(const uint8_t *p, size_t n) {
  ps__declare a, b;
  if (ps__declare_decode(p, n, &a) != 0) return;
  CHECK(a.name[0] != '\0');
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__declare_encode(&w, &a);
  CHECK(!w.oom);
  CHECK(ps__declare_decode(w.data, w.len, &b) == 0);
  CHECK(a.id == b.id && a.kind == b.kind && a.size == b.size);
  CHECK(!strcmp(a.name, b.name) && !strcmp(a.options, b.options));
  ps__wbuf_free(&w);
}

/* Checkpoint bodies: a decoded one re-encodes to one that decodes the same. */
static void check_ckpt(const uint8_t *p, size_t n) {
  ps__wbuf w;
  ps__ckpt_req qa, qb;
  if (ps__ckpt_req_decode(p, n, &qa) == 0) {
    CHECK(qa.dir[0] != '\0');
    ps__wbuf_init(&w);
    ps__ckpt_req_encode(&w, &qa);
    CHECK(!w.oom && ps__ckpt_req_decode(w.data, w.len, &qb) == 0);
    CHECK(qa.id == qb.id && qa.clock == qb.clock && qa.nservers == qb.nservers && !strcmp(qa.dir, qb.dir));
    ps__wbuf_free(&w);
  }
  ps__ckpt_done da, db;
  if (ps__ckpt_done_decode(p, n, &da) == 0) {
    ps__wbuf_init(&w);
    ps__ckpt_done_encode(&w, &da);
    CHECK(!w.oom && ps__ckpt_done_decode(w.data, w.len, &db) == 0);
    CHECK(da.rank == db.rank && da.bytes == db.bytes && da.checksum == db.checksum && da.rows == db.rows &&
          !strcmp(da.name, db.name));
    ps__wbuf_free(&w);
  }
  ps__ckpt_info ia, ib;
  if (ps__ckpt_info_decode(p, n, &ia) == 0) {
    ps__wbuf_init(&w);
    ps__ckpt_info_encode(&w, &ia);
    CHECK(!w.oom && ps__ckpt_info_decode(w.data, w.len, &ib) == 0);
    CHECK(ia.id == ib.id && !strcmp(ia.dir, ib.dir));
    ps__wbuf_free(&w);
  }
}

/* A stall report: a decoded one re-encodes to the same bytes (the decoder takes only
 * bodies of exactly count entries). */
static void check_stall(const uint8_t *p, size_t n) {
  ps__stall v[PS_STALL_MAX];
  size_t k = 99;
  if (ps__stall_decode(p, n, v, &k) != 0) {
    CHECK(k == 0);
    return;
  }
  CHECK(k <= PS_STALL_MAX && n == 4 + 32 * k);
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__stall_encode(&w, v, k);
  CHECK(!w.oom && w.len == n && memcmp(w.data, p, n) == 0);
  ps__wbuf_free(&w);
}

/* The metric body as the scheduler reads it: str name (< 64) then f64 value. */
static void check_metric(const uint8_t *p, size_t n) {
  ps__rbuf r;
  char name[64];
  ps__rbuf_init(&r, p, n);
  ps__rbuf_str(&r, name, sizeof name);
  (void)ps__rbuf_f64(&r);
  CHECK(r.off <= r.len);
  CHECK(memchr(name, 0, sizeof name) != NULL);
}

/* Walk a body as a sequence of strings with varying capacities until it fails. */
static void check_strings(const uint8_t *p, size_t n) {
  static const size_t caps[] = {64, 1, 4096, 8, 2};
  char out[4096];
  ps__rbuf r;
  ps__rbuf_init(&r, p, n);
  out[0] = 'x';
  ps__rbuf_str(&r, out, 0); /* no room for even the terminator */
  CHECK(r.err && r.off == (n >= 4 ? 4u : 0u) && out[0] == 'x');
  ps__rbuf_init(&r, p, n);
  for (unsigned i = 0; !r.err; i++) {
    size_t cap = caps[i % (sizeof caps / sizeof caps[0])];
    size_t before = r.off;
    ps__rbuf_str(&r, out, cap);
    CHECK(r.off <= r.len);
    if (!r.err) {
      CHECK(r.off - before == 4 + strlen(out) || memchr(p + before + 4, 0, r.off - before - 4));
      CHECK(r.off > before);
    } else if (cap) {
      CHECK(out[0] == '\0');
    }
  }
}

/* The handshake on this body: a server's first step (as the frame's type, and as a
 * hello), its second (a proof after a real hello), and a client's (a challenge). */
static void check_auth(int typed, uint8_t type, const uint8_t *p, size_t n) {
  static ps__auth_key key = {.secret = "fuzz-secret-0123456789", .len = 22, .job = "fuzz"};
  ps__hs s, c;
  ps__hs_out out, hello;
  uint8_t types[2] = {typed ? type : PS_MSG_AUTH_HELLO, PS_MSG_AUTH_HELLO};
  for (int i = 0; i < 2; i++) {
    ps__hs_server_start(&s, &key, PS_ROLE_SERVER, 1);
    int rc = ps__hs_recv(&s, types[i], n ? p : NULL, n, &out);
    CHECK(rc == 0 || rc == PS_ERR_AUTH);
    if (rc) {
      CHECK(s.state == PS_HS_FAILED && s.why[0]);
      CHECK(ps__hs_recv(&s, PS_MSG_AUTH_HELLO, n ? p : NULL, n, &out) == PS_ERR_AUTH);
    } else {
      CHECK(s.state == PS_HS_S_WAIT_PROOF && out.type == (PS_MSG_AUTH_HELLO | PS_FRAME_REPLY));
      CHECK(out.len == PS_AUTH_CHALLENGE_LEN && n == PS_AUTH_HELLO_LEN);
    }
  }
  /* A proof from fuzzer bytes after a real hello. */
  CHECK(ps__hs_client_start(&c, &key, PS_ROLE_WORKER, 2, &hello) == 0);
  ps__hs_server_start(&s, &key, PS_ROLE_SERVER, 1);
  CHECK(ps__hs_recv(&s, hello.type, hello.body, hello.len, &out) == 0);
  CHECK(ps__hs_recv(&s, PS_MSG_AUTH_PROOF, n ? p : NULL, n, &out) == PS_ERR_AUTH);
  /* A challenge from fuzzer bytes. */
  CHECK(ps__hs_recv(&c, PS_MSG_AUTH_HELLO | PS_FRAME_REPLY, n ? p : NULL, n, &out) == PS_ERR_AUTH);
  CHECK(c.state == PS_HS_FAILED);
}

/* Data-frame body: keys then floats; touch every byte the header says is there. */
static uint64_t walk_data(const ps__frame_hdr *h, const uint8_t *body, size_t blen) {
  uint64_t sum = 0;
  uint64_t kbytes = (uint64_t)h->nkeys * 8u;
  if (kbytes > blen) return 0;
  for (uint32_t i = 0; i < h->nkeys; i++) sum += ps__get_u64(body + 8u * i);
  for (size_t off = (size_t)kbytes; off + 4 <= blen; off += 4) sum += ps__get_u32(body + off);
  return sum;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const uint8_t *body = data;
  size_t blen = size;
  int typed = 0;
  uint8_t type = 0;
  static volatile uint64_t sink;
  (void)sink;

  if (size >= PS_FRAME_HDR_SIZE) {
    ps__frame_hdr h;
    body = data + PS_FRAME_HDR_SIZE;
    blen = size - PS_FRAME_HDR_SIZE;
    int rc = ps__frame_decode(data, FUZZ_MAX_PAYLOAD, &h);
    CHECK(rc == 0 || rc == PS_ERR_PROTO || rc == PS_ERR_TOO_LARGE);
    if (rc == 0) {
      check_header(data, &h, FUZZ_MAX_PAYLOAD);
      typed = 1;
      type = h.type;
      if (h.payload_len < blen) blen = (size_t)h.payload_len;
      if (ps__frame_is_data(h.type) && h.status == 0) sink = walk_data(&h, body, blen);
    } else {
      CHECK(ps_errmsg()[0] != '\0');
    }
    /* A limit of 0 admits only empty payloads. */
    int rc0 = ps__frame_decode(data, 0, &h);
    if (rc == 0) CHECK(rc0 == 0 || rc0 == PS_ERR_TOO_LARGE);
  }
  /* Every body decoder sees every body: the type byte only picks which one the real
   * receivers would run, and a mutated type should not hide the others. */
  check_hello(body, blen);
  check_membership(body, blen);
  check_declare(body, blen);
  check_metric(body, blen);
  check_ckpt(body, blen);
  check_stall(body, blen);
  check_strings(body, blen);
  check_auth(typed, type, body, blen);
  return 0;
}
