// The one GEMM of the engine: Y[M, N] = X[M, K] · W[N, K]^T (+ Y), bf16 operands, fp32 accumulation,
// through cuBLASLt. cuBLASLt is opened with dlopen when the first Gemm is made, so `_engine` imports on
// machines without CUDA libraries; plans are cached per shape (made outside any graph capture).
#pragma once
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "../common.h"

namespace oi {

struct LtApi;

constexpr int kGemmSkinny = -3;  // Gemm::run's config for skinny_gemm (not `fixed`)
constexpr int kGemmFixed = -4;   // Gemm::run(fixed)'s config for fixed_gemm's own pick (tests, A/B)

class Gemm {
 public:
  explicit Gemm(const std::string& library_hint);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // accumulate: Y += X·Wᵀ (the residual add rides in the epilogue); out_f32: Y is fp32 (logits).
  // fixed: a batch-invariant kernel instead, whose rows do not depend on M (--deterministic): skinny_gemm's
  // invariant mode (skinny_gemm.h, sm_90) where it takes the shape, whatever M is, else fixed_gemm (fixed_gemm.h);
  // config kGemmFixed forces fixed_gemm's own pick and >= 0 one of its families (tests, A/B). Without `fixed`,
  // skinny_gemm takes what it can of up to kSkinnyEngineRows rows, cuBLASLt the rest; kGemmSkinny sends any shape
  // skinny_gemm takes (1-64 rows) to it, for A/B runs (bench gemm_chain, tests).
  void run(const bf16* X, const bf16* W, void* Y, int M, int N, int K, bool accumulate, bool out_f32, cudaStream_t s,
           bool fixed = false, int config = -1);
  // While on, a new shape with M <= 512 times the heuristic's candidates on the buffers it is given and
  // keeps the fastest (the data is overwritten: only for warm-up passes over dummy inputs).
  void set_autotune(bool on) { autotune_ = on; }

 private:
  struct Plan;
  using Key = std::tuple<int, int, int, bool, bool>;
  Plan& plan(int M, int N, int K, bool accumulate, bool out_f32, const bf16* X, const bf16* W, void* Y, cudaStream_t s);

  std::unique_ptr<LtApi> api_;
  void* handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 32u << 20;
  bool autotune_ = false;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace oi
