/*
 * test_prom.c - the latency histograms' buckets (common/hist.h), the Prometheus text
 * writer and reader (proto/prom.h), and the HTTP server's answers (net/http.h) on an
 * ephemeral loopback port.
 */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <math.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/common.h"
#include "common/hist.h"
#include "net/http.h"
#include "proto/prom.h"
#include "sched/sched_int.h"

static char *text_of(ps__wbuf *w) {
  ps__wbuf_bytes(w, "", 1);
  return (char *)w->data;
}

Test(hist, buckets_are_log_spaced_with_bounds_inclusive) {
  cr_expect(eq(int, ps__hist_bucket(0), 0));
  cr_expect(eq(int, ps__hist_bucket(10000), 0));
  cr_expect(eq(int, ps__hist_bucket(10001), 1));
  cr_expect(eq(int, ps__hist_bucket(1000000), 8));   /* 1 ms */
  cr_expect(eq(int, ps__hist_bucket(1000001), 9));
  cr_expect(eq(int, ps__hist_bucket(10000000000ull), PS__HIST_BOUNDS - 1)); /* 10 s */
  cr_expect(eq(int, ps__hist_bucket(10000000001ull), PS__HIST_BOUNDS));     /* above */
  cr_expect(eq(int, ps__hist_bucket(UINT64_MAX), PS__HIST_BOUNDS));
  for (int i = 1; i < PS__HIST_BOUNDS; i++) {
    double r = ps__hist_bound_s(i) / ps__hist_bound_s(i - 1);
    cr_expect(fabs(r - pow(10, 0.25)) < 1e-4, "bounds %d and %d are a quarter decade apart (ratio %g)", i - 1, i, r);
  }
}

Test(prom, histogram_is_cumulative_and_ends_in_inf) {
  ps__hist h;
  memset(&h, 0, sizeof h);
  ps__hist_add(&h, 5000);        /* 5 us: the first bucket */
  ps__hist_add(&h, 2000000);     /* 2 ms */
  ps__hist_add(&h, 20000000000); /* 20 s: only +Inf */
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__prom_family(&w, "ps_x_seconds", "histogram", "A test.");
  ps__prom_hist(&w, "ps_x_seconds", "table=\"t\"", &h);
  char *t = text_of(&w);
  cr_expect(not(eq(ptr, strstr(t, "# HELP ps_x_seconds A test.\n# TYPE ps_x_seconds histogram\n"), NULL)));
  cr_expect(not(eq(ptr, strstr(t, "ps_x_seconds_bucket{table=\"t\",le=\"1e-05\"} 1\n"), NULL)), "%s", t);
  cr_expect(not(eq(ptr, strstr(t, "ps_x_seconds_bucket{table=\"t\",le=\"0.001\"} 1\n"), NULL)), "%s", t);
  cr_expect(not(eq(ptr, strstr(t, "ps_x_seconds_bucket{table=\"t\",le=\"0.00316228\"} 2\n"), NULL)), "%s", t);
  cr_expect(not(eq(ptr, strstr(t, "ps_x_seconds_bucket{table=\"t\",le=\"10\"} 2\n"), NULL)), "%s", t);
  cr_expect(not(eq(ptr, strstr(t, "ps_x_seconds_bucket{table=\"t\",le=\"+Inf\"} 3\n"), NULL)), "%s", t);
  cr_expect(not(eq(ptr, strstr(t, "ps_x_seconds_count{table=\"t\"} 3\n"), NULL)), "%s", t);
  int found = 0;
  cr_expect(fabs(ps__prom_sum(t, strlen(t), "ps_x_seconds_sum", NULL, &found) - 20.002005) < 1e-9);
  cr_expect(eq(int, found, 1));
  ps__wbuf_free(&w);
}

Test(prom, label_values_are_escaped) {
  char l[64] = "";
  ps__prom_label(l, sizeof l, "table", "a\"b\\c\nd");
  ps__prom_label(l, sizeof l, "x", "y");
  cr_expect(eq(str, l, "table=\"a\\\"b\\\\c\\nd\",x=\"y\""));
  char small[12] = "";
  ps__prom_label(small, sizeof small, "table", "a long value"); /* cut, still terminated */
  cr_expect(lt(sz, strlen(small), sizeof small));
}

Test(prom, sum_reads_samples_by_name_and_label) {
  const char *t = "# HELP ps_a_total A.\n# TYPE ps_a_total counter\n"
                  "ps_a_total{table=\"x y}\",peer=\"1\"} 3\nps_a_total{table=\"z\"} 4\nps_a_total_more 100\n"
                  "ps_b 1.5e3\n";
  int f = 0;
  cr_expect(eq(dbl, ps__prom_sum(t, strlen(t), "ps_a_total", NULL, &f), 7.0));
  cr_expect(eq(int, f, 2));
  cr_expect(eq(dbl, ps__prom_sum(t, strlen(t), "ps_a_total", "peer=\"1\"", &f), 3.0));
  cr_expect(eq(dbl, ps__prom_sum(t, strlen(t), "ps_b", NULL, &f), 1500.0));
  cr_expect(eq(dbl, ps__prom_sum(t, strlen(t), "ps_c", NULL, &f), 0.0));
  cr_expect(eq(int, f, 0));
}

/* One HTTP/1.0 exchange with the server on port: the whole answer in buf. */
static size_t exchange(int port, const char *req, char *buf, size_t cap) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  struct timeval tv = {.tv_sec = 10};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  cr_assert(eq(int, connect(fd, (struct sockaddr *)&a, sizeof a), 0));
  cr_assert(eq(sz, (size_t)write(fd, req, strlen(req)), strlen(req)));
  size_t n = 0;
  ssize_t k;
  while (n + 1 < cap && (k = read(fd, buf + n, cap - 1 - n)) > 0) n += (size_t)k;
  buf[n] = '\0';
  close(fd);
  return n;
}

