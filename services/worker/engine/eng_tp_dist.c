/* eng_tp_dist.c — see eng_tp_dist.h. */
#include "eng_tp_dist.h"

#include <math.h>

#include "krn_cpu.h"

uint32_t eng_tp_max_holder(const float *maxima, size_t stride, uint32_t n, float *max) {
    uint32_t holder = n;
    for (uint32_t r = 0; r < n; r++) {
        float m = maxima[(size_t)r * stride];
        if (!isnan(m) && (holder == n || m > maxima[(size_t)holder * stride])) holder = r;
    }
    *max = holder < n ? maxima[(size_t)holder * stride] : NAN;
    return holder;
}

void eng_tp_merge_lists(const uint32_t *const *ids, const float *const *vals, const int *counts,
                        uint32_t n, double sum, uint32_t top_k, uint32_t *out_ids,
                        float *out_probs) {
    /* as krn_cpu_softmax: the limits (sum exactly 1) are not scaled; NaN rows have sum 0 and
     * stay NaN (NaN * inf) */
    float scale = 1.0f / (float)sum;
    krn_cpu_topk_merge(ids, vals, counts, (int)n, scale, (int)top_k, out_ids, out_probs);
}
