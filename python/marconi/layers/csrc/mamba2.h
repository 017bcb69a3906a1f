/* Per-element pieces shared by the Mamba-2 kernels (mamba2_decode_step.c, mamba2_prefill.c):
 * SiLU on the vectorisable exp of vec_math.h, dt's softplus + clamp, and the gate + grouped
 * RMSNorm that ends the mixer. Included once per kernel source; everything is static inline. */
#ifndef MARCONI_MAMBA2_H
#define MARCONI_MAMBA2_H
#include <math.h>

#include "vec_math.h"

#define LANES 16

static inline float silu(float v) { return v / (1.0f + exp_vec(-v)); }

static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* dt = clamp(softplus(raw + bias), lo, hi) */
static inline float mamba2_dt(float raw, float bias, float lo, float hi) {
    return fminf(fmaxf(softplus(raw + bias), lo), hi);
}

/* The mixer's end for one token, in place on y [inner]: y = (y + x * D) * silu(z), then
 * RMS-normed per group of norm_group channels times norm_w. */
static inline void gated_norm_row(float *y, const float *x, const float *z, const float *d_skip,
                                  const float *norm_w, long inner, long norm_group, float eps) {
    for (long j = 0; j < inner; j++) y[j] = (y[j] + x[j] * d_skip[j]) * silu(z[j]);
    for (long g0 = 0; g0 < inner; g0 += norm_group) {
        const float ss = dot_lanes(y + g0, y + g0, 0, norm_group);
        const float rs = 1.0f / sqrtf(ss / (float)norm_group + eps);
        for (long j = g0; j < g0 + norm_group; j++) y[j] = y[j] * rs * norm_w[j];
    }
}
#endif
