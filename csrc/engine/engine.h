// Engine: owns the GPU state of one model -- weights, activations, the paged KV pool and its host tier,
// the GEMM plans, the decode graphs -- and runs one step per call. No Python types here; the binding
// converts openinfer.StepInput to StepInput. Its parts, one file each:
//   engine.cu   lifecycle, launch / collect of eager steps, the KV block copies
//   weights.cu  checkpoint tensors into their slots, random weights
//   kv_pool.cu  activations, the profiling step, KV pool and host tier sizing
//   plan.cu     a step's validation and attention work (shared with the kernel test ops)
//   graphs.cu   the CUDA graph buckets (decode steps; verify rounds with a drafter): capture, arena, replay
//   draft.cu    the drafter of speculative decoding: its weights, KV pool, and its part of a step
#pragma once
#include <algorithm>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../model/drafter.h"
#include "../model/qwen3.h"
#include "options.h"
#include "plan.h"
#include "step.h"
#include "../kernels/draft.cuh"

namespace oi {

// Decode batch sizes that get a CUDA graph: 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ... up to max_num_seqs (and it).
std::vector<int> graph_batch_sizes(int max_num_seqs);

class Engine {
 public:
  Engine(const ModelDims& dims, const EngineOptions& opt);
  ~Engine();

  // Copy one checkpoint tensor (bf16 bits, row-major [rows, cols]) into its slot; fused tensors take a
  // row offset (q/k/v into qkv, gate/up into gate_up).
  void load_tensor(const std::string& kind, int layer, const uint16_t* data, int64_t rows, int64_t cols,
                   int64_t row_offset);
  void init_random(uint64_t seed);
  // Speculative decoding (before finalize()): a DFlash / DSpark drafter whose tensors then load through
  // load_tensor() under the kinds "draft.<kind>" (the layer kinds, fc, hidden_norm, norm, markov_w1/w2).
  // With a drafter, decode steps are eager (each writes the drafter's context for its tokens) and verify rounds
  // of the drafter's span replay the verify graphs (graphs.cu).
  void set_drafter(const DrafterDims& dd);
  bool has_drafter() const { return dr_ != nullptr; }
  // After the weights: allocate activations, run one profiling step, size and zero the KV pool, pin the
  // host tier, capture the decode graphs.
  int64_t finalize();

  // The step contract (docs/architecture.md): launch() validates and queues a step and returns once its
  // inputs are staged (at most two pending); collect() waits for the oldest and returns its result;
  // step() is both, with nothing pending. Steps run in launch order on one stream.
  void launch(const StepInput& in);
  StepResult collect();
  StepResult step(const StepInput& in);
  int pending() const { return (int)pending_.size(); }

  // KV block copies (StepInput.kv_save / kv_load) run on their own streams. Returns (s, l): the copies of
  // every launch numbered <= s (saves) and <= l (loads) have landed; launches are numbered from 1 in order.
  // Never blocks.
  std::pair<int64_t, int64_t> copy_progress();
  void wait_copies();  // blocks until every issued copy has landed (the engine has nothing else to do)
  struct CopyStats {
    int64_t saved_bytes = 0, restored_bytes = 0;
    double restore_seconds = 0;  // device time of the landed restore batches
    int64_t layer_waits = 0;     // kv_load_wait: layers of a forward that waited for their group of a restore
  };
  CopyStats copy_stats() const { return copy_stats_; }
  // Tests: one KV block's bytes (bf16 bits) on the device, or one host slot's.
  std::vector<uint16_t> read_kv_block(int64_t block, bool drafter = false) const;  // drafter: its pool's block
  std::vector<uint16_t> read_host_block(int64_t slot) const;

  // Tests: kernels of later eager launches (graphs keep those they were captured with).
  void set_kernel_choice(const KernelChoice& k) { eager_kernels_ = k; }
  // Profiling: later eager persistent steps stamp layer kPersistentTraceLayer; off returns [SMs, events] ns.
  std::vector<uint64_t> persistent_trace(bool on);

