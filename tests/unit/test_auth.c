/*
 * test_auth.c - the job secret's handshake: the state machine of proto/auth.c with no
 * sockets (a whole exchange, a wrong secret or job id, a replayed proof, a reflected
 * MAC, malformed and out-of-order frames), then the handshake on real loopback
 * connections (net/auth.c): an authenticated connection reaches its owner with the
 * peer's identity, a wrong secret reaches neither owner, a stalled peer is closed at
 * the deadline, a frame naming another sender is refused, and listening on a
 * non-loopback address without a secret is refused. Every loop is bounded.
 */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include "common/common.h"
#include "net/auth.h"
#include "net/net.h"
#include "proto/auth.h"
#include "proto/msg.h"
#include "pshard.h"

#define OK(call)                                                                                    \
  do {                                                                                              \
    int rc_ = (call);                                                                               \
    cr_assert(eq(int, rc_, 0), "%s -> %s: %s", #call, ps_err_name(rc_), ps_errmsg());               \
  } while (0)

static ps__auth_key mk_key(const char *secret, const char *job) {
  ps__auth_key k;
  memset(&k, 0, sizeof k);
  k.len = strlen(secret);
  memcpy(k.secret, secret, k.len);
  snprintf(k.job, sizeof k.job, "%s", job);
  return k;
}

/* ---------------------------------------------------------------- the state machine */

/* Run a whole exchange between kc (client) and ks (server); the step that failed or
 * PS_OK. The client's frames are kept in hello and proof. */
static int exchange(const ps__auth_key *kc, const ps__auth_key *ks, ps__hs *c, ps__hs *s, ps__hs_out *hello,
                    ps__hs_out *proof) {
  ps__hs_out chal, ok;
  OK(ps__hs_client_start(c, kc, PS_ROLE_WORKER, 7, hello));
  ps__hs_server_start(s, ks, PS_ROLE_SERVER, 3);
  int rc = ps__hs_recv(s, hello->type, hello->body, hello->len, &chal);
  if (rc) return rc;
  rc = ps__hs_recv(c, chal.type, chal.body, chal.len, proof);
  if (rc) return rc;
  rc = ps__hs_recv(s, proof->type, proof->body, proof->len, &ok);
  if (rc) return rc;
  cr_assert(eq(int, s->state, PS_HS_DONE));
  rc = ps__hs_recv(c, ok.type, ok.body, ok.len, &chal);
  if (rc) return rc;
  cr_assert(eq(int, c->state, PS_HS_DONE));
  return PS_OK;
}

Test(hs, a_whole_exchange_authenticates_both_sides) {
  ps__auth_key k = mk_key("0123456789abcdef-secret", "job-1");
  ps__hs c, s;
  ps__hs_out hello, proof;
  cr_assert(eq(int, exchange(&k, &k, &c, &s, &hello, &proof), PS_OK));
  cr_assert(eq(int, c.state, PS_HS_DONE));
  cr_assert(eq(int, s.state, PS_HS_DONE));
  cr_assert(eq(u8, s.peer_role, PS_ROLE_WORKER));
  cr_assert(eq(u32, s.peer_node, 7));
  cr_assert(eq(u8, c.peer_role, PS_ROLE_SERVER));
  cr_assert(eq(u32, c.peer_node, 3));
  cr_assert(eq(u8, hello.type, PS_MSG_AUTH_HELLO));
  cr_assert(eq(sz, hello.len, PS_AUTH_HELLO_LEN));
  cr_assert(eq(sz, proof.len, PS_AUTH_PROOF_LEN));
  /* Fresh nonces: a second client's hello differs. */
  ps__hs c2;
  ps__hs_out h2;
  OK(ps__hs_client_start(&c2, &k, PS_ROLE_WORKER, 7, &h2));
  cr_assert(memcmp(h2.body + 6, hello.body + 6, PS_AUTH_NONCE) != 0);
}

Test(hs, a_wrong_secret_fails_at_the_client_and_the_server) {
  ps__auth_key a = mk_key("0123456789abcdef-secret", "job-1"), b = mk_key("0123456789abcdef-other!", "job-1");
  ps__hs c, s;
  ps__hs_out hello, proof;
  /* The client checks the server's MAC first. */
  cr_assert(eq(int, exchange(&a, &b, &c, &s, &hello, &proof), PS_ERR_AUTH));
  cr_assert(eq(int, c.state, PS_HS_FAILED));
  cr_assert(c.why[0] != 0);
  /* A client that pretends it checked: its proof under the wrong key fails the server. */
  ps__hs_out chal, ok;
  ps__hs s2, cb;
  OK(ps__hs_client_start(&cb, &b, PS_ROLE_WORKER, 7, &hello));
  ps__hs_server_start(&s2, &a, PS_ROLE_SERVER, 3);
  cr_assert(eq(int, ps__hs_recv(&s2, hello.type, hello.body, hello.len, &chal), PS_OK));
  ps__hs forged = cb;
  forged.key = &a; /* accept the server's MAC... */
  cr_assert(eq(int, ps__hs_recv(&forged, chal.type, chal.body, chal.len, &proof), PS_OK));
  forged.key = &b;
  ps__hs_out bad;
  memset(&bad, 0, sizeof bad);
  bad.type = PS_MSG_AUTH_PROOF;
  bad.len = PS_AUTH_MAC;
  memcpy(bad.body, proof.body, PS_AUTH_MAC);
  bad.body[0] ^= 1; /* ...and send a proof that is not the one the secret gives */
  cr_assert(eq(int, ps__hs_recv(&s2, bad.type, bad.body, bad.len, &ok), PS_ERR_AUTH));
  cr_assert(eq(int, s2.state, PS_HS_FAILED));
}

Test(hs, another_jobs_id_fails) {
  ps__auth_key a = mk_key("0123456789abcdef-secret", "job-1"), b = mk_key("0123456789abcdef-secret", "job-2");
  ps__hs c, s;
  ps__hs_out hello, proof;
  cr_assert(eq(int, exchange(&a, &b, &c, &s, &hello, &proof), PS_ERR_AUTH));
}

Test(hs, a_replayed_proof_fails_against_a_fresh_challenge) {
  ps__auth_key k = mk_key("0123456789abcdef-secret", "job-1");
  ps__hs c, s, s2;
  ps__hs_out hello, proof, chal, ok;
  cr_assert(eq(int, exchange(&k, &k, &c, &s, &hello, &proof), PS_OK));
  /* The recorded hello and proof, replayed to a new handshake of the server. */
  ps__hs_server_start(&s2, &k, PS_ROLE_SERVER, 3);
  cr_assert(eq(int, ps__hs_recv(&s2, hello.type, hello.body, hello.len, &chal), PS_OK));
  cr_assert(eq(int, ps__hs_recv(&s2, proof.type, proof.body, proof.len, &ok), PS_ERR_AUTH));
}

Test(hs, the_servers_mac_is_not_a_clients_proof) {
  ps__auth_key k = mk_key("0123456789abcdef-secret", "job-1");
  ps__hs c, s;
  ps__hs_out hello, chal, ok;
  OK(ps__hs_client_start(&c, &k, PS_ROLE_WORKER, 7, &hello));
  ps__hs_server_start(&s, &k, PS_ROLE_SERVER, 3);
  cr_assert(eq(int, ps__hs_recv(&s, hello.type, hello.body, hello.len, &chal), PS_OK));
  /* Reflect the server's own MAC back as the proof. */
  cr_assert(eq(int, ps__hs_recv(&s, PS_MSG_AUTH_PROOF, chal.body + 5 + PS_AUTH_NONCE, PS_AUTH_MAC, &ok), PS_ERR_AUTH));
}

Test(hs, a_changed_identity_fails) {
  ps__auth_key k = mk_key("0123456789abcdef-secret", "job-1");
  ps__hs c, s;
  ps__hs_out hello, chal, proof;
  OK(ps__hs_client_start(&c, &k, PS_ROLE_WORKER, 7, &hello));
  ps__hs_server_start(&s, &k, PS_ROLE_SERVER, 3);
  cr_assert(eq(int, ps__hs_recv(&s, hello.type, hello.body, hello.len, &chal), PS_OK));
  chal.body[1] ^= 1; /* the server's node id, changed on the way */
  cr_assert(eq(int, ps__hs_recv(&c, chal.type, chal.body, chal.len, &proof), PS_ERR_AUTH));
}

Test(hs, malformed_and_out_of_order_frames_fail) {
  ps__auth_key k = mk_key("0123456789abcdef-secret", "job-1");
  ps__hs c, s;
  ps__hs_out hello, out;
  uint8_t junk[PS_AUTH_MAX_BODY] = {0};
  OK(ps__hs_client_start(&c, &k, PS_ROLE_WORKER, 7, &hello));
  struct {
    uint8_t type;
    size_t len;
    int patch; /* byte 0 / 1 of the hello to set, -1 none */
    uint8_t v;
  } bad[] = {
      {PS_MSG_HELLO, PS_AUTH_HELLO_LEN, -1, 0},          /* not a handshake frame */
      {PS_MSG_AUTH_PROOF, PS_AUTH_PROOF_LEN, -1, 0},     /* a proof before the hello */
      {PS_MSG_AUTH_HELLO, PS_AUTH_HELLO_LEN - 1, -1, 0}, /* short */
      {PS_MSG_AUTH_HELLO, PS_AUTH_HELLO_LEN + 1, -1, 0}, /* long */
      {PS_MSG_AUTH_HELLO, 0, -1, 0},                     /* empty */
      {PS_MSG_AUTH_HELLO, PS_AUTH_HELLO_LEN, 0, 2},      /* another version */
      {PS_MSG_AUTH_HELLO, PS_AUTH_HELLO_LEN, 1, 0},      /* role 0 */
      {PS_MSG_AUTH_HELLO, PS_AUTH_HELLO_LEN, 1, 9},      /* unknown role */
      {PS_MSG_AUTH_HELLO | PS_FRAME_REPLY, PS_AUTH_CHALLENGE_LEN, -1, 0}, /* a challenge to a server */
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    uint8_t body[PS_AUTH_MAX_BODY];
    memcpy(body, hello.body, PS_AUTH_HELLO_LEN);
    if (bad[i].patch >= 0) body[bad[i].patch] = bad[i].v;
    ps__hs_server_start(&s, &k, PS_ROLE_SERVER, 3);
    cr_assert(eq(int, ps__hs_recv(&s, bad[i].type, bad[i].len ? body : NULL, bad[i].len, &out), PS_ERR_AUTH),
              "case %zu", i);
    cr_assert(eq(int, s.state, PS_HS_FAILED), "case %zu", i);
    /* A failed handshake stays failed, even for the right frame. */
    cr_assert(eq(int, ps__hs_recv(&s, hello.type, hello.body, hello.len, &out), PS_ERR_AUTH), "case %zu", i);
  }
  /* A body length without a body. */
  ps__hs_server_start(&s, &k, PS_ROLE_SERVER, 3);
  cr_assert(eq(int, ps__hs_recv(&s, PS_MSG_AUTH_HELLO, NULL, PS_AUTH_HELLO_LEN, &out), PS_ERR_AUTH));
  /* The client: a challenge of the wrong length, a hello, junk, the end before the challenge. */
  uint8_t types[] = {PS_MSG_AUTH_HELLO | PS_FRAME_REPLY, PS_MSG_AUTH_HELLO, PS_MSG_ERROR,
                     PS_MSG_AUTH_PROOF | PS_FRAME_REPLY};
  size_t lens[] = {PS_AUTH_CHALLENGE_LEN - 1, PS_AUTH_HELLO_LEN, 5, 0};
  for (size_t i = 0; i < sizeof types; i++) {
    ps__hs c2;
    ps__hs_out h2;
    OK(ps__hs_client_start(&c2, &k, PS_ROLE_WORKER, 7, &h2));
    cr_assert(eq(int, ps__hs_recv(&c2, types[i], junk, lens[i], &out), PS_ERR_AUTH), "client case %zu", i);
  }
  /* After success every frame fails. */
  ps__hs_out proof;
  ps__hs s3;
  cr_assert(eq(int, exchange(&k, &k, &c, &s3, &hello, &proof), PS_OK));
  cr_assert(eq(int, ps__hs_recv(&s3, proof.type, proof.body, proof.len, &out), PS_ERR_AUTH));
}

Test(hs, hmac_matches_rfc4231_case_2) {
  uint8_t mac[PS_AUTH_MAC];
  static const uint8_t want[] = {0x5b, 0xdc, 0xc1, 0x46, 0xbf, 0x60, 0x75, 0x4e, 0x6a, 0x04, 0x24,
                                 0x26, 0x08, 0x95, 0x75, 0xc7, 0x5a, 0x00, 0x3f, 0x08, 0x9d, 0x27,
                                 0x39, 0x83, 0x9d, 0xec, 0x58, 0xb9, 0x64, 0xec, 0x38, 0x43};
  const char *msg = "what do ya want for nothing?";
  OK(ps__hmac_sha256((const uint8_t *)"Jefe", 4, (const uint8_t *)msg, strlen(msg), mac));
  cr_assert(eq(int, memcmp(mac, want, sizeof want), 0));
}

/* ---------------------------------------------------------------- on connections */

typedef struct net_rig {
  uv_loop_t loop;
  ps__pool *pool;
  ps__listener l;
  ps__conn *accepted, *connected;
  int connect_status, connect_done, frames, closed_in;
  ps__frame_hdr last;
} net_rig;

static int rig_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  (void)b;
  net_rig *r = c->udata ? c->udata : NULL;
  (void)r;
  return 0;
}
static void rig_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  net_rig *r = c->udata;
  (void)b;
  if (!r) return;
  r->frames++;
  r->last = *h;
}
static void rig_close(ps__conn *c, int status) {
  net_rig *r = c->udata;
  (void)status;
  if (r && c == r->accepted) {
    r->accepted = NULL;
    r->closed_in = 1;
  }
  if (r && c == r->connected) r->connected = NULL;
}
static const ps__conn_ops rig_ops = {rig_header, rig_frame, rig_close};

