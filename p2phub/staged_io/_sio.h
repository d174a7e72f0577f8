/* p2phub staged I/O engine: batches of scattered reads (writes) between files and memory,
 * submitted through io_uring (raw system calls), landing in reused staging slots, copied to
 * (from) host memory with memcpy or to (from) CUDA memory with batched async copies.
 *
 * This header is also what cffi parses: plain declarations only. */

struct sio_engine;

struct sio_stats {
    unsigned long long pieces;       /* reads (writes) submitted, resubmissions included */
    unsigned long long bytes;        /* useful bytes moved */
    unsigned long long copy_calls;   /* driver calls that issued copies */
    unsigned long long copies;       /* copies issued (after merging contiguous runs) */
    unsigned long long merged;       /* pieces merged into the copy before them */
    unsigned long long slot_waits;   /* times no staging slot was free */
    unsigned long long max_inflight; /* deepest the queue went */
    unsigned long long in_place;     /* pieces read straight into host memory (O_DIRECT,
                                        aligned): no staging slot copy */
    int batch_api;                   /* 1: cuMemcpyBatchAsync was used for CUDA copies */
    int fixed;                       /* 1: reads (writes) went to registered staging buffers */
    int io_thread;                   /* 1: a second thread drove io_uring while this one
                                        issued the CUDA copies */
    int aio;                         /* 1: submitted through Linux AIO (io_uring blocked),
                                        0: io_uring */
    unsigned long long split;        /* O_DIRECT reads of twice this and up went in pieces of it
                                        (0: slot-sized pieces only) */
    unsigned long long split_entries;/* entries cut into such pieces */
    unsigned long long fixed_mem;    /* pieces read (written) in place through a range of the
                                        caller's memory registered with the ring
                                        (sio_register_mem): no page pinning per I/O */
    unsigned long long slot_bytes;   /* the staging slots this run was carved into: their */
    unsigned long long slots;        /* size and count (larger, fewer for large entries) */
    unsigned long long inflight_bytes;     /* the bound on bytes of O_DIRECT reads through
                                              slots in flight (0: none) */
    unsigned long long max_inflight_bytes; /* the most such bytes that were in flight */
};

/* Flags of one entry. */
#define SIO_DIRECT 1   /* the fd is O_DIRECT: reads (writes) aligned to SIO_ALIGN */
#define SIO_CUDA 2     /* mem is CUDA device memory (else host memory) */
#define SIO_ALIGN 4096

/* Options of an engine (sio_open), for measurement: the defaults are the fast ones. */
#define SIO_OPT_NO_FIXED 1      /* register nothing with io_uring: staging nor memory */
#define SIO_OPT_NO_IO_THREAD 2  /* CUDA loads: one thread does the I/O and the copies */
#define SIO_OPT_POLL 4          /* wait for completions by polling, not sleeping */

/* A new engine: an io_uring of `depth` entries (a Linux AIO context where io_uring is
 * blocked), `nslots` staging slots of `slot_bytes`
 * (a multiple of SIO_ALIGN) at `stage` (SIO_ALIGN-aligned, slot_bytes * nslots bytes,
 * pinned where CUDA copies use it), copies on CUDA stream `stream` (0: host copies only),
 * `options` a mask of SIO_OPT_* (0: the defaults). The staging memory is registered with
 * the ring (fixed buffers) where the kernel allows it, else read into as plain memory.
 * NULL on failure, with the reason in err. */
struct sio_engine *sio_open(unsigned depth, unsigned long long slot_bytes, unsigned nslots,
                            void *stage, unsigned long long stream, unsigned options,
                            char *err, int errlen);
void sio_close(struct sio_engine *e);

/* Run one batch to the end: write 0 reads file -> mem, 1 writes mem -> file. Per entry i:
 * fd[i], file offset off[i], length len[i], memory address mem[i], flags[i]. result[i] gets
 * the bytes moved, or -errno. Returns 0 when every entry succeeded, the number of failed
 * entries (> 0), or -1 on an engine failure (message in err). A load with CUDA entries runs
 * io_uring on a second thread and issues the copies on the calling thread, whose CUDA
 * context is current. */
int sio_run(struct sio_engine *e, int write, unsigned long long n, const int *fd,
            const unsigned long long *off, const unsigned long long *len,
            const unsigned long long *mem, const unsigned char *flags, long long *result,
            struct sio_stats *stats, char *err, int errlen);

