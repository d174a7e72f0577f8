/* p2phub staged I/O engine thread (see _sio.h, "The engine thread"): every run of a Hub's
 * engines happens on one C thread, in the order it was queued. Single loads and saves are
 * queued one by one without the GIL and leave the queue in runs: what was queued while the
 * thread was busy goes to the engine as one submission. A batch reserves its place in the
 * queue when it is made and is run there when its planner hands it over, so a save and a
 * later load of the same file never trade places. Included by _sio.c.
 *
 * A batch costs the thread one wake-up: a reservation alone does not wake it (there is
 * nothing to run yet); the planner leaves its batch at the reservation's item, whether the
 * thread is there yet or not, and wakes it only if it sleeps; the batch's last run releases
 * the reservation as it ends. Waiters for a batch and for results sleep on conditions of
 * their own, so that neither wakes the other. */

#define SIOQ_REQUEST 0
#define SIOQ_RESERVED 1
/* a run of single requests is cut at this many (the engine's batch arrays are this long) */
#define SIOQ_MAX_RUN 4096
/* a run takes in requests queued while it runs for this long, then ends (its results are
 * published when it ends) */
#define SIOQ_FEED_NS 2000000LL
/* While the engine thread has more to run, the reaper lets results gather, but never for
 * longer than this after the first one, nor past this many. While a thread issues requests
 * back to back, every wake-up of the reaper takes the GIL from it and walks objects that
 * thread just wrote on another core: few, large collections cost the issuer least (a thread
 * that waits collects its own results at once; a lone request's result, the engine idle
 * after it, is collected at once). */
#define SIOQ_REAP_DELAY_NS 8000000LL
#define SIOQ_REAP_BATCH 2048
/* a thread whose wait just ended collects the results itself this soon: the reaper stands
 * back meanwhile rather than take the GIL from it; and as long, from the results' arrival,
 * while a thread whose ticket completed has yet to wake for it */
#define SIOQ_HANDOFF_NS 100000LL

struct sioq_part;

struct sioq_item {
    struct sio_engine *e;
    unsigned long long off, len, mem;
    long long result;
    unsigned run;       /* the length of the run it completed in (0: a reservation) */
    int fd;
    unsigned char kind, write, flags, sync;
    /* a reservation: the batch left for the thread there, and whether it is released */
    struct sioq_part *part;
    unsigned char released;
};

/* a batch left for the thread at its reservation */
struct sioq_part {
    struct sio_engine *e;
    int write;
    int release;        /* the reservation is released once it has run */
    unsigned long long n;
    const int *fd;
    const unsigned long long *off, *len, *mem;
    const unsigned char *flags;
    long long *result;
    struct sio_stats *st;
    char *err;
    int errlen;
    int rc;
    int finished;
};

/* Tickets number the items in queue order. Items [reaped, head) are live in the ring:
 * [next, head) wait for the thread, [completed, next) run now, [reaped, completed) hold
 * results nobody has collected. Everything below is under mu. */
struct sio_queue {
    pthread_mutex_t mu;
    pthread_cond_t work;    /* the idle thread: an item, a batch, a release, stop */
    pthread_cond_t hand;    /* the thread parked at a reservation: a batch, the release */
    pthread_cond_t done;    /* waiters: completions, the thread parked at a reservation */
    pthread_cond_t finish;  /* batch runners: their batch ran */
    pthread_cond_t space;   /* pushers: results collected */
    struct sioq_item *ring;
    unsigned long long cap;
    unsigned long long head, next, completed, reaped;
    unsigned long long parked;      /* 1 + the reservation the thread waits at; 0: none */
    unsigned reach_waiters;         /* threads in sio_queue_wait_reached */
    unsigned ticket_waiters;        /* threads in sio_queue_wait */
    unsigned long long wait_low;    /* the lowest ticket one of them waits for (~0: none) */
    int stop;
    int started;
    int idle;                       /* the thread waits for an item */
    pthread_t thread;
    /* the thread's arrays for one run of requests */
    int *r_fd;
    unsigned long long *r_off, *r_len, *r_mem;
    unsigned char *r_flags;
    long long *r_res;
    /* the run in progress: its engine, direction, CUDA flag, start and length */
    struct sio_engine *run_e;
    int run_write;
    unsigned char run_cuda;
    long long run_start;
    unsigned long long run_n;
    unsigned long long runs, requests, biggest;
    unsigned long long wakes;       /* the thread woke from a sleep (idle or parked) */
    long long handoff_ns;           /* when a waiter's ticket last completed */
    char err[256];
};

