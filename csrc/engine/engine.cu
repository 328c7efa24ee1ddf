#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "../kernels/elementwise.cuh"
#include "../kernels/launch.cuh"
#include "../kernels/random_init.cuh"
#include "engine.h"

namespace oi {
namespace {

#define OI_INPUT_CHECK(cond, msg)                 \
  do {                                            \
    if (!(cond)) {                                \
      std::ostringstream oi_os_;                  \
      oi_os_ << "step: " << msg;                  \
      throw std::invalid_argument(oi_os_.str());  \
    }                                             \
  } while (0)

constexpr size_t kAlign = 256;
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
size_t B_cap_bytes(int64_t S) { return (2 * S + 1) * 4; }  // query_start_loc + context_lens

}  // namespace

Engine::Engine(const ModelDims& dims, const EngineOptions& opt) : d_(dims), opt_(opt) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    throw std::runtime_error(
        "No CUDA GPU is available to the CUDA engine (" + std::string(e == cudaSuccess ? "no device found" : cudaGetErrorString(e)) +
        "); use device=\"cpu\" for the NumPy reference backend.");
  }
  OI_CHECK(d_.head_dim == 128, "head_dim " << d_.head_dim << " is not supported (Qwen3 uses 128)");
  OI_CHECK(d_.heads % d_.kv_heads == 0, "num_attention_heads must be a multiple of num_key_value_heads");
  OI_CHECK(d_.hidden % 8 == 0 && d_.intermediate % 8 == 0, "hidden and intermediate sizes must be multiples of 8");
  OI_CHECK(opt_.block_size == 16, "kv block size must be 16");
  cudaDeviceProp prop{};
  OI_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  num_sms_ = prop.multiProcessorCount;
  device_name_ = prop.name;
  pdl_capable_ = prop.major >= 9;
  pdl_ = opt_.pdl && pdl_capable_;
  pdl_enabled() = pdl_;  // per host thread, read at every launch: set again before this engine launches
  OI_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  gemm_ = std::make_unique<Gemm>(opt_.cublaslt_path);
  kv_ = KvLayout{d_.layers, d_.kv_heads, opt_.block_size, d_.head_dim};

  const int64_t H = d_.hidden, I = d_.intermediate, V = d_.vocab;
  auto wt = [&](int64_t n) { return static_cast<bf16*>(alloc(n * sizeof(bf16), &weight_bytes_)); };
  w_.embed = wt(V * H);
  w_.lm_head = d_.tied ? w_.embed : wt(V * H);
  w_.final_norm = wt(H);
  w_.layers.resize(d_.layers);
  for (auto& L : w_.layers) {
    L.input_norm = wt(H);
    L.post_norm = wt(H);
    L.q_norm = wt(d_.head_dim);
    L.k_norm = wt(d_.head_dim);
    L.qkv = wt((int64_t)d_.qkv_rows() * H);
    L.o = wt(H * d_.heads * d_.head_dim);
    L.gate_up = wt(2 * I * H);
    L.down = wt(H * I);
  }
  rope_ = static_cast<float2*>(alloc((size_t)opt_.max_model_len * (d_.head_dim / 2) * sizeof(float2), &act_bytes_));
  rope_table_init(rope_, opt_.max_model_len, d_.head_dim, d_.rope_theta, stream_);
}

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

Engine::~Engine() {
  if (stream_) cudaStreamSynchronize(stream_);
  for (int i = 0; i < 2; ++i) {
    if (stage_[i]) cudaFreeHost(stage_[i]);
    if (stage_ev_[i]) cudaEventDestroy(stage_ev_[i]);
  }
  for (auto& g : graphs_)
    if (g.exec) cudaGraphExecDestroy(g.exec);
  for (int i = 0; i < 2; ++i) {
    if (graph_host_[i]) cudaFreeHost(graph_host_[i]);
    for (cudaEvent_t e : graph_ev_[i])
      if (e) cudaEventDestroy(e);
  }
  gemm_.reset();
  for (void* p : allocations_) cudaFree(p);
  if (kv_cache_) cudaFree(kv_cache_);
  for (int i = 0; i < 2; ++i) {
    if (host_meta_[i]) cudaFreeHost(host_meta_[i]);
    for (cudaEvent_t e : meta_ev_[i])
      if (e) cudaEventDestroy(e);
  }
  if (stream_) cudaStreamDestroy(stream_);
}

