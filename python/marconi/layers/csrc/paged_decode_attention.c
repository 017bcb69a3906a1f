/* Decode attention straight from the paged KV pool: one query row per request.
 *
 * request b's row attends to the K/V of its first kv_lens[b] slots, kv_index[b * ld + j]
 * (j < kv_lens[b]), in slot-pool layout [slots, Hk, D]; query head i reads KV head
 * i / (Hq / Hk) (GQA as torch's `enable_gqa`). out[b, i] = softmax(scale q k^T) v.
 *
 * Why: torch's path gathers every request's K and V into padded [B, Hk, Lk_max, D] copies and
 * runs a masked SDPA over them: on a 6-request decode step of the `small` model that was ~5 ms
 * of a ~54 ms step (two gathers per attention layer), for ~1 MFLOP of work. Here each (request,
 * KV head) pair reads its rows in place once for the scores and once for the values, its group
 * of query heads together, on torch's OpenMP threads (serial below 64K multiply-adds).
 *
 * fp32 in and out; dot products in 16 partial sums (dot_lanes), softmax by max-subtracted
 * exp_vec (within 2 ulp of expf), so results differ from torch's only by summation order.
 */
#ifdef MARCONI_PYEXT
#include "pyext.h" /* first: Python.h must precede system headers */
#endif
#include <stdlib.h>

#include "vec_math.h"

/* one (request, KV head) pair: `group` query heads at q/out, scores scratch of group * len */
static void attend_pair(const float *q, const float *k_cache, const float *v_cache,
                        const long *slots, long len, long hk, long h, long group, long d,
                        float scale, float *scores, float *out) {
    for (long j = 0; j < len; j++) {
        const float *kr = k_cache + (slots[j] * hk + h) * d;
        for (long g = 0; g < group; g++)
            scores[g * len + j] = scale * dot_lanes(q + g * d, kr, 0, d);
    }
    for (long g = 0; g < group; g++) {
        float *s = scores + g * len, m = s[0], sum = 0.0f;
        for (long j = 1; j < len; j++) m = s[j] > m ? s[j] : m;
        for (long j = 0; j < len; j++) {
            s[j] = exp_vec(s[j] - m);
            sum += s[j];
        }
        const float inv = 1.0f / sum;
        for (long j = 0; j < len; j++) s[j] *= inv;
    }
    for (long e = 0; e < group * d; e++) out[e] = 0.0f;
    for (long j = 0; j < len; j++) {
        const float *vr = v_cache + (slots[j] * hk + h) * d;
        for (long g = 0; g < group; g++) {
            const float p = scores[g * len + j];
            float *o = out + g * d;
            for (long e = 0; e < d; e++) o[e] += p * vr[e];
        }
    }
}

/* q, out [bsz, hq, d]; k_cache, v_cache [slots, hk, d]; kv_index rows of stride ld; kv_lens [bsz]
 * (each >= 1). Returns without writing if a scratch allocation fails (out then keeps garbage:
 * the caller checks `ok` [1], set to 0 on failure). */
void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                            const long *kv_index, const long *kv_lens, float *out, long *ok,
                            long bsz, long hq, long hk, long d, long ld, float scale,
                            long threads) {
    const long group = hq / hk;
    long work = 0, longest = 0;
    for (long b = 0; b < bsz; b++) {
        work += kv_lens[b] * hq * d;
        longest = kv_lens[b] > longest ? kv_lens[b] : longest;
    }
    *ok = 1;
#pragma omp parallel num_threads(threads) if (work >= 1L << 16)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * longest));
        if (scores == NULL) {
#pragma omp atomic write
            *ok = 0;
        }
#pragma omp for schedule(dynamic, 1)
        for (long pair = 0; pair < bsz * hk; pair++) {
            const long b = pair / hk, h = pair % hk, off = (b * hq + h * group) * d;
            if (scores != NULL)
                attend_pair(q + off, k_cache, v_cache, kv_index + b * ld, kv_lens[b], hk, h, group,
                            d, scale, scores, out + off);
        }
        free(scores);
    }
}

#ifdef MARCONI_PYEXT
PYEXT_FUNCTION(paged_decode_attention, "ppppppplllllfl",
               paged_decode_attention(v[0].p, v[1].p, v[2].p, v[3].p, v[4].p, v[5].p, v[6].p,
                                      v[7].l, v[8].l, v[9].l, v[10].l, v[11].l, v[12].f, v[13].l))
PYEXT_MODULE(paged_decode_attention, PYEXT_METHOD(paged_decode_attention))
#endif
