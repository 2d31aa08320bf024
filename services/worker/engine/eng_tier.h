/* eng_tier.h — the swap policy's tier (services/worker/mem/wrk_tier.h) as eng.h reports and
 * steers it, for both backends (eng_cpu_swap.c, eng_cuda_swap.c).
 *
 * Owns: eng_swap_stats from the tier's counters, and the slot count through eng.h's contract
 * (refused without the policy). Does not own: the tier, the engines' use of it. */
#ifndef ENG_TIER_H
#define ENG_TIER_H

#include "eng.h"
#include "wrk_tier.h"

/* t NULL (no swap policy): all zero. */
void eng_tier_stats(wrk_tier *t, eng_swap_stats *out);
/* t NULL: FAILED_PRECONDITION "swap_set_slots: the engine was opened without the swap
 * policy". */
pie_code eng_tier_set_slots(wrk_tier *t, uint32_t slots, uint32_t *applied, pie_status *st);

#endif
