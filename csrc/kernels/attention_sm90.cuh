// Prefill attention on Hopper (sm_90a) with warpgroup MMA (attention_sm90.cu): an experiment that paged_attention()
// reaches for prompt chunks when AttnVariant::prefill_wgmma (or OPENINFER_EXP_PREFILL_WGMMA=1) asks and the launch is
// one it takes; everything else keeps attention.cu's kernels.
#pragma once
#include "attention.cuh"

namespace oi {

// What AttnVariant::prefill_wgmma asks for: 0 off, 1 on, 2 forced also for items of up to 16 rows; -1 resolves to the
// environment switch OPENINFER_EXP_PREFILL_WGMMA (1: on; read once per process).
int prefill_wgmma_mode(const AttnVariant& v);

// Whether the current device runs the kernel at all (compute capability 9.0).
bool prefill_wgmma_device();

// Whether the wgmma kernel takes this launch in `mode` (unsplit, non-segment, no fuse_rope / own_keys_below, head_dim
// 128, block_size 16, 16-byte aligned q rows, a compute capability 9.0 device; max_rows > 16 unless mode 2).
bool prefill_wgmma_takes(const AttnArgs& a, int mode);

// The launch itself; the caller has checked prefill_wgmma_takes. Writes a.out only (no workspace, no counters).
void prefill_attention_sm90(const AttnArgs& a, cudaStream_t s);

}  // namespace oi
