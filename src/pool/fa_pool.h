/* fa_pool.h -- the thread pool that runs fastattn's work items.
 *
 *     fa_pool_run(n_threads, n_work, fn, ctx)
 *
 * calls fn(ctx, w, tid) once for every work item w in [0, n_work), on at most n_threads
 * threads, and returns when all have finished.  tid in [0, n_threads) names the calling
 * thread's workspace; the caller itself is tid 0 and works too.  Which thread runs which
 * item is decided at run time, so fn must give the same result on any thread.
 *
 * Why not OpenMP: fastattn's calls share the cores with NumPy's BLAS, with other worker
 * processes and with whatever else runs on the machine.  An OpenMP team ends every region
 * at a barrier that waits for all of its members, and its idle members spin without
 * giving up the core.  When one member is descheduled -- because a BLAS worker or another
 * process holds its core -- the whole call waits a scheduler time slice, and meanwhile
 * the spinning members keep the other programs' threads off their cores: calls of 0.1 ms
 * become calls of 10 ms.  This pool avoids both:
 *
 *   - Work is claimed item by item from one atomic counter, and the caller starts on it at
 *     once.  A worker that has not woken up yet is never waited for: the threads that do
 *     run take its share.  The caller only waits for items already being computed.
 *   - When the caller nevertheless waited long for a descheduled worker (the cores are
 *     oversubscribed), the next calls run on the caller alone for a few milliseconds,
 *     then try the threads again: a thread that cannot get a core cannot help.
 *   - An idle thread (a worker between calls, the caller waiting for the last items)
 *     polls for a few microseconds, then keeps polling but yields the core on every poll
 *     (sched_yield), so that any other runnable thread gets it, and after
 *     FA_POOL_SPIN_NS it sleeps in the kernel (a futex on Linux, a condition variable
 *     elsewhere) until it is woken.  Back-to-back calls thus start as fast as with
 *     spinning workers, without taking a core from anyone who needs it.
 *
 * Every call publishes a new epoch in the top bits of the claim counter: a worker that
 * wakes late and still holds the previous call's parameters can claim nothing, because
 * its compare-and-swap names the old epoch.  Calls are served one at a time; a call that
 * arrives while another Python thread's call holds the pool runs on its own thread.
 * After fork() the child starts with no workers and makes new ones when it needs them.
 *
 * Calls made from inside torch are the exception.  torch runs its operations on the
 * OpenMP team of the calling thread, and that team's members spin for milliseconds after
 * each of its parallel regions (libgomp's spin count): a pool worker woken meanwhile finds
 * no free core, and the caller ends up waiting for it or working alone.  When the process
 * has one OpenMP library, torch's and this module's, such calls run instead on an OpenMP
 * region with a dynamic schedule: torch's spinning threads join it at once and claim items
 * as the pool's workers would.  Only calls marked as from inside torch (fa_pool_set_in_torch,
 * per thread, set by fastattn's torch integrations) do so under FA_POOL_TEAM_IN_TORCH:
 * the team spins after fastattn's calls too, and next to NumPy's BLAS, whose threads
 * then find no core, that turned 0.15 ms calls into 8 ms ones.  Python picks the mode
 * (fa_pool_set_team; FASTATTN_POOL in fastattn/_machine/threads.py); a forked child goes back to
 * the pool, since the parent's team threads do not exist in it.
 *
 * Backends: POSIX threads where available (Linux, macOS, the BSDs), with the OpenMP team
 * above when built with OpenMP; OpenMP with a dynamic schedule under MSVC; a plain loop
 * when FA_POOL_SERIAL is defined or neither exists.
 */
#ifndef FA_POOL_H
#define FA_POOL_H

#include <stddef.h>
#include <stdint.h>

typedef void (*fa_work_fn)(void* ctx, Py_ssize_t w, int tid);

