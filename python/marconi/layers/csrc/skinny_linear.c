/* y[i][r] = sum_c x[i][c] * w[r][c] (+ bias[r]) for a decode batch's few rows of x, on torch's
 * OpenMP threads.
 *
 * A decode step streams every weight once; with 4-16 rows oneDNN's packed kernel read `small`'s
 * 593 MB of weights at ~13-15 GB/s on our 2-core VM (which streams ~20 GB/s with two threads),
 * MKL's sgemm slower still from 4 rows on. Here each thread walks its share of weight rows in
 * order, RB rows at a time, against MT input rows held in registers (RB x MT accumulators of
 * 16 lanes; more input rows reread the RB weight rows from L1): 13-25% faster than oneDNN at
 * 4-12 rows in the same process (docs/performance.md). fp32 in, fp32 accumulate (16 lanes, then
 * a tree reduction), so results differ from sgemm only by summation order.
 */
#ifdef MARCONI_PYEXT
#include "pyext.h" /* first: Python.h must precede system headers */
#endif
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "vec_math.h"

#define RB 4 /* weight rows per block */
#define MT 4 /* input rows per register tile */

/* y for weight rows r .. r + RB - 1 and input rows m0 .. m0 + mt - 1 (mt <= MT) */
static void tile(const float *x, const float *w, const float *bias, float *y, long n, long k,
                 long r, long m0, long mt) {
    long c = 0;
#ifdef __AVX512F__
    __m512 acc[RB][MT];
    for (int a = 0; a < RB; a++)
        for (int i = 0; i < MT; i++) acc[a][i] = _mm512_setzero_ps();
    for (; c + 16 <= k; c += 16) {
        __m512 wv[RB];
        for (int a = 0; a < RB; a++) wv[a] = _mm512_loadu_ps(w + (r + a) * k + c);
        for (int i = 0; i < MT; i++) {
            if (i < mt) {
                const __m512 xv = _mm512_loadu_ps(x + (m0 + i) * k + c);
                for (int a = 0; a < RB; a++) acc[a][i] = _mm512_fmadd_ps(wv[a], xv, acc[a][i]);
            }
        }
    }
#endif
    for (long a = 0; a < RB; a++)
        for (long i = 0; i < mt; i++) {
            const float *wr = w + (r + a) * k, *xr = x + (m0 + i) * k;
#ifdef __AVX512F__
            float s = _mm512_reduce_add_ps(acc[a][i]);
#else
            float s = 0.0f;
#endif
            s += dot_lanes(wr, xr, c, k);
            y[(m0 + i) * n + r + a] = s + (bias ? bias[r + a] : 0.0f);
        }
}

/* x [m, k], w [n, k], bias [n] or NULL, y [m, n]; m >= 1. Parallel over blocks of weight rows
 * (a contiguous share per thread) when the weight has at least 64K floats. */
void skinny_linear(const float *x, const float *w, const float *bias, float *y, long m, long n,
                   long k, long threads) {
    const long blocks = n / RB;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k >= 1L << 16)
    for (long b = 0; b < blocks; b++)
        for (long m0 = 0; m0 < m; m0 += MT)
            tile(x, w, bias, y, n, k, b * RB, m0, m - m0 < MT ? m - m0 : MT);
    for (long r = blocks * RB; r < n; r++) /* the last n % RB weight rows */
        for (long i = 0; i < m; i++)
            y[i * n + r] = dot_lanes(w + r * k, x + i * k, 0, k) + (bias ? bias[r] : 0.0f);
}

#ifdef MARCONI_PYEXT
PYEXT_FUNCTION(skinny_linear, "ppppllll",
               skinny_linear(v[0].p, v[1].p, v[2].p, v[3].p, v[4].l, v[5].l, v[6].l, v[7].l))
PYEXT_MODULE(skinny_linear, PYEXT_METHOD(skinny_linear))
#endif