Test(http, serves_what_was_published_and_refuses_the_rest) {
  ps__http *h;
  ps__http_opts o = {.host = "127.0.0.1", .port = 0};
  cr_assert(eq(int, ps__http_start(&o, &h), 0), "%s", ps_errmsg());
  int port = ps__http_port(h);
  cr_assert(gt(int, port, 0));
  char buf[4096];
  exchange(port, "GET /metrics HTTP/1.0\r\n\r\n", buf, sizeof buf);
  cr_expect(eq(int, strncmp(buf, "HTTP/1.0 404", 12) && strncmp(buf, "HTTP/1.1 404", 12), 0), "%s", buf);
  cr_assert(eq(int, ps__http_set(h, "/metrics", PS__PROM_CTYPE, "ps_a 1\n", 7, 0), 0));
  cr_assert(eq(int, ps__http_set(h, "/metrics", PS__PROM_CTYPE, "ps_a 2\n", 7, 0), 0)); /* replaces */
  exchange(port, "GET /metrics HTTP/1.0\r\n\r\n", buf, sizeof buf);
  cr_expect(not(eq(ptr, strstr(buf, " 200 "), NULL)), "%s", buf);
  cr_expect(not(eq(ptr, strstr(buf, "Content-Type: " PS__PROM_CTYPE "\r\n"), NULL)), "%s", buf);
  cr_expect(not(eq(ptr, strstr(buf, "\r\n\r\nps_a 2\n"), NULL)), "%s", buf);
  exchange(port, "POST /metrics HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc", buf, sizeof buf);
  cr_expect(not(eq(ptr, strstr(buf, " 405 "), NULL)), "%s", buf);
  cr_expect(not(eq(ptr, strstr(buf, "Allow: GET, HEAD"), NULL)), "%s", buf);
  /* A second server cannot take the same port: an error, not an abort. */
  ps__http *h2 = NULL;
  ps__http_opts o2 = {.host = "127.0.0.1", .port = port};
  cr_expect(eq(int, ps__http_start(&o2, &h2), PS_ERR_IO));
  ps__http_opts o3 = {.host = "no such host.invalid", .port = 0};
  cr_expect(eq(int, ps__http_start(&o3, &h2), PS_ERR_CONFIG));
  ps__http_stop(h);
  ps__http_stop(NULL);
}

/* What the scheduler takes from a node as its metrics text, and what it refuses. */
Test(sched_metrics, check_takes_well_formed_texts_only) {
  static const char *const good[] = {
      "",
      "# HELP ps_a_total A.\n# TYPE ps_a_total counter\nps_a_total 1\nps_a_total{table=\"x \\\" y\"} 2\n",
      "# HELP ps_h H.\n# TYPE ps_h histogram\nps_h_bucket{le=\"+Inf\"} 0\nps_h_sum 0\nps_h_count 0\n"
      "# HELP ps_g G.\n# TYPE ps_g gauge\nps_g NaN\n",
  };
  static const char *const bad[] = {
      "ps_a 1\n",                                                       /* no family */
      "# TYPE ps_a gauge\nps_a 1\n",                                   /* no HELP */
      "# HELP ps_a A.\nps_a 1\n",                                      /* HELP without TYPE */
      "# HELP ps_a A.\n# HELP ps_a A.\n# TYPE ps_a gauge\n",           /* HELP twice */
      "# HELP ps_a A.\n# TYPE ps_b gauge\nps_b 1\n",                  /* TYPE of another name */
      "# HELP ps_a A.\n# TYPE ps_a summary\nps_a 1\n",                /* not a type we use */
      "# HELP ps_a A.\n# TYPE ps_a gauge\nps_b 1\n",                  /* a sample of another family */
      "# HELP ps_a A.\n# TYPE ps_a gauge\nps_a{node=\"1\"} 1\n",    /* the scheduler's label */
      "# HELP ps_a A.\n# TYPE ps_a gauge\nps_a{x=\"1} 1\n",          /* an open quote */
      "# HELP ps_a A.\n# TYPE ps_a gauge\nps_a one\n",                /* not a number */
      "# HELP ps_a A.\n# TYPE ps_a gauge\nps_a 1",                     /* no final newline */
      "# HELP ps_a A.\n# TYPE ps_a gauge\nps_a\t1\n",                /* a control character */
      "# HELP ps_sched_x X.\n# TYPE ps_sched_x gauge\nps_sched_x 1\n",/* the scheduler's own */
      "# HELP other O.\n# TYPE other gauge\nother 1\n",               /* not ps_ */
      "# HELP ps_a A.\n",                                               /* ends after HELP */
      "# comment\n",
  };
  const char *why = NULL;
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
    cr_expect(eq(int, ps__sched_metrics_check(good[i], strlen(good[i]), &why), 0), "good text %zu refused: %s", i, why);
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    why = NULL;
    cr_expect(eq(int, ps__sched_metrics_check(bad[i], strlen(bad[i]), &why), -1), "bad text %zu taken", i);
    cr_expect(not(eq(ptr, (void *)why, NULL)));
  }
  /* Every cut of a good text is refused or taken, never read past its end (ASan). */
  const char *g = good[2];
  for (size_t n = 0; n < strlen(g); n++) {
    char *cut = malloc(n ? n : 1);
    memcpy(cut, g, n);
    ps__sched_metrics_check(cut, n, &why);
    free(cut);
  }
}
