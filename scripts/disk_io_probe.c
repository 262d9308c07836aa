/* The measurement behind roundpipe.disk's choice of threads over io_uring (docs/benchmarks.md,
 * "Optimizer state on a disk"): sequential O_DIRECT writes and reads of a 256 MiB file, with
 * liburing (`depth` requests in flight) and with POSIX threads doing pwrite / pread (`depth`
 * threads), per request size and depth, two rounds, interleaved. Not part of the build:
 *
 *   apt-get install liburing-dev
 *   gcc -O2 -Wall -o /tmp/disk_io_probe scripts/disk_io_probe.c -luring -lpthread
 *   /tmp/disk_io_probe /path/on/the/disk/probe.bin
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <liburing.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const size_t kSize = 256u << 20;
static int fd;
static char* buf;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* GB/s of the whole file in `block`-byte requests, `depth` in flight, through io_uring. */
static double with_uring(int write, size_t block, int depth) {
  struct io_uring ring;
  if (io_uring_queue_init(depth, &ring, 0) != 0) {
    perror("io_uring_queue_init");
    exit(1);
  }
  size_t n = kSize / block, submitted = 0, done = 0;
  double start = now();
  while (done < n) {
    while (submitted < n && submitted - done < (size_t)depth) {
      struct io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      if (write)
        io_uring_prep_write(sqe, fd, buf + submitted * block, block, submitted * block);
      else
        io_uring_prep_read(sqe, fd, buf + submitted * block, block, submitted * block);
      submitted++;
    }
    io_uring_submit(&ring);
    struct io_uring_cqe* cqe;
    io_uring_wait_cqe(&ring, &cqe);
    do {
      if (cqe->res != (int)block) {
        fprintf(stderr, "short or failed transfer: %d\n", cqe->res);
        exit(1);
      }
      io_uring_cqe_seen(&ring, cqe);
      done++;
    } while (io_uring_peek_cqe(&ring, &cqe) == 0);
  }
  io_uring_queue_exit(&ring);
  return kSize / (now() - start) / 1e9;
}

static size_t g_block;
static int g_write;
static size_t g_next;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static void* worker(void* unused) {
  (void)unused;
  for (;;) {
    pthread_mutex_lock(&g_lock);
    size_t i = g_next++;
    pthread_mutex_unlock(&g_lock);
    if (i >= kSize / g_block) return NULL;
    ssize_t r = g_write ? pwrite(fd, buf + i * g_block, g_block, i * g_block)
                        : pread(fd, buf + i * g_block, g_block, i * g_block);
    if (r != (ssize_t)g_block) {
      perror("pwrite/pread");
      exit(1);
    }
  }
}

/* The same with `depth` threads, each issuing one blocking request at a time. */
static double with_threads(int write, size_t block, int depth) {
  pthread_t threads[64];
  g_block = block;
  g_write = write;
  g_next = 0;
  double start = now();
  for (int i = 0; i < depth; i++) pthread_create(&threads[i], NULL, worker, NULL);
  for (int i = 0; i < depth; i++) pthread_join(threads[i], NULL);
  return kSize / (now() - start) / 1e9;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s FILE (created, then removed)\n", argv[0]);
    return 2;
  }
  fd = open(argv[1], O_RDWR | O_CREAT | O_DIRECT, 0600);
  if (fd < 0 || posix_fallocate(fd, 0, kSize) != 0 || posix_memalign((void**)&buf, 4096, kSize)) {
    perror(argv[1]);
    return 1;
  }
  memset(buf, 7, kSize);
  const size_t blocks[] = {1u << 20, 4u << 20};
  const int depths[] = {1, 2, 4, 8};
  for (int round = 0; round < 2; round++) {
    for (int b = 0; b < 2; b++) {
      for (int d = 0; d < 4; d++) {
        double uw = with_uring(1, blocks[b], depths[d]);
        double tw = with_threads(1, blocks[b], depths[d]);
        double ur = with_uring(0, blocks[b], depths[d]);
        double tr = with_threads(0, blocks[b], depths[d]);
        printf("%zu MiB requests, depth %d: write GB/s io_uring %.2f threads %.2f | read GB/s "
               "io_uring %.2f threads %.2f\n", blocks[b] >> 20, depths[d], uw, tw, ur, tr);
        fflush(stdout);
      }
    }
  }
  close(fd);
  unlink(argv[1]);
  return 0;
}
