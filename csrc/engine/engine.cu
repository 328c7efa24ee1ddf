// Lifecycle, launch / collect, eager steps and the KV block copies of the host tier.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../kernels/elementwise.cuh"
#include "../kernels/launch.cuh"
#include "engine.h"

namespace oi {

Engine::Engine(const ModelDims& dims, const EngineOptions& opt) : d_(dims), opt_(opt) {
  try {
    init();
  } catch (...) {  // a throwing constructor runs no destructor: free what was allocated (a 32B OOM held 60 GiB)
    release();
    throw;
  }
}

void Engine::init() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    throw std::runtime_error(std::string("no CUDA GPU was found (") +
                             (e == cudaSuccess ? "no device" : cudaGetErrorString(e)) + ")");
  }
  OI_CHECK(d_.head_dim == 128, "head_dim " << d_.head_dim << " is not supported (Qwen3 uses 128)");
  OI_CHECK(d_.heads % d_.kv_heads == 0, "num_attention_heads must be a multiple of num_key_value_heads");
  OI_CHECK(d_.hidden % 8 == 0 && d_.intermediate % 8 == 0, "hidden and intermediate sizes must be multiples of 8");
  OI_CHECK(opt_.kv_block_size == 16, "kv block size must be 16");
  cudaDeviceProp prop{};
  OI_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  num_sms_ = prop.multiProcessorCount;
  device_name_ = prop.name;
  pdl_capable_ = prop.major >= 9;
  pdl_ = opt_.pdl && pdl_capable_;
  pdl_enabled() = pdl_;  // per host thread, read at every launch: set again before this engine launches
  eager_kernels_.persistent = opt_.persistent_decode;
  OI_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  gemm_ = std::make_unique<Gemm>(opt_.cublaslt_path);
  kv_ = KvLayout{d_.layers, d_.kv_heads, opt_.kv_block_size, d_.head_dim};
  allocate_weights();
  // positions past max_model_len - 1: a draft block's (kMaxDraftBlock at most)
  const int rope_rows = opt_.max_model_len + kMaxDraftBlock;
  rope_ = static_cast<float2*>(alloc((size_t)rope_rows * (d_.head_dim / 2) * sizeof(float2), &act_bytes_));
  rope_table_init(rope_, rope_rows, d_.head_dim, d_.rope_theta, stream_);
}

Engine::~Engine() { release(); }

void Engine::release() noexcept {
  if (stream_) cudaStreamSynchronize(stream_);
  for (cudaStream_t s : {save_stream_, load_stream_})
    if (s) cudaStreamSynchronize(s);
  for (int i = 0; i < 2; ++i) {
    if (stage_[i]) cudaFreeHost(stage_[i]);
    if (stage_ev_[i]) cudaEventDestroy(stage_ev_[i]);
  }
  for (auto& g : graphs_) {
    if (g.exec) cudaGraphExecDestroy(g.exec);
    if (g.graph) cudaGraphDestroy(g.graph);
  }
  for (int i = 0; i < 2; ++i) {
    if (graph_host_[i]) cudaFreeHost(graph_host_[i]);
    for (cudaEvent_t e : graph_ev_[i])
      if (e) cudaEventDestroy(e);
  }
  for (auto* q : {&saves_, &loads_})
    for (const CopyBatch& c : *q) {
      free_events_.insert(free_events_.end(), {c.start, c.end});
      free_events_.insert(free_events_.end(), c.groups.begin(), c.groups.end());
    }
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  gemm_.reset();
  for (void* p : allocations_) cudaFree(p);
  if (kv_cache_) cudaFree(kv_cache_);
  if (taps_) cudaFree(taps_);
  if (dr_ && dr_->kv_cache) cudaFree(dr_->kv_cache);
  if (trace_) cudaFree(trace_);
  if (host_kv_) cudaFreeHost(host_kv_);
  for (int i = 0; i < 2; ++i) {
    if (host_meta_[i]) cudaFreeHost(host_meta_[i]);
    for (cudaEvent_t e : meta_ev_[i])
      if (e) cudaEventDestroy(e);
  }
  for (cudaStream_t s : {save_stream_, load_stream_, stream_})
    if (s) cudaStreamDestroy(s);
}

