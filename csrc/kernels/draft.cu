#include "draft.cuh"
#include "launch.cuh"

namespace oi {
namespace {

// One block per drafting sequence: the anchor is the token its kept row sampled (that row is at position
// p - 1), so the block's rows sit at p .. p + block - 1. Draft j proposes the token at p + j + 1 in both
// formats, and draws the noise of the target's row that samples that token (position p + j).
__global__ void draft_inputs_kernel(DraftInputs a) {
  pdl_wait();
  pdl_trigger();
  const int d = blockIdx.x, b = a.seqs[d];
  const int row = a.rows[d] + (a.accepted ? a.accepted[b] - 1 : 0);
  const int anchor = a.tokens[row], p = a.sample_pos[row] + 1;
  const int32_t* bt = a.block_tables + (int64_t)b * a.bt_stride;
  for (int i = threadIdx.x; i < a.block; i += blockDim.x) {
    const int t = d * a.block + i, pos = p + i;
    a.ids[t] = i == 0 ? anchor : a.mask_token;
    a.positions[t] = pos;
    a.mask_pos[t] = p + a.block - 1;  // every row sees the whole block: no causal mask inside it
    const int blk = bt[pos / a.page];
    a.slots[t] = blk > 0 ? blk * a.page + pos % a.page : -1;  // block 0: a verify bucket's padding, writes nothing
  }
  for (int j = threadIdx.x; j < a.num_drafts; j += blockDim.x) {
    const int r = j * a.D + d;
    a.rows_out[r] = d * a.block + a.first_slot + j;
    a.d_pos[r] = p + j;
    a.d_temperature[r] = a.temperature[row];
    a.d_top_p[r] = a.top_p[row];
    a.d_top_k[r] = a.top_k[row];
    a.d_seeds[r] = a.seeds[row];
  }
  if (threadIdx.x == 0) {
    a.context_lens[b] = p + a.block;
    a.anchors[d] = anchor;
  }
}

}  // namespace

void draft_inputs(const DraftInputs& a, cudaStream_t s) {
  if (a.D == 0) return;
  OI_CUDA_CHECK(launch_kernel(false, draft_inputs_kernel, dim3(a.D), dim3(32), 0, s, nullptr, a));
}

}  // namespace oi