static void rig_accept(void *arg, ps__conn *c) {
  net_rig *r = arg;
  c->udata = r;
  r->accepted = c;
}
static void rig_connected(void *arg, ps__conn *c, int status) {
  net_rig *r = arg;
  r->connect_done = 1;
  r->connect_status = status;
  r->connected = c;
}

static void rig_init(net_rig *r) {
  memset(r, 0, sizeof *r);
  uv_loop_init(&r->loop);
  r->pool = ps__pool_new(1u << 20);
  OK(ps__listen_tcp(&r->l, &r->loop, "127.0.0.1", 0, &rig_ops, rig_accept, r, r->pool, 1u << 20));
}

/* Run the loop until cond or about 5 s. */
#define RUN_UNTIL(r, cond)                                                       \
  do {                                                                           \
    uint64_t t0_ = ps__now_ms();                                                 \
    while (!(cond) && ps__now_ms() - t0_ < 5000) uv_run(&(r)->loop, UV_RUN_NOWAIT), usleep(1000); \
  } while (0)

static void walk_close(uv_handle_t *h, void *arg) {
  (void)arg;
  if (uv_is_closing(h)) return;
  if ((h->type == UV_TCP || h->type == UV_NAMED_PIPE) && h->data && h != (uv_handle_t *)arg) {
    ps__conn_close(h->data, 0);
    return;
  }
  uv_close(h, NULL);
}

