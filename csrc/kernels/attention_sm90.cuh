// Prefill attention on Hopper (sm_90a) with warpgroup MMA (attention_sm90.cu): paged_attention() reaches for it for
// prompt chunks where the launch is one it takes (AttnVariant::prefill_wgmma 1, the default); everything else keeps
// attention.cu's kernels.
#pragma once
#include "attention.cuh"

namespace oi {

// What AttnVariant::prefill_wgmma asks for: 0 off, 1 on (the default), 2 forced also for items of up to 16 rows.
inline int prefill_wgmma_mode(const AttnVariant& v) { return v.prefill_wgmma; }

// Whether the current device runs the kernel at all (compute capability 9.0).
bool prefill_wgmma_device();

// Whether the wgmma kernel takes this launch in `mode` (unsplit, non-segment, no fuse_rope / own_keys_below, head_dim
// 128, block_size 16, 16-byte aligned q rows, a compute capability 9.0 device; max_rows > 16 unless mode 2).
bool prefill_wgmma_takes(const AttnArgs& a, int mode);

// The launch itself; the caller has checked prefill_wgmma_takes. Writes a.out only (no workspace, no counters).
void prefill_attention_sm90(const AttnArgs& a, cudaStream_t s);

}  // namespace oi
