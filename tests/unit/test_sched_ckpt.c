/*
 * test_sched_ckpt.c - the scheduler's checkpoints: the STATE block's encoding, the
 * choice of a checkpoint id, and a whole checkpoint and restore against a scheduler
 * running on a thread, with the server and the worker played by blocking sockets in
 * the test (so that the scheduler's side is checked without the server's).
 */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "net/oneshot.h"
#include "sched/sched_int.h"
#include "store/ckpt.h"

/* ------------------------------------------------------------ STATE and ids */

static ps__sched_tasks make_tasks(uint32_t parts, uint32_t epochs, uint32_t epoch, const char *done) {
  ps__sched_tasks t;
  memset(&t, 0, sizeof t);
  t.init = 1;
  t.parts = parts;
  t.epochs = epochs;
  t.epoch = epoch;
  t.state = calloc(parts, 1);
  for (uint32_t p = 0; p < parts; p++)
    t.state[p] = done[p] == 'd' ? PS__TASK_DONE : done[p] == 'a' ? PS__TASK_ASSIGNED : PS__TASK_PENDING;
  return t;
}

Test(sched_state, round_trip_with_tasks) {
  /* 11 partitions: the bits span two bytes; an assigned partition is not done. */
  ps__sched_tasks t = make_tasks(11, 3, 1, "d.ad......d");
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__sched_state_encode(&w, 42, &t);
  cr_assert_eq(w.len, 4 + 4 + 8 + 1 + 12 + 2, "state is %zu bytes", w.len);
  int64_t clock = -7;
  ps__sched_task_restore r;
  cr_assert_eq(ps__sched_state_decode(w.data, w.len, &clock, &r), 0, "%s", ps_errmsg());
  cr_assert_eq(clock, 42);
  cr_assert(r.have);
  cr_assert_eq(r.parts, 11);
  cr_assert_eq(r.epochs, 3);
  cr_assert_eq(r.epoch, 1);
  const char *want = "d..d......d";
  for (uint32_t p = 0; p < 11; p++) cr_assert_eq(r.done[p], want[p] == 'd', "partition %u: %u", p, r.done[p]);
  free(r.done);
  free(t.state);
  ps__wbuf_free(&w);
}

Test(sched_state, round_trip_without_tasks) {
  ps__sched_tasks t;
  memset(&t, 0, sizeof t);
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__sched_state_encode(&w, 0, &t);
  int64_t clock = -1;
  ps__sched_task_restore r;
  cr_assert_eq(ps__sched_state_decode(w.data, w.len, &clock, &r), 0, "%s", ps_errmsg());
  cr_assert_eq(clock, 0);
  cr_assert_not(r.have);
  cr_assert_null(r.done);
  ps__wbuf_free(&w);
}

Test(sched_state, malformed_blocks_fail_cleanly) {
  ps__sched_tasks t = make_tasks(9, 2, 0, "ddd......");
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__sched_state_encode(&w, 5, &t);
  int64_t clock;
  ps__sched_task_restore r;
  /* Every truncation fails (none reads past the end: ASan checks that). */
  for (size_t n = 0; n < w.len; n++) cr_assert_neq(ps__sched_state_decode(w.data, n, &clock, &r), 0, "length %zu", n);
  /* A byte too many, a wrong magic, a wrong version, a zero partition count. */
  uint8_t buf[64];
  memcpy(buf, w.data, w.len);
  buf[w.len] = 0;
  cr_assert_eq(ps__sched_state_decode(buf, w.len + 1, &clock, &r), PS_ERR_IO);
  cr_assert(strstr(ps_errmsg(), "3 bytes, not 2"), "%s", ps_errmsg());
  buf[0] ^= 1;
  cr_assert_eq(ps__sched_state_decode(buf, w.len, &clock, &r), PS_ERR_IO);
  buf[0] ^= 1;
  buf[4] = 9;
  cr_assert_eq(ps__sched_state_decode(buf, w.len, &clock, &r), PS_ERR_IO);
  cr_assert(strstr(ps_errmsg(), "version 9"), "%s", ps_errmsg());
  buf[4] = 1;
  memset(buf + 17, 0, 4);
  cr_assert_eq(ps__sched_state_decode(buf, w.len, &clock, &r), PS_ERR_IO);
  free(t.state);
  ps__wbuf_free(&w);
}

static char *tmpdir(void) {
  char tmpl[] = "/tmp/ps-sched-ckpt-XXXXXX";
  char *d = mkdtemp(tmpl);
  cr_assert_not_null(d);
  return strdup(d);
}

static void rm_rf(const char *d) {
  char cmd[1200];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", d);
  cr_assert_eq(system(cmd), 0);
}