static void rig_fini(net_rig *r) {
  ps__listener_close(&r->l);
  uv_walk(&r->loop, walk_close, &r->l.h.handle);
  for (int i = 0; i < 100 && uv_loop_alive(&r->loop); i++) uv_run(&r->loop, UV_RUN_NOWAIT);
  cr_assert(eq(int, uv_loop_close(&r->loop), 0));
  ps__auth_self_clear(&r->loop);
  ps__pool_free(r->pool);
  ps__auth_reset();
}

static void set_key(const char *secret, const char *job) {
  ps__auth_reset();
  OK(ps__auth_set_secret(secret, strlen(secret)));
  OK(ps__auth_set_job(job));
}

Test(net, an_authenticated_connection_reaches_both_owners_with_identities) {
  net_rig r;
  set_key("0123456789abcdef-secret", "job-1");
  rig_init(&r);
  ps__auth_self_set(&r.loop, PS_ROLE_WORKER, 5); /* both ends are on this loop */
  OK(ps__connect_tcp(&r.loop, "127.0.0.1", r.l.port, &rig_ops, &r, r.pool, 1u << 20, rig_connected, &r));
  RUN_UNTIL(&r, r.connect_done && r.accepted);
  cr_assert(eq(int, r.connect_status, 0));
  cr_assert(not(eq(ptr, r.connected, NULL)));
  cr_assert(not(eq(ptr, r.accepted, NULL)));
  cr_assert(r.accepted->authed && r.accepted->auth_inbound);
  cr_assert(eq(u8, r.accepted->auth_role, PS_ROLE_WORKER));
  cr_assert(eq(u32, r.accepted->auth_node, 5));
  cr_assert(r.connected->authed && !r.connected->auth_inbound);
  /* A frame with sender 0 arrives as from node 5; one naming node 6 is refused. */
  ps__frame_hdr h = {.type = PS_MSG_STATS, .req_id = 9};
  OK(ps__conn_send_ctrl(r.connected, &h, NULL, 0));
  RUN_UNTIL(&r, r.frames == 1);
  cr_assert(eq(int, r.frames, 1));
  cr_assert(eq(u32, r.last.sender, 5));
  ps__frame_hdr h2 = {.type = PS_MSG_STATS, .req_id = 10, .sender = 6};
  OK(ps__conn_send_ctrl(r.connected, &h2, NULL, 0));
  RUN_UNTIL(&r, r.closed_in);
  cr_assert(r.closed_in, "the frame naming another node did not close the connection");
  cr_assert(eq(int, r.frames, 1), "the owner saw the frame naming another node");
  cr_assert(not(eq(u32, r.last.sender, 6)), "the owner saw a frame naming another node");
  rig_fini(&r);
}