/* O_DIRECT reads through staging slots of 2 x piece_bytes and up go in pieces of piece_bytes
 * (rounded down to SIO_ALIGN; 0: only slot-sized pieces), so that a few large reads reach the
 * disk as many requests. Reads in place are not cut. The default is set by sio_open. */
void sio_set_split(struct sio_engine *e, unsigned long long piece_bytes);
/* O_DIRECT reads through staging slots keep at most `bytes` in flight (0: only the depth
 * bounds them); at least one read is always in flight. Reads in place and buffered reads
 * are not counted. The default is set by sio_open. */
void sio_set_inflight(struct sio_engine *e, unsigned long long bytes);

/* The submission path: 0 io_uring, 1 Linux AIO (io_uring_setup refused, or P2PHUB_IO_URING=0
 * in the environment); `reason` gets why, for the log. */
int sio_submit_path(struct sio_engine *e, char *reason, int reasonlen);

/* Register [addr, addr + len) of the caller's host memory with the ring (fixed buffers, in
 * pieces of at most 1 GiB): O_DIRECT reads in place into it then skip pinning its pages per
 * read. Any thread may call it, also while another runs a batch on the engine; the kernel's
 * table changes on the thread that drives the ring, at once where that is the caller, else at
 * the start of the next sio_run. Returns 0 once the range is in the kernel's table, the
 * entries it waits with for the ring's thread (> 0; ask again after a batch), or why not:
 * -ENOSPC when the table is full, -EOPNOTSUPP where the ring has no sparse buffer table (older
 * kernels, Linux AIO), the kernel's refusal (-ENOMEM over the memlock limit, -EFAULT or
 * -EOPNOTSUPP for memory it will not pin for long). Memory not registered is read into as
 * before. The memory must stay mapped until sio_unregister_mem. */
int sio_register_mem(struct sio_engine *e, void *addr, unsigned long long len);

/* Give up every registered range inside [addr, addr + len): no read uses them from now on;
 * the kernel lets go of their pages at once on the ring's thread, else at the next sio_run or
 * sio_close. Returns the entries given up. */
int sio_unregister_mem(struct sio_engine *e, void *addr, unsigned long long len);

/* The caller's ranges: `live` entries in the kernel's table (given-up ones it still holds
 * included), `pending` entries to install or remove at the next batch, `refused_errno` why the
 * kernel last refused a range (0: never). Returns 1 when the ring has a sparse buffer table. */
int sio_mem_table(struct sio_engine *e, unsigned *live, unsigned *pending, int *refused_errno);

/* What a batch's planner checks, in one pass over its n-entry columns (p2phub.batch._plan).
 * A sum that overflows is -1, so that the planner's "negative" test names it. */
struct sio_scan {
    long long min_off, min_len, min_moff;
    long long min_mend, max_mend;    /* moff + len */
    long long min_fend, max_fend;    /* off + len */
    long long total;                 /* the lengths' sum (-1 past 2^63) */
    int odd;                         /* an offset or length not a multiple of SIO_ALIGN */
};
void sio_scan(unsigned long long n, const long long *off, const long long *len,
              const long long *moff, struct sio_scan *out);

/* A batch's per-entry engine arguments where one fd and one memory serve every entry:
 * fd_out[i] = fd, flags_out[i] = flags, mem_out[i] = base + moff[i]. */
void sio_targets(unsigned long long n, const long long *moff, unsigned long long base, int fd,
                 unsigned char flags, int *fd_out, unsigned char *flags_out,
                 unsigned long long *mem_out);

/* The host-only ceiling: n reads (fd O_DIRECT or not) of len[i] bytes at off[i], `depth` in
 * flight, each into its own slot of `buf` (depth slots of slot_bytes). Returns 0, or -errno. */
int sio_ceiling(int fd, unsigned long long n, const unsigned long long *off,
                const unsigned long long *len, unsigned depth, void *buf,
                unsigned long long slot_bytes, char *err, int errlen);

/* 1 when the CUDA driver offers cuMemcpyBatchAsync (after the first CUDA batch), 0 when not,
 * -1 before the driver was opened. */
int sio_cuda_batch_api(void);

/* Make the CUDA context the engine was opened under current on the calling thread (nothing
 * for a host engine). 0, or -1 when the driver refused. */
int sio_engine_bind(struct sio_engine *e);

/* ------------------------------------------------------------------ the engine thread */

