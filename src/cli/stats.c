/*
 * stats.c - `pshard stats HOST:PORT [--json]`: the STATS of any node (a server or the
 * scheduler), as its text lines or as one JSON object.
 *
 * The request goes through the one-shot request of net/oneshot.h. The STATS text
 * (docs/protocol.md) has four kinds of line, which --json maps as follows:
 *   "key value"                 "key": value (a number when it reads as one)
 *   "key k=v k=v ..."           "key": {"k": v, ...}; a key seen again ("metric") makes
 *                               "keys": [{...}, ...] instead
 *   "table ID name=N k=v ..."   "tables": {"N": {"id": ID, "k": v, ...}}
 *   "key ID k=v ..." ("node")   "keys": [{"id": ID, "k": v, ...}, ...]
 *   "key n n n ..." (histograms: *_staleness)   "key": [n, n, ...]
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/common.h"
#include "common/config.h"
#include "net/oneshot.h"
#include "proto/frame.h"

#define STATS_TIMEOUT_MS 5000u
#define STATS_MAX_REPLY ((uint64_t)64 << 20)

static void stats_usage(FILE *f) {
  fprintf(f,
          "usage: pshard stats HOST:PORT [--json] [--timeout MS]\n\n"
          "Print the counters of the node (server or scheduler) listening at HOST:PORT: its\n"
          "STATS lines, or with --json one JSON object (tables by name, histograms as lists).\n"
          "Exits 0, or 1 with the reason.\n\n"
          "options:\n"
          "  --json         one JSON object instead of the text lines\n"
          "  --timeout MS   give up after MS milliseconds (%u)\n"
          "  -h, --help     this text\n",
          STATS_TIMEOUT_MS);
}

/* A JSON value for token t: a number as it is when it reads as one, else a string. */
static void json_value(FILE *f, const char *t) {
  char *end;
  if (*t && (strtod(t, &end), *end == '\0') && strcmp(t, "nan") && strcmp(t, "inf") && strcmp(t, "-inf")) {
    fputs(t, f);
    return;
  }
  fputc('"', f);
  for (const unsigned char *p = (const unsigned char *)t; *p; p++) {
    if (*p == '"' || *p == '\\') fprintf(f, "\\%c", *p);
    else if (*p < 0x20) fprintf(f, "\\u%04x", *p);
    else fputc(*p, f);
  }
  fputc('"', f);
}

/* "k=v" pairs of tokens [from, n) as JSON members (after `lead` members already written). */
static void json_pairs(FILE *f, char **tok, int from, int n, int lead) {
  for (int i = from; i < n; i++) {
    char *eq = strchr(tok[i], '=');
    if (!eq) continue;
    *eq = '\0';
    fprintf(f, "%s", lead++ ? ", " : "");
    json_value(f, tok[i]);
    fputs(": ", f);
    json_value(f, eq + 1);
    *eq = '=';
  }
}

#define MAX_TOK 256

/* One line, split into tokens in place (the line's own copy). */
typedef struct sline {
  char *buf;
  char *tok[MAX_TOK];
  int n;
  int kind; /* 't' table, 'o' k=v object, 's' scalar, 'l' list */
} sline;

static void classify(sline *l) {
  l->n = 0;
  for (char *s = strtok(l->buf, " \t"); s && l->n < MAX_TOK; s = strtok(NULL, " \t")) l->tok[l->n++] = s;
  char **t = l->tok;
  size_t k0 = strlen(t[0]);
  int hist = k0 > 10 && !strcmp(t[0] + k0 - 10, "_staleness");
  if (l->n >= 3 && !strchr(t[1], '=') && strchr(t[2], '=')) l->kind = strcmp(t[0], "table") ? 'k' : 't';
  else if (l->n >= 2 && strchr(t[1], '=')) l->kind = 'o';
  else if (l->n == 2 && !hist) l->kind = 's';
  else l->kind = 'l';
}

/* Lines of kind 'o' or 'k' with this key. */
static int count_key(const sline *v, int nv, const char *key) {
  int c = 0;
  for (int i = 0; i < nv; i++) c += (v[i].kind == 'o' || v[i].kind == 'k') && !strcmp(v[i].tok[0], key);
  return c;
}