/* A raw TCP client on the listener's port. */
static int raw_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  cr_assert(eq(int, connect(fd, (struct sockaddr *)&sa, sizeof sa), 0));
  return fd;
}

/* Read what the server sent until it closes (up to cap bytes); -1 if it stays open. */
static ssize_t read_to_close(net_rig *r, int fd, uint8_t *buf, size_t cap) {
  size_t n = 0;
  uint64_t t0 = ps__now_ms();
  while (ps__now_ms() - t0 < 5000) {
    uv_run(&r->loop, UV_RUN_NOWAIT);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 5) == 1) {
      ssize_t k = read(fd, buf + n, cap - n);
      if (k <= 0) return (ssize_t)n;
      n += (size_t)k;
    }
  }
  return -1;
}

/* Read one frame (header and body up to cap) from a blocking fd within 5 s while the
 * loop runs: its body length, or -1. */
static ssize_t read_frame(net_rig *r, int fd, ps__frame_hdr *h, uint8_t *body, size_t cap) {
  uint8_t buf[PS_FRAME_HDR_SIZE + 256];
  size_t n = 0;
  uint64_t t0 = ps__now_ms();
  while (ps__now_ms() - t0 < 5000) {
    uv_run(&r->loop, UV_RUN_NOWAIT);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 5) == 1) {
      ssize_t k = read(fd, buf + n, sizeof buf - n);
      if (k <= 0) return -1;
      n += (size_t)k;
    }
    if (n >= PS_FRAME_HDR_SIZE) {
      if (ps__frame_decode(buf, 256, h)) return -1;
      if (n >= PS_FRAME_HDR_SIZE + h->payload_len) {
        size_t len = (size_t)h->payload_len < cap ? (size_t)h->payload_len : cap;
        memcpy(body, buf + PS_FRAME_HDR_SIZE, len);
        return (ssize_t)len;
      }
    }
  }
  return -1;
}

