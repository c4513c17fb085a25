/*
 * fuzz_conn.c - fuzz target for the connection read path (net/conn.c).
 *
 * An input is a byte stream as a peer would send it: any number of frames, possibly
 * broken. It is written into one end of an AF_UNIX socketpair in chunks of
 * pseudo-random size (one chunk per loop iteration, so the reader sees partial
 * headers, partial bodies, and bodies long enough for the direct-read path); the
 * other end is a ps__conn on a private libuv loop. No network, no threads.
 *
 * The owner callbacks pick, per frame and deterministically from the input, where the
 * body goes: a pooled buffer (sometimes taken by on_frame), caller regions split at
 * random points (some empty), discard, a refusal, or regions of the wrong total size.
 * Some frames are answered or close the connection from on_frame.
 *
 * Oracle: a reference walk of the same bytes with ps__frame_decode. The connection
 * must report exactly the frames the walk finds, in order, with bodies equal to the
 * input bytes, and close with the walk's verdict (PS_ERR_CLOSED at end of input, else
 * the decoder's error), unless the harness itself refused or closed.
 */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include "common/common.h"
#include "net/net.h"
#include "proto/frame.h"

#define FUZZ_MAX_PAYLOAD (1u << 20)
#define MAX_ITER 200000

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      fprintf(stderr, "fuzz_conn: property violated at %s:%d: %s\n", __FILE__,       \
              __LINE__, #cond);                                                     \
      abort();                                                                      \
    }                                                                               \
  } while (0)

enum { MODE_POOL, MODE_POOL_TAKE, MODE_IOV, MODE_DISCARD, MODE_REFUSE, MODE_BADSUM };
enum { AFTER_NONE, AFTER_REPLY, AFTER_CLOSE, AFTER_CLOSE_FLUSH };

typedef struct harness {
  const uint8_t *data;
  size_t size;
  uint64_t rng;
  ps__pool *pool;
  /* writer side */
  uv_pipe_t writer;
  uv_idle_t idle;
  size_t wpos;
  int writer_closed;
  unsigned iter;
  /* reader side */
  ps__conn *conn;
  int closed, close_status;
  size_t next;         /* where the next header must start */
  size_t cur;          /* start of the frame being read */
  int mode, after;
  uint8_t *dest;       /* caller regions of the current frame */
  uint64_t headers, frames;
  int stopped_by_harness;
  int expect_status;   /* status of a harness-caused close, -1 none */
} harness;

static uint64_t rnd(harness *H) {
  uint64_t x = H->rng;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  H->rng = x;
  return x;
}

/* ------------------------------------------------------------------ reader callbacks */

