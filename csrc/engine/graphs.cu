// The CUDA graph buckets, captured at start-up over a fixed-layout metadata arena: one graph per batch size of
// decode steps, or, in an engine with a drafter, of verify rounds (the verify forward and the drafter's pass).
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

std::vector<int> Engine::graph_batches(bool verify) const {
  std::vector<int> out;
  if (verify == (dr_ != nullptr))
    for (const auto& g : graphs_)
      if (g.set == 0) out.push_back(g.batch);
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
  alloc_arena(ga_.bytes);
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
  capture_buckets(sizes, [&](int b, bool) {
    qwen3_forward(d_, w_, act_, graph_meta(b, KernelChoice{}), rope_, kv_cache_, kv_, *gemm_, num_sms_, stream_);
  }, false);
}

void Engine::alloc_arena(size_t bytes) {
  for (int i = 0; i < 2; ++i) {
    OI_CUDA_CHECK(cudaMallocHost(&graph_host_[i], bytes));
    for (cudaEvent_t& e : graph_ev_[i]) OI_CUDA_CHECK(cudaEventCreate(&e));
  }
  graph_dev_ = static_cast<char*>(alloc(bytes, &act_bytes_));
}

// Per bucket: one warm-up run (GEMM plans, autotuned on the dummy rows, and tensor maps are made here, outside
// capture), then the capture (body's second argument). split: body records graph_ev_[0][3] once with
// cudaEventRecordExternal while capturing (the flag is invalid outside capture), and the graph keeps that record
// node, which each replay points at its own image's event (draft_ms).
void Engine::capture_buckets(const std::vector<int>& sizes, const std::function<void(int, bool)>& body, bool split,
                             int set) {
  size_t free0 = 0, free1 = 0, total = 0;
  OI_CUDA_CHECK(cudaMemGetInfo(&free0, &total));
  gemm_->set_autotune(opt_.gemm_autotune);
  for (int b : sizes) {
    body(b, false);
    OI_CUDA_CHECK(cudaStreamSynchronize(stream_));
    Graph gr;
    gr.batch = b;
    gr.set = set;
    if (opt_.cuda_graph) {  // else the same bucketed kernels run eagerly: identical outputs either way
      cudaGraph_t g = nullptr;
      OI_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      body(b, true);
      OI_CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
      if (split) {
        size_t n = 0;
        OI_CUDA_CHECK(cudaGraphGetNodes(g, nullptr, &n));
        std::vector<cudaGraphNode_t> nodes(n);
        OI_CUDA_CHECK(cudaGraphGetNodes(g, nodes.data(), &n));
        for (cudaGraphNode_t node : nodes) {
          cudaGraphNodeType type;
          OI_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
          if (type != cudaGraphNodeTypeEventRecord) continue;
          OI_CHECK(!gr.split, "graph " << b << ": more than one event record node");
          gr.split = node;
        }
        OI_CHECK(gr.split, "graph " << b << ": no event record node");
      }
      OI_CUDA_CHECK(cudaGraphInstantiate(&gr.exec, g, 0));
      if (split) gr.graph = g;
      else OI_CUDA_CHECK(cudaGraphDestroy(g));
    }
    graphs_.push_back(gr);
  }
  gemm_->set_autotune(false);
  OI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  OI_CUDA_CHECK(cudaMemGetInfo(&free1, &total));
  graph_bytes_ += free0 > free1 ? (int64_t)(free0 - free1) : 0;
}

const Engine::Graph* Engine::bucket(int B, int set) const {
  for (const auto& g : graphs_)
    if (g.set == set && g.batch >= B) return &g;
  return nullptr;
}

// The host image the next launch stages its inputs in (the two alternate, so one can be staged while the
// other's step runs).
char* Engine::arena_image() const {
  for (const Pending& p : pending_)
    OI_CHECK(!p.graph || p.slot != graph_slot_, "graph arena image " << graph_slot_ << " is still in flight");
  return graph_host_[graph_slot_];
}

