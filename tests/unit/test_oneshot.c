/*
 * test_oneshot.c - the blocking one-request, one-reply exchange (net/oneshot.c).
 *
 * A scripted peer listens on an ephemeral loopback port in a thread of the test and
 * plays one part per test: it replies, replies after an unrelated frame, answers with
 * an error frame, stays silent, sends a reply over the size limit, or hangs up. Each
 * test checks the return code, the message and, for a reply, its bytes; the peer also
 * checks the request it received. Every socket call of the peer has a 5 s timeout, so a
 * broken exchange fails the test instead of hanging it.
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/common.h"
#include "net/oneshot.h"
#include "proto/frame.h"
#include "pshard.h"

typedef enum { P_REPLY, P_UNRELATED_FIRST, P_ERROR, P_SILENT, P_HUGE, P_HANGUP, P_EMPTY } part;

typedef struct peer {
  part part;
  const char *text;    /* reply body (P_REPLY, P_UNRELATED_FIRST, P_ERROR) */
  size_t huge;         /* P_HUGE: body length */
  int lfd;
  int port;
  pthread_t thread;
  ps__frame_hdr got;   /* the request as the peer decoded it */
  int got_ok;          /* 1 once a valid request header was read */
  char got_body[64];
} peer;

static void set_timeouts(int fd) {
  struct timeval tv = {.tv_sec = 5, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

static int read_full(int fd, void *buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, (char *)buf + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    got += (size_t)r;
  }
  return 0;
}

static int write_full(int fd, const void *buf, size_t n) {
  size_t put = 0;
  while (put < n) {
    ssize_t r = send(fd, (const char *)buf + put, n - put, MSG_NOSIGNAL);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    put += (size_t)r;
  }
  return 0;
}

static void send_frame(int fd, ps__frame_hdr h, const void *body, size_t len) {
  uint8_t hdr[PS_FRAME_HDR_SIZE];
  h.payload_len = len;
  ps__frame_encode(&h, hdr);
  if (write_full(fd, hdr, sizeof hdr) == 0 && len) write_full(fd, body, len);
}

/* Wait for the caller to hang up (it does once it has its answer or gave up). */
static void drain_until_eof(int fd) {
  char buf[4096];
  while (read(fd, buf, sizeof buf) > 0) {
  }
}

static void *peer_main(void *arg) {
  peer *p = arg;
  int fd = accept(p->lfd, NULL, NULL);
  if (fd < 0) return NULL;
  set_timeouts(fd);
  uint8_t hdr[PS_FRAME_HDR_SIZE];
  if (read_full(fd, hdr, sizeof hdr) == 0 && ps__frame_decode(hdr, sizeof p->got_body - 1, &p->got) == 0 &&
      read_full(fd, p->got_body, (size_t)p->got.payload_len) == 0) {
    p->got_ok = 1;
    p->got_body[p->got.payload_len] = '\0';
  }
  ps__frame_hdr r = {.type = (uint8_t)(p->got.type | PS_FRAME_REPLY), .req_id = p->got.req_id};
  switch (p->part) {
  case P_UNRELATED_FIRST: {
    ps__frame_hdr other = r;
    other.req_id = r.req_id + 100; /* answers some other request */
    send_frame(fd, other, "not this one", 12);
    ps__frame_hdr hb = {.type = PS_MSG_HEARTBEAT};
    send_frame(fd, hb, NULL, 0);
  }
    /* fall through */
  case P_REPLY: send_frame(fd, r, p->text, strlen(p->text)); break;
  case P_EMPTY: send_frame(fd, r, NULL, 0); break;
  case P_ERROR:
    r.status = PS_ERR_ROLE;
    send_frame(fd, r, p->text, strlen(p->text));
    break;
  case P_HUGE: {
    char *big = malloc(p->huge);
    memset(big, 'x', p->huge);
    send_frame(fd, r, big, p->huge);
    free(big);
    break;
  }
  case P_SILENT: break;
  case P_HANGUP:
    close(fd);
    return NULL;
  }
  drain_until_eof(fd);
  close(fd);
  return NULL;
}

/* Listen on 127.0.0.1 (ephemeral port) and start the peer thread. */
static void peer_start(peer *p) {
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
  socklen_t len = sizeof sa;
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  p->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  cr_assert(p->lfd >= 0);
  set_timeouts(p->lfd); /* accept gives up after 5 s too */
  cr_assert(eq(int, bind(p->lfd, (struct sockaddr *)&sa, sizeof sa), 0));
  cr_assert(eq(int, listen(p->lfd, 4), 0));
  cr_assert(eq(int, getsockname(p->lfd, (struct sockaddr *)&sa, &len), 0));
  p->port = ntohs(sa.sin_port);
  cr_assert(eq(int, pthread_create(&p->thread, NULL, peer_main, p), 0));
}

static void peer_join(peer *p) {
  pthread_join(p->thread, NULL);
  close(p->lfd);
}

/* Ask the peer one STATS question. */
static int ask(const peer *p, uint64_t timeout_ms, uint64_t max_reply, ps__frame_hdr *reply, void **out,
               size_t *n) {
  char addr[64];
  ps__frame_hdr req = {.type = PS_MSG_STATS, .req_id = 42, .sender = 7};
  snprintf(addr, sizeof addr, "127.0.0.1:%d", p->port);
  return ps__oneshot(addr, &req, "ping", 4, timeout_ms, max_reply, reply, out, n);
}

Test(oneshot, reply) {
  peer p = {.part = P_REPLY, .text = "workers=2 servers=1"};
  ps__frame_hdr reply;
  void *out = (void *)1;
  size_t n = 99;
  peer_start(&p);
  int rc = ask(&p, 5000, 1024, &reply, &out, &n);
  peer_join(&p);
  cr_assert(eq(int, rc, 0), "%s: %s", ps_err_name(rc), ps_errmsg());
  cr_assert(eq(sz, n, strlen(p.text)));
  cr_assert(eq(str, (char *)out, (char *)p.text)); /* NUL-terminated */
  cr_assert(eq(u8, reply.type, PS_MSG_STATS | PS_FRAME_REPLY));
  cr_assert(eq(u64, reply.req_id, 42));
  cr_assert(eq(int, reply.status, 0));
  free(out);
  /* The request went out as given, its body included. */
  cr_assert(eq(int, p.got_ok, 1));
  cr_assert(eq(u8, p.got.type, PS_MSG_STATS));
  cr_assert(eq(u64, p.got.req_id, 42));
  cr_assert(eq(u32, p.got.sender, 7));
  cr_assert(eq(str, p.got_body, "ping"));
}

Test(oneshot, reply_after_unrelated_frames) {
  peer p = {.part = P_UNRELATED_FIRST, .text = "the answer"};
  void *out = NULL;
  size_t n = 0;
  peer_start(&p);
  int rc = ask(&p, 5000, 1024, NULL, &out, &n);
  peer_join(&p);
  cr_assert(eq(int, rc, 0), "%s: %s", ps_err_name(rc), ps_errmsg());
  cr_assert(eq(str, (char *)out, "the answer"));
  free(out);
}

Test(oneshot, empty_reply) {
  peer p = {.part = P_EMPTY};
  void *out = (void *)1;
  size_t n = 5;
  peer_start(&p);
  int rc = ask(&p, 5000, 0, NULL, &out, &n);
  peer_join(&p);
  cr_assert(eq(int, rc, 0), "%s: %s", ps_err_name(rc), ps_errmsg());
  cr_assert(eq(ptr, out, NULL));
  cr_assert(eq(sz, n, 0));
}

Test(oneshot, reply_of_exactly_the_limit) {
  peer p = {.part = P_HUGE, .huge = 10000};
  void *out = NULL;
  size_t n = 0;
  peer_start(&p);
  int rc = ask(&p, 5000, 10000, NULL, &out, &n);
  peer_join(&p);
  cr_assert(eq(int, rc, 0), "%s: %s", ps_err_name(rc), ps_errmsg());
  cr_assert(eq(sz, n, 10000));
  cr_assert(eq(u8, ((uint8_t *)out)[9999], 'x'));
  free(out);
}

Test(oneshot, error_frame) {
  peer p = {.part = P_ERROR, .text = "stats are kept by the scheduler"};
  void *out = (void *)1;
  size_t n = 3;
  peer_start(&p);
  int rc = ask(&p, 5000, 8, NULL, &out, &n); /* the message is read even past the limit */
  peer_join(&p);
  cr_assert(eq(int, rc, PS_ERR_ROLE), "%s: %s", ps_err_name(rc), ps_errmsg());
  cr_assert(strstr(ps_errmsg(), "stats are kept by the scheduler") != NULL, "message: %s", ps_errmsg());
  cr_assert(strstr(ps_errmsg(), "127.0.0.1:") != NULL, "message: %s", ps_errmsg());
  cr_assert(eq(ptr, out, NULL));
  cr_assert(eq(sz, n, 0));
}

Test(oneshot, silent_peer_times_out) {
  peer p = {.part = P_SILENT};
  void *out = (void *)1;
  size_t n = 0;
  peer_start(&p);
  uint64_t t0 = ps__now_ms();
  int rc = ask(&p, 300, 1024, NULL, &out, &n);
  uint64_t took = ps__now_ms() - t0;
  peer_join(&p);
  cr_assert(eq(int, rc, PS_ERR_TIMEOUT), "%s: %s", ps_err_name(rc), ps_errmsg());
  cr_assert(strstr(ps_errmsg(), "300 ms") != NULL, "message: %s", ps_errmsg());
  cr_assert(took >= 290 && took < 3000, "took %llu ms", (unsigned long long)took);
  cr_assert(eq(ptr, out, NULL));
  cr_assert(eq(int, p.got_ok, 1)); /* the request did arrive */
}

Test(oneshot, oversized_reply) {
  peer p = {.part = P_HUGE, .huge = 100000};
  void *out = (void *)1;
  size_t n = 0;
  peer_start(&p);
  int rc = ask(&p, 5000, 65536, NULL, &out, &n);
  peer_join(&p);
  cr_assert(eq(int, rc, PS_ERR_TOO_LARGE), "%s: %s", ps_err_name(rc), ps_errmsg());
  cr_assert(strstr(ps_errmsg(), "65536") != NULL, "message: %s", ps_errmsg());
  cr_assert(eq(ptr, out, NULL));
}

Test(oneshot, oversized_under_a_small_limit) {
  peer p = {.part = P_HUGE, .huge = 100};
  void *out = (void *)1;
  size_t n = 0;
  peer_start(&p);
  int rc = ask(&p, 5000, 99, NULL, &out, &n);
  peer_join(&p);
  cr_assert(eq(int, rc, PS_ERR_TOO_LARGE), "%s: %s", ps_err_name(rc), ps_errmsg());
  cr_assert(eq(ptr, out, NULL));
}

Test(oneshot, hangup_without_reply) {
  peer p = {.part = P_HANGUP};
  void *out = (void *)1;
  size_t n = 0;
  peer_start(&p);
  int rc = ask(&p, 5000, 1024, NULL, &out, &n);
  peer_join(&p);
  cr_assert(eq(int, rc, PS_ERR_CLOSED), "%s: %s", ps_err_name(rc), ps_errmsg());
  cr_assert(strstr(ps_errmsg(), "without replying") != NULL, "message: %s", ps_errmsg());
}

Test(oneshot, refused) {
  /* A bound socket that does not listen: connecting to it is refused, and no other
   * process can take the port meanwhile. */
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
  socklen_t len = sizeof sa;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  cr_assert(eq(int, bind(fd, (struct sockaddr *)&sa, sizeof sa), 0));
  cr_assert(eq(int, getsockname(fd, (struct sockaddr *)&sa, &len), 0));
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", ntohs(sa.sin_port));
  ps__frame_hdr req = {.type = PS_MSG_STATS, .req_id = 1};
  void *out = (void *)1;
  size_t n = 0;
  uint64_t t0 = ps__now_ms();
  int rc = ps__oneshot(addr, &req, NULL, 0, 5000, 1024, NULL, &out, &n);
  close(fd);
  cr_assert(eq(int, rc, PS_ERR_UNAVAILABLE), "%s: %s", ps_err_name(rc), ps_errmsg());
  cr_assert(strstr(ps_errmsg(), "refused") != NULL, "message: %s", ps_errmsg());
  cr_assert(strstr(ps_errmsg(), addr) != NULL, "message: %s", ps_errmsg());
  cr_assert(ps__now_ms() - t0 < 3000, "a refusal is not a timeout");
  cr_assert(eq(ptr, out, NULL));
}

Test(oneshot, bad_arguments) {
  ps__frame_hdr req = {.type = PS_MSG_STATS, .req_id = 1};
  void *out;
  size_t n;
  static const char *const bad[] = {"", "127.0.0.1", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:70000",
                                    ":80", "1.2.3.4.5:80", "127.0.0.1:8x"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int rc = ps__oneshot(bad[i], &req, NULL, 0, 1000, 1024, NULL, &out, &n);
    cr_assert(eq(int, rc, PS_ERR_CONFIG), "'%s': %s: %s", bad[i], ps_err_name(rc), ps_errmsg());
    cr_assert(ps_errmsg()[0] != '\0');
    cr_assert(eq(ptr, out, NULL));
  }
  /* a host name is looked up: localhost is an address, and nothing listens on port 1 */
  cr_assert(eq(int, ps__oneshot("localhost:1", &req, NULL, 0, 1000, 1024, NULL, &out, &n), PS_ERR_UNAVAILABLE), "%s",
            ps_errmsg());
  cr_assert(eq(int, ps__oneshot("127.0.0.1:1", &req, NULL, 0, 0, 1024, NULL, &out, &n), PS_ERR_INVALID));
  cr_assert(eq(int, ps__oneshot(NULL, &req, NULL, 0, 1000, 1024, NULL, &out, &n), PS_ERR_INVALID));
  cr_assert(eq(int, ps__oneshot("127.0.0.1:1", NULL, NULL, 0, 1000, 1024, NULL, &out, &n), PS_ERR_INVALID));
  cr_assert(eq(int, ps__oneshot("127.0.0.1:1", &req, NULL, 3, 1000, 1024, NULL, &out, &n), PS_ERR_INVALID));
}