Test(sched_ckpt_id, one_past_the_largest_ckpt_entry) {
  char *d = tmpdir();
  char p[1200];
  uint64_t id = 0;
  cr_assert_eq(ps__sched_ckpt_next_id(d, &id), 0);
  cr_assert_eq(id, 1, "empty dir: %llu", (unsigned long long)id);
  const char *names[] = {"ckpt-3", "ckpt-10", "ckpt-x", "ckpt-", "other-99", "ckpt-7"};
  for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
    snprintf(p, sizeof p, "%s/%s", d, names[i]);
    cr_assert_eq(mkdir(p, 0755), 0);
  }
  cr_assert_eq(ps__sched_ckpt_next_id(d, &id), 0);
  cr_assert_eq(id, 11, "got %llu", (unsigned long long)id);
  snprintf(p, sizeof p, "%s/missing", d);
  cr_assert_eq(ps__sched_ckpt_next_id(p, &id), 0);
  cr_assert_eq(id, 1);
  rm_rf(d);
  free(d);
}

/* ------------------------------------------------------------ a scheduler on a thread */

static void *run_sched(void *arg) {
  ps__sched_run(arg);
  return NULL;
}

static int dial(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
  return fd;
}

static void send_frame(int fd, ps__frame_hdr h, const void *body, size_t len) {
  uint8_t hd[PS_FRAME_HDR_SIZE];
  h.payload_len = len;
  ps__frame_encode(&h, hd);
  cr_assert_eq(write(fd, hd, sizeof hd), (ssize_t)sizeof hd);
  if (len) cr_assert_eq(write(fd, body, len), (ssize_t)len);
}

static void read_full(int fd, void *p, size_t n) {
  size_t got = 0;
  while (got < n) {
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    cr_assert_eq(poll(&pf, 1, 10000), 1, "no frame within 10 s");
    ssize_t r = read(fd, (uint8_t *)p + got, n - got);
    cr_assert_gt(r, 0, "connection closed");
    got += (size_t)r;
  }
}

/* The next frame of type `type` (others, such as MEMBERSHIP, are skipped); its body
 * into body (NUL-terminated). */
static ps__frame_hdr expect(int fd, uint8_t type, char *body, size_t cap) {
  for (;;) {
    uint8_t hd[PS_FRAME_HDR_SIZE];
    ps__frame_hdr h;
    read_full(fd, hd, sizeof hd);
    cr_assert_eq(ps__frame_decode(hd, 1u << 20, &h), 0, "%s", ps_errmsg());
    cr_assert_lt(h.payload_len, cap);
    read_full(fd, body, h.payload_len);
    body[h.payload_len] = 0;
    if (h.type == type) return h;
  }
}

static ps__frame_hdr hello(int fd, uint8_t role) {
  ps__hello hl = {.role = role, .port = 9, .pid = 1};
  snprintf(hl.host, sizeof hl.host, "127.0.0.1");
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__hello_encode(&w, &hl);
  send_frame(fd, (ps__frame_hdr){.type = PS_MSG_HELLO, .req_id = 1}, w.data, w.len);
  ps__wbuf_free(&w);
  char body[4096];
  return expect(fd, PS_MSG_HELLO | PS_FRAME_REPLY, body, sizeof body);
}

static ps__frame_hdr declare(int fd, const char *name, int kind, uint64_t size, const char *opts) {
  ps__declare d = {.kind = (uint8_t)kind, .size = size};
  snprintf(d.name, sizeof d.name, "%s", name);
  snprintf(d.options, sizeof d.options, "%s", opts);
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__declare_encode(&w, &d);
  send_frame(fd, (ps__frame_hdr){.type = PS_MSG_DECLARE, .req_id = 2}, w.data, w.len);
  ps__wbuf_free(&w);
  char body[4096];
  return expect(fd, PS_MSG_DECLARE | PS_FRAME_REPLY, body, sizeof body);
}

typedef struct job {
  ps__sched *s;
  pthread_t th;
  int port;
  char *dir;
} job;

static void job_start(job *j, const char *ckpt_dir, const char *restore) {
  ps__sched_opts o = {.servers = 1, .workers = 1, .checkpoint_dir = ckpt_dir, .restore_dir = restore,
                      .heartbeat_timeout_ms = 20000};
  cr_assert_eq(ps__sched_create(&o, &j->s), 0, "%s", ps_errmsg());
  j->port = ps__sched_port(j->s);
  cr_assert_eq(pthread_create(&j->th, NULL, run_sched, j->s), 0);
}

static void job_stop(job *j) {
  ps__sched_stop(j->s);
  pthread_join(j->th, NULL);
  ps__sched_destroy(j->s);
}

/* The data file a server writes into the checkpoint directory cdir (the scheduler
 * reads its TABLE blocks back): with table id `sparse` > 0, one row of that sparse
 * table of dim 2 (opt=sgd). */
