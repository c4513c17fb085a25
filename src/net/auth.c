/*
 * auth.c - the job secret on connections (see auth.h): the process's key, the loops'
 * identities, and the handshake run on a connection before its owner gets it.
 *
 * During the handshake a connection's ops are this file's (hs_ops) and its frame cap
 * PS_AUTH_MAX_BODY; the owner's ops, cap and callback wait in a ps__auth_conn. On
 * success they are put back and the owner's callback runs, inside the handshake's
 * last frame, so a frame that follows in the same read goes to the owner. On failure
 * the connection closes under hs_ops: the owner of an accepted connection never hears
 * of it, a connecting owner's callback gets NULL and PS_ERR_AUTH.
 *
 * The deadline timer lives in the ps__auth_conn, which is freed when both the
 * connection and the timer are closed (refs). ps__conn_close closes the timer at once
 * (ps__auth_stop), so that a loop's teardown, which closes every handle, finds it
 * closing already.
 */
#include "net/auth.h"

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/common.h"
#include "net/conn_int.h"
#include "proto/msg.h"

#define DEFAULT_TIMEOUT_MS 10000u
#define DEFAULT_PENDING_MAX 64u
#define MAX_LOOPS 64

/* ------------------------------------------------------------------ the key and policy */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static ps__auth_key key;
static int have_key, key_by_call, job_by_call, env_done, env_rc, insecure, insecure_by_call, warned;
static char env_msg[300];
static uint64_t timeout_ms = DEFAULT_TIMEOUT_MS;
static unsigned pending_max = DEFAULT_PENDING_MAX;
static unsigned pending; /* accepted connections in their handshake (atomic) */

static int set_secret_locked(const void *s, size_t n, const char *what, char *msg, size_t cap) {
  if (n < PS_AUTH_SECRET_MIN || n > PS_AUTH_SECRET_MAX) {
    snprintf(msg, cap, "%s: a job secret has %d to %d bytes, not %zu", what, PS_AUTH_SECRET_MIN, PS_AUTH_SECRET_MAX, n);
    return -1;
  }
  memcpy(key.secret, s, n);
  key.len = n;
  have_key = 1;
  return 0;
}

static int set_job_locked(const char *job, const char *what, char *msg, size_t cap) {
  size_t n = strlen(job);
  if (n == 0 || n > PS_AUTH_JOB_MAX) {
    snprintf(msg, cap, "%s: a job id has 1 to %d bytes", what, PS_AUTH_JOB_MAX);
    return -1;
  }
  for (size_t i = 0; i < n; i++)
    if (!isgraph((unsigned char)job[i])) {
      snprintf(msg, cap, "%s: a job id is printable characters without spaces", what);
      return -1;
    }
  snprintf(key.job, sizeof key.job, "%s", job);
  return 0;
}

static int read_secret_file_locked(const char *path, char *msg, size_t cap) {
  uint8_t buf[PS_AUTH_SECRET_MAX + 2];
  struct stat st;
  FILE *f = fopen(path, "rb");
  if (!f) {
    snprintf(msg, cap, "cannot open the secret file %s: %s", path, strerror(errno));
    return -1;
  }
  if (fstat(fileno(f), &st) == 0 && (st.st_mode & 077))
    ps__log(PS_LOG_WARN, "the secret file %s can be read by other users (mode %03o): make it 0600", path,
            (unsigned)(st.st_mode & 0777));
  size_t n = fread(buf, 1, sizeof buf, f);
  int err = ferror(f);
  fclose(f);
  if (err) {
    snprintf(msg, cap, "cannot read the secret file %s", path);
    return -1;
  }
  while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r')) n--;
  char what[300];
  snprintf(what, sizeof what, "the secret file %s", path);
  int rc = set_secret_locked(buf, n, what, msg, cap);
  memset(buf, 0, sizeof buf);
  return rc;
}