void* Engine::alloc(size_t bytes, int64_t* counter) {
  void* p = nullptr;
  OI_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
  allocations_.push_back(p);
  *counter += bytes;
  return p;
}

bf16* Engine::tensor_slot(const std::string& kind, int layer, int64_t* rows, int64_t* cols) {
  const int64_t H = d_.hidden, I = d_.intermediate, D = d_.head_dim;
  if (kind == "embed") { *rows = d_.vocab; *cols = H; return w_.embed; }
  if (kind == "lm_head") {
    OI_CHECK(!d_.tied, "lm_head given for a model with tied word embeddings");
    *rows = d_.vocab; *cols = H; return w_.lm_head;
  }
  if (kind == "final_norm") { *rows = 1; *cols = H; return w_.final_norm; }
  OI_CHECK(layer >= 0 && layer < d_.layers, "layer " << layer << " out of range for " << kind);
  LayerWeights& L = w_.layers[layer];
  if (kind == "input_norm") { *rows = 1; *cols = H; return L.input_norm; }
  if (kind == "post_norm") { *rows = 1; *cols = H; return L.post_norm; }
  if (kind == "q_norm") { *rows = 1; *cols = D; return L.q_norm; }
  if (kind == "k_norm") { *rows = 1; *cols = D; return L.k_norm; }
  if (kind == "qkv") { *rows = d_.qkv_rows(); *cols = H; return L.qkv; }
  if (kind == "o") { *rows = H; *cols = d_.heads * D; return L.o; }
  if (kind == "gate_up") { *rows = 2 * I; *cols = H; return L.gate_up; }
  if (kind == "down") { *rows = H; *cols = I; return L.down; }
  OI_CHECK(false, "unknown tensor kind '" << kind << "'");
}

void Engine::load_tensor(const std::string& kind, int layer, const uint16_t* data, int64_t rows, int64_t cols,
                         int64_t row_offset) {
  int64_t R = 0, C = 0;
  bf16* dst = tensor_slot(kind, layer, &R, &C);
  OI_CHECK(cols == C && row_offset >= 0 && row_offset + rows <= R,
           "tensor " << kind << "[" << layer << "]: got [" << rows << ", " << cols << "] at row " << row_offset
                     << ", slot is [" << R << ", " << C << "]");
  upload(dst + row_offset * C, data, (size_t)rows * cols * sizeof(bf16));
}

// Checkpoint bytes (memory-mapped, page cache) reach the GPU through two pinned 64 MB stages: several
// threads fill one stage while the other is copied, instead of one pageable cudaMemcpy (~3.7 GB/s).
void Engine::upload(void* dst, const void* src, size_t bytes) {
  constexpr size_t kStage = 64u << 20, kSmall = 1u << 20;
  constexpr int kCopyThreads = 8;
  if (bytes < kSmall) {
    OI_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    OI_CUDA_CHECK(cudaStreamSynchronize(stream_));  // pageable source: the call may return before reading it
    return;
  }
  if (!stage_[0]) {
    for (int i = 0; i < 2; ++i) {
      OI_CUDA_CHECK(cudaMallocHost(&stage_[i], kStage));
      OI_CUDA_CHECK(cudaEventCreateWithFlags(&stage_ev_[i], cudaEventDisableTiming));
    }
  }
  for (size_t off = 0; off < bytes; off += kStage) {
    const size_t n = std::min(kStage, bytes - off);
    char* buf = stage_[stage_cur_];
    OI_CUDA_CHECK(cudaEventSynchronize(stage_ev_[stage_cur_]));  // its previous copy is done
    const char* from = static_cast<const char*>(src) + off;
    const size_t per = (n / kCopyThreads + 4095) & ~size_t(4095);
    std::vector<std::thread> pool;
    for (size_t o = 0; o < n; o += per)
      pool.emplace_back([=] { std::memcpy(buf + o, from + o, std::min(per, n - o)); });
    for (auto& t : pool) t.join();
    OI_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + off, buf, n, cudaMemcpyHostToDevice, stream_));
    OI_CUDA_CHECK(cudaEventRecord(stage_ev_[stage_cur_], stream_));
    stage_cur_ ^= 1;
  }
}