/* Which calls run on the calling thread's OpenMP team instead of the pool's threads. */
#define FA_POOL_TEAM_NEVER 0
#define FA_POOL_TEAM_ALWAYS 1
#define FA_POOL_TEAM_IN_TORCH 2     /* calls made inside fastattn's torch integrations */

static void fa_pool_serial(Py_ssize_t n_work, fa_work_fn fn, void* ctx)
{
    for (Py_ssize_t w = 0; w < n_work; w++)
        fn(ctx, w, 0);
}

#if !defined(FA_POOL_SERIAL) && !defined(_WIN32) && (defined(__GNUC__) || defined(__clang__))
#define FA_POOL_PTHREADS 1
#endif

#if defined(FA_POOL_PTHREADS)

#include <pthread.h>
#include <sched.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define FA_POOL_BACKEND "pthreads"
/* Idle threads poll with a pause instruction this many times before they start yielding
 * the core: about a microsecond, which covers the gap between back-to-back calls. */
#define FA_POOL_PAUSES 512
/* ... and sleep after this long without work: longer than a NumPy projection between two
 * attention calls of a decoder layer, short next to a scheduler time slice. */
#ifndef FA_POOL_SPIN_NS
#define FA_POOL_SPIN_NS 300000
#endif
#define FA_POOL_MAX_WORKERS 255
/* A call whose caller waited for other threads' items longer than 2x its own work plus
 * this, waited for a thread the scheduler had taken off its core: the cores are
 * oversubscribed.  The following calls then run on the calling thread alone for a
 * backoff time, from FA_POOL_BACKOFF_NS, doubled while it keeps happening, up to
 * FA_POOL_BACKOFF_MAX_NS; the first call after it uses the threads again. */
#define FA_POOL_STALL_NS 100000
#define FA_POOL_BACKOFF_NS 2000000
#define FA_POOL_BACKOFF_MAX_NS 64000000

/* The claim counter: epoch in the top 24 bits, next unclaimed item below.  CLOSED marks
 * an epoch whose parameters are still being written. */
#define FA_POOL_ITEM_BITS 40
#define FA_POOL_ITEM_MASK ((((uint64_t) 1) << FA_POOL_ITEM_BITS) - 1)
#define FA_POOL_CLOSED FA_POOL_ITEM_MASK

static struct {
    pthread_mutex_t lock;       /* held by the caller of the running call */
    int n_workers;              /* threads started (tid 1..n_workers) */
    int atfork_set;
    int team;                   /* FA_POOL_TEAM_*: which calls run on an OpenMP team */
    uint64_t state;             /* epoch << FA_POOL_ITEM_BITS | next item */
    fa_work_fn fn;              /* the current call's parameters */
    void* ctx;
    uint64_t n_work;
    int n_threads;
    uint32_t done;              /* items finished in the current call */
    uint32_t seq;               /* bumped when a call opens: idle workers wait on it */
    uint32_t sleepers;          /* workers asleep (or about to sleep) on seq */
    uint32_t caller_asleep;     /* the caller sleeps on done */
    int64_t backoff_ns;         /* current backoff (0: the last call did not stall) */
    int64_t serial_until;       /* calls run on the caller alone until then */
#ifndef __linux__
    pthread_mutex_t wait_lock;
    pthread_cond_t wait_cond;
#endif
} fa_pool = {
    PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, FA_POOL_CLOSED, NULL, NULL, 0, 0, 0, 0, 0, 0, 0, 0,
#ifndef __linux__
    PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
#endif
};

/* Set by fastattn's torch integrations around their calls, per thread. */
static __thread int fa_pool_in_torch = 0;

