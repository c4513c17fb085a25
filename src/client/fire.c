/*
 * fire.c - fire-and-forget frames (CLOCK, METRIC) and the CLOCKs held behind pushes,
 * on the loop thread.
 *
 * A frame goes on every link it is for, after the parts queued there: a link still
 * connecting gets it queued as the one part of a detached request that frees itself.
 *
 * A server counts a worker's CLOCK as the end of that worker's pushes for the round.
 * For CLOCK_GUARD_MS after the worker hears of a death, or after a chain member refused
 * one of its pushes to a replicated sync table, a CLOCK waits until every such push sent
 * before it is answered (ctx->keep_unanswered): the push may be on its way to a new
 * head while the CLOCK would reach that head first. A later CLOCK stands for a held one
 * (servers keep the largest); the last answer sends it (ps__clock_unhold), and so does
 * the sweep (ps__clock_release).
 */
#include <string.h>

#include "client/client_int.h"

static void fire_links(ps_ctx *ctx, uint32_t target, const ps__frame_hdr *fh, const void *body, size_t len);

void ps__fire_servers(ps_ctx *ctx, const ps__frame_hdr *h, const void *body, size_t len) {
  fire_links(ctx, SCHED_LINK + 1, h, body, len);
}

/* A CLOCK of clock c to every live server, after the parts queued on each link. */
static void clock_out(ps_ctx *ctx, int64_t c) {
  ps__frame_hdr h = {.type = PS_MSG_CLOCK, .clock = c};
  ps__clock_sent(ctx, c);
  fire_links(ctx, SCHED_LINK + 1, &h, NULL, 0);
}

void ps__mail_fire(void *arg) {
  fire *f = arg;
  ps_ctx *ctx = f->ctx;
  if (f->h.type != PS_MSG_CLOCK) {
    fire_links(ctx, f->target, &f->h, f->body, f->len);
  } else if (ctx->keep_unanswered && ps__now_ms() < ctx->clock_guard_ms) {
    /* Behind unanswered pushes to replicated sync tables, for a while after a death or a
     * push refused by a chain's member: it goes when they are answered (a later CLOCK
     * stands for this one, the servers keep the largest). */
    if (f->h.clock > ctx->held_clock) ctx->held_clock = f->h.clock;
  } else {
    clock_out(ctx, f->h.clock);
  }
  __atomic_sub_fetch(&ctx->outstanding, 1, __ATOMIC_RELEASE);
  free(f);
}

void ps__clock_release(ps_ctx *ctx) {
  if (!ctx->held_clock || ctx->keep_unanswered || ctx->closing) return;
  int64_t c = ctx->held_clock;
  ctx->held_clock = 0;
  clock_out(ctx, c);
}

static void mail_release(void *arg) { ps__clock_release(arg); }

void ps__clock_unhold(ps_ctx *ctx, part *p) {
  p->unanswered = 0;
  /* (if the mail cannot be posted, the sweep sends it) */
  if (!--ctx->keep_unanswered && ctx->held_clock) ps__mailbox_post(ctx->mail, mail_release, ctx);
}

static void fire_links(ps_ctx *ctx, uint32_t target, const ps__frame_hdr *fh, const void *body, size_t len) {
  struct {
    const void *body;
    size_t len;
  } fb = {body, len}, *f = &fb;
  for (peer *l = ctx->links; l; l = l->next) {
    if (target == SCHED_LINK ? l->id != SCHED_LINK : (l->id == SCHED_LINK || !l->alive)) continue;
    ps__frame_hdr h = *fh;
    h.sender = ctx->id;
    if (l->conn && ps__link_take(ctx, l) && !l->queue_head) {
      ps__conn_send_ctrl(l->conn, &h, f->body, f->len);
    } else if (l->alive) {
      /* Not connected yet: queue a one-part request that frees itself. */
      ps_req *r = ps__calloc(1, sizeof *r);
      if (!r) continue;
      r->ctx = ctx;
      r->nparts = r->remaining = 1;
      r->parts = ps__calloc(1, sizeof *r->parts);
      r->bufs = ps__calloc(1, sizeof *r->bufs);
      r->own_keys = f->len ? ps__malloc(f->len) : NULL;
      if (!r->parts || !r->bufs || (f->len && !r->own_keys)) {
        free(r->parts); free(r->bufs); free(r->own_keys); free(r);
        continue;
      }
      pthread_mutex_init(&r->mu, NULL);
      pthread_cond_init(&r->cv, NULL);
      r->canceled = 2; /* detached: freed by the loop when done */
      if (f->len) memcpy(r->own_keys, f->body, f->len);
      r->bufs[0] = uv_buf_init(r->own_keys, (unsigned)f->len);
      part *p = &r->parts[0];
      p->req = r;
      p->target = l->id;
      p->hdr = h;
      p->send = r->bufs;
      p->nsend = f->len ? 1 : 0;
      p->deadline_ms = ps__now_ms() + ctx->timeout_ms;
      p->reply_done = 1; /* no reply expected */
      ps__part_submit(ctx, p);
    }
  }
}
