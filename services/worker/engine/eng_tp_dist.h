/* eng_tp_dist.h — merging a tensor-parallel group's next-token distributions (both backends).
 *
 * Owns: the host side of next_dist over a group, shared by the cpu engine (eng_cpu_tp.c) and
 * the cuda engine (eng_cuda_tp.c): the row's largest number from the ranks' slice maxima and
 * which rank holds its first occurrence, and the exact merge of the ranks' local top-k lists
 * (values exp((l - M) / T) relative to that maximum M, and their sums) into the row's top k of
 * the softmax over the whole vocabulary. Nothing is approximated: the global top k is among
 * the union of the local ones, ties (underflowed zeros too) go to the lower id as on one rank.
 * Does not own: computing the maxima and the lists (the backends' kernels), exchanging them
 * (wrk_coll, wrk_nccl), the list merge itself (krn_cpu_topk_merge). */
#ifndef ENG_TP_DIST_H
#define ENG_TP_DIST_H

#include <stddef.h>
#include <stdint.h>

/* The row's largest number from n ranks' slice maxima (maxima[r * stride]; NaN: that slice has
 * no number), and the first rank holding it (slices are in vocabulary order, so a strict >
 * keeps the lowest id): returns that rank and sets *max, or returns n (and *max NaN) when no
 * rank has a number. */
uint32_t eng_tp_max_holder(const float *maxima, size_t stride, uint32_t n, float *max);

/* The merge of n ranks' lists whose values are exp((l - M) / T), each in krn_cpu_topk's order
 * (descending, ties to the lower id, NaN last) with vocabulary ids, and `sum` the sum of those
 * values over the whole vocabulary (the ranks' sums added in rank order): the top_k of the
 * union scaled by 1 / sum into out_ids / out_probs[top_k]. The limits (sum exactly 1) are not
 * changed by the scaling; a row without numbers (sum 0) stays NaN. n <= 64; top_k <= the sum
 * of the counts. */
void eng_tp_merge_lists(const uint32_t *const *ids, const float *const *vals, const int *counts,
                        uint32_t n, double sum, uint32_t top_k, uint32_t *out_ids,
                        float *out_probs);

#endif