static void fake_file(const char *cdir, uint64_t id, uint32_t sparse) {
  char path[1300];
  snprintf(path, sizeof path, "%s/server-0.psck", cdir);
  ps__ckpt_header hd = {.what = PS_CKPT_DATA, .id = id, .clock = -1, .rank = 0, .nservers = 1};
  ps__ckpt_writer *w;
  cr_assert_eq(ps__ckpt_writer_open(&w, path, &hd), 0, "%s", ps_errmsg());
  if (sparse) {
    ps__ckpt_table t;
    memset(&t, 0, sizeof t);
    t.decl.id = sparse;
    t.decl.kind = PS_SPARSE;
    t.decl.size = 2;
    snprintf(t.decl.name, sizeof t.decl.name, "emb");
    snprintf(t.decl.options, sizeof t.decl.options, "opt=sgd");
    t.width = 2;
    t.row_floats = 2;
    t.nrows = 1;
    uint64_t key = 42;
    float row[2] = {1, 2};
    cr_assert_eq(ps__ckpt_write_table(w, &t), 0, "%s", ps_errmsg());
    cr_assert_eq(ps__ckpt_write_rows(w, sparse, 2, &key, row, 1, 0, UINT64_MAX), 0, "%s", ps_errmsg());
  }
  cr_assert_eq(ps__ckpt_writer_close(w, 1, NULL), 0, "%s", ps_errmsg());
}

/* A server's file holding the TABLE blocks of emb (sparse, dim 4, adam) and w (dense
 * 100 floats, adagrad), without rows: the tables the server cut. */
static void fake_file_two(const char *cdir, uint64_t id, uint32_t emb, uint32_t w) {
  char path[1300];
  snprintf(path, sizeof path, "%s/server-0.psck", cdir);
  ps__ckpt_header hd = {.what = PS_CKPT_DATA, .id = id, .clock = 5, .rank = 0, .nservers = 1};
  ps__ckpt_writer *wr;
  cr_assert_eq(ps__ckpt_writer_open(&wr, path, &hd), 0, "%s", ps_errmsg());
  ps__ckpt_table t;
  memset(&t, 0, sizeof t);
  t.decl.id = emb;
  t.decl.kind = PS_SPARSE;
  t.decl.size = 4;
  snprintf(t.decl.name, sizeof t.decl.name, "emb");
  snprintf(t.decl.options, sizeof t.decl.options, "opt=adam lr=0.01");
  t.width = 4;
  t.row_floats = 12;
  cr_assert_eq(ps__ckpt_write_table(wr, &t), 0, "%s", ps_errmsg());
  memset(&t, 0, sizeof t);
  t.decl.id = w;
  t.decl.kind = PS_DENSE;
  t.decl.size = 100;
  snprintf(t.decl.name, sizeof t.decl.name, "w");
  snprintf(t.decl.options, sizeof t.decl.options, "opt=adagrad lr=0.1");
  t.width = 100;
  t.row_floats = 200;
  cr_assert_eq(ps__ckpt_write_table(wr, &t), 0, "%s", ps_errmsg());
  cr_assert_eq(ps__ckpt_writer_close(wr, 1, NULL), 0, "%s", ps_errmsg());
}