/* One C thread that runs every batch of a Hub's engines in queue order (_sio_queue.c).
 * Items get tickets in queue order; single requests queued back to back on one engine and
 * direction run as one submission; a reservation holds a batch's place until its planner
 * hands the batch over (sio_queue_run) and releases it. Results stay in the queue until
 * collected (sio_queue_reap); a push waits while `capacity` items are uncollected. */
struct sio_queue;

struct sio_queue *sio_queue_open(unsigned long long capacity, char *err, int errlen);
/* runs what is queued (reservations must be released) and ends the thread; results can
 * still be collected */
void sio_queue_close(struct sio_queue *q);
/* closes it if open, and frees it: no other thread may be using it */
void sio_queue_free(struct sio_queue *q);

/* One read (write 0) or write (1) of len bytes at file offset off to (from) memory mem, as
 * one entry of sio_run; `sync`: fsync the fd after the write. Its ticket, or -1 once closed.
 * Its result: the bytes moved or -errno. */
long long sio_queue_push(struct sio_queue *q, struct sio_engine *e, int write, int fd,
                         unsigned long long off, unsigned long long len,
                         unsigned long long mem, unsigned char flags, int sync);
/* A place for a batch: the thread stops there until released. Its ticket, or -1. */
long long sio_queue_reserve(struct sio_queue *q);
/* Run a batch on the thread, at reservation `ticket` (waits for the items before it): as
 * sio_run. May be called several times before the release; `release`: this run is the
 * last, and the reservation is released as it ends (the ticket is not to be used again,
 * whatever the result). */
int sio_queue_run(struct sio_queue *q, unsigned long long ticket, int release,
                  struct sio_engine *e, int write, unsigned long long n, const int *fd,
                  const unsigned long long *off, const unsigned long long *len,
                  const unsigned long long *mem, const unsigned char *flags, long long *result,
                  struct sio_stats *st, char *err, int errlen);
/* Wait until every item before reservation `ticket` has completed. */
void sio_queue_wait_reached(struct sio_queue *q, unsigned long long ticket);
void sio_queue_release(struct sio_queue *q, unsigned long long ticket);

/* 1 once item `ticket` has completed, 0 after timeout_ns (< 0: no limit). The reaper leaves
 * the results of a completed ticket that a thread waits for to that thread. */
int sio_queue_wait(struct sio_queue *q, unsigned long long ticket, long long timeout_ns);
/* For the thread that collects results: wait up to timeout_ns for some (while requests keep
 * arriving, a little longer, so that one wake-up collects many); how many are ready, or -1
 * once the queue is closed and all were collected. */
long long sio_queue_wait_results(struct sio_queue *q, long long timeout_ns);
/* Collect up to max results, oldest first: *first gets the first one's ticket, runs[i] the
 * length of the run result i completed in. */
unsigned long long sio_queue_reap(struct sio_queue *q, unsigned long long *first,
                                  long long *results, unsigned *runs, unsigned long long max);
/* The size of the regular file `path` when it is still the file (dev, ino) an fd was opened
 * on; -1 when it is not (replaced, gone, not regular, any stat error): one stat for the
 * open files that per-request loads reuse, without building Python's stat result. */
long long sio_file_same(const char *path, unsigned long long dev, unsigned long long ino);
/* runs of single requests, requests, the longest run, the thread's wake-ups; the last
 * engine failure's message */
void sio_queue_stats(struct sio_queue *q, unsigned long long *runs,
                     unsigned long long *requests, unsigned long long *biggest,
                     unsigned long long *wakes, char *err, int errlen);

/* NIXL FILE registrations (_sio_file.c), one definition for the adapter and the plugin.
 * A path-mode meta is "ro|rw[,direct][,sync][,noatime][,create]:PATH": 1 with
 * `path` and open(2) `flags` filled; 0 where `meta` is not one (it starts otherwise: the
 * registration's devId is then the caller's fd); -1 for a meta that starts like one and is
 * malformed (why in err). */
int sio_file_meta(const char *meta, char *path, int pathlen, int *flags, char *err, int errlen);
/* Open a path-mode file: created 0600, never through a symbolic link, a regular file or a
 * block device only; the fd, or -1 (why in err). */
int sio_file_open(const char *path, int flags, char *err, int errlen);
/* The bytes a READ may reach: a regular file's size, a block device's capacity; -errno. */
long long sio_file_size(int fd);