static void send_frame(int fd, uint8_t type, const void *body, size_t len) {
  uint8_t buf[PS_FRAME_HDR_SIZE + 256];
  ps__frame_hdr h = {.type = type, .req_id = 1, .payload_len = len};
  ps__frame_encode(&h, buf);
  memcpy(buf + PS_FRAME_HDR_SIZE, body, len);
  cr_assert(eq(long, (long)write(fd, buf, PS_FRAME_HDR_SIZE + len), (long)(PS_FRAME_HDR_SIZE + len)));
}

Test(net, a_wrong_proof_reaches_no_owner) {
  net_rig r;
  set_key("0123456789abcdef-secret", "job-1");
  rig_init(&r);
  ps__auth_key other = mk_key("0123456789abcdef-other!", "job-1");
  ps__hs hs;
  ps__hs_out hello, proof;
  ps__frame_hdr h;
  uint8_t body[256];
  OK(ps__hs_client_start(&hs, &other, PS_ROLE_WORKER, 0, &hello));
  int fd = raw_connect(r.l.port);
  send_frame(fd, hello.type, hello.body, hello.len);
  ssize_t n = read_frame(&r, fd, &h, body, sizeof body);
  cr_assert(eq(long, (long)n, (long)PS_AUTH_CHALLENGE_LEN));
  cr_assert(eq(u8, h.type, PS_MSG_AUTH_HELLO | PS_FRAME_REPLY));
  /* Under another secret the server's MAC does not check out... */
  cr_assert(eq(int, ps__hs_recv(&hs, h.type, body, (size_t)n, &proof), PS_ERR_AUTH));
  /* ...and a proof made up by a client without the secret is refused. */
  uint8_t fake[PS_AUTH_MAC];
  OK(ps__random_bytes(fake, sizeof fake));
  send_frame(fd, PS_MSG_AUTH_PROOF, fake, sizeof fake);
  n = read_frame(&r, fd, &h, body, sizeof body);
  cr_assert(eq(long, (long)n, 21L));
  cr_assert(eq(u8, h.type, PS_MSG_ERROR));
  cr_assert(eq(i32, h.status, PS_ERR_AUTH));
  close(fd);
  for (int i = 0; i < 20; i++) uv_run(&r.loop, UV_RUN_NOWAIT), usleep(1000);
  cr_assert(eq(ptr, r.accepted, NULL));
  rig_fini(&r);
}