void Engine::release_upload_stages() {
  if (!stage_[0]) return;
  OI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (int i = 0; i < 2; ++i) {
    cudaFreeHost(stage_[i]);
    cudaEventDestroy(stage_ev_[i]);
    stage_[i] = nullptr;
    stage_ev_[i] = nullptr;
  }
}

void Engine::init_random(uint64_t seed) {
  // Same scale rule as openinfer.tools.random_checkpoint: projections keep the RMS of their input,
  // embedding rows give non-flat logits after the final norm, norm weights near 1.
  const int64_t H = d_.hidden, I = d_.intermediate, D = d_.head_dim, V = d_.vocab;
  uint64_t n = 0;
  auto next = [&]() { return seed * 1000003ull + (++n); };
  auto normal = [&](bf16* p, int64_t count, int64_t fan_in) { fill_normal(p, count, next(), 0.f, 1.f / std::sqrt((float)fan_in), stream_); };
  auto norm_w = [&](bf16* p, int64_t count) { fill_uniform(p, count, next(), 1.f, 0.1f, stream_); };
  fill_normal(w_.embed, V * H, next(), 0.f, 2.f / std::sqrt((float)H), stream_);
  if (!d_.tied) fill_normal(w_.lm_head, V * H, next(), 0.f, 2.f / std::sqrt((float)H), stream_);
  norm_w(w_.final_norm, H);
  for (auto& L : w_.layers) {
    norm_w(L.input_norm, H);
    norm_w(L.post_norm, H);
    norm_w(L.q_norm, D);
    norm_w(L.k_norm, D);
    normal(L.qkv, (int64_t)d_.qkv_rows() * H, H);
    normal(L.o, H * d_.heads * D, d_.heads * D);
    normal(L.gate_up, 2 * I * H, H);
    normal(L.down, H * I, I);
  }
  OI_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

int64_t Engine::finalize() {
  OI_CHECK(!finalized_, "finalize() called twice");
  pdl_enabled() = pdl_;  // the graphs are captured below
  release_upload_stages();  // every weight is on the GPU once the stream drains
  const int64_t T = opt_.max_num_tokens, S = opt_.max_num_seqs, H = d_.hidden, I = d_.intermediate;
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
  act_.ws_o = static_cast<float*>(alloc((size_t)max_split_rows_ * d_.heads * d_.head_dim * sizeof(float), &act_bytes_));
  act_.ws_lse = static_cast<float*>(alloc((size_t)max_split_rows_ * d_.heads * sizeof(float), &act_bytes_));
  const size_t counter_bytes = (size_t)(T + S + 1) * d_.kv_heads * sizeof(int);  // work items <= T + S + 1
  act_.attn_counters = static_cast<int*>(alloc(counter_bytes, &act_bytes_));
  OI_CUDA_CHECK(cudaMemset(act_.attn_counters, 0, counter_bytes));
  if (persistent_fits(d_.hidden, d_.intermediate, d_.heads, d_.kv_heads, d_.head_dim)) {
    const size_t lw_bytes = w_.layers.size() * sizeof(LayerWeights);
    LayerWeights* dl = static_cast<LayerWeights*>(alloc(lw_bytes, &act_bytes_));
    OI_CUDA_CHECK(cudaMemcpy(dl, w_.layers.data(), lw_bytes, cudaMemcpyHostToDevice));
    w_.dev_layers = dl;
    const size_t ws_bytes = persistent_ws_floats(d_.hidden, d_.intermediate, d_.heads, d_.kv_heads) * sizeof(float);
    act_.layer_ws = static_cast<float*>(alloc(ws_bytes, &act_bytes_));
    OI_CUDA_CHECK(cudaMemset(act_.layer_ws, 0, ws_bytes));
  }

  const int64_t max_blocks_per_seq = (opt_.max_model_len + opt_.block_size - 1) / opt_.block_size;
  meta_in_bytes_ = align_up(3 * T * 4) + align_up(B_cap_bytes(S)) + align_up(S * max_blocks_per_seq * 4) +
                   align_up(6 * S * 4) + align_up(S * 8) + align_up((T + S) * sizeof(AttnWork)) + 16 * kAlign;  // + prev_rows
  meta_bytes_ = meta_in_bytes_ + align_up(2 * S * 4) + align_up(2 * S * kMaxLogprobs * 4) + 4 * kAlign;
  for (int i = 0; i < 2; ++i) {
    OI_CUDA_CHECK(cudaMallocHost(&host_meta_[i], meta_bytes_));
    dev_meta_[i] = static_cast<char*>(alloc(meta_bytes_, &act_bytes_));
    for (cudaEvent_t& e : meta_ev_[i]) OI_CUDA_CHECK(cudaEventCreate(&e));
  }

  // Profiling step (one prompt through every kernel and GEMM shape class) on a throwaway pool, so
  // lazily loaded modules and plans are resident before free memory is read.
  {
    const int n = std::max(1, std::min<int>({(int)T, 256, opt_.max_model_len}));
    const int nb = (n + opt_.block_size - 1) / opt_.block_size;
    bf16* tmp = nullptr;
    OI_CUDA_CHECK(cudaMalloc(&tmp, (size_t)(nb + 1) * kv_block_bytes()));
    std::vector<int32_t> ids(n), pos(n), slots(n), bt(nb);
    for (int i = 0; i < n; ++i) { ids[i] = i % d_.vocab; pos[i] = i; slots[i] = opt_.block_size + i; }
    for (int b = 0; b < nb; ++b) bt[b] = b + 1;
    int32_t qsl[2] = {0, n}, ctx[1] = {n}, sidx[1] = {n - 1}, topk[1] = {0};
    float temp[1] = {1.f}, topp[1] = {0.9f};
    uint64_t seed[1] = {0};
    HostStep hs;
    hs.T = n; hs.B = 1; hs.S = 1; hs.bt_stride = nb;
    hs.ids = ids.data(); hs.positions = pos.data(); hs.query_start_loc = qsl; hs.context_lens = ctx;
    hs.block_tables = bt.data(); hs.slots = slots.data(); hs.sample_idx = sidx;
    hs.temperature = temp; hs.top_p = topp; hs.top_k = topk; hs.seeds = seed; hs.num_logprobs = 1;
    Pending p = enqueue(hs, check(hs, nb + 1), tmp);
    finish_eager(p);
    OI_CUDA_CHECK(cudaFree(tmp));
  }

  size_t free_b = 0, total_b = 0;
  OI_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const double reserve = (1.0 - opt_.gpu_memory_utilization) * (double)total_b;
  const int64_t budget = (int64_t)((double)free_b - reserve);
  const int64_t fit = budget > 0 ? budget / kv_block_bytes() : 0;
  num_blocks_ = opt_.num_kv_blocks > 0 ? opt_.num_kv_blocks : fit;
  OI_CHECK(num_blocks_ <= (int64_t)(free_b / kv_block_bytes()),
           "num_kv_blocks " << num_blocks_ << " does not fit in free GPU memory (" << free_b / kv_block_bytes() << " blocks)");
  OI_CHECK(num_blocks_ >= 2, "not enough GPU memory for the KV cache: " << (free_b >> 20) << " MiB free after weights ("
                                 << (weight_bytes_ >> 20) << " MiB) and activations; raise gpu_memory_utilization");
  OI_CUDA_CHECK(cudaMalloc(&kv_cache_, (size_t)num_blocks_ * kv_block_bytes()));
  OI_CUDA_CHECK(cudaMemset(kv_cache_, 0, (size_t)num_blocks_ * kv_block_bytes()));  // unwritten slots stay finite
  finalized_ = true;
  capture_graphs();  // decode buckets always; the graphs themselves only when cuda_graph is on
  return num_blocks_;
}

StepMeta Engine::graph_meta(int batch) const {
  StepMeta m{};
  const int group = d_.heads / d_.kv_heads;
  m.T = m.B = m.S = m.num_work = batch;
  m.bt_stride = graph_bt_stride_;
  m.max_rows = group;
  // One split count for every context a graph may see: sized for the longest (short ones leave splits empty).
  m.num_splits = attn_num_splits(batch, d_.kv_heads, graph_splits_max_ctx_, batch, num_sms_, max_split_rows_, group);
  m.num_logprobs = 0;
  m.fuse_rope = attention_fuse_rope() && group <= 16;
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
  graph_bt_stride_ = (opt_.max_model_len + opt_.block_size - 1) / opt_.block_size;
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
    const StepMeta m = graph_meta(b);
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
bool Engine::launch_graph(const HostStep& in) {
  // Logits only eagerly (tests compare a bucket's kernels through them; a graph has no copy for them).
  if (graphs_.empty() || in.T != in.B || in.S != in.B || in.num_logprobs != 0 || (in.return_logits && !in.force_eager))
    return false;
  const int B = in.B;
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
  std::memcpy(h + ga_.ids, in.ids, B * 4);
  std::memcpy(h + ga_.pos, in.positions, B * 4);
  std::memcpy(h + ga_.slots, in.slots, B * 4);
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
    qwen3_forward(d_, w_, act_, graph_meta(Bg), rope_, kv_cache_, kv_, *gemm_, num_sms_, stream_);
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
  out.logits = p.logits;
  return out;
}

StepResult Engine::step(const HostStep& in) {
  OI_CHECK(pending_.empty(), "step() with " << pending_.size() << " launched steps not collected");
  launch(in);
  return collect();
}

void Engine::launch(const HostStep& in) {
  OI_CHECK(finalized_, "launch() before finalize()");
  pdl_enabled() = pdl_;
  OI_CHECK(pending_.size() < 2, "launch() with two steps already pending: collect() first");
  const Checked c = check(in, num_blocks_);
  if (in.prev_rows) {
    OI_INPUT_CHECK(last_launch_S_ >= 0, "prev_rows needs a step launched before");
    for (int b = 0; b < in.B; ++b) {
      OI_INPUT_CHECK(in.prev_rows[b] >= -1 && in.prev_rows[b] < last_launch_S_, "prev_rows[" << b << "] = " << in.prev_rows[b]);
      OI_INPUT_CHECK(in.prev_rows[b] < 0 || (in.query_start_loc[b] == b && in.query_start_loc[b + 1] == b + 1),
                     "fed row " << b << " must be one token at index " << b);
    }
  }
  if (!launch_graph(in)) pending_.push_back(enqueue(in, c, kv_cache_));
  last_launch_S_ = in.S;
}

StepResult Engine::collect() {
  OI_CHECK(!pending_.empty(), "collect() with no step launched");
  Pending p = std::move(pending_.front());
  pending_.pop_front();
  return p.graph ? finish_graph(p) : finish_eager(p);
}

Engine::Checked Engine::check(const HostStep& in, int64_t num_blocks) const {
  const int T = in.T, B = in.B, S = in.S;
  // Everything a client could influence is checked here, before any device work.
  OI_INPUT_CHECK(T >= 1 && T <= opt_.max_num_tokens, T << " tokens (1.." << opt_.max_num_tokens << ")");
  OI_INPUT_CHECK(B >= 1 && B <= opt_.max_num_seqs, B << " sequences (1.." << opt_.max_num_seqs << ")");
  OI_INPUT_CHECK(S >= 0 && S <= opt_.max_num_seqs, S << " sampled rows (0.." << opt_.max_num_seqs << ")");
  OI_INPUT_CHECK(in.num_logprobs >= 0 && in.num_logprobs <= kMaxLogprobs, "num_logprobs " << in.num_logprobs);
  OI_INPUT_CHECK(in.bt_stride >= 1 && in.bt_stride <= (opt_.max_model_len + opt_.block_size - 1) / opt_.block_size,
                 "block table width " << in.bt_stride);
  OI_INPUT_CHECK(in.query_start_loc[0] == 0 && in.query_start_loc[B] == T, "query_start_loc must run from 0 to T");
  const int group = d_.heads / d_.kv_heads;
  const int qt = attn_tokens_per_item(group);
  const int64_t max_slot = num_blocks * opt_.block_size;
  Checked c;
  std::vector<AttnWork>& work = c.work;
  work.reserve(T / qt + B + 1);
  int& max_ctx = c.max_ctx;
  int& max_rows = c.max_rows;
  for (int b = 0; b < B; ++b) {
    const int s0 = in.query_start_loc[b], s1 = in.query_start_loc[b + 1];
    OI_INPUT_CHECK(s1 > s0, "sequence " << b << " has no tokens");
    const int ctx = in.context_lens[b];
    OI_INPUT_CHECK(ctx >= s1 - s0 && ctx <= opt_.max_model_len && ctx <= in.bt_stride * opt_.block_size,
                   "context_lens[" << b << "] = " << ctx << " is inconsistent");
    OI_INPUT_CHECK(in.positions[s1 - 1] == ctx - 1, "last position of sequence " << b << " must be context_len - 1");
    const int nb = (ctx + opt_.block_size - 1) / opt_.block_size;
    for (int j = 0; j < nb; ++j) {
      const int blk = in.block_tables[(int64_t)b * in.bt_stride + j];
      OI_INPUT_CHECK(blk >= 0 && blk < num_blocks, "block id " << blk << " out of range");
    }
    for (int t0 = s0; t0 < s1; t0 += qt) {
      const int n = std::min(qt, s1 - t0);
      work.push_back(AttnWork{b, t0, n, 0});
      max_rows = std::max(max_rows, n * group);
    }
    max_ctx = std::max(max_ctx, ctx);
  }
  for (int t = 0; t < T; ++t) {
    const bool fed = in.prev_rows && t < B && in.prev_rows[t] >= 0;  // comes from the previous step's output
    OI_INPUT_CHECK(fed || (in.ids[t] >= 0 && in.ids[t] < d_.vocab), "token id " << in.ids[t] << " out of range");
    OI_INPUT_CHECK(in.positions[t] >= 0 && in.positions[t] < opt_.max_model_len, "position " << in.positions[t] << " out of range");
    OI_INPUT_CHECK(in.slots[t] >= -1 && in.slots[t] < max_slot, "slot " << in.slots[t] << " out of range");
  }
  c.sample_pos.resize(S);
  for (int r = 0; r < S; ++r) {
    OI_INPUT_CHECK(in.sample_idx[r] >= 0 && in.sample_idx[r] < T, "sample_idx " << in.sample_idx[r] << " out of range");
    OI_INPUT_CHECK(std::isfinite(in.temperature[r]) && in.top_p[r] > 0.f && in.top_p[r] <= 1.f, "bad sampling parameters in row " << r);
    c.sample_pos[r] = in.positions[in.sample_idx[r]];
  }
  return c;
}

// A step outside the decode buckets (prefill chunks, mixed batches, logprobs), queued eagerly. Its
// inputs go through one of two pinned staging slots, so the next step can be staged while it runs;
// finish_eager() waits for it.
Engine::Pending Engine::enqueue(const HostStep& in, const Checked& c, bf16* kv_cache) {
  const int T = in.T, B = in.B, S = in.S;
  const std::vector<AttnWork>& work = c.work;
  const int max_ctx = c.max_ctx, max_rows = c.max_rows;
  const std::vector<int32_t>& sample_pos = c.sample_pos;
  const int splits = attn_num_splits((int)work.size(), d_.kv_heads, max_ctx, T, num_sms_, max_split_rows_, max_rows);
  const int slot = meta_slot_;
  for (const Pending& p : pending_)
    OI_CHECK(p.graph || p.slot != slot, "staging slot " << slot << " is still in flight");
  char* host = host_meta_[slot];
  char* dev = dev_meta_[slot];

  // Pack every input into the pinned staging area and send it with one copy.
  size_t off = 0;
  auto put = [&](const void* src, size_t bytes) {
    void* d = dev + off;
    if (bytes) std::memcpy(host + off, src, bytes);
    off = align_up(off + bytes);
    return d;
  };
  StepMeta m{};
  m.T = T; m.B = B; m.S = S; m.bt_stride = in.bt_stride;
  m.num_work = (int)work.size(); m.max_rows = max_rows; m.num_splits = splits; m.num_logprobs = in.num_logprobs;
  m.ids = (const int32_t*)put(in.ids, T * 4);
  m.positions = (const int32_t*)put(in.positions, T * 4);
  m.slots = (const int32_t*)put(in.slots, T * 4);
  m.context_lens = (const int32_t*)put(in.context_lens, B * 4);
  m.block_tables = (const int32_t*)put(in.block_tables, (size_t)B * in.bt_stride * 4);
  m.sample_idx = (const int32_t*)put(in.sample_idx, S * 4);
  m.sample_pos = (const int32_t*)put(sample_pos.data(), S * 4);
  m.temperature = (const float*)put(in.temperature, S * 4);
  m.top_p = (const float*)put(in.top_p, S * 4);
  m.top_k = (const int32_t*)put(in.top_k, S * 4);
  m.seeds = (const uint64_t*)put(in.seeds, S * 8);
  m.work = (const AttnWork*)put(work.data(), work.size() * sizeof(AttnWork));
  const int32_t* prev = in.prev_rows ? (const int32_t*)put(in.prev_rows, B * 4) : nullptr;
  OI_CHECK(off <= meta_in_bytes_, "step metadata overflows its staging area");
  const size_t in_bytes = off;
  off = meta_in_bytes_;  // outputs follow the inputs
  const size_t out_start = off;
  m.out_tokens = (int32_t*)(dev + off); off = align_up(off + S * 4);
  m.out_logprobs = (float*)(dev + off); off = align_up(off + S * 4);
  m.out_top_ids = (int32_t*)(dev + off); off = align_up(off + (size_t)S * in.num_logprobs * 4);
  m.out_top_logprobs = (float*)(dev + off); off = align_up(off + (size_t)S * in.num_logprobs * 4);
  OI_CHECK(off <= meta_bytes_, "step outputs overflow their staging area");

  cudaEvent_t* ev = meta_ev_[slot];
  OI_CUDA_CHECK(cudaMemcpyAsync(dev, host, in_bytes, cudaMemcpyHostToDevice, stream_));
  OI_CUDA_CHECK(cudaEventRecord(ev[0], stream_));
  if (prev)  // fed rows are rows 0..B-1 at their own token index (checked in launch())
    feed_tokens(const_cast<int32_t*>(m.ids), prev, last_tokens_, B, stream_);
  qwen3_forward(d_, w_, act_, m, rope_, kv_cache, kv_, *gemm_, num_sms_, stream_);
  OI_CUDA_CHECK(cudaEventRecord(ev[1], stream_));
  OI_CUDA_CHECK(cudaMemcpyAsync(host + out_start, dev + out_start, off - out_start, cudaMemcpyDeviceToHost, stream_));
  Pending p;
  p.slot = slot;
  p.B = B;
  p.S = S;
  p.num_logprobs = in.num_logprobs;
  if (in.return_logits && S > 0) {
    p.logits.resize((size_t)S * d_.vocab);
    OI_CUDA_CHECK(cudaMemcpyAsync(p.logits.data(), act_.logits, p.logits.size() * 4, cudaMemcpyDeviceToHost, stream_));
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
  r.logits = std::move(p.logits);
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
  return r;
}

}  // namespace oi
