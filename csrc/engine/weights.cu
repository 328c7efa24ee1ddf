// Weights: device slots of the model's tensors, checkpoint bytes into them, or seeded random weights.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "../kernels/random_init.cuh"
#include "engine.h"

namespace oi {

void Engine::allocate_weights() {
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
}

void* Engine::alloc(size_t bytes, int64_t* counter) {
  void* p = nullptr;
  OI_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
  allocations_.push_back(p);
  *counter += bytes;
  return p;
}

bf16* Engine::tensor_slot(const std::string& kind, int layer, int64_t* rows, int64_t* cols) {
  const int64_t H = d_.hidden;
  if (kind == "embed") { *rows = d_.vocab; *cols = H; return w_.embed; }
  if (kind == "lm_head") {
    OI_CHECK(!d_.tied, "lm_head given for a model with tied word embeddings");
    *rows = d_.vocab; *cols = H; return w_.lm_head;
  }
  if (kind == "final_norm") { *rows = 1; *cols = H; return w_.final_norm; }
  if (kind.rfind("draft.", 0) == 0) return drafter_slot(kind.substr(6), layer, rows, cols);
  OI_CHECK(layer >= 0 && layer < d_.layers, "layer " << layer << " out of range for " << kind);
  return layer_slot(w_.layers[layer], kind, rows, cols);
}

// A decoder layer's tensor (the target's or the drafter's: they share the geometry).
bf16* Engine::layer_slot(LayerWeights& L, const std::string& kind, int64_t* rows, int64_t* cols) const {
  const int64_t H = d_.hidden, I = d_.intermediate, D = d_.head_dim;
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

}  // namespace oi