static int print_json(FILE *f, const char *text) {
  int cap = 1;
  for (const char *p = text; *p; p++) cap += *p == '\n';
  sline *v = ps__calloc((size_t)cap, sizeof *v);
  if (!v) return -1;
  int nv = 0;
  for (const char *p = text; *p;) {
    size_t len = strcspn(p, "\n");
    if (len) {
      v[nv].buf = ps__malloc(len + 1);
      if (!v[nv].buf) break;
      memcpy(v[nv].buf, p, len);
      v[nv].buf[len] = '\0';
      classify(&v[nv]);
      if (v[nv].n) nv++;
      else free(v[nv].buf);
    }
    p += len + (p[len] == '\n');
  }
  int members = 0, tables = 0;
  fputs("{", f);
  for (int i = 0; i < nv; i++) { /* the tables, as one object by name */
    if (v[i].kind != 't') continue;
    const char *name = v[i].tok[1];
    for (int j = 2; j < v[i].n; j++)
      if (!strncmp(v[i].tok[j], "name=", 5)) name = v[i].tok[j] + 5;
    fputs(tables++ ? ", " : "\"tables\": {", f);
    json_value(f, name);
    fputs(": {\"id\": ", f);
    json_value(f, v[i].tok[1]);
    json_pairs(f, v[i].tok, 2, v[i].n, 1);
    fputs("}", f);
  }
  if (tables) fputs("}", f), members++;
  for (int i = 0; i < nv; i++) {
    sline *l = &v[i];
    if (l->kind == 't') continue;
    if (l->kind == 'k' || (l->kind == 'o' && count_key(v, nv, l->tok[0]) > 1)) { /* "node", "metric": a list */
      int first = 1;
      for (int j = 0; j < i && first; j++)
        first = !((v[j].kind == 'o' || v[j].kind == 'k') && !strcmp(v[j].tok[0], l->tok[0]));
      if (!first) continue;
      fprintf(f, "%s\"%ss\": [", members++ ? ", " : "", l->tok[0]);
      for (int j = i, k = 0; j < nv; j++) {
        if ((v[j].kind != 'o' && v[j].kind != 'k') || strcmp(v[j].tok[0], l->tok[0])) continue;
        fputs(k++ ? ", {" : "{", f);
        if (v[j].kind == 'k') {
          fputs("\"id\": ", f);
          json_value(f, v[j].tok[1]);
        }
        json_pairs(f, v[j].tok, v[j].kind == 'k' ? 2 : 1, v[j].n, v[j].kind == 'k');
        fputs("}", f);
      }
      fputs("]", f);
      continue;
    }
    fputs(members++ ? ", " : "", f);
    json_value(f, l->tok[0]);
    fputs(": ", f);
    if (l->kind == 'o') {
      fputs("{", f);
      json_pairs(f, l->tok, 1, l->n, 0);
      fputs("}", f);
    } else if (l->kind == 's') {
      json_value(f, l->tok[1]);
    } else {
      fputs("[", f);
      for (int j = 1; j < l->n; j++) {
        fputs(j > 1 ? ", " : "", f);
        json_value(f, l->tok[j]);
      }
      fputs("]", f);
    }
  }
  fputs("}\n", f);
  for (int i = 0; i < nv; i++) free(v[i].buf);
  free(v);
  return 0;
}

char *ps_cli_stats_text(const char *addr, uint64_t timeout_ms) {
  ps__frame_hdr h = {.type = PS_MSG_STATS, .req_id = 1}, reply;
  void *body = NULL;
  size_t n = 0;
  if (ps__oneshot(addr, &h, NULL, 0, timeout_ms, STATS_MAX_REPLY, &reply, &body, &n)) return NULL;
  char *text = ps__malloc(n + 1);
  if (text) {
    memcpy(text, body, n);
    text[n] = '\0';
  } else {
    ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  free(body);
  return text;
}

int ps_cli_stats(int argc, char **argv) {
  static const struct option opts[] = {{"json", no_argument, 0, 'j'},
                                       {"timeout", required_argument, 0, 't'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  uint64_t timeout = STATS_TIMEOUT_MS;
  int json = 0, c;
  optind = 1;
  opterr = 0;
  while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (c) {
    case 'j': json = 1; break;
    case 't':
      if (ps__parse_u64(optarg, &timeout) || timeout == 0 || timeout > 86400000u) {
        fprintf(stderr, "pshard stats: bad value '%s' for --timeout (milliseconds, 1..86400000)\n", optarg);
        return 2;
      }
      break;
    case 'h': stats_usage(stdout); return 0;
    default:
      fprintf(stderr, "pshard stats: unknown or incomplete option '%s'\n", argv[optind - 1]);
      stats_usage(stderr);
      return 2;
    }
  }
  if (optind + 1 != argc) {
    fprintf(stderr, "pshard stats: %s\n", optind >= argc ? "a node's HOST:PORT is required" : "one HOST:PORT expected");
    stats_usage(stderr);
    return 2;
  }
  const char *addr = argv[optind];
  char host[PS_CFG_HOST_MAX];
  int port;
  if (ps__parse_hostport(addr, host, sizeof host, &port) || port == 0) {
    fprintf(stderr, "pshard stats: bad address '%s' (HOST:PORT)\n", addr);
    return 2;
  }
  char *text = ps_cli_stats_text(addr, timeout);
  if (!text) {
    fprintf(stderr, "pshard stats: %s\n", ps_errmsg());
    return 1;
  }
  int rc = 0;
  if (json) rc = print_json(stdout, text) ? 1 : 0;
  else fputs(text, stdout);
  free(text);
  if (rc) fprintf(stderr, "pshard stats: out of memory\n");
  return rc;
}
