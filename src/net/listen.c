/*
 * listen.c - listeners and outgoing connections for TCP and AF_UNIX sockets.
 * Loop thread only.
 *
 * Every node listens or connects before its first frame, so this is where the fault
 * rules of PSHARD_FAULT are armed (ps__fault_arm_env, once per process): a bad spec
 * fails the node's first listen or connect with PS_ERR_CONFIG and a message.
 */
#include <netdb.h>
#include <string.h>
#include <unistd.h>

#include "common/common.h"
#include "common/fault.h"
#include "net/auth.h"
#include "net/net.h"

static void on_connection(uv_stream_t *server, int status) {
  ps__listener *l = server->data;
  if (status != 0) {
    ps__log(PS_LOG_WARN, "accept failed: %s", uv_strerror(status));
    return;
  }
  ps__conn *c = ps__conn_alloc(l->loop, l->ops, NULL, l->pool, l->max_payload);
  if (!c) return;
  int rc = l->is_unix ? uv_pipe_init(l->loop, &c->h.pipe, 0) : uv_tcp_init(l->loop, &c->h.tcp);
  if (rc != 0) {
    ps__conn_free_unopened(c);
    return;
  }
  c->h.handle.data = c;
  c->is_unix = l->is_unix;
  c->budget = l->budget;
  if (uv_accept(server, &c->h.stream) != 0) {
    ps__conn_close(c, PS_ERR_IO);
    return;
  }
  if (l->is_unix) snprintf(c->peer, sizeof c->peer, "unix:%s", l->path);
  if (ps__conn_start(c) != 0) {
    ps__conn_close(c, PS_ERR_IO);
    return;
  }
  ps__auth_accept(c, l->on_accept, l->arg); /* after the handshake, when there is a secret */
}

static void listener_set(ps__listener *l, uv_loop_t *loop, const ps__conn_ops *ops, ps__accept_cb cb,
                         void *arg, ps__pool *pool, uint64_t max_payload) {
  memset(l, 0, sizeof *l);
  l->loop = loop;
  l->ops = ops;
  l->on_accept = cb;
  l->arg = arg;
  l->pool = pool;
  l->max_payload = max_payload;
}

/* host:port into addr: a numeric IPv4 or IPv6 address as it is, else a name looked up
 * (getaddrinfo: /etc/hosts, then DNS, so "localhost" works; the first address found).
 * 0 or -1. A name is looked up when its connection is opened, on the caller's thread;
 * clusters should give numeric addresses, which need no lookup. */
static int resolve(const char *host, int port, struct sockaddr_storage *addr) {
  memset(addr, 0, sizeof *addr);
  if (strchr(host, ':') ? uv_ip6_addr(host, port, (struct sockaddr_in6 *)addr) == 0
                        : uv_ip4_addr(host, port, (struct sockaddr_in *)addr) == 0)
    return 0;
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (!*host || getaddrinfo(host, NULL, &hints, &res) != 0 || !res) return -1;
  int rc = -1;
  for (struct addrinfo *a = res; a && rc; a = a->ai_next) {
    if (a->ai_family == AF_INET && a->ai_addrlen <= sizeof *addr) {
      memcpy(addr, a->ai_addr, a->ai_addrlen);
      ((struct sockaddr_in *)addr)->sin_port = htons((uint16_t)port);
      rc = 0;
    } else if (a->ai_family == AF_INET6 && a->ai_addrlen <= sizeof *addr) {
      memcpy(addr, a->ai_addr, a->ai_addrlen);
      ((struct sockaddr_in6 *)addr)->sin6_port = htons((uint16_t)port);
      rc = 0;
    }
  }
  freeaddrinfo(res);
  return rc;
}

int ps__listen_tcp(ps__listener *l, uv_loop_t *loop, const char *host, int port, const ps__conn_ops *ops,
                   ps__accept_cb cb, void *arg, ps__pool *pool, uint64_t max_payload) {
  struct sockaddr_storage addr;
  int rc = ps__fault_arm_env();
  if (!rc) rc = ps__auth_check_bind(host);
  if (rc) {
    memset(l, 0, sizeof *l); /* nothing to close */
    return rc;
  }
  listener_set(l, loop, ops, cb, arg, pool, max_payload);
  if (resolve(host, port, &addr))
    return ps__fail(PS_ERR_CONFIG, "bad listen address '%s' (an IP address or a host name this machine knows)", host);
  uv_tcp_init(loop, &l->h.tcp);
  l->h.handle.data = l;
  rc = uv_tcp_bind(&l->h.tcp, (struct sockaddr *)&addr, 0);
  if (rc == 0) rc = uv_listen(&l->h.stream, 512, on_connection);
  if (rc != 0) {
    uv_close(&l->h.handle, NULL);
    return ps__fail(PS_ERR_IO, "cannot listen on %s:%d: %s", host, port, uv_strerror(rc));
  }
  int len = sizeof addr;
  uv_tcp_getsockname(&l->h.tcp, (struct sockaddr *)&addr, &len);
  l->port = addr.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&addr)->sin6_port)
                                       : ntohs(((struct sockaddr_in *)&addr)->sin_port);
  return 0;
}

