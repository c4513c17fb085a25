/*
 * prom.c - writing and reading the Prometheus text format (prom.h).
 */
#include "proto/prom.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void ps__prom_family(ps__wbuf *w, const char *name, const char *type, const char *help) {
  char line[512];
  int n = snprintf(line, sizeof line, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
  ps__wbuf_bytes(w, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
}

static void sample(ps__wbuf *w, const char *name, const char *labels, const char *value) {
  ps__wbuf_bytes(w, name, strlen(name));
  if (labels && *labels) {
    ps__wbuf_bytes(w, "{", 1);
    ps__wbuf_bytes(w, labels, strlen(labels));
    ps__wbuf_bytes(w, "}", 1);
  }
  ps__wbuf_bytes(w, " ", 1);
  ps__wbuf_bytes(w, value, strlen(value));
  ps__wbuf_bytes(w, "\n", 1);
}

void ps__prom_u64(ps__wbuf *w, const char *name, const char *labels, uint64_t v) {
  char s[32];
  snprintf(s, sizeof s, "%llu", (unsigned long long)v);
  sample(w, name, labels, s);
}

void ps__prom_f64(ps__wbuf *w, const char *name, const char *labels, double v) {
  char s[40];
  if (isnan(v))
    snprintf(s, sizeof s, "NaN");
  else if (isinf(v))
    snprintf(s, sizeof s, v > 0 ? "+Inf" : "-Inf");
  else
    snprintf(s, sizeof s, "%.17g", v);
  sample(w, name, labels, s);
}

/* labels plus le="bound" */
static void bucket(ps__wbuf *w, const char *name, const char *labels, const char *le, uint64_t cum) {
  char n[128], l[PS__PROM_LABELS_MAX + 32];
  snprintf(n, sizeof n, "%s_bucket", name);
  snprintf(l, sizeof l, "%s%sle=\"%s\"", labels && *labels ? labels : "", labels && *labels ? "," : "", le);
  ps__prom_u64(w, n, l, cum);
}

static void sum_count(ps__wbuf *w, const char *name, const char *labels, double sum, uint64_t count) {
  char n[128];
  snprintf(n, sizeof n, "%s_sum", name);
  ps__prom_f64(w, n, labels, sum);
  snprintf(n, sizeof n, "%s_count", name);
  ps__prom_u64(w, n, labels, count);
}

void ps__prom_hist(ps__wbuf *w, const char *name, const char *labels, const ps__hist *h) {
  ps__hist c;
  ps__hist_read(h, &c);
  uint64_t cum = 0;
  char le[32];
  for (int i = 0; i < PS__HIST_BOUNDS; i++) {
    cum += c.n[i];
    snprintf(le, sizeof le, "%.6g", ps__hist_bound_s(i));
    bucket(w, name, labels, le, cum);
  }
  cum += c.n[PS__HIST_BOUNDS];
  bucket(w, name, labels, "+Inf", cum);
  sum_count(w, name, labels, (double)c.sum_ns * 1e-9, cum);
}

void ps__prom_hist_counts(ps__wbuf *w, const char *name, const char *labels, const double *bounds,
                          const uint64_t *counts, size_t n, double sum) {
  uint64_t cum = 0;
  char le[32];
  for (size_t i = 0; i + 1 < n; i++) {
    cum += counts[i];
    snprintf(le, sizeof le, "%.6g", bounds[i]);
    bucket(w, name, labels, le, cum);
  }
  if (n) cum += counts[n - 1];
  bucket(w, name, labels, "+Inf", cum);
  sum_count(w, name, labels, sum, cum);
}

void ps__prom_label(char *buf, size_t cap, const char *key, const char *value) {
  size_t n = strlen(buf);
  int k = snprintf(buf + n, cap - n, "%s%s=\"", n ? "," : "", key);
  if (k < 0 || (size_t)k >= cap - n) {
    buf[n] = '\0';
    return;
  }
  n += (size_t)k;
  for (const char *p = value; *p && n + 3 < cap; p++) {
    if (*p == '\\' || *p == '"') {
      buf[n++] = '\\';
      buf[n++] = *p;
    } else if (*p == '\n') {
      buf[n++] = '\\';
      buf[n++] = 'n';
    } else {
      buf[n++] = *p;
    }
  }
  if (n + 1 < cap) buf[n++] = '"';
  buf[n] = '\0';
}

double ps__prom_sum(const char *text, size_t len, const char *name, const char *label, int *found) {
  size_t nl = strlen(name);
  double sum = 0;
  int hits = 0;
  const char *p = text, *end = text + len;
  while (p < end) {
    const char *eol = memchr(p, '\n', (size_t)(end - p));
    if (!eol) eol = end;
    size_t ll = (size_t)(eol - p);
    if (ll > nl && p[0] != '#' && !memcmp(p, name, nl) && (p[nl] == ' ' || p[nl] == '{')) {
      const char *v = p + nl;
      if (*v == '{') { /* skip the labels, which may hold spaces in quoted values */
        const char *q = v + 1;
        int inq = 0;
        while (q < eol && (inq || *q != '}')) {
          if (*q == '\\' && inq)
            q++;
          else if (*q == '"')
            inq = !inq;
          q++;
        }
        if (label) {
          size_t lab = strlen(label);
          int ok = 0;
          for (const char *s = v; s + lab <= q; s++)
            if (!memcmp(s, label, lab)) ok = 1;
          if (!ok) goto next;
        }
        v = q + 1;
      } else if (label) {
        goto next;
      }
      char num[48];
      size_t k = 0;
      while (v < eol && *v == ' ') v++;
      while (v < eol && *v != ' ' && k + 1 < sizeof num) num[k++] = *v++;
      num[k] = '\0';
      char *e;
      double x = strtod(num, &e);
      if (k && *e == '\0') {
        sum += x;
        hits++;
      }
    }
  next:
    p = eol + 1;
  }
  if (found) *found = hits;
  return sum;
}

uint64_t ps__rss_bytes(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  unsigned long long size = 0, rss = 0;
  if (!f) return 0;
  int n = fscanf(f, "%llu %llu", &size, &rss);
  fclose(f);
  return n == 2 ? rss * (uint64_t)sysconf(_SC_PAGESIZE) : 0;
}