Test(sched_ckpt, take_then_restore) {
  char *d = tmpdir();
  char body[8192];
  job j;
  job_start(&j, d, NULL);
  int srv = dial(j.port), wk = dial(j.port);
  cr_assert_eq(hello(srv, PS_ROLE_SERVER).clock, 0);
  cr_assert_eq(hello(wk, PS_ROLE_WORKER).clock, 0, "a fresh job starts at clock 0");
  uint32_t emb = declare(wk, "emb", PS_SPARSE, 4, "opt=adam lr=0.01").table;
  uint32_t w = declare(wk, "w", PS_DENSE, 100, "opt=adagrad lr=0.1").table;
  /* Tasks: 4 partitions, 2 epochs; partition 0 done, partition 1 handed out. */
  send_frame(wk, (ps__frame_hdr){.type = PS_MSG_TASK_INIT, .req_id = 3, .table = 4, .batch = 2}, NULL, 0);
  expect(wk, PS_MSG_TASK_INIT | PS_FRAME_REPLY, body, sizeof body);
  ps__frame_hdr t0, t1;
  send_frame(wk, (ps__frame_hdr){.type = PS_MSG_TASK_NEXT, .req_id = 4}, NULL, 0);
  t0 = expect(wk, PS_MSG_TASK_NEXT | PS_FRAME_REPLY, body, sizeof body);
  send_frame(wk, (ps__frame_hdr){.type = PS_MSG_TASK_NEXT, .req_id = 5}, NULL, 0);
  t1 = expect(wk, PS_MSG_TASK_NEXT | PS_FRAME_REPLY, body, sizeof body);
  cr_assert_eq(t0.status, 0);
  cr_assert_eq(t1.status, 0);
  send_frame(wk, (ps__frame_hdr){.type = PS_MSG_TASK_DONE, .req_id = 6, .table = t0.table, .clock = 0}, NULL, 0);
  expect(wk, PS_MSG_TASK_DONE | PS_FRAME_REPLY, body, sizeof body);

  /* A checkpoint at clock 5: the server gets CKPT {1, 5, 1, DIR/ckpt-1} and answers. */
  send_frame(wk, (ps__frame_hdr){.type = PS_MSG_CHECKPOINT, .req_id = 77, .clock = 5}, NULL, 0);
  ps__frame_hdr q = expect(srv, PS_MSG_CKPT, body, sizeof body);
  ps__ckpt_req req;
  cr_assert_eq(ps__ckpt_req_decode(body, q.payload_len, &req), 0, "%s", ps_errmsg());
  char want[1200];
  ps__ckpt_dir_of(d, 1, want, sizeof want);
  cr_assert_eq(req.id, 1);
  cr_assert_eq(req.clock, 5);
  cr_assert_eq(req.nservers, 1);
  cr_assert_str_eq(req.dir, want);
  struct stat st;
  cr_assert_eq(stat(want, &st), 0, "the scheduler creates the checkpoint's directory");
  /* Meanwhile a second request is refused. */
  send_frame(wk, (ps__frame_hdr){.type = PS_MSG_CHECKPOINT, .req_id = 78, .clock = 6}, NULL, 0);
  ps__frame_hdr busy = expect(wk, PS_MSG_CHECKPOINT | PS_FRAME_REPLY, body, sizeof body);
  cr_assert_eq(busy.req_id, 78);
  cr_assert_eq(busy.status, PS_ERR_UNAVAILABLE);
  cr_assert(strstr(body, "a checkpoint is being taken"), "%s", body);
  fake_file_two(want, 1, emb, w);
  ps__ckpt_done dn = {.rank = 0, .bytes = 1000, .checksum = 0xabc, .rows = 12};
  snprintf(dn.name, sizeof dn.name, "server-0.psck");
  ps__wbuf wb;
  ps__wbuf_init(&wb);
  ps__ckpt_done_encode(&wb, &dn);
  send_frame(srv, (ps__frame_hdr){.type = PS_MSG_CKPT | PS_FRAME_REPLY, .req_id = q.req_id}, wb.data, wb.len);
  ps__wbuf_free(&wb);
  ps__frame_hdr done = expect(wk, PS_MSG_CHECKPOINT | PS_FRAME_REPLY, body, sizeof body);
  cr_assert_eq(done.status, 0, "%s", body);
  cr_assert_eq(done.req_id, 77);
  cr_assert_eq(done.clock, 5);
  ps__ckpt_info info;
  cr_assert_eq(ps__ckpt_info_decode(body, done.payload_len, &info), 0);
  cr_assert_eq(info.id, 1);
  cr_assert_str_eq(info.dir, want);

  /* The manifest: header, two tables, the file, the state. */
  char mpath[1300];
  snprintf(mpath, sizeof mpath, "%s/MANIFEST", want);
  ps__ckpt_reader *r;
  ps__ckpt_header hd;
  cr_assert_eq(ps__ckpt_reader_open(&r, mpath, &hd), 0, "%s", ps_errmsg());
  cr_assert_eq(hd.what, PS_CKPT_MANIFEST);
  cr_assert_eq(hd.id, 1);
  cr_assert_eq(hd.clock, 5);
  cr_assert_eq(hd.nservers, 1);
  int ntables = 0, nfiles = 0, nstate = 0;
  for (;;) {
    ps__ckpt_block b;
    cr_assert_eq(ps__ckpt_next(r, &b, NULL, NULL), 0, "%s", ps_errmsg());
    if (b.kind == PS_CKPT_B_END) break;
    if (b.kind == PS_CKPT_B_TABLE) {
      ntables++;
      if (b.table.decl.id == emb) {
        cr_assert_str_eq(b.table.decl.name, "emb");
        cr_assert_eq(b.table.row_floats, 12, "adam dim 4: %u", b.table.row_floats);
      } else {
        cr_assert_eq(b.table.decl.id, w);
        cr_assert_str_eq(b.table.decl.options, "opt=adagrad lr=0.1");
      }
    } else if (b.kind == PS_CKPT_B_FILE) {
      nfiles++;
      cr_assert_str_eq(b.file.name, "server-0.psck");
      cr_assert_eq(b.file.bytes, 1000);
      cr_assert_eq(b.file.checksum, 0xabc);
      cr_assert_eq(b.file.rows, 12);
    } else if (b.kind == PS_CKPT_B_STATE) {
      nstate++;
      int64_t c;
      ps__sched_task_restore tr;
      cr_assert_eq(ps__sched_state_decode(b.state, b.state_len, &c, &tr), 0);
      cr_assert_eq(c, 5);
      cr_assert(tr.have && tr.parts == 4 && tr.epochs == 2 && tr.epoch == 0);
      for (uint32_t p = 0; p < 4; p++) cr_assert_eq(tr.done[p], p == t0.table, "partition %u", p);
      free(tr.done);
    }
  }
  ps__ckpt_reader_close(r);
  cr_assert_eq(ntables, 2);
  cr_assert_eq(nfiles, 1);
  cr_assert_eq(nstate, 1);

  /* A checkpoint at "any clock": a probe (id 0), then the cut at the largest probed
   * clock + 2; the server's error fails it and names the server. */
  send_frame(wk, (ps__frame_hdr){.type = PS_MSG_CHECKPOINT, .req_id = 79, .clock = -1}, NULL, 0);
  q = expect(srv, PS_MSG_CKPT, body, sizeof body);
  cr_assert_eq(ps__ckpt_req_decode(body, q.payload_len, &req), 0);
  cr_assert_eq(req.id, 0, "a probe first");
  send_frame(srv, (ps__frame_hdr){.type = PS_MSG_CKPT | PS_FRAME_REPLY, .req_id = q.req_id, .clock = 7}, NULL, 0);
  q = expect(srv, PS_MSG_CKPT, body, sizeof body);
  cr_assert_eq(ps__ckpt_req_decode(body, q.payload_len, &req), 0);
  cr_assert_eq(req.id, 2);
  cr_assert_eq(req.clock, 9);
  const char *err = "cannot write server-0.psck: no space left on device";
  send_frame(srv, (ps__frame_hdr){.type = PS_MSG_CKPT | PS_FRAME_REPLY, .req_id = q.req_id, .status = PS_ERR_IO}, err,
             strlen(err));
  ps__frame_hdr bad = expect(wk, PS_MSG_CHECKPOINT | PS_FRAME_REPLY, body, sizeof body);
  cr_assert_eq(bad.req_id, 79);
  cr_assert_eq(bad.status, PS_ERR_IO);
  cr_assert(strstr(body, "server rank 0") && strstr(body, "no space left"), "%s", body);
  close(srv);
  close(wk);
  job_stop(&j);

  /* Restore: the clock, the registry with its ids, the tasks. */
  job_start(&j, d, d);
  srv = dial(j.port);
  wk = dial(j.port);
  hello(srv, PS_ROLE_SERVER);
  cr_assert_eq(hello(wk, PS_ROLE_WORKER).clock, 5, "a restored job starts at the checkpoint's clock");
  cr_assert_eq(declare(wk, "w", PS_DENSE, 100, "opt=adagrad lr=0.1").table, w);
  cr_assert_eq(declare(wk, "emb", PS_SPARSE, 4, "opt=adam lr=0.01").table, emb);
  cr_assert_eq(declare(wk, "emb", PS_SPARSE, 8, "opt=adam lr=0.01").status, PS_ERR_CONFLICT);
  uint32_t fresh = declare(wk, "bias", PS_DENSE, 1, "opt=sgd lr=0.1").table;
  cr_assert(fresh != emb && fresh != w, "a new table gets a new id (%u)", fresh);
  send_frame(wk, (ps__frame_hdr){.type = PS_MSG_TASK_INIT, .req_id = 3, .table = 4, .batch = 2}, NULL, 0);
  expect(wk, PS_MSG_TASK_INIT | PS_FRAME_REPLY, body, sizeof body);
  int seen[4] = {0};
  for (int i = 0; i < 3; i++) {
    send_frame(wk, (ps__frame_hdr){.type = PS_MSG_TASK_NEXT, .req_id = 10 + (uint64_t)i}, NULL, 0);
    ps__frame_hdr t = expect(wk, PS_MSG_TASK_NEXT | PS_FRAME_REPLY, body, sizeof body);
    cr_assert_eq(t.status, 0);
    cr_assert_eq(t.clock, 0);
    seen[t.table]++;
  }
  cr_assert_eq(seen[t0.table], 0, "the partition done before the checkpoint is not handed out again");
  close(srv);
  close(wk);
  job_stop(&j);
  rm_rf(d);
  free(d);
}

