// The decode buckets: one CUDA graph per batch size over a fixed-layout metadata arena, captured at start-up.
#include <algorithm>
#include <cstring>

#include "../kernels/elementwise.cuh"
#include "../kernels/launch.cuh"
#include "engine.h"

namespace oi {
std::vector<int> graph_batch_sizes(int max_num_seqs) {
  // Powers of two with one step between each pair from 16 on: padding wastes at most a third of a
  // bucket, and 256 sequences need 13 graphs (start-up time is per graph).
  std::vector<int> out;
  for (int b = 1; b <= max_num_seqs; b *= 2) {
    out.push_back(b);
    if (b >= 16 && b + b / 2 <= max_num_seqs) out.push_back(b + b / 2);
  }
  if (out.empty() || out.back() != max_num_seqs) out.push_back(max_num_seqs);
  return out;
}

std::vector<int> Engine::graph_batches() const {
  std::vector<int> out;
  for (const auto& g : graphs_) out.push_back(g.batch);
  return out;
}

StepMeta Engine::graph_meta(int batch, const KernelChoice& k) const {
  StepMeta m{};
  const int group = d_.heads / d_.kv_heads;
  m.T = m.B = m.S = m.num_work = batch;
  m.bt_stride = graph_bt_stride_;
  m.max_rows = group;
  // One split count for every context a graph may see: sized for the longest (short ones leave splits empty).
  m.num_splits = attn_num_splits(batch, d_.kv_heads, graph_splits_max_ctx_, batch, num_sms_, max_split_rows_, group,
                                 k.attention);
  m.num_logprobs = 0;
  m.fuse_rope = k.fuse_rope && group <= 16;
  m.persistent = batch == 1 && m.fuse_rope && k.persistent && w_.dev_layers;
  m.gemm_path = GemmPath::kLibrary;
  if (opt_.deterministic) {  // the eager steps' kernels: each row's bits do not depend on the batch
    m.num_splits = attn_segment_splits(batch, d_.kv_heads, graph_splits_max_ctx_, batch, num_sms_, max_split_rows_);
    m.attn_segment = kAttnSegment;
    m.gemm_path = GemmPath::kInvariant;
    m.fuse_rope = m.persistent = false;
  }
  m.attention = k.attention;
  m.gemv = k.gemv;
  char* d = graph_dev_;
  m.ids = (const int32_t*)(d + ga_.ids);
  m.positions = (const int32_t*)(d + ga_.pos);
  m.slots = (const int32_t*)(d + ga_.slots);
  m.context_lens = (const int32_t*)(d + ga_.ctx);
  m.sample_idx = (const int32_t*)(d + ga_.sidx);
  m.sample_pos = (const int32_t*)(d + ga_.spos);
  m.top_k = (const int32_t*)(d + ga_.topk);
  m.temperature = (const float*)(d + ga_.temp);
  m.top_p = (const float*)(d + ga_.topp);
  m.seeds = (const uint64_t*)(d + ga_.seeds);
  m.work = (const AttnWork*)(d + ga_.work);
  m.block_tables = (const int32_t*)(d + ga_.bt);
  m.out_tokens = (int32_t*)(d + ga_.tokens);
  m.out_logprobs = (float*)(d + ga_.logprobs);
  m.out_top_ids = nullptr;
  m.out_top_logprobs = nullptr;
  return m;
}

void Engine::capture_graphs() {
  const std::vector<int> sizes = graph_batch_sizes(opt_.max_num_seqs);
  const int Bmax = sizes.back();
  graph_bt_stride_ = (opt_.max_model_len + opt_.kv_block_size - 1) / opt_.kv_block_size;
  graph_splits_max_ctx_ = opt_.max_model_len;
  // Small per-row fields first, block tables last, so a step copies one prefix of the arena.
  size_t off = 0;
  auto field = [&](size_t bytes) { const size_t o = off; off = align_up(off + bytes); return o; };
  ga_.ids = field(Bmax * 4); ga_.pos = field(Bmax * 4); ga_.slots = field(Bmax * 4); ga_.ctx = field(Bmax * 4);
  ga_.sidx = field(Bmax * 4); ga_.spos = field(Bmax * 4); ga_.topk = field(Bmax * 4); ga_.temp = field(Bmax * 4);
  ga_.topp = field(Bmax * 4); ga_.seeds = field(Bmax * 8); ga_.work = field(Bmax * sizeof(AttnWork));
  ga_.prev = field(Bmax * 4);
  ga_.bt = field((size_t)Bmax * graph_bt_stride_ * 4);
  // Outputs after the copied prefix: a step's input copy must not clobber the previous step's tokens,
  // which an overlapped launch reads on the device (feed_tokens).
  ga_.tokens = field(Bmax * 4); ga_.logprobs = field(Bmax * 4);
  ga_.bytes = off;
  for (int i = 0; i < 2; ++i) {
    OI_CUDA_CHECK(cudaMallocHost(&graph_host_[i], ga_.bytes));
    for (cudaEvent_t& e : graph_ev_[i]) OI_CUDA_CHECK(cudaEventCreate(&e));
  }
  graph_dev_ = static_cast<char*>(alloc(ga_.bytes, &act_bytes_));
  // Dummy decode rows for capture: block 0 is reserved, so nothing real is touched.
  char* h0 = graph_host_[0];
  std::memset(h0, 0, ga_.bytes);
  for (int i = 0; i < Bmax; ++i) {
    reinterpret_cast<int32_t*>(h0 + ga_.slots)[i] = -1;
    reinterpret_cast<int32_t*>(h0 + ga_.ctx)[i] = 1;
    reinterpret_cast<int32_t*>(h0 + ga_.sidx)[i] = i;
    reinterpret_cast<float*>(h0 + ga_.topp)[i] = 1.f;
    reinterpret_cast<AttnWork*>(h0 + ga_.work)[i] = AttnWork{i, i, 1, 0};
  }
  std::memcpy(graph_host_[1], h0, ga_.bytes);  // the constant fields (sample_idx, work) live in both images
  OI_CUDA_CHECK(cudaMemcpy(graph_dev_, h0, ga_.bytes, cudaMemcpyHostToDevice));
  gemm_->set_autotune(opt_.gemm_autotune);  // time GEMM candidates for the decode shapes (dummy data)
  for (int b : sizes) {
    const StepMeta m = graph_meta(b, KernelChoice{});
    qwen3_forward(d_, w_, act_, m, rope_, kv_cache_, kv_, *gemm_, num_sms_, stream_);  // warm-up: plans made here
    OI_CUDA_CHECK(cudaStreamSynchronize(stream_));
    Graph gr;
    gr.batch = b;
    if (!opt_.cuda_graph) {  // eager decode still runs the bucketed shapes: identical outputs either way
      graphs_.push_back(gr);
      continue;
    }
    cudaGraph_t g = nullptr;
    OI_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    qwen3_forward(d_, w_, act_, m, rope_, kv_cache_, kv_, *gemm_, num_sms_, stream_);
    OI_CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
    OI_CUDA_CHECK(cudaGraphInstantiate(&gr.exec, g, 0));
    OI_CUDA_CHECK(cudaGraphDestroy(g));
    graphs_.push_back(gr);
  }
  gemm_->set_autotune(false);
  OI_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// Decode-only steps (one token per sequence, no logprobs or logits asked) run padded to the smallest
// bucket that holds the batch, replaying its graph (or, with cuda_graph off or force_eager, the same
// kernels launched eagerly: identical results). Padding rows read the reserved block 0 and write nothing.
// The step is only queued: its inputs go through one of two pinned arena images, so the next launch can
// be staged while this one runs; finish_graph() waits for it.
bool Engine::launch_graph(const StepInput& in) {
  // Logits only eagerly (tests compare a bucket's kernels through them; a graph has no copy for them).
  const int B = in.B();
  if (graphs_.empty() || in.T() != B || in.S() != B || in.num_logprobs != 0 || (in.return_logits && !in.force_eager) ||
      in.verify || in.n_tap_layers > 0 || in.kv_load_wait)  // a graph has no per-layer waits
    return false;
  const Graph* g = nullptr;
  for (const auto& c : graphs_)
    if (c.batch >= B) { g = &c; break; }
  if (!g) return false;
  for (int b = 0; b < B; ++b)
    if (in.query_start_loc[b] != b || in.sample_idx[b] != b) return false;
  const int Bg = g->batch, slot = graph_slot_;
  for (const Pending& p : pending_)
    OI_CHECK(!p.graph || p.slot != slot, "graph arena image " << slot << " is still in flight");
  char* h = graph_host_[slot];
  auto i32 = [&](size_t o) { return reinterpret_cast<int32_t*>(h + o); };
  std::memcpy(h + ga_.ids, in.input_ids, B * 4);
  std::memcpy(h + ga_.pos, in.positions, B * 4);
  std::memcpy(h + ga_.slots, in.slot_mapping, B * 4);
  std::memcpy(h + ga_.ctx, in.context_lens, B * 4);
  std::memcpy(h + ga_.spos, in.positions, B * 4);
  std::memcpy(h + ga_.topk, in.top_k, B * 4);
  std::memcpy(h + ga_.temp, in.temperature, B * 4);
  std::memcpy(h + ga_.topp, in.top_p, B * 4);
  std::memcpy(h + ga_.seeds, in.seeds, B * 8);
  if (in.prev_rows) std::memcpy(h + ga_.prev, in.prev_rows, B * 4);
  for (int b = B; b < Bg; ++b) {  // padding rows
    i32(ga_.ids)[b] = 0; i32(ga_.pos)[b] = 0; i32(ga_.slots)[b] = -1; i32(ga_.ctx)[b] = 1; i32(ga_.spos)[b] = 0;
    i32(ga_.topk)[b] = 0; i32(ga_.prev)[b] = -1;
    reinterpret_cast<float*>(h + ga_.temp)[b] = 0.f;
    reinterpret_cast<float*>(h + ga_.topp)[b] = 1.f;
  }
  const int W = graph_bt_stride_;
  const int nb_cols = std::min(in.bt_stride, W);
  int32_t* bt = i32(ga_.bt);
  for (int b = 0; b < Bg; ++b) {
    int32_t* row = bt + (size_t)b * W;
    if (b < B) std::memcpy(row, in.block_tables + (size_t)b * in.bt_stride, nb_cols * 4);  // only ctx's blocks are read
    else row[0] = 0;
  }
  const size_t bytes = ga_.bt + (size_t)Bg * W * 4;
  cudaEvent_t* ev = graph_ev_[slot];
  OI_CUDA_CHECK(cudaMemcpyAsync(graph_dev_, h, bytes, cudaMemcpyHostToDevice, stream_));
  OI_CUDA_CHECK(cudaEventRecord(ev[0], stream_));
  if (in.prev_rows)  // the previous step's tokens are still in its output field (stream order)
    feed_tokens(reinterpret_cast<int32_t*>(graph_dev_ + ga_.ids), reinterpret_cast<const int32_t*>(graph_dev_ + ga_.prev),
                last_tokens_, Bg, stream_);
  if (g->exec && !in.force_eager) {
    OI_CUDA_CHECK(cudaGraphLaunch(g->exec, stream_));
    ++graph_steps_;
  } else {
    StepMeta m = graph_meta(Bg, eager_kernels_);
    m.trace = m.persistent && trace_on_ ? trace_ : nullptr;
    qwen3_forward(d_, w_, act_, m, rope_, kv_cache_, kv_, *gemm_, num_sms_, stream_);
  }
  OI_CUDA_CHECK(cudaEventRecord(ev[1], stream_));
  OI_CUDA_CHECK(cudaMemcpyAsync(h + ga_.tokens, graph_dev_ + ga_.tokens, ga_.bytes - ga_.tokens, cudaMemcpyDeviceToHost,
                                stream_));
  Pending p;
  p.graph = true;
  p.slot = slot;
  p.B = p.S = B;
  if (in.return_logits) {
    p.logits.resize((size_t)B * d_.vocab);
    OI_CUDA_CHECK(cudaMemcpyAsync(p.logits.data(), act_.logits, p.logits.size() * 4, cudaMemcpyDeviceToHost, stream_));
  }
  OI_CUDA_CHECK(cudaEventRecord(ev[2], stream_));
  pending_.push_back(std::move(p));
  last_tokens_ = reinterpret_cast<const int32_t*>(graph_dev_ + ga_.tokens);
  graph_slot_ ^= 1;  // only once queued: after a failed launch the image stays free
  return true;
}

StepResult Engine::finish_graph(const Pending& p) {
  cudaEvent_t* ev = graph_ev_[p.slot];
  OI_CUDA_CHECK(cudaEventSynchronize(ev[2]));
  StepResult out;
  OI_CUDA_CHECK(cudaEventElapsedTime(&out.gpu_ms, ev[0], ev[1]));
  const char* h = graph_host_[p.slot];
  const int32_t* tok = reinterpret_cast<const int32_t*>(h + ga_.tokens);
  out.tokens.assign(tok, tok + p.B);
  const float* lp = reinterpret_cast<const float*>(h + ga_.logprobs);
  out.logprobs.assign(lp, lp + p.B);
  out.S = p.B;
  out.logits = p.logits;
  out.vocab = d_.vocab;
  out.logit_rows = out.logits.empty() ? 0 : p.B;
  return out;
}

}  // namespace oi
