/*
 * repair_out.c - a tail's copy of its chains to a replacement (repair.c says how a
 * repair goes): the copy-free cut of every table when the membership shows the
 * replacement syncing after this server, then SYNC_ROWS frames of the cut rows (key and
 * whole row), each built from the loop out of at most REPAIR_SCAN_ROWS rows of the cut,
 * one in flight, each sent again after REPAIR_RETRY_MS if refused or lost, and
 * SYNC_DONE (the windows, the steps, the rounds per chain) last. Everything here runs on the server's loop thread.
 */
#include <string.h>

#include "common/common.h"
#include "proto/msg.h"
#include "server/repair_int.h"

#define REPAIR_SCAN_ROWS 65536u   /* rows of the cut read per frame built, at most */
#define REPAIR_RETRY_MS 200u      /* a frame refused or lost is sent again after this */
#define REPAIR_MAX_FAILURES 300u  /* ... this many times, then the stream is abandoned */

void ps__rp_out_free(ps__server *s, rp_out *o) {
  for (size_t i = 0; i < o->nt; i++) {
    if (o->t[i].cut) ps__shard_snap_release(s->sh, &o->t[i].snap);
    free(o->t[i].sel);
    free(o->t[i].cks);
    free(o->t[i].rounds);
  }
  free(o->t);
  free(o->done_body);
  free(o->frame);
  free(o);
}

void ps__rp_out_unlink(ps__server *s, rp_out *o) {
  for (rp_out **pp = &s->repair->outs; *pp; pp = &(*pp)->next)
    if (*pp == o) {
      *pp = o->next;
      return;
    }
}

/* Does any table have a cut being read (a checkpoint)? One cut of a table at a time. */
static int tables_cut(ps__server *s) {
  for (size_t i = 0; i < s->sh->ntables; i++)
    if (s->sh->tables[i] && s->sh->tables[i]->cut) return 1;
  return 0;
}

/* Add unit u to the set (*v, *n) unless it is there: 0 or PS_ERR_NOMEM. */
static int unit_add(uint64_t **v, size_t *n, uint64_t u) {
  for (size_t i = 0; i < *n; i++)
    if ((*v)[i] == u) return 0;
  uint64_t *nv = ps__realloc(*v, (*n + 1) * sizeof *nv);
  if (!nv) return PS_ERR_NOMEM;
  nv[(*n)++] = u;
  *v = nv;
  return 0;
}

/* Start the copy to replacement x: cut every table, note which chains it copies from
 * here (those in which x is the member after this server) and encode what SYNC_DONE
 * carries. 0, PS_ERR_UNAVAILABLE (a checkpoint's cut is being read: later) or NOMEM. */