Test(sched_ckpt, refused_without_a_directory_or_servers) {
  job j;
  job_start(&j, NULL, NULL);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", j.port);
  ps__frame_hdr req = {.type = PS_MSG_CHECKPOINT, .req_id = 1, .clock = -1}, rep;
  void *out = NULL;
  size_t len = 0;
  cr_assert_eq(ps__oneshot(addr, &req, NULL, 0, 5000, 4096, &rep, &out, &len), PS_ERR_CONFIG);
  cr_assert(strstr(ps_errmsg(), "no checkpoint directory"), "%s", ps_errmsg());
  job_stop(&j);

  char *d = tmpdir();
  job_start(&j, d, NULL);
  snprintf(addr, sizeof addr, "127.0.0.1:%d", j.port);
  cr_assert_eq(ps__oneshot(addr, &req, NULL, 0, 5000, 4096, &rep, &out, &len), PS_ERR_UNAVAILABLE);
  cr_assert(strstr(ps_errmsg(), "no server is alive"), "%s", ps_errmsg());
  job_stop(&j);
  rm_rf(d);
  free(d);
}

Test(sched_ckpt, a_bad_restore_fails_create) {
  char *d = tmpdir();
  ps__sched_opts o = {.servers = 1, .workers = 1, .restore_dir = d};
  ps__sched *s = NULL;
  cr_assert_neq(ps__sched_create(&o, &s), 0, "an empty directory holds no checkpoint");
  char p[1200];
  snprintf(p, sizeof p, "%s/MANIFEST", d);
  FILE *f = fopen(p, "w");
  fputs("not a manifest", f);
  fclose(f);
  int rc = ps__sched_create(&o, &s);
  cr_assert_neq(rc, 0, "a bad manifest fails the create");
  cr_assert(strstr(ps_errmsg(), "MANIFEST"), "the message names the file: %s", ps_errmsg());
  rm_rf(d);
  free(d);
}

