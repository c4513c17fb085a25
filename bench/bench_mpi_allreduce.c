/*
 * bench_mpi_allreduce.c - the all-reduce peer of bench_sync: MPI_Allreduce (sum) of N
 * floats per step, run under mpirun by bench_sync. Rank 0 prints the median step time
 * over the steps after a warm-up ("median_s X"), each step bounded by barriers so that
 * every rank starts it together. The gradient buffers are allocated once, as a training
 * loop would; Open MPI's own temporaries follow glibc's allocation thresholds (see
 * bench_sync for the MALLOC_*_THRESHOLD_ runs).
 *
 * usage: mpirun -np K bench_mpi_allreduce N STEPS
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc < 3) {
    if (rank == 0) fprintf(stderr, "usage: bench_mpi_allreduce N STEPS\n");
    MPI_Finalize();
    return 2;
  }
  size_t n = (size_t)atol(argv[1]);
  int steps = atoi(argv[2]), warm = 3;
  float *g = malloc(n * sizeof *g), *sum = malloc(n * sizeof *sum);
  for (size_t i = 0; i < n; i++) g[i] = (float)(i % 97) * 1e-3f;
  double *t = malloc(sizeof *t * (size_t)steps);
  for (int s = 0; s < warm + steps; s++) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    MPI_Allreduce(g, sum, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double dt = MPI_Wtime() - t0, mx;
    MPI_Reduce(&dt, &mx, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (s >= warm) t[s - warm] = mx;
  }
  if (rank == 0) {
    qsort(t, (size_t)steps, sizeof *t, cmp_d);
    printf("median_s %.6f\n", t[steps / 2]);
    printf("check %g\n", (double)sum[1]);
  }
  free(g);
  free(sum);
  free(t);
  MPI_Finalize();
  return 0;
}