int ps__rp_out_start(ps__server *s, uint32_t x) {
  srv_repair *r = s->repair;
  if (tables_cut(s)) return PS_ERR_UNAVAILABLE;
  rp_out *o = ps__calloc(1, sizeof *o);
  if (!o) return PS_ERR_NOMEM;
  o->to = x;
  o->stream = ++r->next_stream;
  o->cut_epoch = s->epoch;
  o->t = ps__calloc(s->sh->ntables ? s->sh->ntables : 1, sizeof *o->t);
  ps__wbuf w;
  ps__wbuf_init(&w);
  int rc = o->t ? 0 : PS_ERR_NOMEM;
  size_t ntab = 0, chains = 0, nunits = 0;
  uint64_t *units = NULL;
  for (size_t i = 0; i < s->sh->ntables && !rc; i++) {
    ps__table *t = s->sh->tables[i];
    if (!t) continue;
    rp_table *rt = &o->t[o->nt];
    ps__srv_chains cx;
    if (ps__srv_chains_init(&cx, s, t)) {
      rc = PS_ERR_NOMEM;
      break;
    }
    rt->nsel = ps__srv_nchains(&cx);
    rt->sel = ps__calloc(rt->nsel ? rt->nsel : 1, 1);
    if (!rt->sel) rc = PS_ERR_NOMEM;
    for (size_t k = 0; k < rt->nsel && !rc; k++) {
      uint32_t next;
      int place = ps__srv_chain_place(&cx, ps__srv_chain_name(&cx, k), &next);
      rt->sel[k] = (uint8_t)(place && next == x);
      chains += rt->sel[k];
      rt->nck += rt->sel[k];
      if (rt->sel[k] && unit_add(&units, &nunits, ps__once_unit(t->id, ps__srv_chain_name(&cx, k)))) rc = PS_ERR_NOMEM;
    }
    /* A sync table's cut is between rounds (they are applied whole, on this thread):
     * the rounds of each chain in it, so the replacement takes the later ones. */
    if (!rc && ps__table_is_sync(t)) {
      rt->cks = ps__malloc((rt->nck ? rt->nck : 1) * sizeof *rt->cks);
      rt->rounds = ps__malloc((rt->nck ? rt->nck : 1) * sizeof *rt->rounds);
      if (!rt->cks || !rt->rounds) rc = PS_ERR_NOMEM;
      for (size_t k = 0, j = 0; k < rt->nsel && !rc; k++) {
        if (!rt->sel[k]) continue;
        rt->cks[j] = ps__srv_chain_name(&cx, k);
        rt->rounds[j] = ps__srv_sync_chain_rounds(s, t, rt->cks[j]);
        j++;
      }
    } else {
      rt->nck = 0;
    }
    ps__srv_chains_free(&cx);
    if (rc) {
      free(rt->sel);
      free(rt->cks);
      free(rt->rounds);
      break;
    }
    if ((rc = ps__shard_snap_keep(t, &rt->snap))) {
      free(rt->sel);
      free(rt->cks);
      free(rt->rounds);
      break;
    }
    rt->cut = 1;
    o->nt++;
    ntab++;
  }
  if (!rc) {
    ps__wbuf_u32(&w, o->stream);
    ps__wbuf_u32(&w, (uint32_t)ntab);
    for (size_t i = 0; i < o->nt; i++) {
      ps__wbuf_u32(&w, o->t[i].snap.decl.id);
      ps__wbuf_u32(&w, (uint32_t)o->t[i].nck);
      ps__wbuf_u64(&w, o->t[i].snap.step);
      ps__wbuf_u64(&w, (uint64_t)o->t[i].snap.version);
      for (size_t j = 0; j < o->t[i].nck; j++) {
        ps__wbuf_u32(&w, o->t[i].cks[j]);
        ps__wbuf_u32(&w, 0);
        ps__wbuf_u64(&w, (uint64_t)o->t[i].rounds[j]);
      }
    }
    /* The workers' clocks as known here: X missed the CLOCKs a worker sent before it
     * knew X, and a round X heads later waits for them. */
    uint32_t nw = 0;
    for (size_t i = 0; i < s->sh->nworkers; i++) nw += s->sh->workers[i].alive;
    ps__wbuf_u32(&w, nw);
    for (size_t i = 0; i < s->sh->nworkers; i++) {
      if (!s->sh->workers[i].alive) continue;
      ps__wbuf_u32(&w, s->sh->workers[i].id);
      ps__wbuf_u32(&w, 0);
      ps__wbuf_u64(&w, (uint64_t)s->sh->workers[i].clock);
    }
    /* The windows of the chains copied from here (this server's place in its other
     * chains differs: what it applied there, the tails X copies those from may not have
     * yet), without the pushes in aggregation buffers not applied yet: the cut's rows do
     * not hold them, and the replacement must apply them when they come (in the buffer's
     * forward, or each on its own when their workers send them again). */
    ps__push_id *pending;
    size_t np = ps__srv_agg_pending(s, &pending);
    const uint64_t none = 0; /* (no chain copied from here: no window) */
    if (np == (size_t)-1 || ps__once_set_encode_except(&s->sh->once, units ? units : &none, nunits, pending, np, &w))
      rc = PS_ERR_NOMEM;
    free(pending);
    if (w.oom || w.len > PS_CTRL_MAX_BODY) rc = PS_ERR_NOMEM;
  }
  free(units);
  if (rc) {
    ps__wbuf_free(&w);
    ps__rp_out_free(s, o);
    if (rc == PS_ERR_UNAVAILABLE) return rc;
    ps__log(PS_LOG_ERROR, "cannot start copying rows to server %u: %s", x, ps_strerror(rc));
    return rc;
  }
  o->done_body = w.data;
  o->done_len = w.len;
  o->next = r->outs;
  r->outs = o;
  ps__log(PS_LOG_INFO, "copying the rows of %zu chain%s of %zu table%s to replacement server %u", chains,
          chains == 1 ? "" : "s", ntab, ntab == 1 ? "" : "s", x);
  return 0;
}