static int env_uint(const char *name, uint64_t lo, uint64_t hi, uint64_t *out, char *msg, size_t cap) {
  const char *v = getenv(name);
  uint64_t x;
  if (!v || !*v) return 0;
  if (ps__parse_u64(v, &x) || x < lo || x > hi) {
    snprintf(msg, cap, "%s: '%s' is not a number from %llu to %llu", name, v, (unsigned long long)lo,
             (unsigned long long)hi);
    return -1;
  }
  *out = x;
  return 0;
}

static int load_env_locked(char *msg, size_t cap) {
  const char *file = getenv("PSHARD_SECRET_FILE"), *sec = getenv("PSHARD_SECRET"), *job = getenv("PSHARD_JOB_ID");
  const char *ins = getenv("PSHARD_INSECURE");
  uint64_t t = timeout_ms, p = pending_max;
  if (file && !*file) file = NULL;
  if (sec && !*sec) sec = NULL;
  if (!key_by_call && file && sec) {
    snprintf(msg, cap, "both PSHARD_SECRET_FILE and PSHARD_SECRET are set: set one");
    return -1;
  }
  if (!key_by_call && file && read_secret_file_locked(file, msg, cap)) return -1;
  if (!key_by_call && sec && set_secret_locked(sec, strlen(sec), "PSHARD_SECRET", msg, cap)) return -1;
  if (!job_by_call && job && *job && set_job_locked(job, "PSHARD_JOB_ID", msg, cap)) return -1;
  if (!insecure_by_call && ins && *ins) {
    if (strcmp(ins, "0") && strcmp(ins, "1")) {
      snprintf(msg, cap, "PSHARD_INSECURE: '%s' is not 0 or 1", ins);
      return -1;
    }
    insecure = ins[0] == '1';
  }
  if (env_uint("PSHARD_AUTH_TIMEOUT_MS", 1, 3600000, &t, msg, cap)) return -1;
  if (env_uint("PSHARD_AUTH_PENDING_MAX", 1, 1000000, &p, msg, cap)) return -1;
  timeout_ms = t;
  pending_max = (unsigned)p;
  return 0;
}

int ps__auth_arm_env(void) {
  pthread_mutex_lock(&mu);
  if (!env_done) {
    env_done = 1;
    if (!key.job[0]) snprintf(key.job, sizeof key.job, "default");
    if (load_env_locked(env_msg, sizeof env_msg)) env_rc = PS_ERR_CONFIG;
  }
  int rc = env_rc;
  pthread_mutex_unlock(&mu);
  return rc ? ps__fail(rc, "%s", env_msg) : 0;
}

int ps__auth_set_secret_file(const char *path) {
  char msg[300];
  if (!path || !*path) return ps__fail(PS_ERR_CONFIG, "empty secret file name");
  pthread_mutex_lock(&mu);
  int rc = read_secret_file_locked(path, msg, sizeof msg);
  if (!rc) key_by_call = 1;
  pthread_mutex_unlock(&mu);
  return rc ? ps__fail(PS_ERR_CONFIG, "%s", msg) : 0;
}

int ps__auth_set_secret(const void *secret, size_t n) {
  char msg[300];
  pthread_mutex_lock(&mu);
  int rc = set_secret_locked(secret, n, "the job secret", msg, sizeof msg);
  if (!rc) key_by_call = 1;
  pthread_mutex_unlock(&mu);
  return rc ? ps__fail(PS_ERR_CONFIG, "%s", msg) : 0;
}

int ps__auth_set_job(const char *job) {
  char msg[300];
  pthread_mutex_lock(&mu);
  int rc = set_job_locked(job ? job : "", "the job id", msg, sizeof msg);
  if (!rc) job_by_call = 1;
  pthread_mutex_unlock(&mu);
  return rc ? ps__fail(PS_ERR_CONFIG, "%s", msg) : 0;
}

void ps__auth_set_insecure(int on) {
  pthread_mutex_lock(&mu);
  insecure = on != 0;
  insecure_by_call = 1;
  pthread_mutex_unlock(&mu);
}