StepLimits Engine::limits() const {
  return StepLimits{opt_.max_num_batched_tokens, opt_.max_num_seqs, max_rows(), opt_.max_model_len, opt_.kv_block_size,
                    num_sms_, max_split_rows_, dr_ ? dr_->dims.block_size : 0, opt_.deterministic, num_blocks_, num_host_blocks_};
}

StepResult Engine::step(const StepInput& in) {
  OI_CHECK(pending_.empty(), "step() with " << pending_.size() << " launched steps not collected");
  launch(in);
  return collect();
}

void Engine::launch(const StepInput& in) {
  OI_CHECK(finalized_, "launch() before finalize()");
  pdl_enabled() = pdl_;
  OI_CHECK(pending_.size() < 2, "launch() with two steps already pending: collect() first");
  if (in.T() == 0 && in.B() == 0) {  // copies only (a restore while nothing else runs)
    plan_copies(in, limits());
    copy_blocks(in);
    issue_copies(in);
    Pending p;
    p.copies_only = true;
    pending_.push_back(std::move(p));
    last_launch_S_ = 0;
    ++launches_;
    return;
  }
  const StepPlan plan = plan_step(in, d_, limits(), eager_kernels_.attention);
  if (in.prev_rows) {
    OI_INPUT_CHECK(last_launch_S_ >= 0, "prev_rows needs a step launched before");
    for (int b = 0; b < in.B(); ++b) {
      OI_INPUT_CHECK(in.prev_rows[b] >= -1 && in.prev_rows[b] < last_launch_S_, "prev_rows[" << b << "] = " << in.prev_rows[b]);
      OI_INPUT_CHECK(in.prev_rows[b] < 0 || (in.query_start_loc[b] == b && in.query_start_loc[b + 1] == b + 1),
                     "fed row " << b << " must be one token at index " << b);
    }
  }
  // Before the forward: they wait for the steps launched before this one only. kv_load_wait: enqueue()
  // issues them after the step's inputs, and hands the forward their per-layer events.
  copy_blocks(in);
  if (!in.kv_load_wait) issue_copies(in);  // kv_load_wait steps are never graphs (launch_graph)
  if (!launch_graph(in) && !launch_verify_graph(in)) pending_.push_back(enqueue(in, plan, kv_cache_));
  layer_ready_.clear();
  last_launch_S_ = in.S();
  ++launches_;
}

StepResult Engine::collect() {
  OI_CHECK(!pending_.empty(), "collect() with no step launched");
  Pending p = std::move(pending_.front());
  pending_.pop_front();
  if (p.copies_only) return StepResult{};
  if (!p.graph) return finish_eager(p);
  return p.verify ? finish_verify_graph(p) : finish_graph(p);
}

bf16* Engine::tap_buffer(size_t elems) {
  if (elems > taps_elems_) {
    OI_CUDA_CHECK(cudaStreamSynchronize(stream_));  // a pending step may still write the old buffer
    if (taps_) OI_CUDA_CHECK(cudaFree(taps_));
    OI_CUDA_CHECK(cudaMalloc(&taps_, elems * sizeof(bf16)));
    taps_elems_ = elems;
  }
  return taps_;
}

// A step outside the decode buckets (prefill chunks, mixed batches, logprobs, verify, taps), queued
// eagerly. Its inputs go through one of two pinned staging slots, so the next step can be staged while it
// runs; finish_eager() waits for it.
void* Engine::Stager::put(const void* src, size_t bytes) {
  void* d = dev + off;
  if (bytes) std::memcpy(host + off, src, bytes);
  off = align_up(off + bytes);
  return d;
}