static long long now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void deadline_in(struct timespec *ts, long long ns)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += ns / 1000000000LL;
    ts->tv_nsec += ns % 1000000000LL;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

static struct sioq_item *q_item(struct sio_queue *q, unsigned long long t)
{
    return &q->ring[t % q->cap];
}

/* fsync each distinct fd of the run's synced writes once; a failure fails its writes */
static void sync_run(struct sio_queue *q, unsigned long long first, unsigned long long n)
{
    unsigned long long i, j;

    for (i = 0; i < n; i++) {
        struct sioq_item *it = q_item(q, first + i);
        int seen = 0;

        if (!it->sync || q->r_res[i] < 0)
            continue;
        for (j = 0; j < i && !seen; j++)
            seen = q_item(q, first + j)->sync && q->r_fd[j] == it->fd;
        if (seen)
            continue;
        if (fsync(it->fd)) {
            long long e = -errno;

            for (j = i; j < n; j++)
                if (q->r_fd[j] == it->fd && q_item(q, first + j)->sync)
                    q->r_res[j] = e;
        }
    }
}

/* Items [next + n, ...) that may join the run (mu held): the run's engine, direction and
 * memory kind, no reservation between; copied into the run's arrays. The new length. */
static unsigned long long take_requests(struct sio_queue *q, unsigned long long n)
{
    while (n < SIOQ_MAX_RUN && q->next + n < q->head) {
        struct sioq_item *it = q_item(q, q->next + n);

        if (it->kind != SIOQ_REQUEST || it->e != q->run_e || it->write != q->run_write ||
            (it->flags & SIO_CUDA) != q->run_cuda)
            break;
        q->r_fd[n] = it->fd;
        q->r_off[n] = it->off;
        q->r_len[n] = it->len;
        q->r_mem[n] = it->mem;
        q->r_flags[n] = it->flags;
        q->r_res[n] = 0;
        n++;
    }
    q->run_n = n;
    return n;
}

/* the engine's feed: requests queued since the run started join it, while it is young */
static unsigned long long feed_run(void *arg, unsigned long long n)
{
    struct sio_queue *q = arg;

    if (now_ns() - q->run_start > SIOQ_FEED_NS)
        return n;
    pthread_mutex_lock(&q->mu);
    n = take_requests(q, n);
    pthread_mutex_unlock(&q->mu);
    return n;
}

/* Run the requests from next on (mu dropped meanwhile): those queued back to back now, and
 * those queued while they run (feed_run); record their results. Returns how many ran. */
static unsigned long long run_requests(struct sio_queue *q)
{
    unsigned long long first = q->next, i, n;
    struct sioq_item *it0 = q_item(q, first);
    struct sio_engine *e = it0->e;
    int write = it0->write, rc;
    struct sio_stats st;
    char err[sizeof(q->err)] = "";

    q->run_e = e;
    q->run_write = write;
    q->run_cuda = it0->flags & SIO_CUDA;
    q->run_start = now_ns();
    n = take_requests(q, 0);
    pthread_mutex_unlock(&q->mu);
    memset(&st, 0, sizeof(st));
    rc = sio_engine_bind(e);
    if (!rc) {
        e->feed = feed_run;
        e->feed_arg = q;
        rc = sio_run(e, write, n, q->r_fd, q->r_off, q->r_len, q->r_mem, q->r_flags,
                     q->r_res, &st, err, sizeof(err));
        e->feed = NULL;
        e->feed_arg = NULL;
    } else {
        say(err, sizeof(err), "cuCtxSetCurrent failed");
    }
    pthread_mutex_lock(&q->mu);
    n = q->run_n;           /* with what joined meanwhile */
    pthread_mutex_unlock(&q->mu);
    if (rc < 0)
        for (i = 0; i < n; i++)
            if (q->r_res[i] >= 0)
                q->r_res[i] = -EIO;
    if (write)
        sync_run(q, first, n);
    pthread_mutex_lock(&q->mu);
    if (rc < 0)
        memcpy(q->err, err, sizeof(q->err));
    for (i = 0; i < n; i++) {
        q_item(q, first + i)->result = q->r_res[i];
        q_item(q, first + i)->run = (unsigned)n;
    }
    q->runs++;
    q->requests += n;
    if (n > q->biggest)
        q->biggest = n;
    q->run_e = NULL;
    return n;
}

