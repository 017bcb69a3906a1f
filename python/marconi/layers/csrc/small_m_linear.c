/* y[i][r] = sum_c x[i][c] * w[r][c] (+ bias[r]) for a few rows of x (decode batches).
 *
 * Decode is weight streaming: every weight is read once per token. MKL's and oneDNN's sgemm
 * read a row-major [N, K] weight at ~11 GB/s on one core of our CPU for M = 1; walking it one
 * row at a time, in order, with every x row in registers/L1 against each weight chunk, streams
 * at ~20 GB/s. fp32 in, fp32 accumulate (16 lanes, then a tree reduction), so results differ
 * from sgemm only by summation order.
 */
#include <stddef.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_M 4 /* = small_m.MAX_ROWS; callers pass 1 <= m <= MAX_M */

void small_m_linear(const float *x, const float *w, const float *bias, float *y, long m, long n,
                    long k) {
    for (long r = 0; r < n; r++) {
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