// The bucket's graph (its image's inputs already copied and ev[0] recorded), or, with cuda_graph off or
// force_eager, the same kernels launched eagerly; then ev[1].
void Engine::replay(const Graph& g, bool force_eager, const std::function<void()>& eager) {
  cudaEvent_t* ev = graph_ev_[graph_slot_];
  if (g.exec && !force_eager) {
    if (g.split) OI_CUDA_CHECK(cudaGraphExecEventRecordNodeSetEvent(g.exec, g.split, ev[3]));  // later launches only
    OI_CUDA_CHECK(cudaGraphLaunch(g.exec, stream_));
    ++graph_steps_;
  } else {
    eager();
  }
  OI_CUDA_CHECK(cudaEventRecord(ev[1], stream_));
}

// After the outputs' copies to the image: ev[2], and the step joins the queue.
void Engine::queue_graph_step(Pending p, const int32_t* dev_tokens) {
  OI_CUDA_CHECK(cudaEventRecord(graph_ev_[graph_slot_][2], stream_));
  p.graph = true;
  p.slot = graph_slot_;
  pending_.push_back(std::move(p));
  last_tokens_ = dev_tokens;
  graph_slot_ ^= 1;  // only once queued: after a failed launch the image stays free
}

// Waits for a queued bucket step; its device time into r, and its image's outputs.
const char* Engine::wait_graph_step(const Pending& p, StepResult& r) const {
  const cudaEvent_t* ev = graph_ev_[p.slot];
  OI_CUDA_CHECK(cudaEventSynchronize(ev[2]));
  OI_CUDA_CHECK(cudaEventElapsedTime(&r.gpu_ms, ev[0], ev[1]));
  if (p.verify) OI_CUDA_CHECK(cudaEventElapsedTime(&r.draft_ms, ev[3], ev[1]));
  r.vocab = d_.vocab;
  return graph_host_[p.slot];
}

// Decode-only steps (one token per sequence, no logprobs or logits asked) run padded to the smallest
// bucket that holds the batch, replaying its graph (or, with cuda_graph off or force_eager, the same
// kernels launched eagerly: identical results). Padding rows read the reserved block 0 and write nothing.
// The step is only queued: its inputs go through one of two pinned arena images, so the next launch can
// be staged while this one runs; finish_graph() waits for it.
bool Engine::launch_graph(const StepInput& in) {
  // Logits only eagerly (tests compare a bucket's kernels through them; a graph has no copy for them).
  const int B = in.B();
  if (dr_ || graphs_.empty() || in.T() != B || in.S() != B || in.num_logprobs != 0 || (in.return_logits && !in.force_eager) ||
      in.verify || in.n_tap_layers > 0 || in.kv_load_wait)  // a graph has no per-layer waits
    return false;
  const Graph* g = bucket(B);
  if (!g) return false;
  for (int b = 0; b < B; ++b)
    if (in.query_start_loc[b] != b || in.sample_idx[b] != b) return false;
  const int Bg = g->batch;
  char* h = arena_image();
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
  OI_CUDA_CHECK(cudaMemcpyAsync(graph_dev_, h, ga_.bt + (size_t)Bg * W * 4, cudaMemcpyHostToDevice, stream_));
  OI_CUDA_CHECK(cudaEventRecord(graph_ev_[graph_slot_][0], stream_));
  if (in.prev_rows)  // the previous step's tokens are still in its output field (stream order)
    feed_tokens(reinterpret_cast<int32_t*>(graph_dev_ + ga_.ids), reinterpret_cast<const int32_t*>(graph_dev_ + ga_.prev),
                last_tokens_, Bg, stream_);
  replay(*g, in.force_eager, [&] {
    StepMeta m = graph_meta(Bg, eager_kernels_);
    m.trace = m.persistent && trace_on_ ? trace_ : nullptr;
    qwen3_forward(d_, w_, act_, m, rope_, kv_cache_, kv_, *gemm_, num_sms_, stream_);
  });
  OI_CUDA_CHECK(cudaMemcpyAsync(h + ga_.tokens, graph_dev_ + ga_.tokens, ga_.bytes - ga_.tokens, cudaMemcpyDeviceToHost,
                                stream_));
  Pending p;
  p.B = p.S = B;
  if (in.return_logits) {
    p.logits.resize((size_t)B * d_.vocab);
    OI_CUDA_CHECK(cudaMemcpyAsync(p.logits.data(), act_.logits, p.logits.size() * 4, cudaMemcpyDeviceToHost, stream_));
  }
  queue_graph_step(std::move(p), reinterpret_cast<const int32_t*>(graph_dev_ + ga_.tokens));
  return true;
}

