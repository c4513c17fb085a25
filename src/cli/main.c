/*
 * main.c - the `pshard` command: dispatches to a subcommand.
 */
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"
#include "proto/frame.h"
#include "pshard.h"
#include "store/ckpt.h"


static const struct {
  const char *name;
  int (*fn)(int, char **);
  const char *help;
} commands[] = {
    {"run", ps_cli_run, "start a scheduler, servers and workers on this machine"},
    {"exec", ps_cli_exec, "take a role from an mpirun or Slurm rank"},
    {"scheduler", ps_cli_scheduler, "run the scheduler of a job"},
    {"server", ps_cli_server, "run a parameter server"},
    {"plan", ps_cli_plan, "estimate memory, traffic, time and learning rate of a job"},
    {"checkpoint", ps_cli_checkpoint, "inspect a checkpoint on disk, or ask a job to write one"},
    {"stats", ps_cli_stats, "print the counters of a running server or scheduler"},
    {"top", ps_cli_top, "watch a running job: servers, workers, where the time goes"},
};

static void usage(FILE *f) {
  fprintf(f, "usage: pshard <command> [options]\n\ncommands:\n");
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].help);
  fprintf(f, "\n'pshard <command> --help' describes a command's options; 'pshard --version' the version.\n");
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
    usage(stdout);
    return 0;
  }
  if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "version")) {
    printf("pshard %s (protocol %d, checkpoint format %d)\n", ps_version(), PS_FRAME_VERSION, PS_CKPT_FORMAT);
    return 0;
  }
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (!strcmp(argv[1], commands[i].name)) return commands[i].fn(argc - 1, argv + 1);
  fprintf(stderr, "pshard: unknown command '%s'\n", argv[1]);
  usage(stderr);
  return 2;
}