/* The STATE block of checkpoint id in dir (the manifest of dir/ckpt-<id>). */
static ps__sched_task_restore read_state(const char *dir, uint64_t id, uint64_t *sparse_rows) {
  char cdir[1200], mpath[1300];
  ps__ckpt_dir_of(dir, id, cdir, sizeof cdir);
  snprintf(mpath, sizeof mpath, "%s/MANIFEST", cdir);
  ps__ckpt_reader *r;
  ps__ckpt_header hd;
  cr_assert_eq(ps__ckpt_reader_open(&r, mpath, &hd), 0, "%s", ps_errmsg());
  ps__sched_task_restore tr;
  memset(&tr, 0, sizeof tr);
  for (;;) {
    ps__ckpt_block b;
    cr_assert_eq(ps__ckpt_next(r, &b, NULL, NULL), 0, "%s", ps_errmsg());
    if (b.kind == PS_CKPT_B_END) break;
    int64_t c;
    if (b.kind == PS_CKPT_B_STATE) cr_assert_eq(ps__sched_state_decode(b.state, b.state_len, &c, &tr), 0);
    if (b.kind == PS_CKPT_B_TABLE && b.table.decl.kind == PS_SPARSE) *sparse_rows = b.table.nrows;
  }
  ps__ckpt_reader_close(r);
  return tr;
}

/* The server's side of a checkpoint: the CKPT it gets (its req_id into *req_id). */
static ps__ckpt_req server_cut(int srv, char *body, size_t cap, uint64_t *req_id) {
  ps__frame_hdr q = expect(srv, PS_MSG_CKPT, body, cap);
  ps__ckpt_req req;
  cr_assert_eq(ps__ckpt_req_decode(body, q.payload_len, &req), 0, "%s", ps_errmsg());
  *req_id = q.req_id;
  return req;
}

static void server_done(int srv, uint64_t req_id, const ps__ckpt_req *req, uint32_t sparse) {
  fake_file(req->dir, req->id, sparse);
  ps__ckpt_done dn = {.rank = 0, .bytes = 10, .checksum = 1, .rows = 0};
  snprintf(dn.name, sizeof dn.name, "server-0.psck");
  ps__wbuf wb;
  ps__wbuf_init(&wb);
  ps__ckpt_done_encode(&wb, &dn);
  send_frame(srv, (ps__frame_hdr){.type = PS_MSG_CKPT | PS_FRAME_REPLY, .req_id = req_id}, wb.data, wb.len);
  ps__wbuf_free(&wb);
}

static uint32_t task_next(int wk, uint64_t req_id, uint32_t *epoch) {
  char body[256];
  send_frame(wk, (ps__frame_hdr){.type = PS_MSG_TASK_NEXT, .req_id = req_id}, NULL, 0);
  ps__frame_hdr t = expect(wk, PS_MSG_TASK_NEXT | PS_FRAME_REPLY, body, sizeof body);
  cr_assert_eq(t.status, 0, "task_next: status %d", t.status);
  if (epoch) *epoch = (uint32_t)t.clock;
  return t.table;
}

static void task_done(int wk, uint64_t req_id, uint32_t part, uint32_t epoch) {
  char body[256];
  send_frame(wk, (ps__frame_hdr){.type = PS_MSG_TASK_DONE, .req_id = req_id, .table = part, .clock = epoch}, NULL, 0);
  cr_assert_eq(expect(wk, PS_MSG_TASK_DONE | PS_FRAME_REPLY, body, sizeof body).status, 0);
}