StepResult Engine::finish_graph(const Pending& p) {
  StepResult out;
  const char* h = wait_graph_step(p, out);
  const int32_t* tok = reinterpret_cast<const int32_t*>(h + ga_.tokens);
  out.tokens.assign(tok, tok + p.B);
  const float* lp = reinterpret_cast<const float*>(h + ga_.logprobs);
  out.logprobs.assign(lp, lp + p.B);
  out.S = p.B;
  out.logits = p.logits;
  out.logit_rows = out.logits.empty() ? 0 : p.B;
  return out;
}


// ---- verify rounds (an engine with a drafter) ----
//
// A round of the scheduler's steady state is one step of B sequences x span tokens [anchor, d1..dk]
// (span = num_drafts + 1), every row sampled, every sequence drafting its next round: the verify forward
// (writing the drafter's context features), count_accepted, then the drafter's context and block passes.
// Padded to a bucket, everything the eager step decides on the host is fixed per bucket: the attention
// items (each sequence's span in the same items: short items, plan.h, as the eager step cuts them up to
// kAttnShortItemsMaxCtx keys, and where a round may hold more keys a second set of graphs with whole spans,
// picked per round by its longest context; --deterministic: whole spans, one set), the split counts (sized for
// the longest context, as the decode graphs do: a short context uses the splits it fills and the rest exit at
// once), the sampled rows (all: sample_idx = 0..T-1), each sequence's first row (b x span) and the drafter's
// one block pass (buckets up to DrafterState::chunk). The anchors, positions and accepted counts the drafter needs are read on the
// device (draft_inputs). Padding sequences sit at positions 0..span-1 of the reserved block 0 with slot -1:
// they write no K/V in either pool (their draft block's slots are -1 too: draft_inputs maps block 0 to -1)
// and read zeros; their tokens and drafts are dropped.

StepMeta Engine::verify_meta(int batch, const KernelChoice& k, int set) const {
  StepMeta m{};
  m.B = batch;
  m.T = m.S = batch * verify_span_;
  m.bt_stride = verify_bt_stride_;
  m.num_work = batch * verify_items_[set];
  m.max_rows = verify_max_rows_[set];
  m.num_splits = attn_num_splits(m.num_work, d_.kv_heads, opt_.max_model_len, m.T, num_sms_, max_split_rows_,
                                 m.max_rows, k.attention);
  m.gemm_path = GemmPath::kLibrary;
  if (opt_.deterministic) {  // the eager verify's kernels: each row's bits are the plain decode's
    m.num_splits = attn_segment_splits(m.num_work, d_.kv_heads, opt_.max_model_len, m.T, num_sms_, max_split_rows_);
    m.attn_segment = kAttnSegment;
    m.gemm_path = GemmPath::kInvariant;
  }
  m.attention = k.attention;
  m.gemv = k.gemv;
  char* d = graph_dev_;
  m.ids = (const int32_t*)(d + va_.ids);
  m.positions = (const int32_t*)(d + va_.pos);
  m.slots = (const int32_t*)(d + va_.slots);
  m.context_lens = (const int32_t*)(d + va_.ctx);
  m.block_tables = (const int32_t*)(d + va_.bt);
  m.sample_idx = dr_->iota;      // every row samples
  m.sample_pos = m.positions;    // so a row's position is its token's
  m.top_k = (const int32_t*)(d + va_.topk);
  m.temperature = (const float*)(d + va_.temp);
  m.top_p = (const float*)(d + va_.topp);
  m.seeds = (const uint64_t*)(d + va_.seeds);
  m.work = (const AttnWork*)(d + va_.work[set]);
  m.seq_rows = (const int32_t*)(d + va_.seq_rows);
  m.out_tokens = (int32_t*)(d + va_.tokens);
  m.out_logprobs = (float*)(d + va_.logprobs);
  m.out_accepted = (int32_t*)(d + va_.accepted);
  m.ctx_slot = dr_->ctx_slot.data();
  m.num_ctx_taps = (int)dr_->dims.taps.size();
  m.ctx_rows = dr_->iota;
  m.ctx_feats = dr_->feats;
  return m;
}

