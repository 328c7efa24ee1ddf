#include <cublasLt.h>
#include <dlfcn.h>

#include <vector>

#include "fixed_gemm.h"
#include "gemm.h"
#include "skinny_gemm.h"
#include "../kernels/launch.cuh"

#define OI_LT_CHECK(expr)                                                                         \
  do {                                                                                            \
    cublasStatus_t oi_st_ = (expr);                                                               \
    if (oi_st_ != CUBLAS_STATUS_SUCCESS) ::oi::fail("cuBLASLt error " + std::to_string((int)oi_st_) + " in " #expr, __FILE__, __LINE__); \
  } while (0)

namespace oi {

struct LtApi {
  void* lib = nullptr;
#define OI_LT_FN(name) decltype(&::name) name = nullptr;
  OI_LT_FN(cublasLtCreate)
  OI_LT_FN(cublasLtDestroy)
  OI_LT_FN(cublasLtMatmulDescCreate)
  OI_LT_FN(cublasLtMatmulDescDestroy)
  OI_LT_FN(cublasLtMatmulDescSetAttribute)
  OI_LT_FN(cublasLtMatrixLayoutCreate)
  OI_LT_FN(cublasLtMatrixLayoutDestroy)
  OI_LT_FN(cublasLtMatmulPreferenceCreate)
  OI_LT_FN(cublasLtMatmulPreferenceDestroy)
  OI_LT_FN(cublasLtMatmulPreferenceSetAttribute)
  OI_LT_FN(cublasLtMatmulAlgoGetHeuristic)
  OI_LT_FN(cublasLtMatmul)
#undef OI_LT_FN
  ~LtApi() {
    if (lib) dlclose(lib);
  }
};

static std::unique_ptr<LtApi> load_lt(const std::string& hint) {
  auto api = std::make_unique<LtApi>();
  std::vector<std::string> names;
  if (!hint.empty()) names.push_back(hint);
  names.push_back("libcublasLt.so.13");
  names.push_back("libcublasLt.so");
  std::string errors;
  for (const auto& n : names) {
    api->lib = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (api->lib) break;
    errors += std::string("\n  ") + dlerror();
  }
  OI_CHECK(api->lib, "cannot load cuBLASLt (libcublasLt.so.13); install the CUDA 13 toolkit or `pip install nvidia-cublas`:" << errors);
#define OI_LT_SYM(name)                                                                   \
  api->name = reinterpret_cast<decltype(api->name)>(dlsym(api->lib, #name));              \
  OI_CHECK(api->name, "cuBLASLt library lacks symbol " #name);
  OI_LT_SYM(cublasLtCreate)
  OI_LT_SYM(cublasLtDestroy)
  OI_LT_SYM(cublasLtMatmulDescCreate)
  OI_LT_SYM(cublasLtMatmulDescDestroy)
  OI_LT_SYM(cublasLtMatmulDescSetAttribute)
  OI_LT_SYM(cublasLtMatrixLayoutCreate)
  OI_LT_SYM(cublasLtMatrixLayoutDestroy)
  OI_LT_SYM(cublasLtMatmulPreferenceCreate)
  OI_LT_SYM(cublasLtMatmulPreferenceDestroy)
  OI_LT_SYM(cublasLtMatmulPreferenceSetAttribute)
  OI_LT_SYM(cublasLtMatmulAlgoGetHeuristic)
  OI_LT_SYM(cublasLtMatmul)
#undef OI_LT_SYM
  return api;
}

struct Gemm::Plan {
  LtApi* api = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (desc) api->cublasLtMatmulDescDestroy(desc);
    if (a) api->cublasLtMatrixLayoutDestroy(a);
    if (b) api->cublasLtMatrixLayoutDestroy(b);
    if (c) api->cublasLtMatrixLayoutDestroy(c);
  }
};

Gemm::Gemm(const std::string& library_hint) : api_(load_lt(library_hint)) {
  cublasLtHandle_t h = nullptr;
  OI_LT_CHECK(api_->cublasLtCreate(&h));
  handle_ = h;
  OI_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
}

Gemm::~Gemm() {
  plans_.clear();
  if (workspace_) cudaFree(workspace_);
  if (handle_) api_->cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

Gemm::Plan& Gemm::plan(int M, int N, int K, bool accumulate, bool out_f32, const bf16* X, const bf16* W, void* Y,
                       cudaStream_t s) {
  const Key key{M, N, K, accumulate, out_f32};
  auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;
  auto p = std::make_unique<Plan>();
  p->api = api_.get();
  // Column-major view: Yᵀ[N, M] = W[K, N]ᵀ · Xᵀ[K, M]
  OI_LT_CHECK(api_->cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  OI_LT_CHECK(api_->cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  OI_LT_CHECK(api_->cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const cudaDataType_t out_t = out_f32 ? CUDA_R_32F : CUDA_R_16BF;
  OI_LT_CHECK(api_->cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, K, N, K));
  OI_LT_CHECK(api_->cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, K, M, K));
  OI_LT_CHECK(api_->cublasLtMatrixLayoutCreate(&p->c, out_t, N, M, N));
  cublasLtMatmulPreference_t pref = nullptr;
  OI_LT_CHECK(api_->cublasLtMatmulPreferenceCreate(&pref));
  OI_LT_CHECK(api_->cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                         &workspace_bytes_, sizeof(workspace_bytes_)));
  constexpr int kCandidates = 8;
  cublasLtMatmulHeuristicResult_t res[kCandidates]{};
  int found = 0;
  const bool tune = autotune_ && M <= 512;
  const cublasStatus_t st = api_->cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(handle_), p->desc, p->a,
                                                                 p->b, p->c, p->c, pref, tune ? kCandidates : 1, res, &found);
  api_->cublasLtMatmulPreferenceDestroy(pref);
  OI_CHECK(st == CUBLAS_STATUS_SUCCESS && found > 0,
           "cuBLASLt has no algorithm for GEMM M=" << M << " N=" << N << " K=" << K << " (status " << (int)st << ")");
  p->algo = res[0].algo;
  if (tune && found > 1) {
    // Small-M (decode) shapes: the heuristic's first pick is often not the fastest; time each candidate.
    cudaEvent_t e0, e1;
    OI_CUDA_CHECK(cudaEventCreate(&e0));
    OI_CUDA_CHECK(cudaEventCreate(&e1));
    const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
    float best = 1e30f;
    for (int i = 0; i < found; ++i) {
      if (res[i].workspaceSize > workspace_bytes_) continue;
      auto launch = [&]() {
        return api_->cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), p->desc, &alpha, W, p->a, X, p->b, &beta, Y,
                                    p->c, Y, p->c, &res[i].algo, workspace_, workspace_bytes_, s);
      };
      if (launch() != CUBLAS_STATUS_SUCCESS) continue;
      OI_CUDA_CHECK(cudaEventRecord(e0, s));
      constexpr int kReps = 10;
      for (int r = 0; r < kReps; ++r) OI_LT_CHECK(launch());
      OI_CUDA_CHECK(cudaEventRecord(e1, s));
      OI_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0.f;
      OI_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (ms < best) {
        best = ms;
        p->algo = res[i].algo;
      }
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  }
  auto& ref = *p;
  plans_.emplace(key, std::move(p));
  return ref;
}

void Gemm::run(const bf16* X, const bf16* W, void* Y, int M, int N, int K, bool accumulate, bool out_f32,
               cudaStream_t s, bool fixed, int config) {
  if (M == 0) return;
  if (fixed) {
    // skinny_gemm's batch-invariant mode where it takes the shape: whether it does never depends on M, so a shape's
    // rows all go one way (H100, 2026-12-07: --deterministic's cost over the default at 4B batch 32 / 64 and a
    // 1,024-token prefill +7% / +24% / +102%, against fixed_gemm's +54% / +116% / +325%)
    if ((config == -1 || config == kGemmSkinny) && skinny_gemm_invariant(X, W, Y, M, N, K, accumulate, out_f32, s))
      return;
    return fixed_gemm(X, W, Y, M, N, K, accumulate, out_f32, s, config < 0 ? -1 : config);
  }
  if ((config == kGemmSkinny || (config == -1 && M <= kSkinnyEngineRows)) &&
      skinny_gemm(X, W, Y, M, N, K, accumulate, out_f32, s))
    return;
  Plan& p = plan(M, N, K, accumulate, out_f32, X, W, Y, s);
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  OI_LT_CHECK(api_->cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), p.desc, &alpha, W, p.a, X, p.b, &beta, Y,
                                   p.c, Y, p.c, &p.algo, workspace_, workspace_bytes_, s));
  pdl_follows_library() = true;
}

}  // namespace oi
