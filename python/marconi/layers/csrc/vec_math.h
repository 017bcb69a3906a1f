/* Arithmetic shared by the kernels, written so that compilers vectorise it: exp_vec (Mamba-2
 * SiLU, attention softmax) and dot_lanes (attention scores, RMSNorm, the skinny linear's tails).
 * Everything is static inline. */
#ifndef MARCONI_VEC_MATH_H
#define MARCONI_VEC_MATH_H

/* exp(x) in plain arithmetic (no libm call), so that loops over it vectorise: x = n ln2 + r,
 * |r| <= ln2 / 2, exp(r) by Cephes' degree-7 polynomial, 2^n by the exponent bits; within
 * 2 ulp of expf on [-87, 88]; x is clamped there (+-inf give NaN: only SiLU uses it). */
static inline float exp_vec(float x) {
    x += (float)(x < -87.0f) * (-87.0f - x); /* a clamp written so that it vectorises */
    x += (float)(x > 88.0f) * (88.0f - x);
    const int n = (int)(x * 1.44269504089f + __builtin_copysignf(0.5f, x));
    const float r = x - (float)n * 0.693359375f + (float)n * 2.12194440e-4f;
    float q = 1.9875691500e-4f;
    q = q * r + 1.3981999507e-3f;
    q = q * r + 8.3334519073e-3f;
    q = q * r + 4.1665795894e-2f;
    q = q * r + 1.6666665459e-1f;
    q = q * r + 5.0000001201e-1f;
    const int bits = (n + 127) << 23;
    float scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return (1.0f + r + r * r * q) * scale;
}

/* sum_{c0 <= c < k} a[c] b[c] in 16 partial sums (the compiler vectorises them), then added */
static inline float dot_lanes(const float *a, const float *b, long c0, long k) {
    float acc[16] = {0.0f};
    long c = c0;
    for (; c + 16 <= k; c += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[c + j] * b[c + j];
    for (; c < k; c++) acc[c % 16] += a[c] * b[c];
    float s = 0.0f;
    for (int j = 0; j < 16; j++) s += acc[j];
    return s;
}
#endif