Engine::Pending Engine::enqueue(const StepInput& in, const StepPlan& plan, bf16* kv_cache, bool drafter) {
  const int T = in.T(), B = in.B(), S = in.S();
  const int slot = meta_slot_;
  for (const Pending& p : pending_)
    OI_CHECK(p.graph || p.slot != slot, "staging slot " << slot << " is still in flight");
  char* host = host_meta_[slot];
  char* dev = dev_meta_[slot];

  // Pack every input into the pinned staging area and send it with one copy.
  Stager st{host, dev};
  auto put = [&](const void* src, size_t bytes) { return st.put(src, bytes); };
  StepMeta m{};
  m.T = T; m.B = B; m.S = S; m.bt_stride = in.bt_stride;
  m.num_work = (int)plan.work.size(); m.max_rows = plan.max_rows; m.num_splits = plan.num_splits;
  m.num_logprobs = in.num_logprobs;
  m.attention = eager_kernels_.attention;
  m.gemv = eager_kernels_.gemv;
  m.gemm_path = opt_.deterministic ? GemmPath::kInvariant : GemmPath::kLibrary;
  m.attn_segment = plan.segment;
  m.ids = (const int32_t*)put(in.input_ids, T * 4);
  m.positions = (const int32_t*)put(in.positions, T * 4);
  m.slots = (const int32_t*)put(in.slot_mapping, T * 4);
  m.context_lens = (const int32_t*)put(in.context_lens, B * 4);
  m.block_tables = (const int32_t*)put(in.block_tables, (size_t)B * in.bt_stride * 4);
  m.sample_idx = (const int32_t*)put(in.sample_idx, S * 4);
  m.sample_pos = (const int32_t*)put(plan.sample_pos.data(), S * 4);
  m.temperature = (const float*)put(in.temperature, S * 4);
  m.top_p = (const float*)put(in.top_p, S * 4);
  m.top_k = (const int32_t*)put(in.top_k, S * 4);
  m.seeds = (const uint64_t*)put(in.seeds, S * 8);
  m.work = (const AttnWork*)put(plan.work.data(), plan.work.size() * sizeof(AttnWork));
  const int32_t* prev = in.prev_rows ? (const int32_t*)put(in.prev_rows, B * 4) : nullptr;
  if (in.verify) m.seq_rows = (const int32_t*)put(plan.seq_rows.data(), (B + 1) * 4);
  const int R = (int)in.n_tap_rows, L = (int)in.n_tap_layers;
  if (L > 0) {
    m.tap_slot = plan.tap_slot.data();  // host side: read while the forward is queued, below
    m.num_taps = L;
    m.num_tap_rows = R;
    m.tap_rows = (const int32_t*)put(in.tap_rows, R * 4);
    m.out_taps = tap_buffer(std::max<size_t>((size_t)R * L * d_.hidden, 1));
  }
  drafter = drafter && dr_;
  DraftStage ds;
  if (drafter) {
    m.ctx_slot = dr_->ctx_slot.data();
    m.num_ctx_taps = (int)dr_->dims.taps.size();
    m.ctx_rows = dr_->iota;
    m.ctx_feats = dr_->feats;
    ds = stage_draft(in, plan, st);
  }
  size_t off = st.off;
  OI_CHECK(off <= meta_in_bytes_, "step metadata overflows its staging area");
  const size_t in_bytes = off;
  off = meta_in_bytes_;  // outputs follow the inputs
  const size_t out_start = off;
  m.out_tokens = (int32_t*)(dev + off); off = align_up(off + S * 4);
  m.out_logprobs = (float*)(dev + off); off = align_up(off + S * 4);
  m.out_top_ids = (int32_t*)(dev + off); off = align_up(off + (size_t)S * in.num_logprobs * 4);
  m.out_top_logprobs = (float*)(dev + off); off = align_up(off + (size_t)S * in.num_logprobs * 4);
  if (in.verify) { m.out_accepted = (int32_t*)(dev + off); off = align_up(off + B * 4); }
  const size_t drafts_off = off;
  if (ds.num_seqs) off = align_up(off + (size_t)ds.num_seqs * dr_->dims.num_drafts * 4);
  OI_CHECK(off <= meta_bytes_, "step outputs overflow their staging area");

  cudaEvent_t* ev = meta_ev_[slot];
  OI_CUDA_CHECK(cudaMemcpyAsync(dev, host, in_bytes, cudaMemcpyHostToDevice, stream_));
  if (in.kv_load_wait && kv_cache == kv_cache_) {
    // After the step's inputs: host-to-device copies of two streams may share a copy engine, and the
    // forward must not wait behind the whole restore for its metadata.
    issue_copies(in);
    if (!layer_ready_.empty()) {
      m.layer_ready = layer_ready_.data();  // read while the forward is queued
      copy_stats_.layer_waits += (int64_t)layer_ready_.size();
    }
  }
  OI_CUDA_CHECK(cudaEventRecord(ev[0], stream_));
  if (prev)  // fed rows are rows 0..B-1 at their own token index (checked in launch())
    feed_tokens(const_cast<int32_t*>(m.ids), prev, last_tokens_, B, stream_);
  qwen3_forward(d_, w_, act_, m, rope_, kv_cache, kv_, *gemm_, num_sms_, stream_);
  Pending p;
  p.slot = slot;
  p.B = B;
  p.S = S;
  p.num_logprobs = in.num_logprobs;
  p.verify = in.verify;
  p.drafter = drafter;
  if (in.return_logits && S > 0) {  // before the drafter, which reuses the logits buffer
    p.logits.resize((size_t)S * d_.vocab);
    OI_CUDA_CHECK(cudaMemcpyAsync(p.logits.data(), act_.logits, p.logits.size() * 4, cudaMemcpyDeviceToHost, stream_));
  }
  OI_CUDA_CHECK(cudaEventRecord(ev[3], stream_));
  if (drafter) {
    run_drafter(m, ds, (int32_t*)(dev + drafts_off), eager_kernels_.attention);
    p.draft_seqs = plan.draft_seqs;
  }
  OI_CUDA_CHECK(cudaEventRecord(ev[1], stream_));
  OI_CUDA_CHECK(cudaMemcpyAsync(host + out_start, dev + out_start, off - out_start, cudaMemcpyDeviceToHost, stream_));
  if (L > 0 && R > 0) {  // pageable: this launch waits for the copy
    p.taps = L;
    p.tap_rows = R;
    p.hidden.resize((size_t)R * L * d_.hidden);
    OI_CUDA_CHECK(cudaMemcpyAsync(p.hidden.data(), m.out_taps, p.hidden.size() * 2, cudaMemcpyDeviceToHost, stream_));
  }
  OI_CUDA_CHECK(cudaEventRecord(ev[2], stream_));
  last_tokens_ = m.out_tokens;
  meta_slot_ ^= 1;  // only once queued: after a failed launch the slot stays free
  return p;
}

