/* exp_vec: an exp that vectorises, shared by the kernels (Mamba-2 SiLU, attention softmax). */
#ifndef MARCONI_EXP_VEC_H
#define MARCONI_EXP_VEC_H

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
#endif
