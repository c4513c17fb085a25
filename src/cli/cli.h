/*
 * cli.h - subcommands of the `pshard` command. Each returns the process exit status:
 * 0 success, 1 runtime failure, 2 usage error (bad flag; usage printed to stderr).
 */
#ifndef PS_CLI_H
#define PS_CLI_H

#include <stddef.h>
#include <stdint.h>

int ps_cli_scheduler(int argc, char **argv);
int ps_cli_server(int argc, char **argv);
int ps_cli_plan(int argc, char **argv);
int ps_cli_run(int argc, char **argv);
int ps_cli_exec(int argc, char **argv);
int ps_cli_plan_measured(int argc, char **argv);
/* `pshard checkpoint inspect DIR` (cli/ckpt.c), or the trigger below for HOST:PORT. */
int ps_cli_checkpoint(int argc, char **argv);
int ps_cli_stats(int argc, char **argv);
int ps_cli_top(int argc, char **argv);
/* Ask the scheduler at HOST:PORT for its counters (text, NUL-terminated, at most cap - 1
 * bytes) within timeout_ms. 0, or -1 with the reason in ps_errmsg(). */
/* The running pshard binary's path (/proc/self/exe), or "pshard". */
const char *ps_cli_self_exe(void);
/* The STATS text of the node at addr, NUL-terminated and malloc'd (stats.c); NULL with
 * the reason in ps_errmsg. */
char *ps_cli_stats_text(const char *addr, uint64_t timeout_ms);
int ps_cli_fetch_stats(const char *addr, uint64_t timeout_ms, char *out, size_t cap);
/* `pshard checkpoint HOST:PORT [--timeout MS]` (argv[0] is the subcommand's name): a
 * checkpoint of the running job now, its id, clock and directory printed. */
int ps_cli_checkpoint_trigger(int argc, char **argv);

#endif