Test(net, a_server_that_refuses_fails_the_connect_with_auth) {
  net_rig r;
  set_key("0123456789abcdef-secret", "job-1");
  rig_init(&r);
  /* A raw listener that answers the hello with the refusal. */
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET};
  socklen_t sl = sizeof sa;
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  cr_assert(eq(int, bind(ls, (struct sockaddr *)&sa, sizeof sa), 0));
  cr_assert(eq(int, listen(ls, 4), 0));
  getsockname(ls, (struct sockaddr *)&sa, &sl);
  OK(ps__connect_tcp(&r.loop, "127.0.0.1", ntohs(sa.sin_port), &rig_ops, &r, r.pool, 1u << 20, rig_connected, &r));
  int fd = -1;
  for (int i = 0; i < 2000 && fd < 0; i++) {
    uv_run(&r.loop, UV_RUN_NOWAIT);
    struct pollfd p = {.fd = ls, .events = POLLIN};
    if (poll(&p, 1, 2) == 1) fd = accept(ls, NULL, NULL);
  }
  cr_assert(fd >= 0);
  ps__frame_hdr h;
  uint8_t body[256];
  cr_assert(eq(long, (long)read_frame(&r, fd, &h, body, sizeof body), (long)PS_AUTH_HELLO_LEN));
  cr_assert(eq(u8, h.type, PS_MSG_AUTH_HELLO));
  uint8_t out[PS_FRAME_HDR_SIZE + 21];
  ps__frame_hdr e = {.type = PS_MSG_ERROR, .status = PS_ERR_AUTH, .payload_len = 21};
  ps__frame_encode(&e, out);
  memcpy(out + PS_FRAME_HDR_SIZE, "authentication failed", 21);
  cr_assert(eq(long, (long)write(fd, out, sizeof out), (long)sizeof out));
  RUN_UNTIL(&r, r.connect_done);
  cr_assert(r.connect_done);
  cr_assert(eq(int, r.connect_status, PS_ERR_AUTH));
  cr_assert(eq(ptr, r.connected, NULL));
  close(fd);
  close(ls);
  rig_fini(&r);
}

