/*
 * gen_corpus.c - write the seed corpus for the frame and connection fuzz targets.
 *
 * Usage: fuzz_gen_corpus DIR [AUTH_DIR]. Writes one valid frame of each request and
 * reply type (bodies built with the real encoders), plus a few multi-frame streams for
 * the connection target: a session, a dense push large enough for the direct-read path,
 * and a valid frame followed by garbage. The output is committed under
 * tests/fuzz/corpus/frame; rerun after a wire change and commit the difference. With
 * AUTH_DIR, also the handshake target's seeds (fuzz_auth.h), into tests/fuzz/corpus/auth.
 * The handshake runs under fixed nonces, so every run writes the same bytes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "fuzz_auth.h"
#include "proto/auth.h"
#include "proto/frame.h"
#include "proto/msg.h"

static const char *dir;

/* A growing byte stream of frames. */
typedef struct stream {
  uint8_t *p;
  size_t len;
} stream;

static void append(stream *s, const void *p, size_t n) {
  s->p = realloc(s->p, s->len + n + 1);
  if (!s->p) abort();
  if (n) memcpy(s->p + s->len, p, n);
  s->len += n;
}

static void frame(stream *s, ps__frame_hdr h, const void *body, size_t len) {
  uint8_t hdr[PS_FRAME_HDR_SIZE];
  h.payload_len = len;
  ps__frame_encode(&h, hdr);
  append(s, hdr, sizeof hdr);
  append(s, body, len);
}

static void save(const char *name, const stream *s) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(s->p, 1, s->len, f) != s->len || fclose(f) != 0) {
    fprintf(stderr, "cannot write %s\n", path);
    exit(1);
  }
}

/* Write one frame as its own file and append it to a session stream. */
static void one(const char *name, ps__frame_hdr h, const void *body, size_t len, stream *session) {
  stream s = {0};
  frame(&s, h, body, len);
  save(name, &s);
  if (session) append(session, s.p, s.len);
  free(s.p);
}

static ps__frame_hdr hdr(uint8_t type, uint64_t req_id) {
  ps__frame_hdr h;
  memset(&h, 0, sizeof h);
  h.type = type;
  h.req_id = req_id;
  h.lr = -1.0f;
  return h;
}

/* ---------------------------------------------------------------- handshake seeds */

static void put(stream *s, uint8_t b) { append(s, &b, 1); }

/* A step delivering a whole frame of the fuzzer's (fuzz_auth.h). */
static void put_frame(stream *s, int to, uint8_t type, const void *body, size_t len) {
  put(s, (uint8_t)(FUZZ_AUTH_OP_FRAME | to));
  put(s, type);
  put(s, (uint8_t)len);
  append(s, body, len);
}

static void save_auth(const char *name, stream *s) {
  save(name, s);
  free(s->p);
  s->p = NULL;
  s->len = 0;
}

