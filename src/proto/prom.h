/*
 * prom.h - the Prometheus text exposition format (version 0.0.4), written and read.
 *
 * A node's metrics are one text in that format: families in a fixed order, each a
 * HELP line, a TYPE line and its samples. The same text is served on the node's
 * /metrics and sent to the scheduler (PS_MSG_NODE_METRICS), which merges the nodes'
 * texts into one for the job with a node label (sched/metrics.c). Names are ps_...,
 * in base units (seconds, bytes), counters end in _total.
 */
#ifndef PS_PROM_H
#define PS_PROM_H

#include <stddef.h>
#include <stdint.h>

#include "common/hist.h"
#include "proto/frame.h"

#define PS__PROM_CTYPE "text/plain; version=0.0.4; charset=utf-8"
#define PS__PROM_LABELS_MAX 512 /* a sample's labels, as text */

/* A family's HELP and TYPE lines; type is counter, gauge or histogram. */
void ps__prom_family(ps__wbuf *w, const char *name, const char *type, const char *help);
/* One sample: name{labels} value (labels "" or NULL: none). */
void ps__prom_u64(ps__wbuf *w, const char *name, const char *labels, uint64_t v);
void ps__prom_f64(ps__wbuf *w, const char *name, const char *labels, double v);
/* A latency histogram's samples in seconds: name_bucket (cumulative, le="+Inf" last),
 * name_sum, name_count. */
void ps__prom_hist(ps__wbuf *w, const char *name, const char *labels, const ps__hist *h);
/* A histogram of n counts per bucket over the given n - 1 finite upper bounds (the
 * last count is above them), with their sum. */
void ps__prom_hist_counts(ps__wbuf *w, const char *name, const char *labels, const double *bounds,
                          const uint64_t *counts, size_t n, double sum);
/* Append key="value" (value escaped, a comma first when buf is not empty) to the
 * NUL-terminated labels in buf of cap bytes; cut at cap. */
void ps__prom_label(char *buf, size_t cap, const char *key, const char *value);
/* The sum of every sample named exactly `name` in an exposition text whose labels
 * contain `label` (e.g. "role=\"worker\"", NULL: any). *found counts them (may be NULL). */
double ps__prom_sum(const char *text, size_t len, const char *name, const char *label, int *found);
/* This process's resident memory in bytes (/proc/self/statm), 0 if unknown. */
uint64_t ps__rss_bytes(void);

#endif