/* At reservation t: run the batches left there until it is released. */
static void serve_reservation(struct sio_queue *q, unsigned long long t)
{
    struct sioq_item *it = q_item(q, t);

    q->parked = t + 1;
    if (q->reach_waiters)
        pthread_cond_broadcast(&q->done);
    for (;;) {
        struct sioq_part *p;

        while (!it->part && !it->released) {
            pthread_cond_wait(&q->hand, &q->mu);
            q->wakes++;
        }
        p = it->part;
        if (!p)
            break;
        pthread_mutex_unlock(&q->mu);
        p->rc = sio_engine_bind(p->e);
        if (!p->rc)
            p->rc = sio_run(p->e, p->write, p->n, p->fd, p->off, p->len, p->mem, p->flags,
                            p->result, p->st, p->err, p->errlen);
        else
            say(p->err, p->errlen, "cuCtxSetCurrent failed");
        pthread_mutex_lock(&q->mu);
        it->part = NULL;
        if (p->release)
            it->released = 1;
        p->finished = 1;        /* p is gone once its runner sees this */
        pthread_cond_broadcast(&q->finish);
    }
    q->parked = 0;
    it->result = 0;
    it->run = 0;        /* a reservation's place: no request's result */
}

static void *queue_main(void *arg)
{
    struct sio_queue *q = arg;

    pthread_mutex_lock(&q->mu);
    for (;;) {
        struct sioq_item *it;
        unsigned long long n;
        int reserved;

        while (q->next == q->head && !q->stop) {
            q->idle = 1;
            pthread_cond_wait(&q->work, &q->mu);
            q->idle = 0;
            q->wakes++;
        }
        if (q->next == q->head)
            break;      /* stopped, and nothing is left */
        it = q_item(q, q->next);
        reserved = it->kind == SIOQ_RESERVED;
        if (reserved) {
            serve_reservation(q, q->next);
            n = 1;
        } else {
            n = run_requests(q);
        }
        q->next += n;
        q->completed = q->next;
        /* a reservation with every result before it collected: nobody needs to collect
         * it (the reaper would take the GIL from the batch's own thread to do nothing),
         * and nobody waits for it (its batch's runners wait on finish): no one to wake */
        if (reserved && q->reaped == q->next - 1) {
            q->reaped = q->next;
            pthread_cond_broadcast(&q->space);
            continue;
        }
        pthread_cond_broadcast(&q->done);
    }
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

struct sio_queue *sio_queue_open(unsigned long long capacity, char *err, int errlen)
{
    struct sio_queue *q;
    pthread_condattr_t ca;

    if (capacity < 1 || capacity > (1ULL << 24)) {
        say(err, errlen, "queue capacity %llu: want 1..%llu", capacity, 1ULL << 24);
        return NULL;
    }
    q = calloc(1, sizeof(*q));
    if (!q)
        goto nomem;
    q->cap = capacity;
    q->wait_low = ~0ULL;
    q->ring = calloc(capacity, sizeof(*q->ring));
    q->r_fd = calloc(SIOQ_MAX_RUN, sizeof(*q->r_fd));
    q->r_off = calloc(SIOQ_MAX_RUN, sizeof(*q->r_off));
    q->r_len = calloc(SIOQ_MAX_RUN, sizeof(*q->r_len));
    q->r_mem = calloc(SIOQ_MAX_RUN, sizeof(*q->r_mem));
    q->r_flags = calloc(SIOQ_MAX_RUN, sizeof(*q->r_flags));
    q->r_res = calloc(SIOQ_MAX_RUN, sizeof(*q->r_res));
    if (!q->ring || !q->r_fd || !q->r_off || !q->r_len || !q->r_mem || !q->r_flags || !q->r_res)
        goto nomem;
    pthread_mutex_init(&q->mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&q->work, &ca);
    pthread_cond_init(&q->hand, &ca);
    pthread_cond_init(&q->done, &ca);
    pthread_cond_init(&q->finish, &ca);
    pthread_cond_init(&q->space, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&q->thread, NULL, queue_main, q)) {
        say(err, errlen, "pthread_create: %s", strerror(errno));
        pthread_mutex_destroy(&q->mu);
        pthread_cond_destroy(&q->work);
        pthread_cond_destroy(&q->hand);
        pthread_cond_destroy(&q->done);
        pthread_cond_destroy(&q->finish);
        pthread_cond_destroy(&q->space);
        goto fail;
    }
    q->started = 1;
    return q;
nomem:
    say(err, errlen, "out of memory");
fail:
    if (q) {
        free(q->ring), free(q->r_fd), free(q->r_off), free(q->r_len), free(q->r_mem);
        free(q->r_flags), free(q->r_res);
        free(q);
    }
    return NULL;
}