static int on_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  harness *H = c->udata;
  uint8_t enc[PS_FRAME_HDR_SIZE];
  CHECK(!H->closed);
  CHECK(H->next + PS_FRAME_HDR_SIZE <= H->size);
  ps__frame_encode(h, enc);
  CHECK(memcmp(enc, H->data + H->next, PS_FRAME_HDR_SIZE) == 0);
  CHECK(h->payload_len <= FUZZ_MAX_PAYLOAD);
  H->cur = H->next;
  H->next = H->cur + PS_FRAME_HDR_SIZE + (size_t)h->payload_len;
  H->headers++;
  /* Refusals and closes end the stream, so they are rare enough for later frames. */
  unsigned r = (unsigned)(rnd(H) % 32);
  H->mode = r == 0 ? MODE_REFUSE : r == 1 ? MODE_BADSUM : r < 10 ? MODE_DISCARD : r < 18 ? MODE_IOV
          : r < 24 ? MODE_POOL_TAKE : MODE_POOL;
  r = (unsigned)(rnd(H) % 32);
  H->after = r == 0 ? AFTER_CLOSE : r == 1 ? AFTER_CLOSE_FLUSH : r < 6 ? AFTER_REPLY : AFTER_NONE;
  b->udata = H;
  switch (H->mode) {
  case MODE_DISCARD:
    b->discard = 1;
    return 0;
  case MODE_REFUSE:
    H->stopped_by_harness = 1;
    H->expect_status = PS_ERR_INVALID;
    return ps__fail(PS_ERR_INVALID, "fuzz harness refuses this %s frame", ps__frame_type_name(h->type));
  case MODE_IOV:
  case MODE_BADSUM: {
    size_t len = (size_t)h->payload_len;
    size_t extra = H->mode == MODE_BADSUM ? 1 + (size_t)(rnd(H) % 16) : 0;
    H->dest = malloc(len + extra + 1);
    CHECK(H->dest != NULL);
    unsigned n = 1 + (unsigned)(rnd(H) % PS_BODY_MAX_IOV);
    size_t off = 0, total = len + extra;
    for (unsigned i = 0; i < n; i++) {
      size_t take = i + 1 == n ? total - off : (size_t)(rnd(H) % (total - off + 1));
      if (i + 1 < n && rnd(H) % 4 == 0) take = 0;
      b->iov_small[i] = uv_buf_init((char *)H->dest + off, 0);
      b->iov_small[i].len = take;
      off += take;
    }
    b->iov = b->iov_small;
    b->niov = n;
    if (H->mode == MODE_BADSUM && len > 0) { /* an empty body skips the size check */
      H->stopped_by_harness = 1;
      H->expect_status = PS_ERR_SIZE;
    }
    return 0;
  }
  default:
    return 0;
  }
}

static void on_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  harness *H = c->udata;
  const uint8_t *want = H->data + H->cur + PS_FRAME_HDR_SIZE;
  size_t len = (size_t)h->payload_len;
  CHECK(!H->closed);
  CHECK(b->udata == H);
  CHECK(H->mode != MODE_DISCARD && H->mode != MODE_REFUSE);
  CHECK(H->cur + PS_FRAME_HDR_SIZE + len <= H->size);
  H->frames++;
  if (H->mode == MODE_IOV || H->mode == MODE_BADSUM) {
    CHECK(H->mode == MODE_IOV || len == 0);
    CHECK(len == 0 || memcmp(H->dest, want, len) == 0);
    free(H->dest);
    H->dest = NULL;
  } else if (len == 0) {
    CHECK(b->buf == NULL);
  } else {
    CHECK(b->buf != NULL && b->len == len);
    CHECK(memcmp(b->buf, want, len) == 0);
    if (H->mode == MODE_POOL_TAKE) {
      ps__pool_put(H->pool, b->buf, b->len);
      b->buf = NULL;
    }
  }
  switch (H->after) {
  case AFTER_REPLY:
    ps__conn_send_error(c, h, PS_ERR_INVALID, "fuzz harness reply");
    break;
  case AFTER_CLOSE:
    H->stopped_by_harness = 1;
    H->expect_status = 0;
    ps__conn_close(c, 0);
    break;
  case AFTER_CLOSE_FLUSH:
    H->stopped_by_harness = 1;
    H->expect_status = 0;
    ps__conn_close_after_flush(c, 0);
    break;
  default:
    break;
  }
}

static void on_close(ps__conn *c, int status) {
  harness *H = c->udata;
  CHECK(!H->closed);
  H->closed = 1;
  H->close_status = status;
  H->conn = NULL;
  free(H->dest);
  H->dest = NULL;
}

static const ps__conn_ops fuzz_ops = {on_header, on_frame, on_close};

/* ------------------------------------------------------------------ writer */

static void writer_stop(harness *H) {
  if (H->writer_closed) return;
  H->writer_closed = 1;
  uv_idle_stop(&H->idle);
  uv_close((uv_handle_t *)&H->idle, NULL);
  uv_close((uv_handle_t *)&H->writer, NULL);
}

static size_t chunk_size(harness *H) {
  uint64_t r = rnd(H) % 10;
  if (r < 5) return 1 + (size_t)(rnd(H) % 128);
  if (r < 8) return 129 + (size_t)(rnd(H) % 4096);
  return 4097 + (size_t)(rnd(H) % 70000);
}

