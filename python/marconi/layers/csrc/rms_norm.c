/* y[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w for a few rows (decode steps).
 *
 * torch's fused rms_norm dispatches five ops per call (~50 us for one row of a few hundred
 * floats on our CPU); a decode step of a hybrid model calls it once or twice per layer. fp32 in
 * and out, the sum of squares in 16 partial sums (dot_lanes, vec_math.h), so results
 * differ from torch's only by summation order.
 */
#ifdef MARCONI_PYEXT
#include "pyext.h" /* first: Python.h must precede system headers */
#endif
#include <math.h>

#include "vec_math.h"

void rms_norm_rows(const float *x, const float *w, float *y, long rows, long dim, float eps) {
    for (long i = 0; i < rows; i++, x += dim, y += dim) {
        const float r = 1.0f / sqrtf(dot_lanes(x, x, 0, dim) / (float)dim + eps);
        for (long j = 0; j < dim; j++) y[j] = x[j] * r * w[j];
    }
}

#ifdef MARCONI_PYEXT
PYEXT_FUNCTION(rms_norm_rows, "pppllf",
               rms_norm_rows(v[0].p, v[1].p, v[2].p, v[3].l, v[4].l, v[5].f))
PYEXT_MODULE(rms_norm, PYEXT_METHOD(rms_norm_rows))
#endif
