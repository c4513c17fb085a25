/*
 * http.c - the metrics and dashboard HTTP server over libmicrohttpd (http.h).
 *
 * The published texts are reference-counted blobs: ps__http_set swaps a path's blob
 * under the mutex, a request takes a reference under it and gives it back when
 * libmicrohttpd has sent the response, so a text being sent is never freed under it.
 */
#include "net/http.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netdb.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "common/common.h"

typedef struct blob {
  int refs;           /* under ps__http.mu */
  const char *data;
  size_t len;
  char own[];         /* the copy, unless static */
} blob;

typedef struct entry {
  char path[64];
  const char *ctype;
  blob *b;
  uint64_t asked_ms; /* the last request for it (under mu) */
} entry;

struct ps__http {
  struct MHD_Daemon *d;
  int port;
  pthread_mutex_t mu;
  entry e[PS__HTTP_PATHS];
  size_t n;
};

static void blob_unref(ps__http *h, blob *b) {
  if (!b) return;
  pthread_mutex_lock(&h->mu);
  int last = --b->refs == 0;
  pthread_mutex_unlock(&h->mu);
  if (last) free(b);
}

typedef struct sent {
  ps__http *h;
  blob *b;
} sent;

static void on_sent(void *cls) {
  sent *s = cls;
  blob_unref(s->h, s->b);
  free(s);
}

static enum MHD_Result reply_text(struct MHD_Connection *c, unsigned status, const char *text) {
  struct MHD_Response *r = MHD_create_response_from_buffer(strlen(text), (void *)text, MHD_RESPMEM_PERSISTENT);
  if (!r) return MHD_NO;
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/plain; charset=utf-8");
  if (status == MHD_HTTP_METHOD_NOT_ALLOWED) MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
  enum MHD_Result rc = MHD_queue_response(c, status, r);
  MHD_destroy_response(r);
  return rc;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
  ps__http *h = cls;
  (void)version, (void)upload, (void)con_cls;
  if (strcmp(method, MHD_HTTP_METHOD_GET) && strcmp(method, MHD_HTTP_METHOD_HEAD)) {
    *upload_size = 0; /* the body is not read: the connection is closed after the answer */
    return reply_text(c, MHD_HTTP_METHOD_NOT_ALLOWED, "method not allowed: GET or HEAD only\n");
  }
  blob *b = NULL;
  const char *ctype = NULL;
  uint64_t now = ps__now_ms();
  pthread_mutex_lock(&h->mu);
  for (size_t i = 0; i < h->n; i++)
    if (!strcmp(h->e[i].path, url) && h->e[i].b) {
      h->e[i].asked_ms = now;
      b = h->e[i].b;
      b->refs++;
      ctype = h->e[i].ctype;
      break;
    }
  pthread_mutex_unlock(&h->mu);
  if (!b) return reply_text(c, MHD_HTTP_NOT_FOUND, "not found\n");
  sent *s = malloc(sizeof *s);
  struct MHD_Response *r = NULL;
  if (s) {
    s->h = h;
    s->b = b;
    r = MHD_create_response_from_buffer_with_free_callback_cls(b->len, (void *)b->data, on_sent, s);
  }
  if (!r) {
    free(s);
    blob_unref(h, b);
    return reply_text(c, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory\n");
  }
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
  MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
  enum MHD_Result rc = MHD_queue_response(c, MHD_HTTP_OK, r);
  MHD_destroy_response(r);
  return rc;
}

int ps__http_start(const ps__http_opts *o, ps__http **out) {
  const char *host = o->host && *o->host ? o->host : "127.0.0.1";
  if (o->port < 0 || o->port > 65535) return ps__fail(PS_ERR_CONFIG, "bad HTTP port %d (0 to 65535)", o->port);
  /* Numeric addresses only (and localhost): starting never waits on a name server. */
  if (!strcmp(host, "localhost")) host = "127.0.0.1";
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICHOST},
                  *ai = NULL;
  char port[16];
  snprintf(port, sizeof port, "%d", o->port);
  if (getaddrinfo(host, port, &hints, &ai) || !ai)
    return ps__fail(PS_ERR_CONFIG, "bad HTTP address '%s' (a numeric IPv4 or IPv6 address, or localhost)", host);
  ps__http *h = ps__calloc(1, sizeof *h);
  if (!h) {
    freeaddrinfo(ai);
    return ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  pthread_mutex_init(&h->mu, NULL);
  unsigned flags = MHD_USE_AUTO_INTERNAL_THREAD | (ai->ai_family == AF_INET6 ? MHD_USE_IPv6 : 0);
  unsigned max_conns = o->max_conns ? o->max_conns : 64, timeout = o->timeout_s ? o->timeout_s : 10;
  h->d = MHD_start_daemon(flags, (uint16_t)o->port, NULL, NULL, on_request, h, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                          MHD_OPTION_CONNECTION_LIMIT, max_conns, MHD_OPTION_PER_IP_CONNECTION_LIMIT,
                          max_conns < 32 ? max_conns : 32u, MHD_OPTION_CONNECTION_TIMEOUT, timeout,
                          MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)32768, MHD_OPTION_END);
  freeaddrinfo(ai);
  if (!h->d) {
    pthread_mutex_destroy(&h->mu);
    free(h);
    return ps__fail(PS_ERR_IO, "cannot serve HTTP on %s:%d: address in use or not available", host, o->port);
  }
  if (strcmp(host, "127.0.0.1") && strcmp(host, "::1"))
    ps__log(PS_LOG_WARN, "HTTP on %s: the metrics (and a scheduler's dashboard) are open to anyone who can connect there",
            host);
  const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
  h->port = di ? di->port : o->port;
  *out = h;
  return 0;
}

