/* y[i][r] = sum_c x[i][c] * w[r][c] (+ bias[r]) for a few rows of x (decode batches).
 *
 * Decode is weight streaming: every weight is read once per token. MKL's and oneDNN's sgemm
 * read a row-major [N, K] weight at ~11 GB/s on one core of our CPU for M = 1; walking it one
 * row at a time, in order, with every x row in registers/L1 against each weight chunk, streams
 * at ~20 GB/s. fp32 in, fp32 accumulate (16 lanes, then a tree reduction), so results differ
 * from sgemm only by summation order.
 *
 * Two threads (small_m_set_threads(2)): on CPUs whose single core cannot pull the memory
 * bandwidth (Intel server parts: ~10 GB/s a core), a helper thread takes chunks of weight rows.
 * It must never make a step wait on a core it does not get (OpenMP's barriers collapse 14x when
 * another process holds the second core, docs/performance_log.md), so:
 *   - chunks are claimed one at a time from a counter tagged with the job's generation; the
 *     caller claims too, so a helper that is asleep or descheduled simply gets no chunks;
 *   - the caller waits only for chunks the helper actually claimed (each a few microseconds of
 *     work), and if that wait ever exceeds STALL_NS (the helper was descheduled mid-chunk), the
 *     next BACKOFF_CALLS calls run on the caller alone;
 *   - the helper spins SPIN_NS after a job for the next one (decode calls come back to back),
 *     then sleeps on a condition variable.
 * The helper reads a job's pointers only through a claim of that job's generation, which it can
 * get only while the job is unfinished, i.e. while the caller is still inside the call.
 */
#ifdef MARCONI_PYEXT
#include "pyext.h" /* first: Python.h must precede system headers */
#endif
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_M 4          /* = small_m.MAX_ROWS; callers pass 1 <= m <= MAX_M */
#define CHUNK_ROWS 32    /* weight rows per claim */
#define MIN_SPLIT_ROWS 128 /* smaller weights stay on the caller */
#define SPIN_NS 200000L  /* helper spins this long for the next job, then sleeps */
#define STALL_NS 100000L /* a longer wait for the helper turns it off for a while */
#define BACKOFF_CALLS 256

static void rows_range(const float *x, const float *w, const float *bias, float *y, long m,
                       long n, long k, long r0, long r1) {
    for (long r = r0; r < r1; r++) {
        const float *wr = w + r * k;
#ifdef __AVX512F__
        __m512 acc[MAX_M];
        for (long i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
        long c = 0;
        for (; c + 16 <= k; c += 16) {
            __m512 wv = _mm512_loadu_ps(wr + c);
            for (long i = 0; i < m; i++)
                acc[i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i * k + c), acc[i]);
        }
        if (c < k) {
            __mmask16 tail = (__mmask16)((1u << (k - c)) - 1u);
            __m512 wv = _mm512_maskz_loadu_ps(tail, wr + c);
            for (long i = 0; i < m; i++)
                acc[i] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(tail, x + i * k + c), acc[i]);
        }
        for (long i = 0; i < m; i++)
            y[i * n + r] = _mm512_reduce_add_ps(acc[i]) + (bias ? bias[r] : 0.0f);
#else /* portable: 16 independent partial sums per row, which compilers vectorise */
        float acc[MAX_M][16] = {{0.0f}};
        long c = 0;
        for (; c + 16 <= k; c += 16)
            for (long i = 0; i < m; i++)
                for (int j = 0; j < 16; j++) acc[i][j] += wr[c + j] * x[i * k + c + j];
        for (; c < k; c++)
            for (long i = 0; i < m; i++) acc[i][c % 16] += wr[c] * x[i * k + c];
        for (long i = 0; i < m; i++) {
            float s = 0.0f;
            for (int j = 0; j < 16; j++) s += acc[i][j];
            y[i * n + r] = s + (bias ? bias[r] : 0.0f);
        }
#endif
    }
}