/* Everything queued runs (reservations must be released by their owners), then the thread
 * ends; results can still be collected until sio_queue_free. */
void sio_queue_close(struct sio_queue *q)
{
    int join;

    pthread_mutex_lock(&q->mu);
    q->stop = 1;
    join = q->started;
    q->started = 0;
    pthread_cond_broadcast(&q->work);
    pthread_cond_broadcast(&q->space);
    pthread_cond_broadcast(&q->done);
    pthread_mutex_unlock(&q->mu);
    if (join)
        pthread_join(q->thread, NULL);
    /* wake collectors: everything has completed */
    pthread_mutex_lock(&q->mu);
    pthread_cond_broadcast(&q->done);
    pthread_mutex_unlock(&q->mu);
}

void sio_queue_free(struct sio_queue *q)
{
    if (!q)
        return;
    sio_queue_close(q);
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->work);
    pthread_cond_destroy(&q->hand);
    pthread_cond_destroy(&q->done);
    pthread_cond_destroy(&q->finish);
    pthread_cond_destroy(&q->space);
    free(q->ring), free(q->r_fd), free(q->r_off), free(q->r_len), free(q->r_mem);
    free(q->r_flags), free(q->r_res);
    free(q);
}

/* Queue an item; wake the idle thread for a request (a reservation gives it nothing to
 * run until its batch or release comes). */
static long long q_push(struct sio_queue *q, const struct sioq_item *src)
{
    unsigned long long t;

    pthread_mutex_lock(&q->mu);
    while (q->head - q->reaped >= q->cap && !q->stop)
        pthread_cond_wait(&q->space, &q->mu);
    if (q->stop) {
        pthread_mutex_unlock(&q->mu);
        return -1;
    }
    t = q->head++;
    *q_item(q, t) = *src;
    if (q->idle && src->kind == SIOQ_REQUEST)
        pthread_cond_signal(&q->work);
    pthread_mutex_unlock(&q->mu);
    return (long long)t;
}

long long sio_queue_push(struct sio_queue *q, struct sio_engine *e, int write, int fd,
                         unsigned long long off, unsigned long long len,
                         unsigned long long mem, unsigned char flags, int sync)
{
    struct sioq_item it = {
        .e = e, .off = off, .len = len, .mem = mem, .fd = fd, .kind = SIOQ_REQUEST,
        .write = !!write, .flags = flags, .sync = !!sync,
    };

    return q_push(q, &it);
}

long long sio_file_same(const char *path, unsigned long long dev, unsigned long long ino)
{
    struct stat st;

    if (stat(path, &st) || !S_ISREG(st.st_mode) || (unsigned long long)st.st_dev != dev ||
        (unsigned long long)st.st_ino != ino)
        return -1;
    return (long long)st.st_size;
}

long long sio_queue_reserve(struct sio_queue *q)
{
    struct sioq_item it = { .kind = SIOQ_RESERVED, .fd = -1 };

    return q_push(q, &it);
}

/* Something was left at reservation t (mu held): wake the thread if it sleeps (parked
 * there, or idle before it); a busy thread finds it when it gets there. */
static void wake_for(struct sio_queue *q, unsigned long long t)
{
    if (q->parked == t + 1)
        pthread_cond_signal(&q->hand);
    else if (q->idle)
        pthread_cond_signal(&q->work);
}

int sio_queue_run(struct sio_queue *q, unsigned long long ticket, int release,
                  struct sio_engine *e, int write, unsigned long long n, const int *fd,
                  const unsigned long long *off, const unsigned long long *len,
                  const unsigned long long *mem, const unsigned char *flags, long long *result,
                  struct sio_stats *st, char *err, int errlen)
{
    struct sioq_part p = {
        .e = e, .write = write, .release = !!release, .n = n, .fd = fd, .off = off,
        .len = len, .mem = mem, .flags = flags, .result = result, .st = st, .err = err,
        .errlen = errlen,
    };

    pthread_mutex_lock(&q->mu);
    q_item(q, ticket)->part = &p;
    wake_for(q, ticket);
    while (!p.finished)
        pthread_cond_wait(&q->finish, &q->mu);
    pthread_mutex_unlock(&q->mu);
    return p.rc;
}