Test(net, a_stranger_gets_the_uniform_refusal) {
  net_rig r;
  set_key("0123456789abcdef-secret", "job-1");
  rig_init(&r);
  uint8_t buf[4096];
  /* A plain frame without a handshake, and a frame too large for one: the same answer. */
  for (int k = 0; k < 2; k++) {
    int fd = raw_connect(r.l.port);
    ps__frame_hdr h = {.type = PS_MSG_STATS, .req_id = 1, .payload_len = k ? 4096 : 0};
    uint8_t hdr[PS_FRAME_HDR_SIZE];
    ps__frame_encode(&h, hdr);
    cr_assert(eq(long, (long)write(fd, hdr, sizeof hdr), (long)sizeof hdr));
    ssize_t n = read_to_close(&r, fd, buf, sizeof buf);
    close(fd);
    cr_assert(eq(long, (long)n, (long)(PS_FRAME_HDR_SIZE + 21)), "case %d", k);
    ps__frame_hdr e;
    OK(ps__frame_decode(buf, 1024, &e));
    cr_assert(eq(u8, e.type, PS_MSG_ERROR));
    cr_assert(eq(i32, e.status, PS_ERR_AUTH));
    cr_assert(eq(int, memcmp(buf + PS_FRAME_HDR_SIZE, "authentication failed", 21), 0));
  }
  cr_assert(eq(ptr, r.accepted, NULL));
  rig_fini(&r);
}