/* ---- the helper thread ------------------------------------------------------------------ */
typedef struct {
    const float *x, *w, *bias;
    float *y;
    long m, n, k;
} job_t;

static job_t job;                 /* written by the caller between jobs only */
static uint64_t claim;            /* gen << 40 | nchunks << 20 | next chunk (atomic) */
static long done_chunks;          /* chunks finished by the helper in this job (atomic) */
static uint64_t posted;           /* generation of the latest job (atomic) */
static int helper_sleeping;       /* atomic */
static int threads = 1, started = 0;
static int in_use = 0;            /* atomic: a caller is inside a two-thread job */
static long backoff = 0; /* calls left on the caller alone (touched under in_use) */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;

#define GEN(v) ((v) >> 40)
#define NCH(v) (((v) >> 20) & 0xFFFFF)
#define IDX(v) ((v) & 0xFFFFF)

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *helper(void *arg) {
    (void)arg;
    uint64_t seen = 0;
    for (;;) {
        long t0 = now_ns();
        uint64_t g;
        while ((g = __atomic_load_n(&posted, __ATOMIC_ACQUIRE)) == seen) {
            if (now_ns() - t0 < SPIN_NS) {
                relax();
                continue;
            }
            pthread_mutex_lock(&mu);
            __atomic_store_n(&helper_sleeping, 1, __ATOMIC_SEQ_CST);
            while (__atomic_load_n(&posted, __ATOMIC_SEQ_CST) == seen) pthread_cond_wait(&cv, &mu);
            __atomic_store_n(&helper_sleeping, 0, __ATOMIC_SEQ_CST);
            pthread_mutex_unlock(&mu);
            t0 = now_ns();
        }
        seen = g;
        job_t j = job; /* may be torn if job g ended meanwhile: then no claim below succeeds */
        for (;;) { /* CAS, not fetch_add: a stale helper must not consume a newer job's chunk */
            uint64_t v = __atomic_load_n(&claim, __ATOMIC_ACQUIRE);
            if (GEN(v) != (g & 0xFFFFFF) || IDX(v) >= NCH(v)) break;
            if (!__atomic_compare_exchange_n(&claim, &v, v + 1, 0, __ATOMIC_ACQ_REL,
                                             __ATOMIC_ACQUIRE))
                continue;
            long r0 = (long)IDX(v) * CHUNK_ROWS, r1 = r0 + CHUNK_ROWS;
            rows_range(j.x, j.w, j.bias, j.y, j.m, j.n, j.k, r0, r1 < j.n ? r1 : j.n);
            __atomic_fetch_add(&done_chunks, 1, __ATOMIC_RELEASE);
        }
    }
    return NULL;
}

static void after_fork_child(void) { /* the helper does not exist in a forked child */
    started = 0, threads = 1, helper_sleeping = 0;
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&cv, NULL);
}

/* two-thread calls, chunks the helper did, ns the caller waited for it, stalls (backoffs),
 * periods run on one thread, periods run on two */
static long stats[6];

void small_m_stats(long *out) {
    for (int i = 0; i < 6; i++) out[i] = stats[i];
}

/* 1 = the caller alone (default), 2 = the caller + one helper thread. Returns the setting. */
int small_m_set_threads(int t) {
    if (t >= 2 && !started) {
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&tid, &attr, helper, NULL) == 0) {
            started = 1;
            pthread_atfork(NULL, NULL, after_fork_child);
        }
        pthread_attr_destroy(&attr);
    }
    threads = (t >= 2 && started) ? 2 : 1;
    return threads;
}

static void two_threads(const float *x, const float *w, const float *bias, float *y, long m,
                        long n, long k);

/* Online A/B of one thread vs two: the first PROBE_CALLS calls of every PERIOD_CALLS alternate
 * the two, timed (ns per weight byte), and the rest of the period uses the faster. Two threads
 * win ~1.6-2.3x on a quiet machine here and lose ~1.5x while another process keeps a core busy
 * (docs/performance_log.md), so neither can be the fixed choice. */