  int64_t num_kv_blocks() const { return num_blocks_; }
  int64_t num_host_blocks() const { return num_host_blocks_; }
  int64_t kv_block_bytes() const { return kv_.block_stride() * (int64_t)sizeof(bf16); }
  int64_t weight_bytes() const { return weight_bytes_; }
  int64_t activation_bytes() const { return act_bytes_; }
  int num_sms() const { return num_sms_; }
  std::vector<int> graph_batches(bool verify = false) const;  // the decode buckets, or the verify ones
  int64_t graph_steps() const { return graph_steps_; }  // graph replays so far, decode and verify
  int64_t graph_bytes() const { return graph_bytes_; }  // device memory the captured graphs took (cudaMemGetInfo)
  // finalize()'s phases in order, seconds each (weights_drain, activations, profile_step, kv_pool, graphs)
  const std::vector<std::pair<std::string, double>>& finalize_seconds() const { return finalize_seconds_; }
  // PDL for later eager launches (captured graphs keep their edges): tests compare the two launch modes.
  bool pdl() const { return pdl_; }
  void set_pdl(bool on) { pdl_ = on && pdl_capable_; }
  std::string device_name() const { return device_name_; }
  bool persistent_capable() const { return w_.dev_layers != nullptr; }

 private:
  void init();              // the constructor's work
  void release() noexcept;  // frees everything allocated so far (the destructor, or a constructor that threw)
  struct Pending {
    bool graph = false;
    bool copies_only = false;  // a step of no tokens: nothing to wait for
    int slot = 0;  // graph arena image, or eager staging slot
    int bucket = 0;  // verify graphs: the bucket's sequences (padding included)
    int B = 0, S = 0, num_logprobs = 0, taps = 0, tap_rows = 0;
    bool verify = false;
    bool drafter = false;  // the drafter ran after the target (draft_ms; drafts when draft_seqs)
    std::vector<float> logits;  // when the step asked for logits (pageable: that launch waits for its copy)
    std::vector<uint16_t> hidden;
    std::vector<int32_t> draft_seqs;  // drafting sequences, in chunks of dr_->chunk
  };
  // Staging of an eager step's inputs: host image and device twin, filled front to back.
  struct Stager {
    char *host, *dev;
    size_t off = 0;
    void* put(const void* src, size_t bytes);
  };
  // The drafting part of an eager step, staged (device pointers into the step's metadata).
  struct DraftStage {
    int num_seqs = 0;
    const int32_t *seqs = nullptr, *rows = nullptr;
    const AttnWork* work = nullptr;
    std::vector<int> work_start;  // [chunks + 1] first work item of each chunk
    std::vector<int> max_ctx;     // [chunks] upper bound of a chunk's block context
  };