StepResult Engine::finish_eager(Pending& p) {
  cudaEvent_t* ev = meta_ev_[p.slot];
  OI_CUDA_CHECK(cudaEventSynchronize(ev[2]));
  StepResult r;
  OI_CUDA_CHECK(cudaEventElapsedTime(&r.gpu_ms, ev[0], ev[1]));
  const char* h = host_meta_[p.slot] + meta_in_bytes_;
  auto take = [&](auto& vec, size_t n, size_t& o) {
    using Tv = typename std::decay_t<decltype(vec)>::value_type;
    vec.assign(reinterpret_cast<const Tv*>(h + o), reinterpret_cast<const Tv*>(h + o) + n);
    o = align_up(o + n * sizeof(Tv));
  };
  size_t o = 0;
  const int S = p.S;
  take(r.tokens, S, o);
  take(r.logprobs, S, o);
  take(r.top_ids, (size_t)S * p.num_logprobs, o);
  take(r.top_logprobs, (size_t)S * p.num_logprobs, o);
  if (p.verify) take(r.accepted, p.B, o);
  if (p.drafter) {
    OI_CUDA_CHECK(cudaEventElapsedTime(&r.draft_ms, ev[3], ev[1]));
    if (!p.draft_seqs.empty()) take_drafts(p, reinterpret_cast<const int32_t*>(h + o), r);
  }
  r.S = S;
  r.num_logprobs = p.num_logprobs;
  r.accepted_rows = p.verify ? p.B : 0;
  r.logits = std::move(p.logits);
  r.vocab = d_.vocab;
  r.logit_rows = r.logits.empty() ? 0 : S;
  r.hidden = std::move(p.hidden);
  r.tap_rows = p.tap_rows;
  r.tap_width = p.taps * d_.hidden;
  return r;
}

// ---- the host tier's block copies ----

cudaEvent_t Engine::event() {
  if (free_events_.empty()) {
    cudaEvent_t e;
    OI_CUDA_CHECK(cudaEventCreate(&e));
    return e;
  }
  cudaEvent_t e = free_events_.back();
  free_events_.pop_back();
  return e;
}