int ps__listen_unix(ps__listener *l, uv_loop_t *loop, const char *path, const ps__conn_ops *ops,
                    ps__accept_cb cb, void *arg, ps__pool *pool, uint64_t max_payload) {
  int frc = ps__fault_arm_env();
  if (!frc) frc = ps__auth_arm_env();
  if (frc) {
    memset(l, 0, sizeof *l);
    return frc;
  }
  listener_set(l, loop, ops, cb, arg, pool, max_payload);
  l->is_unix = 1;
  if (strlen(path) >= sizeof l->path) return ps__fail(PS_ERR_CONFIG, "unix socket path too long: %s", path);
  snprintf(l->path, sizeof l->path, "%s", path);
  unlink(path);
  uv_pipe_init(loop, &l->h.pipe, 0);
  l->h.handle.data = l;
  int rc = uv_pipe_bind(&l->h.pipe, path);
  if (rc == 0) rc = uv_listen(&l->h.stream, 512, on_connection);
  if (rc != 0) {
    uv_close(&l->h.handle, NULL);
    l->path[0] = '\0';
    return ps__fail(PS_ERR_IO, "cannot listen on %s: %s", path, uv_strerror(rc));
  }
  return 0;
}

void ps__listener_close(ps__listener *l) {
  if (!l->loop || uv_is_closing(&l->h.handle)) return;
  uv_close(&l->h.handle, NULL);
  if (l->is_unix && l->path[0]) unlink(l->path);
}

typedef struct connect_req {
  uv_connect_t req;
  ps__conn *conn;
  ps__connect_cb cb;
  void *arg;
} connect_req;


static void free_unstarted(uv_handle_t *h) { ps__conn_free_unopened(h->data); }

static void on_connect(uv_connect_t *req, int status) {
  connect_req *cr = (connect_req *)req;
  ps__conn *c = cr->conn;
  if (status == 0 && ps__conn_start(c) == 0) {
    ps__auth_connected(c, cr->cb, cr->arg); /* cb once authenticated, when there is a secret */
  } else {
    /* A handle closed while its connect was pending (a loop's teardown walks every
     * handle) gets UV_ECANCELED here from inside uv_close: the close already under way
     * frees it, a second uv_close would abort. */
    if (!uv_is_closing(&c->h.handle)) {
      c->closing = 1;
      uv_close(&c->h.handle, free_unstarted);
    }
    cr->cb(cr->arg, NULL, status ? ps__uv_err(status) : PS_ERR_IO);
  }
  free(cr);
}

__attribute__((noinline)) static int connect_common(uv_loop_t *loop, const char *host, int port, const char *path,
                          const ps__conn_ops *ops, void *udata, ps__pool *pool, uint64_t max_payload,
                          ps__connect_cb cb, void *arg) {
  int frc = ps__fault_arm_env();
  if (!frc) frc = ps__auth_arm_env();
  if (frc) return frc;
  ps__conn *c = ps__conn_alloc(loop, ops, udata, pool, max_payload);
  connect_req *cr = ps__malloc(sizeof *cr);
  int rc;
  if (!c || !cr) {
    if (c) ps__conn_free_unopened(c);
    free(cr);
    return ps__fail(PS_ERR_NOMEM, "out of memory connecting");
  }
  cr->conn = c;
  cr->cb = cb;
  cr->arg = arg;
  if (path) {
    c->is_unix = 1;
    snprintf(c->peer, sizeof c->peer, "unix:%s", path);
    uv_pipe_init(loop, &c->h.pipe, 0);
    c->h.handle.data = c;
    uv_pipe_connect(&cr->req, &c->h.pipe, path, on_connect);
    return 0;
  }
  struct sockaddr_storage addr;
  if (resolve(host, port, &addr)) {
    ps__conn_free_unopened(c);
    free(cr);
    return ps__fail(PS_ERR_CONFIG, "bad address '%s' (an IP address, or a host name that resolves)", host);
  }
  snprintf(c->peer, sizeof c->peer, "%s:%d", host, port);
  uv_tcp_init(loop, &c->h.tcp);
  c->h.handle.data = c;
  rc = uv_tcp_connect(&cr->req, &c->h.tcp, (struct sockaddr *)&addr, on_connect);
  if (rc) {
    free(cr);
    c->closing = 1;
    uv_close(&c->h.handle, free_unstarted);
    return ps__fail(ps__uv_err(rc), "cannot connect to %s:%d: %s", host, port, uv_strerror(rc));
  }
  return 0;
}

int ps__connect_tcp(uv_loop_t *loop, const char *host, int port, const ps__conn_ops *ops, void *udata,
                    ps__pool *pool, uint64_t max_payload, ps__connect_cb cb, void *arg) {
  return connect_common(loop, host, port, NULL, ops, udata, pool, max_payload, cb, arg);
}

int ps__connect_unix(uv_loop_t *loop, const char *path, const ps__conn_ops *ops, void *udata,
                     ps__pool *pool, uint64_t max_payload, ps__connect_cb cb, void *arg) {
  return connect_common(loop, NULL, 0, path, ops, udata, pool, max_payload, cb, arg);
}
