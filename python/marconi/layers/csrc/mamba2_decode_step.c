/* One Mamba-2 decode step for a batch, updating the SSM state pool in place.
 *
 * For request i (state slot slots[i]), head h (group g = h / (H / G)), channel p:
 *   state[p][n] = state[p][n] * decay[i][h] + x[i][h][p] * dt[i][h] * b[i][g][n]
 *   y[i][h][p]  = sum_n state[p][n] * c[i][g][n]
 * with decay = exp(dt * A) computed by the caller. Every state row is read once and written
 * once, where torch's batched path gathers the slots, updates a copy in two passes and
 * scatters it back (five passes over the states). fp32 in and
 * out; the sum runs in 16 partial sums (the compiler vectorises them), so y differs from a
 * matmul only by summation order.
 */

#define LANES 16

void mamba2_decode_step(float *ssm, const long *slots, long bsz, long H, long P, long N, long G,
                        const float *x, const float *dt, const float *decay_, const float *b,
                        const float *c, float *y) {
    const long hpg = H / G;
    for (long i = 0; i < bsz; i++) {
        float *s_i = ssm + slots[i] * H * P * N;
        for (long h = 0; h < H; h++) {
            const long g = h / hpg;
            const float d = dt[i * H + h];
            const float decay = decay_[i * H + h];
            const float *bb = b + (i * G + g) * N;
            const float *cc = c + (i * G + g) * N;
            for (long p = 0; p < P; p++) {
                float *st = s_i + (h * P + p) * N;
                const float xd = x[(i * H + h) * P + p] * d;
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
                y[(i * H + h) * P + p] = sum;
            }
        }
    }
}