// Every sequence of the bucket drafts, from its first sampled row (the drafter adds the accepted count).
Engine::DraftStage Engine::verify_draft_stage(int batch) const {
  DraftStage ds;
  ds.num_seqs = batch;
  ds.seqs = dr_->iota;
  ds.rows = (const int32_t*)(graph_dev_ + va_.seq_rows);
  ds.work = (const AttnWork*)(graph_dev_ + va_.draft_work);
  ds.work_start = {0, batch * verify_draft_items_};
  ds.max_ctx = {opt_.max_model_len + dr_->dims.block_size};  // one split count for every context, as above
  return ds;
}

void Engine::pad_verify_rows(char* h, int b0, int b1) const {
  const int span = verify_span_, W = verify_bt_stride_;
  // the columns a padding sequence reads: its keys (< span) and its draft block's (< span + block)
  const int cols = std::min(W, (span + dr_->dims.block_size + opt_.kv_block_size - 1) / opt_.kv_block_size);
  auto i32 = [&](size_t o) { return reinterpret_cast<int32_t*>(h + o); };
  for (int t = b0 * span; t < b1 * span; ++t) {
    i32(va_.ids)[t] = 0; i32(va_.pos)[t] = t % span; i32(va_.slots)[t] = -1; i32(va_.topk)[t] = 0;
    reinterpret_cast<float*>(h + va_.temp)[t] = 0.f;
    reinterpret_cast<float*>(h + va_.topp)[t] = 1.f;
    reinterpret_cast<uint64_t*>(h + va_.seeds)[t] = 0;
  }
  for (int b = b0; b < b1; ++b) {
    i32(va_.ctx)[b] = span;
    std::memset(h + va_.bt + (size_t)b * W * 4, 0, (size_t)cols * 4);
  }
}

