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
 *
 * Each tile function is compiled for one exact number of input rows and prefetch on or off
 * (TILES below): with the row count a runtime value the loop branched on it at every step, and
 * GCC folded the weight loads into the FMAs (TILE). Same Zen 5, `benchmark/bench_skinny.py
 * --baseline 8a7ac0b` (the median of 41 paired calls, this over that): small's four weight
 * shapes streamed from memory 0.96 / 0.96 / 0.95 / 0.99x the time at 1 / 3 / 8 / 16 rows (the
 * `-mno-avx512f` build on the same CPU 0.98 / 0.90 / 0.81x at 1 / 8 / 16); a 504x768 weight
 * held in L2 0.87 / 0.81 / 0.92 / 0.92x. The sums and their order are unchanged: results are
 * bit-identical.
 */
#ifdef MARCONI_PYEXT
#include "pyext.h" /* first: Python.h must precede system headers */
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "vec_math.h"

/* The build's vector: 16 lanes with AVX-512 (MT = 4 input rows a tile, 32 registers), 8 with
 * AVX2 + FMA (MT = 2, 16 registers), none in plain C (dot_lanes computes every sum). */
#ifdef __AVX512F__
typedef __m512 vec;
#define VW 16
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, acc) _mm512_fmadd_ps(a, b, acc)
#define VSUM(v) _mm512_reduce_add_ps(v)
#define TILE_ROWS 4
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
#define VW 8
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, acc) _mm256_fmadd_ps(a, b, acc)
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define VSUM(v) hsum256(v)
#define TILE_ROWS 2
#else
#define TILE_ROWS 4
#endif

#ifdef VW
/* A tile function NAME: y for weight rows r, r + rs, ..., r + (RB - 1) rs against exactly MT
 * input rows m0 .. m0 + MT - 1; PF: also prefetch the next block's rows (r + 1 + a rs) into L2,
 * once per 64 bytes. A step loads the MT input vectors, then each weight vector once for its
 * MT FMAs (RB * MT + MT + 1 registers). MT and PF are constants of each function, so the loop
 * has no branch; the empty asm keeps the weight vector in a register: without it GCC folded
 * the load into each of the MT FMAs, and the load ports, not the FMAs, bounded the tile
 * (AVX-512 6 x 4 tile: 28 loads a step for 24 FMAs). */
#define TILE(NAME, RB, MT, PF)                                                                 \
    static void NAME(const float *x, const float *w, const float *bias, float *y, long n,      \
                     long k, long r, long rs, long m0) {                                        \
        const float *wr[RB], *xr[MT];                                                           \
        for (int a = 0; a < RB; a++) wr[a] = w + (r + a * rs) * k;                              \
        for (int i = 0; i < MT; i++) xr[i] = x + (m0 + i) * k;                                  \
        vec acc[RB][MT];                                                                        \
        for (int a = 0; a < RB; a++)                                                            \
            for (int i = 0; i < MT; i++) acc[a][i] = VZERO();                                   \
        long c = 0;                                                                             \
        for (; c + VW <= k; c += VW) {                                                          \
            vec xv[MT];                                                                         \
            for (int i = 0; i < MT; i++) xv[i] = VLOAD(xr[i] + c);                              \
            for (int a = 0; a < RB; a++) {                                                      \
                vec wv = VLOAD(wr[a] + c);                                                      \
                __asm__("" : "+v"(wv));                                                         \
                if (PF && c % 16 == 0)                                                          \
                    _mm_prefetch((const char *)(wr[a] + k + c), _MM_HINT_T1);                   \
                for (int i = 0; i < MT; i++) acc[a][i] = VFMA(wv, xv[i], acc[a][i]);            \
            }                                                                                   \
        }                                                                                       \
        for (int a = 0; a < RB; a++)                                                            \
            for (int i = 0; i < MT; i++) {                                                      \
                float s = VSUM(acc[a][i]);                                                      \
                if (c < k) /* the columns past the last multiple of VW */                       \
                    s += dot_lanes(wr[a], xr[i], c, k);                                         \
                y[(m0 + i) * n + r + a * rs] = s + (bias ? bias[r + a * rs] : 0.0f);            \
            }                                                                                   \
    }