/* The next frame of stream o into o->frame: rows of its current table, or SYNC_DONE.
 * 0, or -1 (out of memory, or a row too large for a frame: the stream is abandoned). */
static int out_build(ps__server *s, rp_out *o) {
  while (o->cur < o->nt && o->t[o->cur].sent_decl && o->t[o->cur].next >= o->t[o->cur].snap.n) {
    rp_table *done = &o->t[o->cur++];
    ps__shard_snap_release(s->sh, &done->snap); /* read through: the table forgets the cut */
    done->cut = 0;
  }
  if (o->cur == o->nt) {
    if (!(o->frame = ps__malloc(o->done_len ? o->done_len : 1))) return -1;
    memcpy(o->frame, o->done_body, o->done_len);
    o->flen = o->done_len;
    o->fh = (ps__frame_hdr){.type = PS_MSG_SYNC_DONE, .epoch = s->epoch, .clock = (int64_t)o->cut_epoch};
    o->done_sent = 1;
    return 0;
  }
  rp_table *rt = &o->t[o->cur];
  ps__table *t = ps__shard_table(s->sh, rt->snap.decl.id);
  ps__wbuf decl;
  ps__wbuf_init(&decl);
  ps__declare_encode(&decl, &rt->snap.decl);
  size_t rf = rt->snap.row_floats, per = 8 + 4 * rf, head = PS_SYNC_ROWS_PREFIX + 4 + decl.len;
  if (decl.oom || head + per > PS_CTRL_MAX_BODY || !t) {
    ps__log(PS_LOG_ERROR, "table '%s': %s", rt->snap.decl.name,
            !t ? "dropped while its rows were copied" : "a row does not fit a copy frame");
    ps__wbuf_free(&decl);
    return -1;
  }
  size_t cap = (PS_CTRL_MAX_BODY - head) / per;
  uint8_t *f = ps__malloc(head + cap * per);
  float *row = ps__malloc(rf * sizeof *row);
  ps__srv_chains cx;
  int cx_ok = !ps__srv_chains_init(&cx, s, t);
  if (!f || !row || !cx_ok) {
    free(f);
    free(row);
    if (cx_ok) ps__srv_chains_free(&cx);
    ps__wbuf_free(&decl);
    return -1;
  }
  /* keys first, rows after them: gather both, then close the gap */
  uint8_t *keys = f + head;
  float *rows = ps__malloc(cap * per);
  size_t n = 0;
  int err = !rows;
  for (uint32_t scanned = 0; !err && rt->next < rt->snap.n && n < cap && scanned < REPAIR_SCAN_ROWS; scanned++) {
    uint64_t i = rt->next++;
    uint64_t key = ps__snap_key(&rt->snap, i);
    if (ps__snap_read(&rt->snap, i, row)) {
      err = 1;
      break;
    }
    size_t ck = ps__srv_chain_index(&cx, ps__srv_row_chain(&cx, key));
    if (ck >= rt->nsel || !rt->sel[ck]) continue;
    ps__put_u64(keys + 8 * n, key);
    memcpy(rows + n * rf, row, rf * sizeof *row);
    n++;
  }
  ps__srv_chains_free(&cx);
  free(row);
  if (err) {
    ps__log(PS_LOG_ERROR, "table '%s': its cut could not be read (out of memory saving rows)", rt->snap.decl.name);
    free(rows);
    free(f);
    ps__wbuf_free(&decl);
    return -1;
  }
  ps__put_u32(f, o->stream);
  ps__put_u32(f + 4, (uint32_t)rf);
  ps__put_u32(f + 8, (uint32_t)decl.len);
  memcpy(f + 12, decl.data, decl.len);
  memcpy(keys + 8 * n, rows, n * rf * sizeof(float));
  free(rows);
  ps__wbuf_free(&decl);
  o->frame = f;
  o->flen = head + n * per;
  o->fh = (ps__frame_hdr){.type = PS_MSG_SYNC_ROWS, .table = rt->snap.decl.id, .batch = (uint32_t)n, .epoch = s->epoch,
                          .clock = (int64_t)o->cut_epoch};
  o->rows += n;
  rt->sent_decl = 1;
  return 0;
}