void Engine::capture_verify_graphs() {
  const DrafterDims& dd = dr_->dims;
  const int span = dd.num_drafts + 1, bsz = dd.block_size, group = d_.heads / d_.kv_heads;
  // The decode buckets whose verify fits a step and whose drafting is one block pass.
  std::vector<int> sizes;
  for (int b : graph_batch_sizes(opt_.max_num_seqs))
    if (b <= dr_->chunk && b * span <= opt_.max_num_batched_tokens && b * span <= opt_.max_sampled_rows)
      sizes.push_back(b);
  if (sizes.empty() || span + bsz > opt_.max_model_len) return;  // every round eager
  const int Bmax = sizes.back(), T = Bmax * span;
  verify_span_ = span;
  verify_bt_stride_ = (opt_.max_model_len + bsz + opt_.kv_block_size - 1) / opt_.kv_block_size;
  // Attention items of the largest bucket; a smaller bucket's are its first ones (sequence order). Short items
  // whatever the context (unknown here), and whole spans for rounds past kAttnShortItemsMaxCtx where they differ.
  std::vector<int32_t> qsl(Bmax + 1), seq_rows(Bmax + 1);
  for (int b = 0; b <= Bmax; ++b) qsl[b] = seq_rows[b] = b * span;
  std::vector<AttnWork> work[2];
  for (int set = 0; set < 2; ++set) {
    work[set] = attention_work(qsl.data(), Bmax, group, &verify_max_rows_[set], set == 0 && !opt_.deterministic);
    verify_items_[set] = (int)work[set].size() / Bmax;
  }
  verify_sets_ = work[0].size() != work[1].size() && opt_.max_model_len > kAttnShortItemsMaxCtx ? 2 : 1;
  const int qt = attn_tokens_per_item(group);
  std::vector<AttnWork> dwork;  // the block pass's items, as stage_draft makes them (sequence d drafts in rows d x block..)
  for (int d = 0; d < Bmax; ++d)
    for (int t0 = 0; t0 < bsz; t0 += qt) dwork.push_back(AttnWork{d, d * bsz + t0, std::min(qt, bsz - t0), 0});
  verify_draft_items_ = (int)dwork.size() / Bmax;

  // Per-step inputs first (bt last: a step copies one prefix), then the outputs, then constants.
  const int W = verify_bt_stride_;
  size_t off = 0;
  auto field = [&](size_t bytes) { const size_t o = off; off = align_up(off + bytes); return o; };
  VerifyArena& a = va_;
  a.ids = field(T * 4); a.pos = field(T * 4); a.slots = field(T * 4); a.topk = field(T * 4); a.temp = field(T * 4);
  a.topp = field(T * 4); a.seeds = field(T * 8); a.ctx = field(Bmax * 4); a.bt = field((size_t)Bmax * W * 4);
  // after the copied prefix: the next launch's copy must not clobber the tokens its feed may read
  a.tokens = field(T * 4); a.logprobs = field(T * 4); a.accepted = field(Bmax * 4);
  a.drafts = field((size_t)Bmax * dd.num_drafts * 4);
  a.seq_rows = field((Bmax + 1) * 4);
  for (int set = 0; set < 2; ++set) a.work[set] = field(work[set].size() * sizeof(AttnWork));
  a.draft_work = field(dwork.size() * sizeof(AttnWork));
  a.bytes = off;
  alloc_arena(a.bytes);
  char* h0 = graph_host_[0];
  std::memset(h0, 0, a.bytes);
  pad_verify_rows(h0, 0, Bmax);  // capture over padding only: nothing real is touched
  std::memcpy(h0 + a.seq_rows, seq_rows.data(), seq_rows.size() * 4);
  for (int set = 0; set < 2; ++set) std::memcpy(h0 + a.work[set], work[set].data(), work[set].size() * sizeof(AttnWork));
  std::memcpy(h0 + a.draft_work, dwork.data(), dwork.size() * sizeof(AttnWork));
  OI_CUDA_CHECK(cudaMemcpy(graph_dev_, h0, a.bytes, cudaMemcpyHostToDevice));  // the constants stay on the device

  int32_t* drafts = reinterpret_cast<int32_t*>(graph_dev_ + a.drafts);
  for (int set = 0; set < verify_sets_; ++set)
    capture_buckets(sizes, [&](int b, bool capturing) {
      const StepMeta m = verify_meta(b, KernelChoice{}, set);
      qwen3_forward(d_, w_, act_, m, rope_, kv_cache_, kv_, *gemm_, num_sms_, stream_);
      // an event record node (a plain record in a capture is only an ordering): the drafter's device time
      if (capturing) OI_CUDA_CHECK(cudaEventRecordWithFlags(graph_ev_[0][3], stream_, cudaEventRecordExternal));
      run_drafter(m, verify_draft_stage(b), drafts, KernelChoice{}.attention);
    }, true, set);
}