  // weights.cu
  void allocate_weights();
  void* alloc(size_t bytes, int64_t* counter);
  void upload(void* dst, const void* src, size_t bytes);
  void release_upload_stages();
  bf16* tensor_slot(const std::string& kind, int layer, int64_t* rows, int64_t* cols);
  bf16* layer_slot(LayerWeights& L, const std::string& kind, int64_t* rows, int64_t* cols) const;
  // kv_pool.cu
  void allocate_activations();
  void profile_step();
  void allocate_kv();
  // engine.cu
  StepLimits limits() const;
  int max_rows() const { return std::max(opt_.max_num_seqs, opt_.max_sampled_rows); }  // sampled rows of a step
  Pending enqueue(const StepInput& in, const StepPlan& plan, bf16* kv_cache, bool drafter = true);  // an eager step
  StepResult finish_eager(Pending& p);
  void issue_copies(const StepInput& in);
  void copy_blocks(const StepInput& in);  // StepInput.kv_copy
  bf16* tap_buffer(size_t elems);
  // draft.cu
  bf16* drafter_slot(const std::string& kind, int layer, int64_t* rows, int64_t* cols);
  void allocate_drafter();
  DraftStage stage_draft(const StepInput& in, const StepPlan& plan, Stager& st);
  void run_drafter(const StepMeta& m, const DraftStage& ds, int32_t* out_drafts, const AttnVariant& v);
  void take_drafts(const Pending& p, const int32_t* host_drafts, StepResult& r) const;
  // graphs.cu
  struct Graph {
    int batch = 0;
    cudaGraphExec_t exec = nullptr;   // null when cuda_graph is off
    cudaGraph_t graph = nullptr;      // verify graphs: kept for the node handle below
    cudaGraphNode_t split = nullptr;  // verify graphs: the event record node between the target's part and the drafter's
    int set = 0;                      // verify graphs: their attention items (verify_items_)
  };
  struct GraphArena {
    size_t ids, pos, slots, ctx, sidx, spos, topk, temp, topp, seeds, work, prev, bt, tokens, logprobs, bytes;
  };
  // The bucket machinery both kinds share: the pinned images, their events and the device arena; each bucket's
  // warm-up run (GEMM plans and tensor maps are made outside capture) and capture; the smallest bucket that holds
  // B sequences; queueing a step through the current image; waiting for one.
  void alloc_arena(size_t bytes);
  void capture_buckets(const std::vector<int>& sizes, const std::function<void(int batch, bool capturing)>& body,
                       bool split, int set = 0);
  const Graph* bucket(int B, int set = 0) const;
  char* arena_image() const;
  void replay(const Graph& g, bool force_eager, const std::function<void()>& eager);
  void queue_graph_step(Pending p, const int32_t* dev_tokens);
  const char* wait_graph_step(const Pending& p, StepResult& r) const;
  void capture_graphs();
  StepMeta graph_meta(int batch, const KernelChoice& k) const;
  bool launch_graph(const StepInput& in);  // queues a decode bucket step; false when the step is not one
  StepResult finish_graph(const Pending& p);
  // Verify rounds (an engine with a drafter): per bucket, the verify forward over [anchor, d1..dk] of every
  // sequence (k = the drafter's num_drafts) and the drafter's pass after it, in one graph.
  struct VerifyArena {
    size_t ids, pos, slots, topk, temp, topp, seeds, ctx, bt, tokens, logprobs, accepted, drafts, seq_rows, work[2],
        draft_work, bytes;
  };
  void capture_verify_graphs();
  StepMeta verify_meta(int batch, const KernelChoice& k, int set) const;
  DraftStage verify_draft_stage(int batch) const;
  void pad_verify_rows(char* h, int b0, int b1) const;
  bool launch_verify_graph(const StepInput& in);  // queues a verify bucket step; false when the step is not one
  StepResult finish_verify_graph(const Pending& p);

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
  KernelChoice eager_kernels_{};
  // Two pinned staging areas (eager steps alternate, so one can be filled while the other's step
  // runs) and their device twins, for all per-step metadata and outputs.
  char* host_meta_[2] = {nullptr, nullptr};
  char* dev_meta_[2] = {nullptr, nullptr};
  cudaEvent_t meta_ev_[2][4] = {};  // per slot: start, end of the forward, outputs on the host, end of the target's part
  int meta_slot_ = 0;
  size_t meta_bytes_ = 0, meta_in_bytes_ = 0;  // both multiples of 256
  bool finalized_ = false;
  bool pdl_capable_ = false;  // sm_90+
  bool pdl_ = false;          // programmatic dependent launch (options, and capable)
  std::vector<Graph> graphs_;  // decode buckets, or verify buckets in an engine with a drafter: ascending batch per set
  GraphArena ga_{};
  char* graph_host_[2] = {nullptr, nullptr};  // pinned arena images; launches alternate between them
  // per slot: start, end of the forward, outputs on the host, end of the target's part (verify graphs)
  cudaEvent_t graph_ev_[2][4] = {};
  int graph_slot_ = 0;
  int last_launch_S_ = -1;                     // sampled rows of the last launch (-1: none yet)
  const int32_t* last_tokens_ = nullptr;       // device: the last launch's sampled tokens (what prev_rows reads)
  std::deque<Pending> pending_;
  char* graph_dev_ = nullptr;
  int graph_bt_stride_ = 0, graph_splits_max_ctx_ = 0;
  int64_t graph_steps_ = 0, graph_bytes_ = 0;
  std::vector<std::pair<std::string, double>> finalize_seconds_;
  VerifyArena va_{};  // the arena's layout in an engine with a drafter (ga_ without one)
  int verify_span_ = 0, verify_bt_stride_ = 0, verify_draft_items_ = 0;
  // The verify graphs' attention items per sequence and their most rows, per set: 0, every round's where one set
  // is captured, else those of rounds up to kAttnShortItemsMaxCtx keys (short items, plan.h); 1, the longer
  // rounds' (whole spans). Two sets where short items cut the span and max_model_len exceeds that context.
  int verify_items_[2] = {}, verify_max_rows_[2] = {}, verify_sets_ = 1;
  char* stage_[2] = {nullptr, nullptr};  // pinned upload stages (weights only; freed by finalize)
  cudaEvent_t stage_ev_[2] = {nullptr, nullptr};
  int stage_cur_ = 0;
  // Tap layers' rows (grown on demand; eager steps only).
  bf16* taps_ = nullptr;
  size_t taps_elems_ = 0;
  uint64_t* trace_ = nullptr;  // persistent_trace() buffer
  bool trace_on_ = false;
  // The host KV tier: pinned slots of one KV block each, and the copy streams. A batch of copies waits on
  // an event recorded on the compute stream at its launch, so it sees every K/V written by earlier steps
  // and lands after every earlier step that may still write a block it targets.
  char* host_kv_ = nullptr;
  int64_t num_host_blocks_ = 0;
  cudaStream_t save_stream_ = nullptr, load_stream_ = nullptr;
  struct CopyBatch {
    int64_t launch = 0, bytes = 0;
    cudaEvent_t start = nullptr, end = nullptr;
    std::vector<cudaEvent_t> groups;  // kv_load_wait: the end of each group of layers (layer_ready_ points here)
  };
  std::deque<CopyBatch> saves_, loads_;  // issued, not yet seen landed, in launch order
  std::vector<cudaEvent_t> free_events_;
  int64_t launches_ = 0;  // launches so far (the number of the latest)
  std::vector<cudaEvent_t> layer_ready_;  // per layer, for the launch being issued (kv_load_wait), else empty
  CopyStats copy_stats_;
  cudaEvent_t event();
  void retire(std::deque<CopyBatch>& q, bool restore, bool block);
  // The drafter (speculative decoding), or null.
  struct DrafterState {
    DrafterDims dims;
    ModelDims md;  // the target's dims with the drafter's layer count
    DrafterWeights w;
    KvLayout kv{};
    bf16* kv_cache = nullptr;   // its own pool, under the target's block ids
    bf16* feats = nullptr;      // [max tokens, taps * H] the step's context features
    int32_t* iota = nullptr;    // 0 .. max tokens - 1 (every row is a context row)
    std::vector<int> ctx_slot;  // [target layers] index among the taps, or -1
    int chunk = 0;              // drafting sequences per block pass (the activations hold chunk * block rows)
    DraftInputs scratch{};      // device outputs of draft_inputs, sized for one chunk
    bf16* markov_u = nullptr;
    float2* markov_part = nullptr;
    unsigned* markov_sync = nullptr;
    float* logprobs = nullptr;
    int64_t block_bytes() const { return kv.block_stride() * (int64_t)sizeof(bf16); }
  };
  std::unique_ptr<DrafterState> dr_;
};

}  // namespace oi