static inline void fa_pool_pause(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t fa_pool_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Sleep while *word == expected (spurious returns are fine: callers re-check). */
static void fa_pool_sleep(uint32_t* word, uint32_t expected)
{
#ifdef __linux__
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
#else
    pthread_mutex_lock(&fa_pool.wait_lock);
    if (__atomic_load_n(word, __ATOMIC_SEQ_CST) == expected)
        pthread_cond_wait(&fa_pool.wait_cond, &fa_pool.wait_lock);
    pthread_mutex_unlock(&fa_pool.wait_lock);
#endif
}

static void fa_pool_wake(uint32_t* word)
{
#ifdef __linux__
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
#else
    (void) word;
    pthread_mutex_lock(&fa_pool.wait_lock);
    pthread_cond_broadcast(&fa_pool.wait_cond);
    pthread_mutex_unlock(&fa_pool.wait_lock);
#endif
}

/* Wait until *word != value: poll, then poll yielding the core, then sleep.  `flag` is
 * raised while asleep so that whoever changes *word knows to wake us. */
static uint32_t fa_pool_wait_change(uint32_t* word, uint32_t value, uint32_t* flag)
{
    uint32_t now;
    for (int i = 0; i < FA_POOL_PAUSES; i++) {
        if ((now = __atomic_load_n(word, __ATOMIC_ACQUIRE)) != value)
            return now;
        fa_pool_pause();
    }
    int64_t until = fa_pool_now_ns() + FA_POOL_SPIN_NS;
    do {
        if ((now = __atomic_load_n(word, __ATOMIC_ACQUIRE)) != value)
            return now;
        sched_yield();
    } while (fa_pool_now_ns() < until);
    for (;;) {
        __atomic_fetch_add(flag, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(word, __ATOMIC_SEQ_CST) == value)
            fa_pool_sleep(word, value);
        __atomic_fetch_sub(flag, 1, __ATOMIC_SEQ_CST);
        if ((now = __atomic_load_n(word, __ATOMIC_ACQUIRE)) != value)
            return now;
    }
}

/* Claim and run items of the open call until none is left (or the call is over). */
static void fa_pool_work(int tid)
{
    uint64_t st = __atomic_load_n(&fa_pool.state, __ATOMIC_ACQUIRE);
    uint64_t epoch = st >> FA_POOL_ITEM_BITS;
    if ((st & FA_POOL_ITEM_MASK) == FA_POOL_CLOSED)
        return;
    /* Parameters written for a later epoch make the compare-and-swap below fail: they are
     * written after that epoch's CLOSED state (release), which our acquire then sees. */
    uint64_t n_work = __atomic_load_n(&fa_pool.n_work, __ATOMIC_ACQUIRE);
    int n_threads = __atomic_load_n(&fa_pool.n_threads, __ATOMIC_ACQUIRE);
    fa_work_fn fn = __atomic_load_n(&fa_pool.fn, __ATOMIC_ACQUIRE);
    void* ctx = __atomic_load_n(&fa_pool.ctx, __ATOMIC_ACQUIRE);
    if (tid >= n_threads)
        return;
    for (;;) {
        if ((st >> FA_POOL_ITEM_BITS) != epoch || (st & FA_POOL_ITEM_MASK) >= n_work)
            return;
        if (__atomic_compare_exchange_n(&fa_pool.state, &st, st + 1, 1,
                                        __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            fn(ctx, (Py_ssize_t) (st & FA_POOL_ITEM_MASK), tid);
            if (__atomic_add_fetch(&fa_pool.done, 1, __ATOMIC_SEQ_CST) == (uint32_t) n_work
                    && __atomic_load_n(&fa_pool.caller_asleep, __ATOMIC_SEQ_CST))
                fa_pool_wake(&fa_pool.done);
            st = __atomic_load_n(&fa_pool.state, __ATOMIC_ACQUIRE);
        }
    }
}

static void* fa_pool_worker(void* arg)
{
    int tid = (int) (intptr_t) arg;
    for (;;) {
        /* seq is read before the state: a call opened after this read bumps it. */
        uint32_t seen = __atomic_load_n(&fa_pool.seq, __ATOMIC_ACQUIRE);
        fa_pool_work(tid);
        fa_pool_wait_change(&fa_pool.seq, seen, &fa_pool.sleepers);
    }
    return NULL;
}

static void fa_pool_after_fork_child(void)
{
    /* Only the forking thread exists in the child: forget the workers (new ones are
     * started on demand) and any call that another thread had open. */
    pthread_mutex_init(&fa_pool.lock, NULL);
#ifndef __linux__
    pthread_mutex_init(&fa_pool.wait_lock, NULL);
    pthread_cond_init(&fa_pool.wait_cond, NULL);
#endif
    fa_pool.n_workers = 0;
    /* The OpenMP library may still count the parent's team threads, which the child does
     * not have: its calls use the pool's threads. */
    fa_pool.team = FA_POOL_TEAM_NEVER;
    fa_pool.state |= FA_POOL_CLOSED;
    fa_pool.sleepers = 0;
    fa_pool.caller_asleep = 0;
}

static void fa_pool_atfork_once(void)
{
    if (!__atomic_exchange_n(&fa_pool.atfork_set, 1, __ATOMIC_ACQ_REL))
        pthread_atfork(NULL, NULL, fa_pool_after_fork_child);
}

/* Start workers until there are n (caller holds the lock); returns how many exist. */
static int fa_pool_grow(int n)
{
    fa_pool_atfork_once();
    if (n > FA_POOL_MAX_WORKERS)
        n = FA_POOL_MAX_WORKERS;
    while (fa_pool.n_workers < n) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int err = pthread_create(&th, &attr, fa_pool_worker,
                                 (void*) (intptr_t) (fa_pool.n_workers + 1));
        pthread_attr_destroy(&attr);
        if (err)
            break;
        fa_pool.n_workers++;
    }
    return fa_pool.n_workers;
}

#ifdef _OPENMP
#include <omp.h>

static void fa_pool_run_openmp(int n_threads, Py_ssize_t n_work, fa_work_fn fn, void* ctx)
{
    Py_ssize_t w;
    #pragma omp parallel for schedule(dynamic) num_threads(n_threads)
    for (w = 0; w < n_work; w++)
        fn(ctx, w, omp_get_thread_num());
}
#endif

static void fa_pool_run(int n_threads, Py_ssize_t n_work, fa_work_fn fn, void* ctx)
{
    if (n_threads > n_work)
        n_threads = (int) n_work;
    if (n_threads <= 1 || (uint64_t) n_work >= UINT32_MAX
            || pthread_mutex_trylock(&fa_pool.lock) != 0) {
        fa_pool_serial(n_work, fn, ctx);
        return;
    }
#ifdef _OPENMP
    int team = __atomic_load_n(&fa_pool.team, __ATOMIC_RELAXED);
    if (team == FA_POOL_TEAM_ALWAYS || (team == FA_POOL_TEAM_IN_TORCH && fa_pool_in_torch)) {
        fa_pool_run_openmp(n_threads, n_work, fn, ctx);
        pthread_mutex_unlock(&fa_pool.lock);
        return;
    }
#endif
    int workers = fa_pool_grow(n_threads - 1);
    if (n_threads > workers + 1)
        n_threads = workers + 1;
    int64_t t_start = fa_pool_now_ns();
    if (n_threads <= 1 || t_start < fa_pool.serial_until) {
        pthread_mutex_unlock(&fa_pool.lock);
        fa_pool_serial(n_work, fn, ctx);
        return;
    }

    /* Open a new epoch: CLOSED while its parameters are written, then item 0. */
    uint64_t epoch = ((fa_pool.state >> FA_POOL_ITEM_BITS) + 1) & 0xFFFFFF;
    __atomic_store_n(&fa_pool.state, (epoch << FA_POOL_ITEM_BITS) | FA_POOL_CLOSED,
                     __ATOMIC_RELEASE);
    __atomic_store_n(&fa_pool.n_work, (uint64_t) n_work, __ATOMIC_RELEASE);
    __atomic_store_n(&fa_pool.n_threads, n_threads, __ATOMIC_RELEASE);
    __atomic_store_n(&fa_pool.fn, fn, __ATOMIC_RELEASE);
    __atomic_store_n(&fa_pool.ctx, ctx, __ATOMIC_RELEASE);
    __atomic_store_n(&fa_pool.done, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&fa_pool.state, epoch << FA_POOL_ITEM_BITS, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&fa_pool.seq, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&fa_pool.sleepers, __ATOMIC_SEQ_CST))
        fa_pool_wake(&fa_pool.seq);

    fa_pool_work(0);

    /* Wait for the items other threads are still computing. */
    int64_t t_worked = fa_pool_now_ns();
    uint32_t done;
    while ((done = __atomic_load_n(&fa_pool.done, __ATOMIC_ACQUIRE)) != (uint32_t) n_work)
        fa_pool_wait_change(&fa_pool.done, done, &fa_pool.caller_asleep);
    int64_t t_end = fa_pool_now_ns();
    if (t_end - t_worked > 2 * (t_worked - t_start) + FA_POOL_STALL_NS) {
        fa_pool.backoff_ns = fa_pool.backoff_ns ? 2 * fa_pool.backoff_ns : FA_POOL_BACKOFF_NS;
        if (fa_pool.backoff_ns > FA_POOL_BACKOFF_MAX_NS)
            fa_pool.backoff_ns = FA_POOL_BACKOFF_MAX_NS;
        fa_pool.serial_until = t_end + fa_pool.backoff_ns;
    } else {
        fa_pool.backoff_ns = 0;
    }
    pthread_mutex_unlock(&fa_pool.lock);
}

