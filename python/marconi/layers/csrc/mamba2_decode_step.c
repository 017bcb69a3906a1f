/* Mamba-2 decode for a batch, updating the conv and SSM state pools in place.
 *
 * mamba2_decode_step: the SSM recurrence alone. For request i (state slot slots[i]), head h
 * (group g = h / (H / G)), channel p:
 *   state[p][n] = state[p][n] * decay[i][h] + x[i][h][p] * dt[i][h] * b[i][g][n]
 *   y[i][h][p]  = sum_n state[p][n] * c[i][g][n]
 * with decay = exp(dt * A) computed by the caller. Every state row is read once and written
 * once, where torch's batched path gathers the slots, updates a copy in two passes and
 * scatters it back (five passes over the states).
 *
 * mamba2_decode_fused: the whole mixer between in_proj and out_proj for one token per request
 * (the ~30 small torch ops of Mamba2Mixer._decode + gated_rms_norm, each a dispatch of a few
 * microseconds on rows of a few hundred floats): causal conv over the conv state + the new xBC
 * row (conv state shifted in place), SiLU, dt = clamp(softplus(dt + dt_bias)), decay =
 * exp(dt * A), the recurrence above, the D skip, then y * silu(z) RMS-normed per group of
 * norm_group channels times norm_w.
 *
 * Built with -fopenmp (see mamba2_prefill.c: the threads are torch's).
 *
 * fp32 in and out; sums run in 16 partial sums (the compiler vectorises them), so results
 * differ from torch's only by summation order and libm rounding.
 */
#ifdef MARCONI_PYEXT
#include "pyext.h" /* first: Python.h must precede system headers */
#endif
#include "mamba2.h"

/* One head of one request: update its P state rows by one token, write y[p]. */
static void ssm_head(float *st, long P, long N, float xd_scale, const float *x, float decay,
                     const float *bb, const float *cc, float *y) {
    for (long p = 0; p < P; p++, st += N) {
        const float xd = x[p] * xd_scale;
        float acc[LANES] = {0.0f};
        long n = 0;
        for (; n + LANES <= N; n += LANES)
            for (int j = 0; j < LANES; j++) {
                const float v = st[n + j] * decay + xd * bb[n + j];
                st[n + j] = v;
                acc[j] += v * cc[n + j];
            }
        for (; n < N; n++) {
            const float v = st[n] * decay + xd * bb[n];
            st[n] = v;
            acc[n % LANES] += v * cc[n];
        }
        float sum = 0.0f;
        for (int j = 0; j < LANES; j++) sum += acc[j];
        y[p] = sum;
    }
}

void mamba2_decode_step(float *ssm, const long *slots, long bsz, long H, long P, long N, long G,
                        const float *x, const float *dt, const float *decay, const float *b,
                        const float *c, float *y) {
    const long hpg = H / G;
    for (long i = 0; i < bsz; i++) {
        float *s_i = ssm + slots[i] * H * P * N;
        for (long h = 0; h < H; h++) {
            const long off = (i * G + h / hpg) * N;
            ssm_head(s_i + h * P * N, P, N, dt[i * H + h], x + (i * H + h) * P,
                     decay[i * H + h], b + off, c + off, y + (i * H + h) * P);
        }
    }
}

/* proj: [bsz, proj_stride] in_proj rows laid out z [H*P] | xBC [C] | dt [H] (C = H*P + 2*G*N);
 * conv_pool: [slots, K-1, C]; ssm_pool: [slots, H, P, N]; conv_w: [K, C]; conv_b: [C] or NULL;
 * dt_bias, a_neg: [H]; d_skip, norm_w: [H*P]; work: [bsz * (C + H)] scratch; out: [bsz, H*P].
 * Threads: `threads` OpenMP threads (the caller passes torch's intra-op count) over requests
 * (conv, gate + norm) and over (request, head) pairs; one below 64K state floats. */
void mamba2_decode_fused(const float *proj, long proj_stride, float *conv_pool, float *ssm_pool,
                         const long *slots, long bsz, long H, long P, long N, long G, long K,
                         const float *conv_w, const float *conv_b, const float *dt_bias,
                         const float *a_neg, float lo, float hi, const float *d_skip,
                         const float *norm_w, long norm_group, float eps, float *work,
                         float *out, long threads) {
    const long inner = H * P, gn = G * N, C = inner + 2 * gn, hpg = H / G;
    float *xbcs = work, *dts = work + bsz * C;
#pragma omp parallel num_threads(threads) if (bsz * H * P * N >= 1L << 16)
    {
#pragma omp for
        for (long i = 0; i < bsz; i++) {
            const float *xin = proj + i * proj_stride + inner, *dtin = xin + C;
            float *cst = conv_pool + slots[i] * (K - 1) * C, *xbc = xbcs + i * C;
            for (long c = 0; c < C; c++) { /* conv over [state rows, new row], then shift */
                float acc = conv_b ? conv_b[c] : 0.0f;
                for (long k = 0; k < K - 1; k++) acc += cst[k * C + c] * conv_w[k * C + c];
                acc += xin[c] * conv_w[(K - 1) * C + c];
                for (long k = 0; k + 1 < K - 1; k++) cst[k * C + c] = cst[(k + 1) * C + c];
                if (K > 1) cst[(K - 2) * C + c] = xin[c];
                xbc[c] = silu(acc);
            }
            for (long h = 0; h < H; h++) dts[i * H + h] = mamba2_dt(dtin[h], dt_bias[h], lo, hi);
        }
#pragma omp for schedule(static)
        for (long ih = 0; ih < bsz * H; ih++) {
            const long i = ih / H, h = ih % H, off = inner + (h / hpg) * N;
            const float *xbc = xbcs + i * C;
            ssm_head(ssm_pool + (slots[i] * H + h) * P * N, P, N, dts[ih], xbc + h * P,
                     expf(dts[ih] * a_neg[h]), xbc + off, xbc + off + gn, out + ih * P);
        }
#pragma omp for
        for (long i = 0; i < bsz; i++)
            gated_norm_row(out + i * inner, xbcs + i * C, proj + i * proj_stride, d_skip, norm_w,
                           inner, norm_group, eps);
    }
}

#ifdef MARCONI_PYEXT
PYEXT_FUNCTION(mamba2_decode_step, "pplllllpppppp",
               mamba2_decode_step(v[0].p, v[1].p, v[2].l, v[3].l, v[4].l, v[5].l, v[6].l, v[7].p,
                                  v[8].p, v[9].p, v[10].p, v[11].p, v[12].p))
PYEXT_FUNCTION(mamba2_decode_fused, "plpppllllllppppffpplfppl",
               mamba2_decode_fused(v[0].p, v[1].l, v[2].p, v[3].p, v[4].p, v[5].l, v[6].l, v[7].l,
                                   v[8].l, v[9].l, v[10].l, v[11].p, v[12].p, v[13].p, v[14].p,
                                   v[15].f, v[16].f, v[17].p, v[18].p, v[19].l, v[20].f, v[21].p,
                                   v[22].p, v[23].l))
PYEXT_MODULE(mamba2_decode_step, PYEXT_METHOD(mamba2_decode_step),
             PYEXT_METHOD(mamba2_decode_fused))
#endif