#else
#define TILE(NAME, RB, MT, PF)                                                                 \
    static void NAME(const float *x, const float *w, const float *bias, float *y, long n,      \
                     long k, long r, long rs, long m0) {                                        \
        for (long a = 0; a < RB; a++)                                                           \
            for (long i = 0; i < MT; i++) {                                                     \
                const long row = r + a * rs;                                                    \
                const float s = dot_lanes(w + row * k, x + (m0 + i) * k, 0, k);                 \
                y[(m0 + i) * n + row] = s + (bias ? bias[row] : 0.0f);                          \
            }                                                                                   \
    }
#endif

typedef void (*tile_fn)(const float *, const float *, const float *, float *, long, long, long,
                        long, long);

/* TILES[rb][pf][mt - 1]: rb 4 / 6 weight rows (index 0 / 1), pf 0 / 1, mt 1 .. TILE_ROWS.
 * 1-3 input rows: 4 streams per thread; 4 rows and more: 6 (AMD EPYC, the AVX-512 tiles, small
 * model, decode step as summed layer timings at 1 / 2 / 4 / 6 / 16 rows: 14.7 / 16.6 / 23.5 /
 * 29.5 / 54.0 ms with 4 x 4 tiles, 15.5 / 18.5 / 21.6 / 26.7 / 47.9 with 6 x 4) */
#if TILE_ROWS == 4
#define TILE_SET(RB, PF)                                                                       \
    TILE(t##RB##_##PF##_1, RB, 1, PF)                                                           \
    TILE(t##RB##_##PF##_2, RB, 2, PF)                                                           \
    TILE(t##RB##_##PF##_3, RB, 3, PF)                                                           \
    TILE(t##RB##_##PF##_4, RB, 4, PF)
#define TILE_ROW(RB, PF) {t##RB##_##PF##_1, t##RB##_##PF##_2, t##RB##_##PF##_3, t##RB##_##PF##_4}
#else
#define TILE_SET(RB, PF) TILE(t##RB##_##PF##_1, RB, 1, PF) TILE(t##RB##_##PF##_2, RB, 2, PF)
#define TILE_ROW(RB, PF) {t##RB##_##PF##_1, t##RB##_##PF##_2}
#endif
TILE_SET(4, 0)
TILE_SET(4, 1)
TILE_SET(6, 0)
TILE_SET(6, 1)
static const tile_fn TILES[2][2][TILE_ROWS] = {{TILE_ROW(4, 0), TILE_ROW(4, 1)},
                                               {TILE_ROW(6, 0), TILE_ROW(6, 1)}};

/* x [m, k], w [n, k], bias [n] or NULL, y [m, n]; m >= 1. Parallel over blocks (a contiguous
 * share per thread) when the weight has at least 64K floats. */
void skinny_linear(const float *x, const float *w, const float *bias, float *y, long m, long n,
                   long k, long threads) {
    const long rb = m < 4 ? 4 : 6, blocks = n / rb;
    const tile_fn *once = TILES[rb == 6][0], *ahead = TILES[rb == 6][1];
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k >= 1L << 16)
    for (long b = 0; b < blocks; b++) {
        /* more than one pass over block b: the passes also prefetch block b + 1 */
        const tile_fn *tiles = m > TILE_ROWS && b + 1 < blocks ? ahead : once;
        for (long m0 = 0; m0 < m; m0 += TILE_ROWS) {
            const long mt = m - m0 < TILE_ROWS ? m - m0 : TILE_ROWS;
            tiles[mt - 1](x, w, bias, y, n, k, b, blocks, m0);
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