void ps__auth_reset(void) {
  pthread_mutex_lock(&mu);
  memset(&key, 0, sizeof key);
  have_key = key_by_call = job_by_call = env_done = env_rc = insecure = insecure_by_call = warned = 0;
  timeout_ms = DEFAULT_TIMEOUT_MS;
  pending_max = DEFAULT_PENDING_MAX;
  pthread_mutex_unlock(&mu);
}

int ps__auth_enabled(void) {
  pthread_mutex_lock(&mu);
  int on = have_key;
  pthread_mutex_unlock(&mu);
  return on;
}

static int is_loopback(const char *host) {
  return !strncmp(host, "127.", 4) || !strcmp(host, "::1") || !strcmp(host, "localhost");
}

int ps__auth_check_bind(const char *host) {
  int rc = ps__auth_arm_env();
  if (rc) return rc;
  pthread_mutex_lock(&mu);
  int on = have_key, ins = insecure, warn = !have_key && !warned;
  if (warn) warned = 1;
  pthread_mutex_unlock(&mu);
  if (on) return 0;
  if (!is_loopback(host) && !ins)
    return ps__fail(PS_ERR_CONFIG,
                    "refusing to listen on %s without a job secret: anyone who can reach it could read and change "
                    "the tables (set PSHARD_SECRET_FILE or PSHARD_SECRET, or pass --insecure)",
                    host);
  if (warn)
    ps__log(PS_LOG_WARN, "no job secret is set: connections are not authenticated (%s); set PSHARD_SECRET_FILE or "
            "PSHARD_SECRET", is_loopback(host) ? "anyone on this host can connect" : "--insecure");
  return 0;
}

/* ------------------------------------------------------------------ loop identities */

static struct {
  uv_loop_t *loop;
  uint8_t role;
  uint32_t node;
} selves[MAX_LOOPS];

void ps__auth_self_set(uv_loop_t *loop, uint8_t role, uint32_t node) {
  pthread_mutex_lock(&mu);
  int slot = -1;
  for (int i = 0; i < MAX_LOOPS; i++) {
    if (selves[i].loop == loop) {
      slot = i;
      break;
    }
    if (slot < 0 && !selves[i].loop) slot = i;
  }
  if (slot >= 0) {
    selves[slot].loop = loop;
    selves[slot].role = role;
    selves[slot].node = node;
  } else {
    ps__log(PS_LOG_WARN, "more than %d event loops in one process: this one presents itself as a tool", MAX_LOOPS);
  }
  pthread_mutex_unlock(&mu);
}

void ps__auth_self_clear(uv_loop_t *loop) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAX_LOOPS; i++)
    if (selves[i].loop == loop) memset(&selves[i], 0, sizeof selves[i]);
  pthread_mutex_unlock(&mu);
}

static void self_of(uv_loop_t *loop, uint8_t *role, uint32_t *node) {
  *role = PS_AUTH_ROLE_TOOL;
  *node = 0;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAX_LOOPS; i++)
    if (selves[i].loop == loop) {
      *role = selves[i].role;
      *node = selves[i].node;
      break;
    }
  pthread_mutex_unlock(&mu);
}

void ps__conn_auth_bind(ps__conn *c, uint32_t node) {
  if (c && c->authed) c->auth_node = node;
}

/* ------------------------------------------------------------------ the handshake on a connection */

typedef struct ps__auth_conn {
  ps__hs hs;
  ps__auth_key key; /* a copy: the process's key may not change under a handshake */
  ps__conn *c;      /* NULL once the connection is gone */
  const ps__conn_ops *ops;
  uint64_t max_payload;
  int inbound;
  ps__accept_cb accept_cb;
  ps__connect_cb connect_cb;
  void *cb_arg;
  int reported;     /* the connect callback was called */
  int refs;         /* the connection, the timer */
  uv_timer_t timer;
  uint8_t body[PS_AUTH_MAX_BODY];
} ps__auth_conn;

static void hs_unref(ps__auth_conn *a) {
  if (--a->refs == 0) {
    memset(&a->key, 0, sizeof a->key);
    free(a);
  }
}

