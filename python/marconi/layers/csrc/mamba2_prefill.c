/* Mamba-2 prefill for a packed batch: the whole mixer between in_proj and out_proj in one call.
 *
 * mamba2_prefill_fused: B requests, each resuming from its working slot (zeros where fresh[r])
 * and advancing its conv and SSM states in place by its new tokens. Per token: the causal conv
 * over [resume conv state, new xBC rows], SiLU, dt = clamp(softplus(dt + dt_bias)), decay =
 * exp(dt * A), then the recurrence of the decode step, token by token,
 *   state[p][n] = state[p][n] * decay + x[p] * dt * b[n],   y[p] = sum_n state[p][n] c[n],
 * then the D skip, the gate silu(z) and the grouped RMSNorm. The recurrence runs in the same
 * order however a sequence is split into passes (a cached prefix, chunked prefill), so a split
 * prefill computes exactly the bits of one pass. Capture c writes the conv and SSM states after
 * the first cap_off[c] new tokens of request cap_req[c] to slot cap_slot[c] (0: the resume
 * state). Capture slots must differ from every working slot.
 *
 * Why not the chunked SSD form (Mamba2Mixer._prefill, ~30 torch ops a layer): on a CPU the
 * recurrence is cheap when one head's state (P x N floats, 16 KB at 64 x 64) stays in L1 while
 * the head's tokens stream past, and it needs no segment padding, gathers or decay matrices.
 * The scan keeps the head's state transposed ([N][P]), so the update and y = state c both run
 * along p with no horizontal sums.
 *
 * Threads: `threads` OpenMP threads (the caller passes torch's intra-op count) over tokens
 * (conv, gate + norm) and over (request, head) pairs (the scan).
 * Built with -fopenmp; inside torch the library's libgomp.so.1 is the one torch already
 * loaded (same soname), so the kernel shares torch's thread pool and wait policy.
 */
#ifdef MARCONI_PYEXT
#include "pyext.h" /* first: Python.h must precede system headers */
#endif
#include "mamba2.h"

/* dst [cols, rows] = src [rows, cols] transposed */
static void transpose(float *restrict dst, const float *restrict src, long rows, long cols) {
    for (long i = 0; i < rows; i++)
        for (long j = 0; j < cols; j++) dst[j * rows + i] = src[i * cols + j];
}

/* One token of one head on its transposed state stt [N][P]: stt[n][p] = stt[n][p] * decay +
 * b[n] * x[p] * dt, y[p] = sum_n stt[n][p] c[n]. Inlined with a constant P (the caller's
 * P == 64 branch), the p loop lives in registers. */
static inline __attribute__((always_inline)) void
scan_token(float *restrict stt, const long P, long N, float dt, const float *restrict x,
           float decay, const float *restrict bb, const float *restrict cc, float *restrict y) {
    float xd[P], acc[P];
    for (long p = 0; p < P; p++) xd[p] = x[p] * dt, acc[p] = 0.0f;
    for (long n = 0; n < N; n++, stt += P) {
        const float bn = bb[n], cn = cc[n];
        for (long p = 0; p < P; p++) {
            const float v = stt[p] * decay + bn * xd[p];
            stt[p] = v;
            acc[p] += v * cn;
        }
    }
    for (long p = 0; p < P; p++) y[p] = acc[p];
}

/* Row j of request r's conv input sequence: its resume state's K-1 rows, then its new rows. */
static inline const float *conv_row(const float *head, const float *xin, long stride, long C,
                                    long km1, long j) {
    return j < km1 ? head + j * C : xin + (j - km1) * stride;
}

/* proj: [T, proj_stride] in_proj rows (z [H*P] | xBC [C] | dt [H]), request r's at rows
 * starts[r] .. starts[r+1] - 1, tok_req[t] the request of row t; work: [T * (C + 2H) +
 * B * (K-1) * C] scratch; out: [T, H*P]; pools, weights and the rest as mamba2_decode_fused. */