void sio_queue_wait_reached(struct sio_queue *q, unsigned long long ticket)
{
    pthread_mutex_lock(&q->mu);
    q->reach_waiters++;
    if (q->parked != ticket + 1 && q->idle)
        pthread_cond_signal(&q->work);
    while (q->parked != ticket + 1)
        pthread_cond_wait(&q->done, &q->mu);
    q->reach_waiters--;
    pthread_mutex_unlock(&q->mu);
}

void sio_queue_release(struct sio_queue *q, unsigned long long ticket)
{
    pthread_mutex_lock(&q->mu);
    q_item(q, ticket)->released = 1;
    wake_for(q, ticket);
    pthread_mutex_unlock(&q->mu);
}

int sio_queue_wait(struct sio_queue *q, unsigned long long ticket, long long timeout_ns)
{
    struct timespec dl;
    int done;

    pthread_mutex_lock(&q->mu);
    if (timeout_ns >= 0)
        deadline_in(&dl, timeout_ns);
    /* the reaper leaves a completed ticket's results to the thread registered for it */
    q->ticket_waiters++;
    if (ticket < q->wait_low)
        q->wait_low = ticket;
    while (q->completed <= ticket) {
        if (timeout_ns < 0)
            pthread_cond_wait(&q->done, &q->mu);
        else if (pthread_cond_timedwait(&q->done, &q->mu, &dl) == ETIMEDOUT)
            break;
    }
    if (!--q->ticket_waiters)
        q->wait_low = ~0ULL;
    done = q->completed > ticket;
    if (done)
        q->handoff_ns = now_ns();
    pthread_mutex_unlock(&q->mu);
    return done;
}

long long sio_queue_wait_results(struct sio_queue *q, long long timeout_ns)
{
    struct timespec end, dl;
    long long first, left;

    pthread_mutex_lock(&q->mu);
    deadline_in(&end, timeout_ns);
    for (;;) {
        while (q->completed == q->reaped && !(q->stop && q->reaped == q->head))
            if (pthread_cond_timedwait(&q->done, &q->mu, &end) == ETIMEDOUT)
                goto out;
        /* while the engine runs more, let results gather: one wake-up per many (it
         * publishes results at the end of each run and broadcasts done; it holds mu from
         * there until it waits idle or starts the next run, so idle is what it will do
         * next); and leave them to a waiter that woke, or is to wake, for them */
        first = 0;
        while (q->completed > q->reaped && q->completed - q->reaped < SIOQ_REAP_BATCH &&
               !q->stop) {
            long long now = now_ns(), handoff = q->handoff_ns + SIOQ_HANDOFF_NS - now;

            if (!first)
                first = now;
            if (q->ticket_waiters && q->wait_low < q->completed)
                handoff = SIOQ_HANDOFF_NS - (now - first);
            if (q->idle && handoff <= 0)
                break;
            left = SIOQ_REAP_DELAY_NS - (now - first);
            if (left <= 0)
                break;
            deadline_in(&dl, q->idle && handoff < left ? handoff : left);
            pthread_cond_timedwait(&q->done, &q->mu, &dl);
        }
        if (q->completed > q->reaped || q->stop)
            break;
        /* a waiter collected them all: wait for the next ones, here rather than in Python */
    }
out:
    left = q->stop && q->reaped == q->head ? -1 : (long long)(q->completed - q->reaped);
    pthread_mutex_unlock(&q->mu);
    return left;
}

unsigned long long sio_queue_reap(struct sio_queue *q, unsigned long long *first,
                                  long long *results, unsigned *runs, unsigned long long max)
{
    unsigned long long n, i;

    pthread_mutex_lock(&q->mu);
    n = q->completed - q->reaped;
    if (n > max)
        n = max;
    *first = q->reaped;
    for (i = 0; i < n; i++) {
        results[i] = q_item(q, q->reaped + i)->result;
        runs[i] = q_item(q, q->reaped + i)->run;
    }
    q->reaped += n;
    if (n)
        pthread_cond_broadcast(&q->space);
    pthread_mutex_unlock(&q->mu);
    return n;
}

void sio_queue_stats(struct sio_queue *q, unsigned long long *runs,
                     unsigned long long *requests, unsigned long long *biggest,
                     unsigned long long *wakes, char *err, int errlen)
{
    pthread_mutex_lock(&q->mu);
    *runs = q->runs;
    *requests = q->requests;
    *biggest = q->biggest;
    *wakes = q->wakes;
    say(err, errlen, "%s", q->err);
    pthread_mutex_unlock(&q->mu);
}