static void timer_closed(uv_handle_t *h) { hs_unref(h->data); }

static void hs_stop_timer(ps__auth_conn *a) {
  if (!uv_is_closing((uv_handle_t *)&a->timer)) uv_close((uv_handle_t *)&a->timer, timer_closed);
}

void ps__auth_stop(ps__conn *c) {
  if (c->hs) hs_stop_timer(c->hs);
}

static void refuse(ps__conn *c, const char *why) {
  ps__auth_conn *a = c->hs;
  if (c->closing) return;
  ps__log(PS_LOG_WARN, "authentication of %s failed: %s", c->peer, why);
  if (a && a->inbound) {
    ps__frame_hdr h = {.type = PS_MSG_ERROR, .status = PS_ERR_AUTH};
    static const char text[] = "authentication failed";
    ps__conn_send_ctrl(c, &h, text, sizeof text - 1);
    ps__conn_close_after_flush(c, PS_ERR_AUTH);
  } else {
    ps__conn_close(c, PS_ERR_AUTH);
  }
}

void ps__auth_refuse(ps__conn *c, const char *why) { refuse(c, why && *why ? why : "malformed frame"); }

void ps__auth_refuse_sender(ps__conn *c) {
  char msg[160];
  snprintf(msg, sizeof msg, "%s frame from node %u names node %u as its sender", ps__frame_type_name(c->cur.type),
           c->auth_node, c->cur.sender);
  ps__log(PS_LOG_WARN, "closing connection from %s: %s", c->peer, msg);
  if (c->closing) return;
  ps__conn_send_error(c, &c->cur, PS_ERR_AUTH, msg);
  ps__conn_close_after_flush(c, PS_ERR_AUTH);
}

static void deadline_tick(uv_timer_t *t) {
  ps__auth_conn *a = t->data;
  if (a->c) refuse(a->c, "the handshake did not finish in time");
}

static int hs_on_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__auth_conn *a = c->hs;
  if (h->payload_len > sizeof a->body) return ps__fail(PS_ERR_AUTH, "frame too large for the handshake");
  if (h->payload_len) {
    b->iov_small[0] = uv_buf_init((char *)a->body, (unsigned)h->payload_len);
    b->iov = b->iov_small;
    b->niov = 1;
  }
  return 0;
}

static int send_out(ps__conn *c, const ps__hs_out *o) {
  ps__frame_hdr h = {.type = o->type, .req_id = 1};
  return ps__conn_send_ctrl(c, &h, o->body, o->len);
}

/* Authenticated: give the connection back to its owner. */
static void hs_done(ps__conn *c) {
  ps__auth_conn *a = c->hs;
  c->ops = a->ops;
  c->max_payload = a->max_payload;
  c->authed = 1;
  c->auth_role = a->hs.peer_role;
  c->auth_node = a->hs.peer_node;
  c->auth_inbound = a->inbound;
  c->hs = NULL;
  a->c = NULL;
  hs_stop_timer(a);
  hs_unref(a); /* the connection's reference */
  if (a->inbound) {
    __atomic_fetch_sub(&pending, 1, __ATOMIC_RELAXED);
    a->accept_cb(a->cb_arg, c);
  } else {
    a->reported = 1;
    a->connect_cb(a->cb_arg, c, 0);
  }
}

static void hs_on_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__auth_conn *a = c->hs;
  ps__hs_out out;
  if (c->closing) return;
  if (h->type == PS_MSG_ERROR && !a->inbound) {
    refuse(c, h->status == PS_ERR_AUTH ? "the peer refused this job's secret" : "the peer refused the handshake");
    return;
  }
  int rc = ps__hs_recv(&a->hs, h->type, h->payload_len ? a->body : NULL, (size_t)h->payload_len, &out);
  if (rc) {
    refuse(c, a->hs.why);
    return;
  }
  if (out.type && send_out(c, &out)) {
    refuse(c, "cannot send a handshake frame");
    return;
  }
  if (a->hs.state == PS_HS_DONE) hs_done(c);
}

