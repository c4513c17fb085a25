/*
 * http.h - a small HTTP/1.1 server for metrics and the dashboard (libmicrohttpd).
 *
 * It serves a fixed set of paths, each the latest bytes its owner published: the
 * owner's loop renders a text (the node's /metrics, the scheduler's JSON) now and then
 * and hands it over with ps__http_set; the HTTP thread answers every request from what
 * was published last. The two share one mutex held only to swap or take a reference to
 * a published text, so a request never reads the owner's state and never makes its
 * loop wait, and the owner's hot path takes no lock at all.
 *
 * GET and HEAD are answered (200, or 404 for a path not served); any other method is
 * 405. Connections are limited in number (o.max_conns, 32 per client address) and idle
 * ones are closed after o.timeout_s.
 *
 * Threads: ps__http_start, ps__http_stop on the owner's thread; ps__http_set from any
 * thread; requests are answered on the server's own thread.
 */
#ifndef PS_HTTP_H
#define PS_HTTP_H

#include <stddef.h>
#include <stdint.h>

typedef struct ps__http ps__http;

typedef struct ps__http_opts {
  const char *host;     /* address to bind (127.0.0.1): numeric IPv4 or IPv6, or localhost */
  int port;             /* 0 = ephemeral */
  unsigned max_conns;   /* 0: 64 */
  unsigned timeout_s;   /* idle connections closed after this; 0: 10 */
} ps__http_opts;

#define PS__HTTP_PATHS 16 /* paths one server serves at most */

/* Bind and start the server thread. 0, or PS_ERR_CONFIG (a bad host), PS_ERR_IO (the
 * address cannot be bound: the message says why), PS_ERR_NOMEM. */
int ps__http_start(const ps__http_opts *o, ps__http **out);
/* The port bound (the ephemeral one for port 0). */
int ps__http_port(const ps__http *h);
/* Serve path (e.g. "/metrics") with content type ctype (a string that lives as long as
 * h, usually a literal): data (len bytes) is copied, or with is_static kept as it is
 * (it must then live as long as h). Replaces what path served before. 0, or
 * PS_ERR_NOMEM, PS_ERR_RANGE (more than PS__HTTP_PATHS paths). Any thread. */
int ps__http_set(ps__http *h, const char *path, const char *ctype, const void *data, size_t len, int is_static);
/* When path was last asked for (ps__now_ms), 0 if never. Any thread. */
uint64_t ps__http_asked_ms(ps__http *h, const char *path);
/* Stop serving and free h (waits for the requests being answered). NULL is a no-op. */
void ps__http_stop(ps__http *h);

#endif