static void auth_seeds(void) {
  static ps__auth_key key = {.secret = FUZZ_AUTH_SECRET, .len = sizeof FUZZ_AUTH_SECRET - 1, .job = FUZZ_AUTH_JOB};
  uint8_t nc[PS_AUTH_NONCE], ns[PS_AUTH_NONCE], cfg = (uint8_t)((PS_ROLE_WORKER - 1) | (PS_ROLE_SERVER - 1) << 2);
  ps__hs c, s;
  ps__hs_out hello, chal, proof, ok;
  stream x = {0};
  fuzz_auth_nonces(nc, ns);
  if (ps__hs_client_start_nonce(&c, &key, PS_ROLE_WORKER, FUZZ_AUTH_NODE_C, nc, &hello)) exit(1);
  ps__hs_server_start_nonce(&s, &key, PS_ROLE_SERVER, FUZZ_AUTH_NODE_S, ns);
  if (ps__hs_recv(&s, hello.type, hello.body, hello.len, &chal) || ps__hs_recv(&c, chal.type, chal.body, chal.len, &proof) ||
      ps__hs_recv(&s, proof.type, proof.body, proof.len, &ok) || ps__hs_recv(&c, ok.type, ok.body, ok.len, &ok))
    exit(1);
  int S = FUZZ_AUTH_TO_SERVER, C = FUZZ_AUTH_TO_CLIENT;
  /* The whole exchange relayed, and spelled out frame by frame. */
  put(&x, cfg);
  put(&x, FUZZ_AUTH_OP_RELAY | S), put(&x, FUZZ_AUTH_OP_RELAY | C), put(&x, FUZZ_AUTH_OP_RELAY | S),
      put(&x, FUZZ_AUTH_OP_RELAY | C);
  save_auth("relay-all.bin", &x);
  put(&x, cfg);
  put_frame(&x, S, hello.type, hello.body, hello.len);
  put_frame(&x, C, chal.type, chal.body, chal.len);
  put_frame(&x, S, proof.type, proof.body, proof.len);
  put_frame(&x, C, PS_MSG_AUTH_PROOF | PS_FRAME_REPLY, NULL, 0);
  save_auth("frames-all.bin", &x);
  /* Every role on both sides, relayed. */
  for (unsigned r = 0; r < 16; r++) {
    char name[64];
    put(&x, (uint8_t)r);
    for (int i = 0; i < 4; i++) put(&x, (uint8_t)(FUZZ_AUTH_OP_RELAY | (i & 1)));
    snprintf(name, sizeof name, "roles-%u-%u.bin", (r & 3) + 1, (r >> 2) + 1);
    save_auth(name, &x);
  }
  /* Another secret, another job: the server's challenge fails on the client. */
  put(&x, (uint8_t)(cfg | FUZZ_AUTH_OTHER_KEY));
  put(&x, FUZZ_AUTH_OP_RELAY | S), put(&x, FUZZ_AUTH_OP_RELAY | C);
  save_auth("other-secret.bin", &x);
  put(&x, (uint8_t)(cfg | FUZZ_AUTH_OTHER_JOB_ID));
  put(&x, FUZZ_AUTH_OP_RELAY | S), put(&x, FUZZ_AUTH_OP_RELAY | C);
  save_auth("other-job.bin", &x);
  /* One byte of each frame changed: the hello's version, the challenge's MAC, the proof. */
  put(&x, cfg);
  put(&x, FUZZ_AUTH_OP_CORRUPT | S), put(&x, 0), put(&x, 0x02);
  save_auth("corrupt-hello.bin", &x);
  put(&x, cfg);
  put(&x, FUZZ_AUTH_OP_RELAY | S);
  put(&x, FUZZ_AUTH_OP_CORRUPT | C), put(&x, PS_AUTH_CHALLENGE_LEN - 1), put(&x, 0x80);
  save_auth("corrupt-challenge.bin", &x);
  put(&x, cfg);
  put(&x, FUZZ_AUTH_OP_RELAY | S), put(&x, FUZZ_AUTH_OP_RELAY | C);
  put(&x, FUZZ_AUTH_OP_CORRUPT | S), put(&x, 7), put(&x, 0x01);
  save_auth("corrupt-proof.bin", &x);
  /* Out of order: a proof first, a challenge to the server, a replayed hello. */
  put(&x, cfg);
  put_frame(&x, S, proof.type, proof.body, proof.len);
  save_auth("proof-first.bin", &x);
  put(&x, cfg);
  put_frame(&x, S, chal.type, chal.body, chal.len);
  put_frame(&x, C, hello.type, hello.body, hello.len);
  save_auth("swapped.bin", &x);
  put(&x, cfg);
  put(&x, FUZZ_AUTH_OP_RELAY | S), put(&x, FUZZ_AUTH_OP_RELAY | S);
  save_auth("hello-twice.bin", &x);
  /* After the end: one more frame each way. */
  put(&x, cfg);
  for (int i = 0; i < 4; i++) put(&x, (uint8_t)(FUZZ_AUTH_OP_RELAY | (i & 1)));
  put(&x, FUZZ_AUTH_OP_RELAY | S), put(&x, FUZZ_AUTH_OP_RELAY | C);
  save_auth("after-end.bin", &x);
  /* Wrong lengths: a short hello, a long proof. */
  put(&x, cfg);
  put_frame(&x, S, hello.type, hello.body, hello.len - 1);
  save_auth("short-hello.bin", &x);
  put(&x, cfg);
  put(&x, FUZZ_AUTH_OP_RELAY | S), put(&x, FUZZ_AUTH_OP_RELAY | C);
  uint8_t longer[PS_AUTH_PROOF_LEN + 1];
  memcpy(longer, proof.body, PS_AUTH_PROOF_LEN);
  longer[PS_AUTH_PROOF_LEN] = 0;
  put_frame(&x, S, proof.type, longer, sizeof longer);
  save_auth("long-proof.bin", &x);
}

