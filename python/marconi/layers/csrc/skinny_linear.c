/* y[i][r] = sum_c x[i][c] * w[r][c] (+ bias[r]) for a decode batch's few rows of x, on torch's
 * OpenMP threads.
 *
 * A decode step streams every weight once; with 4-16 rows oneDNN's packed kernel read `small`'s
 * 593 MB of weights at ~13-15 GB/s on our 2-core VM, MKL's sgemm slower still from 4 rows on.
 * Here a tile takes RB weight rows against MT input rows held in registers (RB x MT
 * accumulators of 16 lanes with AVX-512, MT = 4; of 8 lanes with AVX2 + FMA, MT = 2, which
 * its 16 registers hold; more input rows reread the RB weight rows from L1), and the RB
 * rows of a tile are a quarter (a sixth) of the weight apart: block b takes rows b, b + B,
 * b + 2B, ... (B = n / RB), so each thread reads RB long sequential streams, one per part of
 * the weight, instead of RB short ones that end every RB rows. On an AMD EPYC that made the
 * small model's decode step (summed layer timings) 22.5 -> 14.8 ms at 1 row, 33 -> 27 ms at 6:
 * short streams leave the hardware prefetchers retraining at every tile (rows of 768 floats
 * streamed at 20 GB/s, of 3072 at 29). Without the AVX2 tile (plain C, each weight row
 * reread per input row) an AVX2 AMD EPYC's 8-wide FMAs were load-bound past a few rows, slower
 * than the packed path (3352x768 weight, 2 threads, streamed: 635 / 980 / 1654 us at 4 / 8 /
 * 16 rows vs the packed 500 / 645 / 905); with it 367 / 547 / 912. fp32 in, fp32 accumulate
 * (a lane per column modulo the vector width, then a tree reduction), so results differ from
 * sgemm only by summation order.
 *
 * Past MT input rows a block's weight rows are read again from cache for each further group of
 * MT rows, and the memory streams idle meanwhile; so then every pass also prefetches the next
 * block's rows into L2 (pf), keeping memory busy while the cached passes compute. On an AMD
 * EPYC Zen 5 (2 threads, small's three weight shapes streamed from memory, interleaved, best
 * of 21) 8 / 12 / 16 rows took 232-261 / 268-293 / 314-352 us with it vs 252-303 / 327-362 /
 * 367-430 without; 1-4 rows (one pass) are unchanged.
 */
#ifdef MARCONI_PYEXT
#include "pyext.h" /* first: Python.h must precede system headers */
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "vec_math.h"

/* A tile function NAME: y for weight rows r, r + rs, ..., r + (RB - 1) rs and input rows
 * m0 .. m0 + mt - 1 (mt <= MT); AVX-512 has 32 registers, RB * MT + RB + 1 of them in use. */
#define TILE(NAME, RB, MT)                                                                     \
    static void NAME(const float *x, const float *w, const float *bias, float *y, long n,      \
                     long k, long r, long rs, long m0, long mt, int pf) {                       \
        long c = 0;                                                                             \
        TILE_SIMD(RB, MT)                                                                       \
        for (long a = 0; a < RB; a++)                                                           \
            for (long i = 0; i < mt; i++) {                                                     \
                const long row = r + a * rs;                                                    \
                const float s = TILE_LANES(a, i) + dot_lanes(w + row * k, x + (m0 + i) * k, c, k); \
                y[(m0 + i) * n + row] = s + (bias ? bias[row] : 0.0f);                          \
            }                                                                                   \
    }

#ifdef __AVX512F__
/* 16 columns a step; the columns past the last multiple of 16 go to dot_lanes */
#define TILE_SIMD(RB, MT)                                                                      \
    __m512 acc[RB][MT];                                                                         \
    for (int a = 0; a < RB; a++)                                                                \
        for (int i = 0; i < MT; i++) acc[a][i] = _mm512_setzero_ps();                           \
    for (; c + 16 <= k; c += 16) {                                                              \
        __m512 wv[RB];                                                                          \
        for (int a = 0; a < RB; a++) wv[a] = _mm512_loadu_ps(w + (r + a * rs) * k + c);         \
        if (pf)                                                                                 \
            for (int a = 0; a < RB; a++)                                                        \
                _mm_prefetch((const char *)(w + (r + 1 + a * rs) * k + c), _MM_HINT_T1);        \
        for (int i = 0; i < MT; i++) {                                                          \
            if (i < mt) {                                                                       \
                const __m512 xv = _mm512_loadu_ps(x + (m0 + i) * k + c);                        \
                for (int a = 0; a < RB; a++) acc[a][i] = _mm512_fmadd_ps(wv[a], xv, acc[a][i]); \
            }                                                                                   \
        }                                                                                       \
    }