static int fa_pool_workers(void) { return __atomic_load_n(&fa_pool.n_workers, __ATOMIC_RELAXED); }

/* Which calls run on the caller's OpenMP team (FA_POOL_TEAM_*; never without OpenMP). */
static void fa_pool_set_team(int team)
{
#ifdef _OPENMP
    fa_pool_atfork_once();
    __atomic_store_n(&fa_pool.team, team, __ATOMIC_RELAXED);
#else
    (void) team;
#endif
}

static int fa_pool_team(void) { return __atomic_load_n(&fa_pool.team, __ATOMIC_RELAXED); }

/* Mark this thread's next calls as made from inside torch (on) or not; returns the
 * previous mark. */
static int fa_pool_set_in_torch(int on)
{
    int previous = fa_pool_in_torch;
    fa_pool_in_torch = on;
    return previous;
}

#elif defined(_OPENMP) && !defined(FA_POOL_SERIAL)

#include <omp.h>
#define FA_POOL_BACKEND "openmp"

static void fa_pool_run(int n_threads, Py_ssize_t n_work, fa_work_fn fn, void* ctx)
{
    if (n_threads > n_work)
        n_threads = (int) n_work;
    if (n_threads <= 1) {
        fa_pool_serial(n_work, fn, ctx);
        return;
    }
    Py_ssize_t w;
    #pragma omp parallel for schedule(dynamic) num_threads(n_threads)
    for (w = 0; w < n_work; w++)
        fn(ctx, w, omp_get_thread_num());
}

static int fa_pool_workers(void) { return 0; }
static void fa_pool_set_team(int team) { (void) team; }
static int fa_pool_team(void) { return FA_POOL_TEAM_NEVER; }
static int fa_pool_set_in_torch(int on) { (void) on; return 0; }

#else

#define FA_POOL_BACKEND "none"

static void fa_pool_run(int n_threads, Py_ssize_t n_work, fa_work_fn fn, void* ctx)
{
    (void) n_threads;
    fa_pool_serial(n_work, fn, ctx);
}

static int fa_pool_workers(void) { return 0; }
static void fa_pool_set_team(int team) { (void) team; }
static int fa_pool_team(void) { return FA_POOL_TEAM_NEVER; }
static int fa_pool_set_in_torch(int on) { (void) on; return 0; }

#endif

#endif /* FA_POOL_H */