void mamba2_prefill_fused(const float *proj, long proj_stride, float *conv_pool,
                          float *ssm_pool, const long *slots, const long *starts,
                          const long *tok_req, const unsigned char *fresh, long B, long H, long P,
                          long N, long G, long K, const float *conv_w, const float *conv_b,
                          const float *dt_bias, const float *a_neg, float lo, float hi,
                          const float *d_skip, const float *norm_w, long norm_group, float eps,
                          const long *cap_req, const long *cap_off, const long *cap_slot,
                          long ncap, float *work, float *out, long threads) {
    const long inner = H * P, gn = G * N, C = inner + 2 * gn, hpg = H / G, km1 = K - 1;
    const long T = starts[B], PN = P * N;
    float *xa = work, *dts = xa + T * C, *decays = dts + T * H, *heads = decays + T * H;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for
        for (long r = 0; r < B; r++) { /* each request's resume conv state, before any write */
            const float *cst = conv_pool + slots[r] * km1 * C;
            for (long j = 0; j < km1 * C; j++) heads[r * km1 * C + j] = fresh[r] ? 0.0f : cst[j];
        }
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++) { /* conv + SiLU, then dt and its decay */
            const long r = tok_req[t];
            const float *head = heads + r * km1 * C, *xin = proj + starts[r] * proj_stride + inner;
            float *o = xa + t * C;
            for (long c = 0; c < C; c++) o[c] = conv_b ? conv_b[c] : 0.0f;
            for (long k = 0; k < K; k++) {
                const float *src = conv_row(head, xin, proj_stride, C, km1, t - starts[r] + k);
                for (long c = 0; c < C; c++) o[c] += src[c] * conv_w[k * C + c];
            }
            for (long c = 0; c < C; c++) o[c] = silu(o[c]);
            const float *dtin = proj + t * proj_stride + inner + C;
            for (long h = 0; h < H; h++) {
                dts[t * H + h] = mamba2_dt(dtin[h], dt_bias[h], lo, hi);
                decays[t * H + h] = expf(dts[t * H + h] * a_neg[h]);
            }
        }
#pragma omp for nowait
        for (long i = 0; i < ncap + B; i++) { /* conv states: the captures', then each final */
            const long r = i < ncap ? cap_req[i] : i - ncap;
            const long q = i < ncap ? cap_off[i] : starts[r + 1] - starts[r];
            const float *head = heads + r * km1 * C, *xin = proj + starts[r] * proj_stride + inner;
            float *dst = conv_pool + (i < ncap ? cap_slot[i] : slots[r]) * km1 * C;
            for (long k = 0; k < km1; k++) {
                const float *src = conv_row(head, xin, proj_stride, C, km1, q + k);
                for (long c = 0; c < C; c++) dst[k * C + c] = src[c];
            }
        }
#pragma omp for schedule(dynamic)
        for (long rh = 0; rh < B * H; rh++) { /* the recurrence, one head's state at a time */
            const long r = rh / H, h = rh % H, t0 = starts[r], off = inner + (h / hpg) * N;
            float *st = ssm_pool + (slots[r] * H + h) * PN, stt[PN];
            if (fresh[r])
                for (long j = 0; j < PN; j++) st[j] = 0.0f;
            for (long i = 0; i < ncap; i++)
                if (cap_req[i] == r && cap_off[i] == 0)
                    for (long j = 0; j < PN; j++) ssm_pool[(cap_slot[i] * H + h) * PN + j] = st[j];
            transpose(stt, st, P, N);
            for (long t = t0; t < starts[r + 1]; t++) {
                const float *x = xa + t * C;
                float *y = out + t * inner + h * P;
                if (P == 64)
                    scan_token(stt, 64, N, dts[t * H + h], x + h * P, decays[t * H + h], x + off,
                               x + off + gn, y);
                else
                    scan_token(stt, P, N, dts[t * H + h], x + h * P, decays[t * H + h], x + off,
                               x + off + gn, y);
                for (long i = 0; i < ncap; i++)
                    if (cap_req[i] == r && cap_off[i] == t - t0 + 1)
                        transpose(ssm_pool + (cap_slot[i] * H + h) * PN, stt, N, P);
            }
            transpose(st, stt, N, P);
        }
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++) /* D skip, gate, grouped RMSNorm */
            gated_norm_row(out + t * inner, xa + t * C, proj + t * proj_stride, d_skip, norm_w,
                           inner, norm_group, eps);
    }
}

#ifdef MARCONI_PYEXT
PYEXT_FUNCTION(mamba2_prefill_fused, "plppppppllllllppppffpplfppplppl",
               mamba2_prefill_fused(v[0].p, v[1].l, v[2].p, v[3].p, v[4].p, v[5].p, v[6].p,
                                    v[7].p, v[8].l, v[9].l, v[10].l, v[11].l, v[12].l, v[13].l,
                                    v[14].p, v[15].p, v[16].p, v[17].p, v[18].f, v[19].f,
                                    v[20].p, v[21].p, v[22].l, v[23].f, v[24].p, v[25].p,
                                    v[26].p, v[27].l, v[28].p, v[29].p, v[30].l))
PYEXT_MODULE(mamba2_prefill, PYEXT_METHOD(mamba2_prefill_fused))
#endif
