// Engine: owns the GPU state of one model -- weights, activations, the paged KV pool, the GEMM plans --
// and runs one step per call. No Python types here; the binding converts NumPy arrays to HostStep.
#pragma once
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "../model/qwen3.h"

namespace oi {

struct EngineOptions {
  int max_num_tokens = 8192;   // tokens per step
  int max_num_seqs = 256;      // sequences (and sampled rows) per step
  int max_model_len = 40960;
  int block_size = 16;
  double gpu_memory_utilization = 0.90;
  int num_kv_blocks = 0;       // > 0: use exactly this many blocks instead of sizing from free memory
  std::string cublaslt_path;   // hint for dlopen; empty: the loader's search path
  bool cuda_graph = true;      // capture decode steps for the batch sizes of graph_batch_sizes()
  bool pdl = true;             // programmatic dependent launch between kernels (kernels/launch.cuh)
  bool gemm_autotune = true;   // time cuBLASLt candidates for the decode shapes at start-up (else: heuristic's pick)
};

// Decode batch sizes that get a CUDA graph: 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ... up to max_num_seqs (and it).
std::vector<int> graph_batch_sizes(int max_num_seqs);

// One step's inputs, as host pointers (layout: docs/architecture.md).
struct HostStep {
  int T = 0, B = 0, S = 0, bt_stride = 0;
  const int32_t *ids, *positions, *query_start_loc, *context_lens, *block_tables, *slots, *sample_idx;
  const float *temperature, *top_p;
  const int32_t* top_k;
  const uint64_t* seeds;
  int num_logprobs = 0;
  bool return_logits = false;
  bool force_eager = false;  // decode buckets launched without their graph (for graph == eager tests)
  // [B] or null. Row b's input id is the previous launch's sampled token prev_rows[b] when >= 0 (its
  // ids[b] is then ignored): a step can go out before the previous one's tokens reach the host. A fed
  // row has one token, at index b (the rows that continue decoding come first in a step).
  const int32_t* prev_rows = nullptr;
};

struct StepResult {
  std::vector<int32_t> tokens, top_ids;
  std::vector<float> logprobs, top_logprobs, logits;
  float gpu_ms = 0.f;
};

class Engine {
 public:
  Engine(const ModelDims& dims, const EngineOptions& opt);
  ~Engine();

  // Copy one checkpoint tensor (bf16 bits, row-major [rows, cols]) into its slot; fused tensors take a
  // row offset (q/k/v into qkv, gate/up into gate_up).
  void load_tensor(const std::string& kind, int layer, const uint16_t* data, int64_t rows, int64_t cols,
                   int64_t row_offset);
  void init_random(uint64_t seed);
  // After the weights: allocate activations, run one profiling step, size and zero the KV pool.
  int64_t finalize();
  StepResult step(const HostStep& in);  // launch + collect; nothing may be pending
  // Overlapped steps: launch() queues a step and returns once its inputs are staged (at most two steps
  // pending); collect() waits for the oldest and returns its result.
  void launch(const HostStep& in);
  StepResult collect();
  int pending() const { return (int)pending_.size(); }

  int64_t num_kv_blocks() const { return num_blocks_; }
  int64_t kv_block_bytes() const { return kv_.block_stride() * (int64_t)sizeof(bf16); }
  int64_t weight_bytes() const { return weight_bytes_; }
  int64_t activation_bytes() const { return act_bytes_; }
  int num_sms() const { return num_sms_; }
  std::vector<int> graph_batches() const;
  int64_t graph_steps() const { return graph_steps_; }
  // PDL for later eager launches (captured graphs keep their edges): tests compare the two launch modes.
  bool pdl() const { return pdl_; }
  void set_pdl(bool on) { pdl_ = on && pdl_capable_; }
  std::string device_name() const { return device_name_; }

 private:
  void* alloc(size_t bytes, int64_t* counter);
  void upload(void* dst, const void* src, size_t bytes);
  void release_upload_stages();
  bf16* tensor_slot(const std::string& kind, int layer, int64_t* rows, int64_t* cols);
  struct Checked {  // what validation derives from a step's inputs
    std::vector<AttnWork> work;
    std::vector<int32_t> sample_pos;
    int max_ctx = 0, max_rows = 1;
  };
  Checked check(const HostStep& in, int64_t num_blocks) const;
  struct Pending {
    bool graph = false;
    int slot = 0;  // graph arena image, or eager staging slot
    int B = 0, S = 0, num_logprobs = 0;
    std::vector<float> logits;  // when the step asked for logits (pageable: that launch waits for its copy)
  };
  // A step outside the decode buckets (prefill chunks, mixed batches, logprobs), queued eagerly.
  Pending enqueue(const HostStep& in, const Checked& c, bf16* kv_cache);
  StepResult finish_eager(Pending& p);
  // CUDA Graph decode: a fixed-layout metadata arena shared by every captured batch size.
  struct Graph {
    int batch = 0;
    cudaGraphExec_t exec = nullptr;  // null when cuda_graph is off
  };
  struct GraphArena {
    size_t ids, pos, slots, ctx, sidx, spos, topk, temp, topp, seeds, work, prev, bt, tokens, logprobs, bytes;
  };
  void capture_graphs();
  StepMeta graph_meta(int batch) const;
  bool launch_graph(const HostStep& in);  // queues a decode bucket step; false when the step is not one
  StepResult finish_graph(const Pending& p);

  ModelDims d_;
  EngineOptions opt_;
  KvLayout kv_{};
  cudaStream_t stream_ = nullptr;
  int num_sms_ = 0;
  std::string device_name_;
  std::unique_ptr<Gemm> gemm_;
  std::vector<void*> allocations_;
  Weights w_;
  Activations act_{};
  float2* rope_ = nullptr;
  bf16* kv_cache_ = nullptr;
  int64_t num_blocks_ = 0;
  int64_t weight_bytes_ = 0, act_bytes_ = 0;
  int max_split_rows_ = 4096;
  // Two pinned staging areas (eager steps alternate, so one can be filled while the other's step
  // runs) and their device twins, for all per-step metadata and outputs.
  char* host_meta_[2] = {nullptr, nullptr};
  char* dev_meta_[2] = {nullptr, nullptr};
  cudaEvent_t meta_ev_[2][3] = {};  // per slot: start, end of the forward, outputs on the host
  int meta_slot_ = 0;
  size_t meta_bytes_ = 0, meta_in_bytes_ = 0;  // both multiples of 256
  bool finalized_ = false;
  bool pdl_capable_ = false;  // sm_90+
  bool pdl_ = false;          // programmatic dependent launch (options, and capable)
  std::vector<Graph> graphs_;  // ascending batch
  GraphArena ga_{};
  char* graph_host_[2] = {nullptr, nullptr};  // pinned arena images; launches alternate between them
  cudaEvent_t graph_ev_[2][3] = {};            // per slot: start, end of the forward, outputs on the host
  int graph_slot_ = 0;
  int last_launch_S_ = -1;                     // sampled rows of the last launch (-1: none yet)
  const int32_t* last_tokens_ = nullptr;       // device: the last launch's sampled tokens (what prev_rows reads)
  std::deque<Pending> pending_;
  char* graph_dev_ = nullptr;
  int graph_bt_stride_ = 0, graph_splits_max_ctx_ = 0;
  int64_t graph_steps_ = 0;
  char* stage_[2] = {nullptr, nullptr};  // pinned upload stages (weights only; freed by finalize)
  cudaEvent_t stage_ev_[2] = {nullptr, nullptr};
  int stage_cur_ = 0;
};

}  // namespace oi