#define TILE_LANES(a, i) _mm512_reduce_add_ps(acc[a][i])
#define TILE_ROWS 4 /* MT of both tiles */
#elif defined(__AVX2__) && defined(__FMA__)
/* 8 columns a step. With 16 registers the MT input vectors stay in registers and each weight
 * vector is loaded once and used MT times: RB * MT + MT + 1 registers (6 x 2: 15) */
#define TILE_SIMD(RB, MT)                                                                      \
    __m256 acc[RB][MT];                                                                         \
    for (int a = 0; a < RB; a++)                                                                \
        for (int i = 0; i < MT; i++) acc[a][i] = _mm256_setzero_ps();                           \
    for (; c + 8 <= k; c += 8) {                                                                \
        __m256 xv[MT];                                                                          \
        for (int i = 0; i < MT; i++)                                                            \
            xv[i] = i < mt ? _mm256_loadu_ps(x + (m0 + i) * k + c) : _mm256_setzero_ps();       \
        for (int a = 0; a < RB; a++) {                                                          \
            const __m256 wv = _mm256_loadu_ps(w + (r + a * rs) * k + c);                        \
            if (pf && (c & 15) == 0)                                                            \
                _mm_prefetch((const char *)(w + (r + 1 + a * rs) * k + c), _MM_HINT_T1);        \
            for (int i = 0; i < MT; i++) acc[a][i] = _mm256_fmadd_ps(wv, xv[i], acc[a][i]);     \
        }                                                                                       \
    }
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define TILE_LANES(a, i) hsum256(acc[a][i])
#define TILE_ROWS 2 /* MT of both tiles */
#else
#define TILE_SIMD(RB, MT)
#define TILE_LANES(a, i) 0.0f
#define TILE_ROWS 4
#endif

/* 1-3 input rows: 4 streams per thread; 4 rows and more: 6 (AMD EPYC, the AVX-512 tiles, small
 * model, decode step as summed layer timings at 1 / 2 / 4 / 6 / 16 rows: 14.7 / 16.6 / 23.5 /
 * 29.5 / 54.0 ms with 4 x 4 tiles, 15.5 / 18.5 / 21.6 / 26.7 / 47.9 with 6 x 4) */
TILE(tile4, 4, TILE_ROWS)
TILE(tile6, 6, TILE_ROWS)

/* x [m, k], w [n, k], bias [n] or NULL, y [m, n]; m >= 1. Parallel over blocks (a contiguous
 * share per thread) when the weight has at least 64K floats. */
void skinny_linear(const float *x, const float *w, const float *bias, float *y, long m, long n,
                   long k, long threads) {
    const long rb = m < 4 ? 4 : 6, blocks = n / rb;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k >= 1L << 16)
    for (long b = 0; b < blocks; b++) {
        const int pf = m > TILE_ROWS && b + 1 < blocks; /* more than one pass over block b */
        for (long m0 = 0; m0 < m; m0 += TILE_ROWS) {
            const long mt = m - m0 < TILE_ROWS ? m - m0 : TILE_ROWS;
            if (rb == 4)
                tile4(x, w, bias, y, n, k, b, blocks, m0, mt, pf);
            else
                tile6(x, w, bias, y, n, k, b, blocks, m0, mt, pf);
        }
    }
    for (long r = blocks * rb; r < n; r++) /* the last n % rb weight rows */
        for (long i = 0; i < m; i++)
            y[i * n + r] = dot_lanes(w + r * k, x + i * k, 0, k) + (bias ? bias[r] : 0.0f);
}

#ifdef MARCONI_PYEXT
PYEXT_FUNCTION(skinny_linear, "ppppllll",
               skinny_linear(v[0].p, v[1].p, v[2].p, v[3].p, v[4].l, v[5].l, v[6].l, v[7].l))
PYEXT_MODULE(skinny_linear, PYEXT_METHOD(skinny_linear))
#endif