Test(sched_ckpt, task_state_of_the_cut_and_a_named_directory) {
  /* A scheduler without a checkpoint directory takes one into the directory a request
   * names; the task state is the one of the moment the cut was sent. */
  char *d = tmpdir();
  char named[1200], body[8192];
  snprintf(named, sizeof named, "%s/saved", d);
  job j;
  job_start(&j, NULL, NULL);
  int srv = dial(j.port), wk = dial(j.port);
  hello(srv, PS_ROLE_SERVER);
  hello(wk, PS_ROLE_WORKER);
  uint32_t emb = declare(wk, "emb", PS_SPARSE, 2, "opt=sgd").table;
  send_frame(wk, (ps__frame_hdr){.type = PS_MSG_TASK_INIT, .req_id = 3, .table = 3, .batch = 1}, NULL, 0);
  expect(wk, PS_MSG_TASK_INIT | PS_FRAME_REPLY, body, sizeof body);
  uint32_t a = task_next(wk, 4, NULL), b = task_next(wk, 5, NULL);
  task_done(wk, 6, a, 0);
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__wbuf_str(&w, named);
  send_frame(wk, (ps__frame_hdr){.type = PS_MSG_CHECKPOINT, .req_id = 7, .clock = 3}, w.data, w.len);
  ps__wbuf_free(&w);
  uint64_t rid;
  ps__ckpt_req req = server_cut(srv, body, sizeof body, &rid);
  char want[1300];
  ps__ckpt_dir_of(named, 1, want, sizeof want);
  cr_assert_str_eq(req.dir, want, "the cut goes into the named directory");
  /* b is finished while the servers write: its pushes may be past the cut. */
  task_done(wk, 8, b, 0);
  server_done(srv, rid, &req, emb);
  ps__frame_hdr rep = expect(wk, PS_MSG_CHECKPOINT | PS_FRAME_REPLY, body, sizeof body);
  cr_assert_eq(rep.status, 0, "%s", body);
  uint64_t srows = 0;
  ps__sched_task_restore tr = read_state(named, 1, &srows);
  cr_assert_eq(srows, 1, "the manifest has the sparse table's rows over the files: %llu", (unsigned long long)srows);
  cr_assert(tr.have && tr.parts == 3 && tr.epoch == 0);
  for (uint32_t p = 0; p < 3; p++) cr_assert_eq(tr.done[p], p == a, "partition %u done: %u", p, tr.done[p]);
  free(tr.done);
  /* A bad body is refused with a message. */
  send_frame(wk, (ps__frame_hdr){.type = PS_MSG_CHECKPOINT, .req_id = 9, .clock = 3}, "xy", 2);
  rep = expect(wk, PS_MSG_CHECKPOINT | PS_FRAME_REPLY, body, sizeof body);
  cr_assert_eq(rep.status, PS_ERR_INVALID);
  cr_assert(strstr(body, "directory"), "%s", body);

  /* Finish every epoch, save again: a restore of a finished schedule starts afresh. */
  uint32_t c = task_next(wk, 10, NULL);
  task_done(wk, 11, c, 0);
  ps__wbuf_init(&w);
  ps__wbuf_str(&w, named);
  send_frame(wk, (ps__frame_hdr){.type = PS_MSG_CHECKPOINT, .req_id = 12, .clock = 4}, w.data, w.len);
  ps__wbuf_free(&w);
  req = server_cut(srv, body, sizeof body, &rid);
  ps__ckpt_dir_of(named, 2, want, sizeof want);
  cr_assert_str_eq(req.dir, want);
  server_done(srv, rid, &req, emb);
  cr_assert_eq(expect(wk, PS_MSG_CHECKPOINT | PS_FRAME_REPLY, body, sizeof body).status, 0, "%s", body);
  close(srv);
  close(wk);
  job_stop(&j);

  /* Restoring checkpoint 1 resumes epoch 0 without a; checkpoint 2 starts afresh. */
  char one[1300];
  ps__ckpt_dir_of(named, 1, one, sizeof one);
  for (int round = 0; round < 2; round++) {
    job_start(&j, NULL, round == 0 ? one : named);
    srv = dial(j.port);
    wk = dial(j.port);
    hello(srv, PS_ROLE_SERVER);
    cr_assert_eq(hello(wk, PS_ROLE_WORKER).clock, round == 0 ? 3 : 4);
    send_frame(wk, (ps__frame_hdr){.type = PS_MSG_TASK_INIT, .req_id = 3, .table = 3, .batch = 1}, NULL, 0);
    expect(wk, PS_MSG_TASK_INIT | PS_FRAME_REPLY, body, sizeof body);
    int seen[3] = {0};
    int n = round == 0 ? 2 : 3;
    for (int i = 0; i < n; i++) {
      uint32_t e, p = task_next(wk, 20 + (uint64_t)i, &e);
      cr_assert_eq(e, 0);
      cr_assert_lt(p, 3);
      seen[p]++;
    }
    if (round == 0) cr_assert(!seen[a] && seen[b] && seen[c], "only the partitions not done at the cut");
    else cr_assert(seen[0] && seen[1] && seen[2], "a finished schedule starts afresh");
    close(srv);
    close(wk);
    job_stop(&j);
  }
  /* Checkpoints a request named are never pruned. */
  struct stat st;
  cr_assert_eq(stat(one, &st), 0);
  rm_rf(d);
  free(d);
}