int main(int argc, char **argv) {
  if (argc != 2 && argc != 3) {
    fprintf(stderr, "usage: %s DIR [AUTH_DIR]\n", argv[0]);
    return 2;
  }
  if (argc == 3) {
    dir = argv[2];
    auth_seeds();
  }
  dir = argv[1];
  stream session = {0};
  ps__wbuf w;

  /* hello: a server and a worker; the reply carries id (table) and rank (batch). */
  ps__hello hello;
  memset(&hello, 0, sizeof hello);
  hello.role = PS_ROLE_SERVER;
  hello.port = 7001;
  hello.pid = 4242;
  strcpy(hello.host, "127.0.0.1");
  strcpy(hello.unix_path, "/tmp/pshard-4242-7001-0.sock");
  strcpy(hello.hostid, "3f2a9c1e");
  ps__wbuf_init(&w);
  ps__hello_encode(&w, &hello);
  one("hello-server.bin", hdr(PS_MSG_HELLO, 1), w.data, w.len, NULL);
  ps__wbuf_free(&w);
  memset(&hello, 0, sizeof hello);
  hello.role = PS_ROLE_WORKER;
  hello.pid = 4243;
  strcpy(hello.hostid, "3f2a9c1e");
  ps__wbuf_init(&w);
  ps__hello_encode(&w, &hello);
  one("hello-worker.bin", hdr(PS_MSG_HELLO, 1), w.data, w.len, &session);
  ps__wbuf_free(&w);
  ps__frame_hdr h = hdr(PS_MSG_HELLO | PS_FRAME_REPLY, 1);
  h.table = 3;
  h.batch = 0;
  h.epoch = 1;
  one("hello-reply.bin", h, NULL, 0, NULL);

  /* The handshake: a whole exchange under a fixed key (auth-*.bin). */
  {
    static ps__auth_key key = {.secret = FUZZ_AUTH_SECRET, .len = sizeof FUZZ_AUTH_SECRET - 1, .job = FUZZ_AUTH_JOB};
    ps__hs c, s;
    ps__hs_out hello, chal, proof, ok;
    uint8_t nc[PS_AUTH_NONCE], ns[PS_AUTH_NONCE];
    fuzz_auth_nonces(nc, ns);
    if (ps__hs_client_start_nonce(&c, &key, PS_ROLE_WORKER, FUZZ_AUTH_NODE_C, nc, &hello)) return 1;
    ps__hs_server_start_nonce(&s, &key, PS_ROLE_SERVER, FUZZ_AUTH_NODE_S, ns);
    if (ps__hs_recv(&s, hello.type, hello.body, hello.len, &chal) || ps__hs_recv(&c, chal.type, chal.body, chal.len, &proof) ||
        ps__hs_recv(&s, proof.type, proof.body, proof.len, &ok))
      return 1;
    one("auth-hello.bin", hdr(hello.type, 1), hello.body, hello.len, NULL);
    one("auth-challenge.bin", hdr(chal.type, 1), chal.body, chal.len, NULL);
    one("auth-proof.bin", hdr(proof.type, 1), proof.body, proof.len, NULL);
    one("auth-ok.bin", hdr(ok.type, 1), NULL, 0, NULL);
  }

  /* stall: a server's sync round waits for two workers. */
  {
    ps__stall v[2] = {{.worker = 4, .table = 1, .round = 0, .held_ms = 1184}, {.worker = 5, .table = 2, .round = 7, .held_ms = 200}};
    ps__wbuf_init(&w);
    ps__stall_encode(&w, v, 2);
    ps__frame_hdr sh = hdr(PS_MSG_STALL, 0);
    sh.sender = 1;
    one("stall.bin", sh, w.data, w.len, NULL);
    ps__wbuf_free(&w);
  }

  /* membership: two servers and a dead worker. */
  ps__member mem[3];
  memset(mem, 0, sizeof mem);
  for (int i = 0; i < 3; i++) {
    mem[i].id = (uint32_t)i + 1;
    mem[i].role = i < 2 ? PS_ROLE_SERVER : PS_ROLE_WORKER;
    mem[i].alive = i < 2;
    mem[i].rank = i < 2 ? (uint32_t)i : 0;
    mem[i].port = i < 2 ? (uint16_t)(7001 + i) : 0;
    strcpy(mem[i].host, "127.0.0.1");
    if (i == 0) strcpy(mem[i].unix_path, "/tmp/pshard-4242-7001-0.sock");
    strcpy(mem[i].hostid, "3f2a9c1e");
  }
  ps__membership m = {.epoch = 4, .servers_expected = 2, .workers_expected = 1, .started = 1, .n = 3, .m = mem};
  ps__wbuf_init(&w);
  ps__membership_encode(&w, &m);
  h = hdr(PS_MSG_MEMBERSHIP, 0);
  h.epoch = 4;
  one("membership.bin", h, w.data, w.len, NULL);
  ps__wbuf_free(&w);

  h = hdr(PS_MSG_HEARTBEAT, 0);
  h.sender = 3;
  one("heartbeat.bin", h, NULL, 0, NULL);

  /* declare (to the scheduler) and create (to each server, with the id). */
  ps__declare d;
  memset(&d, 0, sizeof d);
  d.kind = PS_SPARSE;
  d.size = 2;
  strcpy(d.name, "emb");
  strcpy(d.options, "opt=adam lr=0.01 init=normal:0.01");
  ps__wbuf_init(&w);
  ps__declare_encode(&w, &d);
  h = hdr(PS_MSG_DECLARE, 2);
  h.sender = 3;
  one("declare.bin", h, w.data, w.len, &session);
  ps__wbuf_free(&w);
  h = hdr(PS_MSG_DECLARE | PS_FRAME_REPLY, 2);
  h.table = 1;
  one("declare-reply.bin", h, NULL, 0, NULL);
  d.id = 1;
  ps__wbuf_init(&w);
  ps__declare_encode(&w, &d);
  h = hdr(PS_MSG_CREATE, 3);
  h.table = 1;
  h.sender = 3;
  one("create.bin", h, w.data, w.len, &session);
  ps__wbuf_free(&w);
  h = hdr(PS_MSG_CREATE | PS_FRAME_REPLY, 3);
  h.table = 1;
  one("create-reply.bin", h, NULL, 0, NULL);

  /* barrier: clock is the barrier sequence number. */
  h = hdr(PS_MSG_BARRIER, 4);
  h.sender = 3;
  h.clock = 1;
  one("barrier.bin", h, NULL, 0, NULL);
  h = hdr(PS_MSG_BARRIER | PS_FRAME_REPLY, 4);
  h.clock = 1;
  one("barrier-reply.bin", h, NULL, 0, NULL);

  /* metric: str name, f64 value; no reply. */
  ps__wbuf_init(&w);
  ps__wbuf_str(&w, "loss");
  ps__wbuf_f64(&w, 0.693);
  h = hdr(PS_MSG_METRIC, 0);
  h.sender = 3;
  h.clock = 2;
  one("metric.bin", h, w.data, w.len, &session);
  ps__wbuf_free(&w);

  h = hdr(PS_MSG_LEAVE, 0);
  h.sender = 3;
  one("leave.bin", h, NULL, 0, NULL);

  /* Sparse push and pull of 3 keys of a dim-2 table. */
  uint8_t buf[4096];
  static const uint64_t keys[3] = {7, 0, UINT64_MAX};
  for (int i = 0; i < 3; i++) ps__put_u64(buf + 8 * i, keys[i]);
  for (int i = 0; i < 6; i++) {
    float v = 0.5f * (float)(i - 2);
    uint32_t b;
    memcpy(&b, &v, 4);
    ps__put_u32(buf + 24 + 4 * i, b);
  }
  h = hdr(PS_MSG_PUSH, 5);
  h.sender = 3;
  h.table = 1;
  h.batch = 32;
  h.nkeys = 3;
  h.inc = 0x0123456789abcdefull; /* the push's identity: the worker's incarnation, */
  h.seq = 41;                     /* and its sequence to this server */
  one("push.bin", h, buf, 24 + 24, &session);
  h = hdr(PS_MSG_PUSH, 6);
  h.sender = 3;
  h.table = 1;
  h.batch = 32;
  h.lr = 0.05f;
  one("push-empty.bin", h, NULL, 0, NULL);
  h = hdr(PS_MSG_PUSH | PS_FRAME_REPLY, 5);
  h.table = 1;
  one("push-reply.bin", h, NULL, 0, NULL);
  h = hdr(PS_MSG_PULL, 7);
  h.sender = 3;
  h.table = 1;
  h.nkeys = 3;
  h.clock = 1;
  one("pull.bin", h, buf, 24, &session);
  h = hdr(PS_MSG_PULL | PS_FRAME_REPLY, 7);
  h.table = 1;
  h.clock = 1;
  h.epoch = 4;
  one("pull-reply.bin", h, buf + 24, 24, NULL);

  /* Dense: segments are (offset, count) pairs; values follow in segment order. */
  ps__put_u64(buf, 0);
  ps__put_u64(buf + 8, 3);
  ps__put_u64(buf + 16, 65536);
  ps__put_u64(buf + 24, 2);
  memset(buf + 32, 0x3f, 20);
  h = hdr(PS_MSG_PUSH_DENSE, 8);
  h.sender = 3;
  h.table = 2;
  h.batch = 16;
  h.nkeys = 4;
  h.inc = 0x0123456789abcdefull;
  h.seq = 42;
  one("push-dense.bin", h, buf, 32 + 20, &session);
  h = hdr(PS_MSG_PULL_DENSE, 9);
  h.sender = 3;
  h.table = 2;
  h.nkeys = 4;
  h.clock = 1;
  one("pull-dense.bin", h, buf, 32, NULL);
  h = hdr(PS_MSG_PULL_DENSE | PS_FRAME_REPLY, 9);
  h.table = 2;
  h.clock = 1;
  one("pull-dense-reply.bin", h, buf + 32, 20, NULL);

  /* Peer memory: after the segments, the expiry, the shared-buffer hint and one
   * (address, length) pair per region of the sender (protocol.md 6.2a). */
  ps__put_u64(buf + 32, 123456789);
  ps__put_u64(buf + 40, 0);
  ps__put_u64(buf + 48, 0x7f0000001000ull);
  ps__put_u64(buf + 56, 20);
  h = hdr(PS_MSG_PUSH_DENSE, 10);
  h.sender = 3;
  h.table = 2;
  h.batch = 16;
  h.nkeys = 4;
  h.xport = PS_XPORT_PEER_MEM;
  one("push-dense-peer.bin", h, buf, 64, NULL);
  h.type = PS_MSG_PULL_DENSE;
  h.req_id = 11;
  one("pull-dense-peer.bin", h, buf, 64, NULL);
  h = hdr(PS_MSG_PULL_DENSE | PS_FRAME_REPLY, 11);
  h.table = 2;
  h.xport = PS_XPORT_PEER_MEM;
  one("pull-dense-peer-reply.bin", h, NULL, 0, NULL);

  h = hdr(PS_MSG_CLOCK, 0);
  h.sender = 3;
  h.clock = 1;
  one("clock.bin", h, NULL, 0, &session);

  /* Errors: a connection-level notice and an error reply to a data request. */
  static const char notice[] = "bad frame magic 0x00000000";
  h = hdr(PS_MSG_ERROR, 0);
  h.status = PS_ERR_PROTO;
  one("error.bin", h, notice, sizeof notice - 1, NULL);
  static const char moved[] = "key 7 of table 'emb' is not on this server (epoch 4)";
  h = hdr(PS_MSG_PULL | PS_FRAME_REPLY, 7);
  h.status = PS_ERR_MOVED;
  h.table = 1;
  h.clock = 1;
  one("error-reply.bin", h, moved, sizeof moved - 1, NULL);

  h = hdr(PS_MSG_STATS, 10);
  one("stats.bin", h, NULL, 0, &session);
  static const char stats[] = "epoch 4\nstarted 1\nservers_alive 2\nworkers_alive 1\n";
  h = hdr(PS_MSG_STATS | PS_FRAME_REPLY, 10);
  one("stats-reply.bin", h, stats, sizeof stats - 1, NULL);

  /* Data-partition tasks: everything in the header. */
  h = hdr(PS_MSG_TASK_INIT, 12);
  h.sender = 3;
  h.table = 64;
  h.batch = 2;
  one("task-init.bin", h, NULL, 0, &session);
  h = hdr(PS_MSG_TASK_NEXT, 13);
  h.sender = 3;
  h.batch = 5000;
  one("task-next.bin", h, NULL, 0, NULL);
  h = hdr(PS_MSG_TASK_NEXT | PS_FRAME_REPLY, 13);
  h.table = 17;
  h.clock = 1;
  one("task-next-reply.bin", h, NULL, 0, NULL);
  h = hdr(PS_MSG_TASK_DONE, 14);
  h.sender = 3;
  h.table = 17;
  h.clock = 1;
  one("task-done.bin", h, NULL, 0, NULL);

  /* Checkpoints: the scheduler's request to a server and its answer; a request to the
   * scheduler and its answer. */
  {
    ps__wbuf w;
    ps__ckpt_req q = {.id = 4, .clock = 12, .nservers = 2};
    snprintf(q.dir, sizeof q.dir, "/tmp/ck/ckpt-4");
    ps__wbuf_init(&w);
    ps__ckpt_req_encode(&w, &q);
    h = hdr(PS_MSG_CKPT, 15);
    one("ckpt.bin", h, w.data, w.len, NULL);
    ps__wbuf_free(&w);
    ps__ckpt_done d = {.rank = 1, .bytes = 4096, .checksum = 0x1234, .rows = 10};
    snprintf(d.name, sizeof d.name, "server-1.psck");
    ps__wbuf_init(&w);
    ps__ckpt_done_encode(&w, &d);
    h = hdr(PS_MSG_CKPT | PS_FRAME_REPLY, 15);
    h.clock = 12;
    one("ckpt-reply.bin", h, w.data, w.len, NULL);
    ps__wbuf_free(&w);
    h = hdr(PS_MSG_CHECKPOINT, 16);
    h.sender = 3;
    h.clock = 12;
    one("checkpoint.bin", h, NULL, 0, NULL);
    ps__ckpt_info ci = {.id = 4};
    snprintf(ci.dir, sizeof ci.dir, "/tmp/ck/ckpt-4");
    ps__wbuf_init(&w);
    ps__ckpt_info_encode(&w, &ci);
    h = hdr(PS_MSG_CHECKPOINT | PS_FRAME_REPLY, 16);
    h.clock = 12;
    one("checkpoint-reply.bin", h, w.data, w.len, NULL);
    ps__wbuf_free(&w);
  }

  save("stream-session.bin", &session);
  free(session.p);

  /* A dense push of 12000 floats (48 KB, past the direct-read threshold), then a clock. */
  stream big = {0};
  enum { NV = 12000 };
  uint8_t *body = calloc(1, 16 + 4 * NV);
  ps__put_u64(body, 100);
  ps__put_u64(body + 8, NV);
  for (uint32_t i = 0; i < NV; i++) ps__put_u32(body + 16 + 4 * i, i * 2654435761u);
  h = hdr(PS_MSG_PUSH_DENSE, 11);
  h.sender = 3;
  h.table = 2;
  h.batch = 1;
  h.nkeys = 2;
  frame(&big, h, body, 16 + 4 * NV);
  h = hdr(PS_MSG_CLOCK, 0);
  h.sender = 3;
  h.clock = 2;
  frame(&big, h, NULL, 0);
  save("stream-large-push.bin", &big);
  free(big.p);
  free(body);

  /* A valid frame, then a header with a bad magic and some trailing bytes. */
  stream bad = {0};
  h = hdr(PS_MSG_HEARTBEAT, 0);
  frame(&bad, h, NULL, 0);
  uint8_t junk[80];
  memset(junk, 0xab, sizeof junk);
  append(&bad, junk, sizeof junk);
  save("stream-bad-tail.bin", &bad);
  free(bad.p);
  return 0;
}