static rp_out *out_by_stream(ps__server *s, uint32_t stream) {
  for (rp_out *o = s->repair ? s->repair->outs : NULL; o; o = o->next)
    if (o->stream == stream) return o;
  return NULL;
}

/* A frame of a stream was answered (g->status 0: taken). */
static void out_answered(ps__server *s, srv_fwd_group *g) {
  rp_out *o = out_by_stream(s, (uint32_t)g->round);
  if (!o) return; /* dropped meanwhile */
  o->inflight = 0;
  if (g->status) {
    if (++o->failures > REPAIR_MAX_FAILURES) {
      ps__log(PS_LOG_ERROR, "copy to server %u abandoned: %s", o->to, g->msg);
      ps__rp_out_unlink(s, o);
      ps__rp_out_free(s, o);
      return;
    }
    o->retry_at = uv_now(&s->loop) + REPAIR_RETRY_MS; /* the same frame again */
    return;
  }
  o->failures = 0;
  free(o->frame);
  o->frame = NULL;
  if (o->done_sent) {
    ps__log(PS_LOG_INFO, "copied %llu rows to replacement server %u", (unsigned long long)o->rows, o->to);
    s->repair->streams_done++;
    s->repair->rows_out += o->rows;
    if (ps__rp_ids_add(&s->repair->served, &s->repair->nserved, o->to))
      ps__log(PS_LOG_ERROR, "out of memory noting the copy to server %u as done", o->to);
    ps__rp_out_unlink(s, o);
    ps__rp_out_free(s, o);
    return;
  }
  ps__rp_out_pump(s, o);
}

/* Send stream o's next frame unless one is in flight or waits for its retry. */
void ps__rp_out_pump(ps__server *s, rp_out *o) {
  if (o->inflight || (o->retry_at && uv_now(&s->loop) < o->retry_at)) return;
  o->retry_at = 0;
  if (!o->frame && out_build(s, o)) {
    ps__log(PS_LOG_ERROR, "copy to server %u abandoned", o->to);
    ps__rp_out_unlink(s, o);
    ps__rp_out_free(s, o);
    return;
  }
  void *buf = ps__pool_get(s->pool, o->flen ? o->flen : 1);
  srv_fwd_group *g = buf ? ps__srv_group_new(s) : NULL;
  if (!g) {
    if (buf) ps__pool_put(s->pool, buf, o->flen ? o->flen : 1);
    o->retry_at = uv_now(&s->loop) + REPAIR_RETRY_MS;
    return;
  }
  memcpy(buf, o->frame, o->flen);
  g->done = out_answered;
  g->round = o->stream;
  g->out = 1;
  o->inflight = 1;
  o->fh.epoch = s->epoch;
  if (ps__srv_forward_frame(s, o->to, &o->fh, buf, o->flen, 0, g)) {
    g->out = 0;
    g->status = PS_ERR_NOMEM;
    snprintf(g->msg, sizeof g->msg, "%s", ps_errmsg());
  }
  g->building = 0;
  ps__srv_group_maybe_done(s, g); /* out_answered runs now if it failed already */
}