static void idle_cb(uv_idle_t *idle) {
  harness *H = idle->data;
  if (H->closed || H->wpos == H->size || ++H->iter > MAX_ITER) {
    writer_stop(H);
    return;
  }
  size_t n = chunk_size(H);
  if (n > H->size - H->wpos) n = H->size - H->wpos;
  uv_buf_t b = uv_buf_init((char *)H->data + H->wpos, (unsigned)n);
  int rc = uv_try_write((uv_stream_t *)&H->writer, &b, 1);
  if (rc > 0) H->wpos += (size_t)rc;
  else if (rc != UV_EAGAIN || (H->conn && H->conn->closing)) writer_stop(H); /* the reader is gone */
}

/* ------------------------------------------------------------------ reference walk */

/* How the stream should end without harness intervention: frames seen and the status. */
static void reference(const uint8_t *data, size_t size, uint64_t *headers, int *status) {
  size_t pos = 0;
  *headers = 0;
  *status = PS_ERR_CLOSED;
  while (size - pos >= PS_FRAME_HDR_SIZE) {
    ps__frame_hdr h;
    int rc = ps__frame_decode(data + pos, FUZZ_MAX_PAYLOAD, &h);
    if (rc) {
      *status = rc;
      return;
    }
    (*headers)++;
    if (h.payload_len > size - pos - PS_FRAME_HDR_SIZE) return;
    pos += PS_FRAME_HDR_SIZE + (size_t)h.payload_len;
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int init;
  if (!init) {
    signal(SIGPIPE, SIG_IGN);
    init = 1;
  }
  harness H;
  uv_loop_t loop;
  int fds[2];
  memset(&H, 0, sizeof H);
  H.data = data;
  H.size = size;
  H.expect_status = -1;
  H.rng = 0x9e3779b97f4a7c15ull ^ ps__hash64(data, size, 7);
  if (!H.rng) H.rng = 1;

  CHECK(uv_loop_init(&loop) == 0);
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
  H.pool = ps__pool_new(8u << 20);
  CHECK(H.pool != NULL);
  H.conn = ps__conn_alloc(&loop, &fuzz_ops, &H, H.pool, FUZZ_MAX_PAYLOAD);
  CHECK(H.conn != NULL);
  CHECK(uv_pipe_init(&loop, &H.conn->h.pipe, 0) == 0);
  CHECK(uv_pipe_open(&H.conn->h.pipe, fds[0]) == 0);
  H.conn->is_unix = 1;
  CHECK(ps__conn_start(H.conn) == 0);

  CHECK(uv_pipe_init(&loop, &H.writer, 0) == 0);
  CHECK(uv_pipe_open(&H.writer, fds[1]) == 0);
  H.writer.data = &H;
  CHECK(uv_idle_init(&loop, &H.idle) == 0);
  H.idle.data = &H;
  CHECK(uv_idle_start(&H.idle, idle_cb) == 0);

  uv_run(&loop, UV_RUN_DEFAULT);
  CHECK(H.closed);
  CHECK(H.dest == NULL);
  CHECK(uv_loop_close(&loop) == 0);
  ps__pool_free(H.pool);

  uint64_t want_headers;
  int want_status;
  reference(data, size, &want_headers, &want_status);
  if (getenv("PSHARD_FUZZ_VERBOSE"))
    fprintf(stderr, "fuzz_conn: %zu bytes: %llu headers, %llu frames, close %s%s; reference %llu, %s\n", size,
            (unsigned long long)H.headers, (unsigned long long)H.frames, ps_err_name(H.close_status),
            H.stopped_by_harness ? " (harness)" : "", (unsigned long long)want_headers, ps_err_name(want_status));
  if (H.stopped_by_harness) {
    CHECK(H.headers <= want_headers);
    CHECK(H.close_status == H.expect_status);
  } else if (H.iter <= MAX_ITER) {
    CHECK(H.headers == want_headers);
    CHECK(H.close_status == want_status);
  }
  return 0;
}