// kv_copy: whole blocks (every layer's K and V, and the drafter's) on the step's own stream, in order, so that
// they land after every step launched before this one and before its forward (or graph) reads them; called
// before issue_copies(), whose copies wait for an event recorded after these (a load may refill a source).
void Engine::copy_blocks(const StepInput& in) {
  for (int64_t i = 0; i < in.n_kv_copy; ++i) {
    const int64_t src = in.kv_copy[2 * i], dst = in.kv_copy[2 * i + 1];
    const int64_t bb = kv_block_bytes();
    OI_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<char*>(kv_cache_) + dst * bb, reinterpret_cast<char*>(kv_cache_) + src * bb,
                                  (size_t)bb, cudaMemcpyDeviceToDevice, stream_));
    if (dr_) {
      const int64_t db = dr_->block_bytes();
      OI_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<char*>(dr_->kv_cache) + dst * db,
                                    reinterpret_cast<char*>(dr_->kv_cache) + src * db, (size_t)db,
                                    cudaMemcpyDeviceToDevice, stream_));
    }
  }
}

// A kv_load_wait restore copies group-major in G groups of layers, one pitched DMA per run of blocks and
// group: G = layers when the blocks come in few runs, fewer for scattered blocks, so that a call moves at
// least kMinLoadCallBytes and issuing them (a few us each) stays well ahead of the link.
constexpr int64_t kMaxLoadCalls = 4096, kMinLoadCallBytes = 512 << 10;

// One DMA per run of blocks adjacent on both sides (a 16k-token restore: ~1k copies of one 2.25 MiB block,
// fewer where the pool hands out neighbours), on the tier's own stream, after the steps launched before.
// kv_load_wait: the loads go layer group by layer group (every block's layers [l0, l1), then the next
// group), each group ending in an event that layer_ready_ hands to this launch's forward, so that layer l
// computes while the later layers are still on the link.
void Engine::issue_copies(const StepInput& in) {
  layer_ready_.clear();
  if (in.n_kv_save == 0 && in.n_kv_load == 0) return;
  cudaEvent_t after = event();  // everything launched before this step (its forward comes later)
  OI_CUDA_CHECK(cudaEventRecord(after, stream_));
  const int64_t bb = kv_block_bytes();
  char* dev = reinterpret_cast<char*>(kv_cache_);
  auto run = [&](const int32_t* pairs, int64_t n, bool save, std::deque<CopyBatch>& q) {
    if (n == 0) return;
    cudaStream_t s = save ? save_stream_ : load_stream_;
    CopyBatch c;
    c.launch = launches_ + 1;
    c.start = event();
    c.end = event();
    OI_CUDA_CHECK(cudaStreamWaitEvent(s, after, 0));
    OI_CUDA_CHECK(cudaEventRecord(c.start, s));
    std::vector<std::pair<int64_t, int64_t>> runs;  // (first pair, blocks)
    for (int64_t i = 0; i < n;) {
      const int32_t a = pairs[2 * i], b = pairs[2 * i + 1];  // (source, destination)
      int64_t j = i + 1;
      while (j < n && pairs[2 * j] == a + (j - i) && pairs[2 * j + 1] == b + (j - i)) ++j;
      runs.emplace_back(i, j - i);
      i = j;
    }
    const int L = d_.layers;
    const int64_t nr = (int64_t)runs.size();
    const int G = save || !in.kv_load_wait
                      ? 1 : (int)std::clamp<int64_t>(std::min(kMaxLoadCalls / nr, n * bb / (nr * kMinLoadCallBytes)), 1, L);
    const int64_t lb = bb / L;  // one layer of a block
    if (G > 1) layer_ready_.assign(L, nullptr);
    for (int g = 0; g < G; ++g) {
      const int l0 = g * L / G, l1 = (g + 1) * L / G;
      const int64_t off = l0 * lb, width = (l1 - l0) * lb;  // the whole block when G == 1
      for (const auto& [i, len] : runs) {
        const int64_t a = pairs[2 * i], b = pairs[2 * i + 1];
        if (save)
          OI_CUDA_CHECK(cudaMemcpyAsync(host_kv_ + b * bb, dev + a * bb, (size_t)len * bb, cudaMemcpyDeviceToHost, s));
        else if (G == 1)
          OI_CUDA_CHECK(cudaMemcpyAsync(dev + b * bb, host_kv_ + a * bb, (size_t)len * bb, cudaMemcpyHostToDevice, s));
        else  // rows: the run's blocks, pitch one block; the row is layers [l0, l1) of that block
          OI_CUDA_CHECK(cudaMemcpy2DAsync(dev + b * bb + off, bb, host_kv_ + a * bb + off, bb, width, len,
                                          cudaMemcpyHostToDevice, s));
      }
      if (G > 1) {
        cudaEvent_t e = g + 1 < G ? event() : c.end;
        if (g + 1 < G) {
          OI_CUDA_CHECK(cudaEventRecord(e, s));
          c.groups.push_back(e);
        }
        for (int l = l0; l < l1; ++l) layer_ready_[l] = e;
      }
    }
    OI_CUDA_CHECK(cudaEventRecord(c.end, s));
    if (!save && in.kv_load_wait && G == 1) layer_ready_.assign(L, c.end);  // one group: every layer waits for all
    c.bytes = n * bb;
    q.push_back(c);
  };
  run(in.kv_save, in.n_kv_save, true, saves_);
  run(in.kv_load, in.n_kv_load, false, loads_);
  free_events_.push_back(after);  // reusable once recorded again: waits already issued keep their capture
}