/* ------------------------------------------------------------ registration tokens */

static ps__frame_hdr hello_token(int fd, uint8_t role, uint64_t token, uint32_t sender) {
  ps__hello hl = {.role = role, .port = 9, .pid = 1, .token = token};
  snprintf(hl.host, sizeof hl.host, "127.0.0.1");
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__hello_encode(&w, &hl);
  send_frame(fd, (ps__frame_hdr){.type = PS_MSG_HELLO, .req_id = 1, .sender = sender}, w.data, w.len);
  ps__wbuf_free(&w);
  char body[4096];
  for (;;) { /* the answer, or the error that refuses it */
    uint8_t hd[PS_FRAME_HDR_SIZE];
    ps__frame_hdr h;
    read_full(fd, hd, sizeof hd);
    cr_assert_eq(ps__frame_decode(hd, 1u << 20, &h), 0, "%s", ps_errmsg());
    cr_assert_lt(h.payload_len, sizeof body);
    read_full(fd, body, h.payload_len);
    if (h.type == (PS_MSG_HELLO | PS_FRAME_REPLY) || h.type == PS_MSG_ERROR || h.status) return h;
  }
}

static void job_start_state(job *j, const char *state_dir) {
  ps__sched_opts o = {.servers = 1, .workers = 2, .state_dir = state_dir, .heartbeat_timeout_ms = 20000};
  cr_assert_eq(ps__sched_create(&o, &j->s), 0, "%s", ps_errmsg());
  j->port = ps__sched_port(j->s);
  cr_assert_eq(pthread_create(&j->th, NULL, run_sched, j->s), 0);
}

/* A node whose registration the scheduler took and saved, but whose answer was lost
 * (the scheduler died before sending it), registers again with the same token: the
 * scheduler started again from its state gives it back its id and rank instead of
 * registering a second node. Another token, or the same one under another role, is a
 * new node. */
Test(sched_state, a_registration_sent_again_with_its_token_keeps_its_id_and_rank) {
  char *d = tmpdir();
  job j;
  job_start_state(&j, d);
  int srv = dial(j.port), w0 = dial(j.port), w1 = dial(j.port);
  ps__frame_hdr s0 = hello_token(srv, PS_ROLE_SERVER, 0x1111, 0);
  ps__frame_hdr a = hello_token(w0, PS_ROLE_WORKER, 0xabcdef0123456789ull, 0);
  ps__frame_hdr b = hello_token(w1, PS_ROLE_WORKER, 0x2222, 0);
  cr_assert_eq(a.status, 0);
  cr_assert_eq(b.status, 0);
  cr_assert_neq(a.table, b.table);
  close(srv);
  close(w0);
  close(w1);
  job_stop(&j); /* as if killed: the state file holds the three registrations */

  job_start_state(&j, d);
  /* Worker a never saw its answer: it registers afresh (sender 0), same token. */
  w0 = dial(j.port);
  ps__frame_hdr again = hello_token(w0, PS_ROLE_WORKER, 0xabcdef0123456789ull, 0);
  cr_assert_eq(again.status, 0);
  cr_assert_eq(again.table, a.table, "id %u, first registered as %u", again.table, a.table);
  cr_assert_eq(again.batch, a.batch, "rank %u, first registered as %u", again.batch, a.batch);
  /* The same token under another role is not that node. */
  int x = dial(j.port);
  ps__frame_hdr other = hello_token(x, PS_ROLE_SERVER, 0x2222, 0);
  cr_assert(other.status != 0 || (other.table != b.table && other.table != s0.table),
            "a server took worker %u's place by its token", b.table);
  close(x);
  /* Worker b comes back by its id, as a node that saw its answer does. */
  w1 = dial(j.port);
  ps__frame_hdr back = hello_token(w1, PS_ROLE_WORKER, 0x2222, b.table);
  cr_assert_eq(back.status, 0);
  cr_assert_eq(back.table, b.table);
  /* Now connected, its token names no free node: a third process with it is new. */
  int y = dial(j.port);
  ps__frame_hdr third = hello_token(y, PS_ROLE_WORKER, 0xabcdef0123456789ull, 0);
  cr_assert(third.status != 0 || third.table != a.table, "a connected node's place was taken by its token");
  close(y);
  close(w0);
  close(w1);
  job_stop(&j);
  rm_rf(d);
  free(d);
}