static void hs_on_close(ps__conn *c, int status) {
  ps__auth_conn *a = c->hs;
  if (!a) return; /* refused at accept: never had a handshake */
  c->hs = NULL;
  a->c = NULL;
  if (a->inbound) {
    __atomic_fetch_sub(&pending, 1, __ATOMIC_RELAXED);
  } else if (!a->reported) {
    /* Refused (by either side): PS_ERR_AUTH, final. Cut off otherwise (the peer's cap
     * on pending handshakes, a reset): PS_ERR_UNAVAILABLE, which callers may retry. */
    int rc = status == PS_ERR_AUTH ? PS_ERR_AUTH : status == 0 ? PS_ERR_CLOSED : PS_ERR_UNAVAILABLE;
    a->reported = 1;
    ps__fail(rc, rc == PS_ERR_AUTH ? "authentication with %s failed" : "%s closed the connection during the handshake",
             c->peer);
    a->connect_cb(a->cb_arg, NULL, rc);
  }
  hs_stop_timer(a);
  hs_unref(a);
}

static const ps__conn_ops hs_ops = {.on_header = hs_on_header, .on_frame = hs_on_frame, .on_close = hs_on_close};

/* Put c under the handshake. NULL when there is no memory (c untouched). */
static ps__auth_conn *hs_begin(ps__conn *c, int inbound) {
  ps__auth_conn *a = ps__calloc(1, sizeof *a);
  if (!a) return NULL;
  pthread_mutex_lock(&mu);
  a->key = key;
  uint64_t t = timeout_ms;
  pthread_mutex_unlock(&mu);
  a->c = c;
  a->inbound = inbound;
  a->ops = c->ops;
  a->max_payload = c->max_payload;
  a->refs = 2;
  uv_timer_init(c->loop, &a->timer);
  a->timer.data = a;
  uv_timer_start(&a->timer, deadline_tick, t, 0);
  c->hs = a;
  c->ops = &hs_ops;
  c->max_payload = PS_AUTH_MAX_BODY;
  return a;
}

void ps__auth_accept(ps__conn *c, ps__accept_cb cb, void *arg) {
  if (!ps__auth_enabled()) {
    cb(arg, c);
    return;
  }
  pthread_mutex_lock(&mu);
  unsigned cap = pending_max;
  pthread_mutex_unlock(&mu);
  if (__atomic_load_n(&pending, __ATOMIC_RELAXED) >= cap) {
    ps__log(PS_LOG_WARN, "closing connection from %s: %u connections are authenticating already", c->peer, cap);
    c->ops = &hs_ops; /* the owner never sees it */
    ps__conn_close(c, PS_ERR_AUTH);
    return;
  }
  ps__auth_conn *a = hs_begin(c, 1);
  if (!a) {
    c->ops = &hs_ops;
    ps__conn_close(c, PS_ERR_NOMEM);
    return;
  }
  __atomic_fetch_add(&pending, 1, __ATOMIC_RELAXED);
  a->accept_cb = cb;
  a->cb_arg = arg;
  uint8_t role;
  uint32_t node;
  self_of(c->loop, &role, &node);
  ps__hs_server_start(&a->hs, &a->key, role, node);
}

void ps__auth_connected(ps__conn *c, ps__connect_cb cb, void *arg) {
  if (!ps__auth_enabled()) {
    cb(arg, c, 0);
    return;
  }
  ps__auth_conn *a = hs_begin(c, 0);
  if (!a) {
    c->ops = &hs_ops; /* the owner hears of it through cb only */
    ps__conn_close(c, PS_ERR_NOMEM);
    cb(arg, NULL, ps__fail(PS_ERR_NOMEM, "out of memory authenticating a connection"));
    return;
  }
  a->connect_cb = cb;
  a->cb_arg = arg;
  uint8_t role;
  uint32_t node;
  ps__hs_out out;
  self_of(c->loop, &role, &node);
  if (ps__hs_client_start(&a->hs, &a->key, role, node, &out) || send_out(c, &out)) refuse(c, a->hs.why);
}