void Engine::retire(std::deque<CopyBatch>& q, bool restore, bool block) {
  while (!q.empty()) {
    CopyBatch& c = q.front();
    if (block) {
      OI_CUDA_CHECK(cudaEventSynchronize(c.end));
    } else {
      const cudaError_t e = cudaEventQuery(c.end);
      if (e == cudaErrorNotReady) return;
      OI_CUDA_CHECK(e);
    }
    if (restore) {
      float ms = 0.f;
      OI_CUDA_CHECK(cudaEventElapsedTime(&ms, c.start, c.end));
      copy_stats_.restore_seconds += ms / 1e3;
      copy_stats_.restored_bytes += c.bytes;
    } else {
      copy_stats_.saved_bytes += c.bytes;
    }
    free_events_.insert(free_events_.end(), {c.start, c.end});
    free_events_.insert(free_events_.end(), c.groups.begin(), c.groups.end());
    q.pop_front();
  }
}

std::pair<int64_t, int64_t> Engine::copy_progress() {
  retire(saves_, false, false);
  retire(loads_, true, false);
  return {saves_.empty() ? launches_ : saves_.front().launch - 1, loads_.empty() ? launches_ : loads_.front().launch - 1};
}

void Engine::wait_copies() {
  retire(saves_, false, true);
  retire(loads_, true, true);
}

std::vector<uint16_t> Engine::read_kv_block(int64_t block, bool drafter) const {
  OI_CHECK(block >= 0 && block < num_blocks_, "read_kv_block: block " << block << " out of range");
  OI_CHECK(!drafter || dr_, "read_kv_block: no drafter");
  const int64_t bytes = drafter ? dr_->block_bytes() : kv_block_bytes();
  const char* pool = reinterpret_cast<const char*>(drafter ? dr_->kv_cache : kv_cache_);
  std::vector<uint16_t> out(bytes / 2);
  OI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  OI_CUDA_CHECK(cudaMemcpy(out.data(), pool + block * bytes, bytes, cudaMemcpyDeviceToHost));
  return out;
}

std::vector<uint16_t> Engine::read_host_block(int64_t slot) const {
  OI_CHECK(slot >= 0 && slot < num_host_blocks_, "read_host_block: slot " << slot << " out of range");
  const uint16_t* p = reinterpret_cast<const uint16_t*>(host_kv_ + slot * kv_block_bytes());
  return std::vector<uint16_t>(p, p + kv_block_bytes() / 2);
}

std::vector<uint64_t> Engine::persistent_trace(bool on) {
  const size_t n = (size_t)num_sms_ * kPersistentEvents;
  std::vector<uint64_t> out;
  if (on) {
    if (!trace_) OI_CUDA_CHECK(cudaMalloc(&trace_, n * sizeof(uint64_t)));
    OI_CUDA_CHECK(cudaMemset(trace_, 0, n * sizeof(uint64_t)));
  } else if (trace_) {
    out.resize(n);
    OI_CUDA_CHECK(cudaStreamSynchronize(stream_));
    OI_CUDA_CHECK(cudaMemcpy(out.data(), trace_, n * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  }
  trace_on_ = on;
  return out;
}

}  // namespace oi