int ps__http_port(const ps__http *h) { return h->port; }

int ps__http_set(ps__http *h, const char *path, const char *ctype, const void *data, size_t len, int is_static) {
  blob *b = ps__malloc(sizeof *b + (is_static ? 0 : len));
  if (!b) return ps__fail(PS_ERR_NOMEM, "out of memory");
  b->refs = 1;
  b->len = len;
  if (is_static) {
    b->data = data;
  } else {
    if (len) memcpy(b->own, data, len);
    b->data = b->own;
  }
  blob *old = NULL;
  int rc = 0;
  pthread_mutex_lock(&h->mu);
  size_t i = 0;
  while (i < h->n && strcmp(h->e[i].path, path)) i++;
  if (i == h->n) {
    if (h->n == PS__HTTP_PATHS || strlen(path) >= sizeof h->e[0].path) {
      rc = -1;
    } else {
      snprintf(h->e[i].path, sizeof h->e[i].path, "%s", path);
      h->n++;
    }
  }
  if (!rc) {
    old = h->e[i].b;
    h->e[i].b = b;
    h->e[i].ctype = ctype;
  }
  pthread_mutex_unlock(&h->mu);
  if (rc) {
    free(b);
    return ps__fail(PS_ERR_RANGE, "too many HTTP paths");
  }
  blob_unref(h, old);
  return 0;
}

uint64_t ps__http_asked_ms(ps__http *h, const char *path) {
  uint64_t t = 0;
  pthread_mutex_lock(&h->mu);
  for (size_t i = 0; i < h->n; i++)
    if (!strcmp(h->e[i].path, path)) t = h->e[i].asked_ms;
  pthread_mutex_unlock(&h->mu);
  return t;
}

void ps__http_stop(ps__http *h) {
  if (!h) return;
  MHD_stop_daemon(h->d); /* joins its thread: every response was destroyed */
  for (size_t i = 0; i < h->n; i++) blob_unref(h, h->e[i].b);
  pthread_mutex_destroy(&h->mu);
  free(h);
}