Test(net, a_stalled_handshake_is_closed_at_the_deadline_and_the_cap_holds) {
  net_rig r;
  set_key("0123456789abcdef-secret", "job-1");
  setenv("PSHARD_AUTH_TIMEOUT_MS", "300", 1);
  setenv("PSHARD_AUTH_PENDING_MAX", "2", 1);
  OK(ps__auth_arm_env());
  unsetenv("PSHARD_AUTH_TIMEOUT_MS");
  unsetenv("PSHARD_AUTH_PENDING_MAX");
  rig_init(&r);
  int a = raw_connect(r.l.port), b = raw_connect(r.l.port);
  for (int i = 0; i < 50; i++) uv_run(&r.loop, UV_RUN_NOWAIT), usleep(1000);
  /* A third while two authenticate: closed at once, without an answer. */
  int c = raw_connect(r.l.port);
  uint8_t buf[256];
  uint64_t t0 = ps__now_ms();
  cr_assert(eq(long, (long)read_to_close(&r, c, buf, sizeof buf), 0L));
  cr_assert(lt(u64, ps__now_ms() - t0, 250), "the connection over the cap was not closed at once");
  /* The two stalled ones: closed with the refusal once the deadline passed. */
  ssize_t n = read_to_close(&r, a, buf, sizeof buf);
  cr_assert(eq(long, (long)n, (long)(PS_FRAME_HDR_SIZE + 21)));
  cr_assert(ge(u64, ps__now_ms() - t0, 200));
  cr_assert(eq(long, (long)read_to_close(&r, b, buf, sizeof buf), (long)(PS_FRAME_HDR_SIZE + 21)));
  close(a), close(b), close(c);
  /* The cap is free again: a real client gets through. */
  OK(ps__connect_tcp(&r.loop, "127.0.0.1", r.l.port, &rig_ops, &r, r.pool, 1u << 20, rig_connected, &r));
  RUN_UNTIL(&r, r.connect_done && r.accepted);
  cr_assert(eq(int, r.connect_status, 0));
  cr_assert(not(eq(ptr, r.accepted, NULL)));
  rig_fini(&r);
}

Test(net, listening_beyond_loopback_needs_a_secret_or_insecure) {
  ps__auth_reset();
  unsetenv("PSHARD_SECRET");
  unsetenv("PSHARD_SECRET_FILE");
  cr_assert(eq(int, ps__auth_check_bind("0.0.0.0"), PS_ERR_CONFIG));
  cr_assert(strstr(ps_errmsg(), "without a job secret") != NULL, "%s", ps_errmsg());
  OK(ps__auth_check_bind("127.0.0.1"));
  OK(ps__auth_check_bind("::1"));
  ps__auth_set_insecure(1);
  OK(ps__auth_check_bind("0.0.0.0"));
  ps__auth_reset();
  OK(ps__auth_set_secret("0123456789abcdef", 16));
  OK(ps__auth_check_bind("0.0.0.0"));
  ps__auth_reset();
}

Test(net, bad_secrets_are_refused_with_a_message) {
  char path[] = "/tmp/pshard-test-secret-XXXXXX";
  int fd = mkstemp(path);
  cr_assert(fd >= 0);
  cr_assert(eq(long, (long)write(fd, "short\n", 6), 6L));
  close(fd);
  ps__auth_reset();
  cr_assert(eq(int, ps__auth_set_secret_file(path), PS_ERR_CONFIG));
  cr_assert(strstr(ps_errmsg(), "16 to 1024 bytes") != NULL, "%s", ps_errmsg());
  cr_assert(eq(int, ps__auth_set_secret_file("/nonexistent/secret"), PS_ERR_CONFIG));
  cr_assert(eq(int, ps__auth_set_job("has space"), PS_ERR_CONFIG));
  cr_assert(eq(int, ps__auth_set_job(""), PS_ERR_CONFIG));
  /* A good file: its trailing newline is not part of the secret. */
  FILE *f = fopen(path, "w");
  fputs("0123456789abcdef\n", f);
  fclose(f);
  OK(ps__auth_set_secret_file(path));
  cr_assert(ps__auth_enabled());
  /* Both variables at once are ambiguous. */
  ps__auth_reset();
  setenv("PSHARD_SECRET_FILE", path, 1);
  setenv("PSHARD_SECRET", "0123456789abcdef", 1);
  cr_assert(eq(int, ps__auth_arm_env(), PS_ERR_CONFIG));
  unsetenv("PSHARD_SECRET_FILE");
  ps__auth_reset();
  OK(ps__auth_arm_env());
  cr_assert(ps__auth_enabled());
  unsetenv("PSHARD_SECRET");
  unlink(path);
  ps__auth_reset();
}