#define PERIOD_CALLS 8192
#define PROBE_CALLS 512
static long period_pos = 0, probe_ns[2], probe_bytes[2];
static int chosen = 2;

void small_m_linear(const float *x, const float *w, const float *bias, float *y, long m, long n,
                    long k) {
    if (threads < 2 || n < MIN_SPLIT_ROWS) {
        rows_range(x, w, bias, y, m, n, k, 0, n);
        return;
    }
    const long pos = period_pos++;
    if (period_pos >= PERIOD_CALLS) period_pos = 0; /* callers racing here only skew the A/B */
    if (pos >= PROBE_CALLS) {
        if (pos == PROBE_CALLS) { /* decide: two threads iff cheaper per byte */
            chosen = probe_ns[1] * (double)probe_bytes[0] < probe_ns[0] * (double)probe_bytes[1]
                         ? 2 : 1;
            stats[4 + chosen - 1]++;
            probe_ns[0] = probe_ns[1] = probe_bytes[0] = probe_bytes[1] = 0;
        }
        if (chosen == 2) two_threads(x, w, bias, y, m, n, k);
        else rows_range(x, w, bias, y, m, n, k, 0, n);
        return;
    }
    const int mode = pos & 1; /* 0: one thread, 1: two */
    const long t0 = now_ns();
    if (mode) two_threads(x, w, bias, y, m, n, k);
    else rows_range(x, w, bias, y, m, n, k, 0, n);
    probe_ns[mode] += now_ns() - t0;
    probe_bytes[mode] += n * k;
}

static void two_threads(const float *x, const float *w, const float *bias, float *y, long m,
                        long n, long k) {
    int free_ = 0;
    if (backoff > 0 ||
        !__atomic_compare_exchange_n(&in_use, &free_, 1, 0, __ATOMIC_ACQUIRE,
                                     __ATOMIC_RELAXED)) { /* another caller thread has it */
        if (backoff > 0) backoff--;
        rows_range(x, w, bias, y, m, n, k, 0, n);
        return;
    }
    const long nch = (n + CHUNK_ROWS - 1) / CHUNK_ROWS;
    const uint64_t g = __atomic_load_n(&posted, __ATOMIC_RELAXED) + 1;
    job = (job_t){x, w, bias, y, m, n, k};
    __atomic_store_n(&done_chunks, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&claim, ((g & 0xFFFFFF) << 40) | ((uint64_t)nch << 20), __ATOMIC_RELEASE);
    __atomic_store_n(&posted, g, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&helper_sleeping, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&mu);
        pthread_cond_signal(&cv);
        pthread_mutex_unlock(&mu);
    }
    long mine = 0;
    for (;;) {
        uint64_t v = __atomic_fetch_add(&claim, 1, __ATOMIC_ACQ_REL);
        if (IDX(v) >= NCH(v)) break;
        long r0 = (long)IDX(v) * CHUNK_ROWS, r1 = r0 + CHUNK_ROWS;
        rows_range(x, w, bias, y, m, n, k, r0, r1 < n ? r1 : n);
        mine++;
    }
    /* every chunk is claimed; wait for the helper's (claimed ones only) */
    stats[0]++, stats[1] += nch - mine;
    if (__atomic_load_n(&done_chunks, __ATOMIC_ACQUIRE) + mine < nch) {
        long t0 = now_ns();
        while (__atomic_load_n(&done_chunks, __ATOMIC_ACQUIRE) + mine < nch) relax();
        long waited = now_ns() - t0;
        stats[2] += waited;
        if (waited > STALL_NS) backoff = BACKOFF_CALLS, stats[3]++;
    }
    __atomic_store_n(&in_use, 0, __ATOMIC_RELEASE);
}

#ifdef MARCONI_PYEXT
PYEXT_FUNCTION(small_m_linear, "pppplll",
               small_m_linear(v[0].p, v[1].p, v[2].p, v[3].p, v[4].l, v[5].l, v[6].l))
PYEXT_MODULE(small_m_linear, PYEXT_METHOD(small_m_linear))
#endif