// A verify round of the drafter's span for every sequence, each drafting (the scheduler's steady state),
// without logprobs, logits, taps or fed rows: padded to the smallest bucket that holds it and replayed
// (or, with cuda_graph off or force_eager, the same kernels launched eagerly). Queued through the arena
// images as decode steps are; finish_verify_graph() waits for it.
bool Engine::launch_verify_graph(const StepInput& in) {
  const int B = in.B(), span = verify_span_, T = B * span;
  if (!dr_ || graphs_.empty() || !in.verify || in.n_draft != B || in.T() != T || in.S() != T || in.num_logprobs != 0 ||
      in.return_logits || in.n_tap_layers > 0 || in.kv_load_wait || in.prev_rows)
    return false;
  // Rounds past kAttnShortItemsMaxCtx keys take the whole-span set: each short item reads its sequence's whole KV.
  int set = 0;
  for (int b = 0; b < B && verify_sets_ > 1; ++b)
    if (in.context_lens[b] > kAttnShortItemsMaxCtx) set = 1;
  const Graph* g = bucket(B, set);
  if (!g) return false;
  for (int b = 0; b < B; ++b)
    if (in.draft[b] != 1 || in.query_start_loc[b] != b * span) return false;
  for (int r = 0; r < T; ++r)
    if (in.sample_idx[r] != r) return false;
  const int Bg = g->batch, W = verify_bt_stride_;
  char* h = arena_image();
  std::memcpy(h + va_.ids, in.input_ids, T * 4);
  std::memcpy(h + va_.pos, in.positions, T * 4);
  std::memcpy(h + va_.slots, in.slot_mapping, T * 4);
  std::memcpy(h + va_.topk, in.top_k, T * 4);
  std::memcpy(h + va_.temp, in.temperature, T * 4);
  std::memcpy(h + va_.topp, in.top_p, T * 4);
  std::memcpy(h + va_.seeds, in.seeds, T * 8);
  std::memcpy(h + va_.ctx, in.context_lens, B * 4);
  const int nb_cols = std::min(in.bt_stride, W);  // a drafting sequence's table covers its draft block (plan.cu)
  for (int b = 0; b < B; ++b)
    std::memcpy(h + va_.bt + (size_t)b * W * 4, in.block_tables + (size_t)b * in.bt_stride, nb_cols * 4);
  pad_verify_rows(h, B, Bg);
  int32_t* drafts = reinterpret_cast<int32_t*>(graph_dev_ + va_.drafts);
  OI_CUDA_CHECK(cudaMemcpyAsync(graph_dev_, h, va_.bt + (size_t)Bg * W * 4, cudaMemcpyHostToDevice, stream_));
  OI_CUDA_CHECK(cudaEventRecord(graph_ev_[graph_slot_][0], stream_));
  replay(*g, in.force_eager, [&] {
    const StepMeta m = verify_meta(Bg, eager_kernels_, set);
    qwen3_forward(d_, w_, act_, m, rope_, kv_cache_, kv_, *gemm_, num_sms_, stream_);
    OI_CUDA_CHECK(cudaEventRecord(graph_ev_[graph_slot_][3], stream_));
    run_drafter(m, verify_draft_stage(Bg), drafts, eager_kernels_.attention);
  });
  OI_CUDA_CHECK(cudaMemcpyAsync(h + va_.tokens, graph_dev_ + va_.tokens, va_.seq_rows - va_.tokens,
                                cudaMemcpyDeviceToHost, stream_));
  Pending p;
  p.verify = p.drafter = true;
  p.B = B;
  p.S = T;
  p.bucket = Bg;
  queue_graph_step(std::move(p), reinterpret_cast<const int32_t*>(graph_dev_ + va_.tokens));
  return true;
}

StepResult Engine::finish_verify_graph(const Pending& p) {
  StepResult r;
  const char* h = wait_graph_step(p, r);
  const int32_t* tok = reinterpret_cast<const int32_t*>(h + va_.tokens);
  const float* lp = reinterpret_cast<const float*>(h + va_.logprobs);
  const int32_t* acc = reinterpret_cast<const int32_t*>(h + va_.accepted);
  const int32_t* dr = reinterpret_cast<const int32_t*>(h + va_.drafts);
  r.tokens.assign(tok, tok + p.S);
  r.logprobs.assign(lp, lp + p.S);
  r.accepted.assign(acc, acc + p.B);
  const int nd = dr_->dims.num_drafts;
  r.drafts.resize((size_t)p.B * nd);
  for (int b = 0; b < p.B; ++b)  // the block pass's draft rows are slot-major over the bucket: j x bucket + b
    for (int j = 0; j < nd; ++j) r.drafts[(size_t)b * nd + j] = dr[(size_t)j * p.bucket + b];
  r.S = p.S;
  r.accepted_rows = r.draft_rows = p.B;
  r.num_drafts = nd;
  return r;
}

}  // namespace oi
