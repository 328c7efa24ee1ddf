// Memory after the weights: activations for the largest step, the per-step staging areas, one profiling
// step, then the paged KV pool from what is left (or exactly gpu_num_kv_blocks) and the pinned host tier.
#include <algorithm>
#include <chrono>

#include "../kernels/launch.cuh"
#include "engine.h"

namespace oi {
int64_t Engine::finalize() {
  OI_CHECK(!finalized_, "finalize() called twice");
  pdl_enabled() = pdl_;  // the graphs are captured below
  // Each phase's seconds for the start-up log (the device drained at each mark): where the time to ready goes.
  auto t = std::chrono::steady_clock::now();
  auto mark = [&](const char* phase) {
    OI_CUDA_CHECK(cudaDeviceSynchronize());
    const auto now = std::chrono::steady_clock::now();
    finalize_seconds_.emplace_back(phase, std::chrono::duration<double>(now - t).count());
    t = now;
  };
  release_upload_stages();  // every weight is on the GPU once the stream drains
  mark("weights_drain");
  allocate_activations();
  mark("activations");
  profile_step();
  mark("profile_step");
  allocate_kv();
  mark("kv_pool");
  finalized_ = true;
  // decode buckets always (the graphs themselves only when cuda_graph is on); none with a drafter, whose
  // context every step writes: verify buckets then
  if (dr_) capture_verify_graphs();
  else capture_graphs();
  mark("graphs");
  return num_blocks_;
}

void Engine::allocate_activations() {
  // T tokens, Q sequences, S sampled rows (several per sequence in a verify step; a draft chunk's rows)
  const int64_t T = opt_.max_num_batched_tokens, Q = opt_.max_num_seqs, H = d_.hidden, I = d_.intermediate;
  if (dr_) dr_->chunk = (int)std::min<int64_t>({Q, 16, T / dr_->dims.block_size});
  const int64_t S = std::max<int64_t>(max_rows(), dr_ ? (int64_t)dr_->chunk * dr_->dims.num_drafts : 0);
  opt_.max_sampled_rows = (int)S;
  auto ab = [&](int64_t n) { return static_cast<bf16*>(alloc(n * sizeof(bf16), &act_bytes_)); };
  act_.x = ab(T * H);
  act_.h = ab(T * H);
  act_.qkv = ab(T * d_.qkv_rows());
  act_.attn = ab(T * d_.heads * d_.head_dim);
  act_.gu = ab(T * 2 * I);
  act_.act = ab(T * I);
  act_.xs = ab(S * H);
  act_.hs = ab(S * H);
  act_.logits = static_cast<float*>(alloc(S * d_.vocab * sizeof(float), &act_bytes_));
  // split partials, [max_split_rows] rows; an unsplit chunk-invariant launch (deterministic steps only) keeps
  // every token's running total there (T rows)
  const size_t ws_rows = opt_.deterministic ? std::max<size_t>(max_split_rows_, T) : (size_t)max_split_rows_;
  act_.ws_o = static_cast<float*>(alloc(ws_rows * d_.heads * d_.head_dim * sizeof(float), &act_bytes_));
  act_.ws_lse = static_cast<float*>(alloc((size_t)max_split_rows_ * d_.heads * sizeof(float), &act_bytes_));
  const size_t counter_bytes = (size_t)(T + Q + 1) * d_.kv_heads * sizeof(int);  // work items <= T + Q + 1
  act_.attn_counters = static_cast<int*>(alloc(counter_bytes, &act_bytes_));
  OI_CUDA_CHECK(cudaMemset(act_.attn_counters, 0, counter_bytes));
  if (opt_.persistent_decode && persistent_fits(d_.hidden, d_.intermediate, d_.heads, d_.kv_heads, d_.head_dim)) {
    const size_t lw_bytes = w_.layers.size() * sizeof(LayerWeights);
    LayerWeights* dl = static_cast<LayerWeights*>(alloc(lw_bytes, &act_bytes_));
    OI_CUDA_CHECK(cudaMemcpy(dl, w_.layers.data(), lw_bytes, cudaMemcpyHostToDevice));
    w_.dev_layers = dl;
    const size_t ws_bytes = persistent_ws_floats(d_.hidden, d_.intermediate, d_.heads, d_.kv_heads) * sizeof(float);
    act_.layer_ws = static_cast<float*>(alloc(ws_bytes, &act_bytes_));
    OI_CUDA_CHECK(cudaMemset(act_.layer_ws, 0, ws_bytes));
  }
  // Staging: every input array (token rows, tap rows, sequence rows, block tables, sampled rows, work items,
  // the verify rows and prev_rows, the drafting sequences and their work items), then the outputs (tokens,
  // log-probs, top-N, accepted counts, drafts).
  const int64_t max_blocks_per_seq = (opt_.max_model_len + kMaxDraftBlock + opt_.kv_block_size - 1) / opt_.kv_block_size;
  const int64_t draft_items = dr_ ? Q * ((dr_->dims.block_size + attn_tokens_per_item(d_.heads / d_.kv_heads) - 1) /
                                         attn_tokens_per_item(d_.heads / d_.kv_heads)) : 0;
  meta_in_bytes_ = align_up(4 * T * 4) + align_up((2 * Q + 1) * 4) + align_up(Q * max_blocks_per_seq * 4) +
                   align_up(6 * S * 4) + align_up(S * 8) + align_up((T + Q) * sizeof(AttnWork)) +
                   2 * align_up((Q + 1) * 4) + 2 * align_up(Q * 4) + align_up(draft_items * sizeof(AttnWork)) +
                   20 * kStageAlign;
  const int64_t drafts = dr_ ? Q * dr_->dims.num_drafts : 0;
  meta_bytes_ = meta_in_bytes_ + align_up(2 * S * 4) + align_up(Q * 4) + align_up(2 * S * kMaxLogprobs * 4) +
                align_up(drafts * 4) + 6 * kStageAlign;
  for (int i = 0; i < 2; ++i) {
    OI_CUDA_CHECK(cudaMallocHost(&host_meta_[i], meta_bytes_));
    dev_meta_[i] = static_cast<char*>(alloc(meta_bytes_, &act_bytes_));
    for (cudaEvent_t& e : meta_ev_[i]) OI_CUDA_CHECK(cudaEventCreate(&e));
  }
  if (dr_) allocate_drafter();
}

// One prompt through every kernel and GEMM shape class on a throwaway pool, so that lazily loaded
// modules and plans are resident before free memory is read.
void Engine::profile_step() {
  const int n = std::max(1, std::min<int>({opt_.max_num_batched_tokens, 256, opt_.max_model_len}));
  const int bs = opt_.kv_block_size, nb = (n + bs - 1) / bs;
  bf16* tmp = nullptr;
  OI_CUDA_CHECK(cudaMalloc(&tmp, (size_t)(nb + 1) * kv_block_bytes()));
  std::vector<int32_t> ids(n), pos(n), slots(n), bt(nb);
  for (int i = 0; i < n; ++i) { ids[i] = i % d_.vocab; pos[i] = i; slots[i] = bs + i; }
  for (int b = 0; b < nb; ++b) bt[b] = b + 1;
  int32_t qsl[2] = {0, n}, ctx[1] = {n}, sidx[1] = {n - 1}, topk[1] = {0};
  float temp[1] = {1.f}, topp[1] = {0.9f};
  uint64_t seed[1] = {0};
  StepInput in;
  in.input_ids = ids.data(); in.n_input_ids = n;
  in.positions = pos.data(); in.n_positions = n;
  in.slot_mapping = slots.data(); in.n_slot_mapping = n;
  in.query_start_loc = qsl; in.n_query_start_loc = 2;
  in.context_lens = ctx; in.n_context_lens = 1;
  in.block_tables = bt.data(); in.n_block_tables = 1; in.bt_stride = nb;
  in.sample_idx = sidx; in.n_sample_idx = 1;
  in.temperature = temp; in.top_p = topp; in.top_k = topk; in.seeds = seed;
  in.n_temperature = in.n_top_p = in.n_top_k = in.n_seeds = 1;
  in.num_logprobs = 1;
  StepLimits lim = limits();
  lim.num_blocks = nb + 1;
  Pending p = enqueue(in, plan_step(in, d_, lim, eager_kernels_.attention), tmp, false);  // no drafter pool yet
  finish_eager(p);
  OI_CUDA_CHECK(cudaFree(tmp));
}

void Engine::allocate_kv() {
  size_t free_b = 0, total_b = 0;
  OI_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const double reserve = (1.0 - opt_.gpu_memory_utilization) * (double)total_b;
  const int64_t budget = (int64_t)((double)free_b - reserve);
  // a block id holds the target's K/V and, with a drafter, the drafter's (its own pool, same ids)
  const int64_t per_block = kv_block_bytes() + (dr_ ? dr_->block_bytes() : 0);
  const int64_t fit = budget > 0 ? budget / per_block : 0;
  num_blocks_ = opt_.gpu_num_kv_blocks > 0 ? opt_.gpu_num_kv_blocks : fit;
  OI_CHECK(num_blocks_ <= (int64_t)(free_b / per_block),
           "num_kv_blocks " << num_blocks_ << " does not fit in free GPU memory (" << free_b / per_block << " blocks)");
  OI_CHECK(num_blocks_ >= 2, "not enough GPU memory for the KV cache: " << (free_b >> 20) << " MiB free after weights ("
                                 << (weight_bytes_ >> 20) << " MiB) and activations; raise gpu_memory_utilization");
  OI_CUDA_CHECK(cudaMalloc(&kv_cache_, (size_t)num_blocks_ * kv_block_bytes()));
  OI_CUDA_CHECK(cudaMemset(kv_cache_, 0, (size_t)num_blocks_ * kv_block_bytes()));  // unwritten slots stay finite
  if (dr_) {
    OI_CUDA_CHECK(cudaMalloc(&dr_->kv_cache, (size_t)num_blocks_ * dr_->block_bytes()));
    OI_CUDA_CHECK(cudaMemset(dr_->kv_cache, 0, (size_t)num_blocks_ * dr_->block_bytes()));
  }

  num_host_blocks_ = opt_.host_kv_bytes / kv_block_bytes();
  if (opt_.host_kv_bytes > 0) {
    OI_CHECK(num_host_blocks_ >= 1, "the host KV tier (" << opt_.host_kv_bytes << " bytes) is smaller than one KV block ("
                                                          << kv_block_bytes() << " bytes)");
    const size_t bytes = (size_t)num_host_blocks_ * kv_block_bytes();
    // Pinned, so that a block copy is one DMA at the link's speed (pageable memory copies through a
    // bounce buffer and can stall the other copies of the stream).
    const cudaError_t e = cudaHostAlloc(&host_kv_, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess) {
      cudaGetLastError();
      host_kv_ = nullptr;
      OI_CHECK(false, "cannot pin " << (bytes >> 20) << " MiB of host memory for the KV tier (" << cudaGetErrorString(e)
                                    << "); lower kv_offload_host_gib");
    }
    OI_CUDA_CHECK(cudaStreamCreateWithFlags(&save_stream_, cudaStreamNonBlocking));
    OI_CUDA_CHECK(cudaStreamCreateWithFlags(&load_stream_, cudaStreamNonBlocking));
  }
}

}  // namespace oi
