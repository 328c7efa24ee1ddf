// Kernel timing harnesses, a build target of their own (cmake -DOPENINFER_BENCH=ON builds the module
// openinfer._bench beside _engine; bench/bench_kernels.py drives it). Each times one kernel family at the
// model's shapes the way a step runs it (cold L2, or replayed in a CUDA graph) and names the bound it is
// measured against; correctness of the same kernels is tests/test_gpu_kernels.py's job.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <memory>
#include <vector>

#include "../../csrc/gemm/fixed_gemm.h"
#include "../../csrc/gemm/gemm.h"
#include "../../csrc/gemm/skinny_gemm.h"
#include "../../csrc/kernels/attention.cuh"
#include "../../csrc/kernels/attention_sm90.cuh"
#include "../../csrc/kernels/elementwise.cuh"
#include "../../csrc/kernels/gemv.cuh"
#include "../../csrc/kernels/launch.cuh"
#include "../../csrc/kernels/random_init.cuh"

namespace py = pybind11;
using namespace oi;

namespace {

// RAII device buffer.
struct Dev {
  void* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t bytes) : n(bytes) { OI_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 16))); }
  ~Dev() { cudaFree(p); }
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

Gemm& ops_gemm() {
  static std::unique_ptr<Gemm> g;
  if (!g) g = std::make_unique<Gemm>("");
  return *g;
}

// Median time (us) of one replay of the CUDA graph that `enqueue` captures on a fresh stream (after one
// uncaptured run, which configures the kernels, and three warm-up replays).
template <typename F>
double graph_median_us(F&& enqueue, int reps) {
  OI_CHECK(reps >= 1, "reps must be >= 1, got " << reps);
  cudaStream_t st;
  OI_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  enqueue(st);
  OI_CUDA_CHECK(cudaStreamSynchronize(st));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  OI_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  enqueue(st);
  OI_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
  OI_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  OI_CUDA_CHECK(cudaEventCreate(&e0));
  OI_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<float> t;
  for (int i = 0; i < reps + 3; ++i) {
    OI_CUDA_CHECK(cudaEventRecord(e0, st));
    OI_CUDA_CHECK(cudaGraphLaunch(exec, st));
    OI_CUDA_CHECK(cudaEventRecord(e1, st));
    OI_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0.f;
    OI_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 3) t.push_back(ms * 1000.f);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
  std::sort(t.begin(), t.end());
  return (double)t[t.size() / 2];
}

}  // namespace

PYBIND11_MODULE(_bench, m) {
  m.doc() = "openinfer kernel timing harnesses (bench/cuda/)";
  m.def("set_pdl", [](bool on) { pdl_enabled() = on; }, "programmatic dependent launch for this thread's launches");
  m.def("gemv_chain", [](int M, const std::vector<std::array<int, 4>>& shapes, int layers, int reps, int kernel) {
    // Median graph-replay time (us) of `layers` repetitions of the fused GEMVs `shapes` ((N, K, prologue,
    // epilogue) each), every layer with its own weights: the decode step's weight stream without attention.
    OI_CHECK(M >= 1 && layers >= 1 && !shapes.empty(), "gemv_chain: need M >= 1, layers >= 1 and a shape");
    size_t per_layer = 0, max_k = 0, max_n = 0;
    for (const auto& sh : shapes) {
      OI_CHECK(sh[0] >= 1 && sh[1] >= 1, "gemv_chain: bad shape " << sh[0] << "x" << sh[1]);
      per_layer += (size_t)sh[0] * sh[1];
      max_n = std::max<size_t>(max_n, sh[0]);
      max_k = std::max<size_t>(max_k, sh[1]);
    }
    Dev w(per_layer * layers * 2), x((size_t)M * max_k * 2), nw(max_k * 2), y((size_t)M * max_n * 4);
    fill_normal(w.as<bf16>(), (int64_t)(per_layer * layers), 1, 0.f, 0.02f, 0);
    fill_normal(x.as<bf16>(), (int64_t)(M * max_k), 2, 0.f, 1.f, 0);
    fill_normal(nw.as<bf16>(), (int64_t)max_k, 3, 1.f, 0.1f, 0);
    OI_CUDA_CHECK(cudaMemset(y.p, 0, y.n));
    OI_CUDA_CHECK(cudaDeviceSynchronize());
    cudaDeviceProp prop{};
    OI_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    return graph_median_us([&](cudaStream_t st) {
      const bf16* W = w.as<bf16>();
      for (int l = 0; l < layers; ++l)
        for (const auto& sh : shapes) {
          GemvArgs g{x.as<bf16>(), nw.as<bf16>(), 1e-6f, W, y.p, M, sh[0], sh[1], (GemvKernel)kernel};
          if (!gemv(g, (GemvIn)sh[2], (GemvOut)sh[3], prop.multiProcessorCount, st))
            throw std::invalid_argument("gemv_chain: the fused GEMV refuses a shape");
          W += (size_t)sh[0] * sh[1];
        }
    }, reps);
  }, py::arg("M"), py::arg("shapes"), py::arg("layers"), py::arg("reps"), py::arg("kernel") = 0,
     "expected: ~90% of weight bytes / 4.21 TB/s at M = 1 and 2 (4B chain 2.8 MB per layer)");
  m.def("gemm_chain", [](int M, const std::vector<std::array<int, 2>>& shapes, int layers, int reps, int config,
                         int invariant_chunks) {
    // Median graph-replay time (us) of `layers` repetitions of the GEMMs `shapes` ((N, K) each, every layer
    // its own weights) at M rows: config -4 fixed_gemm as its launcher picks, -3 skinny_gemm (wgmma + TMA, 1-64 rows;
    // cuBLASLt where it refuses a shape), -2 cuBLASLt, -1 the engine's batch-invariant path (skinny_gemm's invariant
    // mode; fixed_gemm where it refuses a shape), >= 0 that fixed_gemm family. invariant_chunks (config -1 only):
    // skinny_gemm_invariant called directly with its 64-row chunks per block forced (1, 2, 4; 0: Gemm::run's path).
    OI_CHECK(M >= 1 && layers >= 1 && !shapes.empty(), "gemm_chain: need M >= 1, layers >= 1 and a shape");
    OI_CHECK(config >= kGemmFixed && config < kFixedGemmConfigs, "gemm_chain: config " << config);
    OI_CHECK(invariant_chunks == 0 || (config == -1 && (invariant_chunks == 1 || invariant_chunks == 2 ||
                                                        invariant_chunks == 4)),
             "gemm_chain: invariant_chunks " << invariant_chunks << " (1, 2 or 4 with config -1)");
    const bool fixed = config > -2 || config == kGemmFixed;
    size_t per_layer = 0, max_k = 0, max_n = 0;
    for (const auto& sh : shapes) {
      per_layer += (size_t)sh[0] * sh[1];
      max_n = std::max<size_t>(max_n, sh[0]);
      max_k = std::max<size_t>(max_k, sh[1]);
    }
    Dev w(per_layer * layers * 2), x((size_t)M * max_k * 2), y((size_t)M * max_n * 2);
    fill_normal(w.as<bf16>(), (int64_t)(per_layer * layers), 1, 0.f, 0.02f, 0);
    fill_normal(x.as<bf16>(), (int64_t)(M * max_k), 2, 0.f, 1.f, 0);
    OI_CUDA_CHECK(cudaMemset(y.p, 0, y.n));
    OI_CUDA_CHECK(cudaDeviceSynchronize());
    Gemm& gm = ops_gemm();
    return graph_median_us([&](cudaStream_t st) {
      const bf16* W = w.as<bf16>();
      for (int l = 0; l < layers; ++l)
        for (const auto& sh : shapes) {
          if (invariant_chunks > 0)
            OI_CHECK(skinny_gemm_invariant(x.as<bf16>(), W, y.p, M, sh[0], sh[1], false, false, st, false,
                                           invariant_chunks),
                     "gemm_chain: skinny_gemm_invariant refused N=" << sh[0] << " K=" << sh[1]);
          else
            gm.run(x.as<bf16>(), W, y.p, M, sh[0], sh[1], false, false, st, fixed, config);
          W += (size_t)sh[0] * sh[1];
        }
    }, reps);
  }, py::arg("M"), py::arg("shapes"), py::arg("layers"), py::arg("reps"), py::arg("config") = -2,
     py::arg("invariant_chunks") = 0,
     "one decode step's GEMMs in a graph (no RMSNorm, SiLU or attention): skinny_gemm's invariant mode (-4), "
     "skinny_gemm (-3), cuBLASLt (-2) or a fixed_gemm family");
  m.def("linear", [](int M, int N, int K, int in_mode, int out_mode, bool use_gemv, int reps) {
    // Median time (us) of one linear layer with a cold L2: the weights rotate over >= 256 MB of copies.
    const size_t wbytes = (size_t)N * K * 2;
    const int copies = (int)std::max<size_t>(2, (256u << 20) / wbytes + 1);
    Dev w(wbytes * copies), x((size_t)M * K * 2), nw((size_t)K * 2), y((size_t)M * N * 4), scratch((size_t)M * K * 2),
        gu((size_t)M * N * 2);
    fill_normal(w.as<bf16>(), (int64_t)N * K * copies, 1, 0.f, 0.02f, 0);
    fill_normal(x.as<bf16>(), (int64_t)M * K, 2, 0.f, 1.f, 0);
    fill_normal(nw.as<bf16>(), K, 3, 1.f, 0.1f, 0);
    fill_normal(y.as<bf16>(), (int64_t)M * N * 2, 4, 0.f, 1.f, 0);
    cudaDeviceProp prop{};
    OI_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    Gemm& gm = ops_gemm();
    auto run = [&](int i) {
      const bf16* W = w.as<bf16>() + (size_t)(i % copies) * N * K;
      if (use_gemv) {
        GemvArgs g{x.as<bf16>(), nw.as<bf16>(), 1e-6f, W, y.p, M, N, K};
        if (!gemv(g, (GemvIn)in_mode, (GemvOut)out_mode, prop.multiProcessorCount, 0)) return false;
      } else {
        const bf16* src = x.as<bf16>();
        if (in_mode == (int)GemvIn::kRmsNorm) { rmsnorm(src, nw.as<bf16>(), scratch.as<bf16>(), M, K, 1e-6f, 0); src = scratch.as<bf16>(); }
        if (out_mode == (int)GemvOut::kSiluMul) {
          gm.run(src, W, gu.p, M, N, K, false, false, 0);
          silu_mul(gu.as<bf16>(), y.as<bf16>(), M, N / 2, 0);
        } else {
          gm.run(src, W, y.p, M, N, K, out_mode == (int)GemvOut::kAccumulate, out_mode == (int)GemvOut::kF32, 0);
        }
      }
      return true;
    };
    for (int i = 0; i < 3; ++i)
      if (!run(i)) return -1.0;
    cudaEvent_t e0, e1;
    OI_CUDA_CHECK(cudaEventCreate(&e0));
    OI_CUDA_CHECK(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int i = 0; i < reps; ++i) {
      OI_CUDA_CHECK(cudaEventRecord(e0, 0));
      run(i + 3);
      OI_CUDA_CHECK(cudaEventRecord(e1, 0));
      OI_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0.f;
      OI_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      t.push_back(ms * 1000.f);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    std::sort(t.begin(), t.end());
    return (double)t[t.size() / 2];
  }, "one linear layer, cold L2 (us): the fused GEMV (use_gemv) or RMSNorm/SiLU + cuBLASLt; expected: the fused "
     "GEMV ~85-95% of N*K*2 bytes / 4.21 TB/s at M <= 2 (-1: it refuses the shape)");
  m.def("attention", [](int B, int ctx, int num_heads, int num_kv_heads, int layers, int num_splits, int reps,
                        bool key_warps, int cluster_cap) {
    const AttnVariant variant{key_warps, cluster_cap};
    // Median time (us) of one decode attention launch (B rows, each `ctx` keys) inside a CUDA graph of
    // `layers` launches over as many layers of the cache (cold L2, as in a real step).
    OI_CHECK(B >= 1 && ctx >= 1 && layers >= 1 && num_kv_heads >= 1 && num_heads % num_kv_heads == 0 &&
                 num_heads / num_kv_heads <= 16 && num_splits <= kAttnMaxSplits,
             "attention: need batch, ctx, layers >= 1, a query group of at most 16 heads and at most "
                 << kAttnMaxSplits << " splits");
    const int D = 128, pages = (ctx + 15) / 16, qw = (num_heads + 2 * num_kv_heads) * D;
    const KvLayout kv{layers, num_kv_heads, 16, D};
    Dev cache((size_t)B * pages * kv.block_stride() * 2), q((size_t)B * qw * 2), out((size_t)B * num_heads * D * 2);
    fill_normal(cache.as<bf16>(), (int64_t)(cache.n / 2), 5, 0.f, 1.f, 0);
    fill_normal(q.as<bf16>(), (int64_t)B * qw, 6, 0.f, 1.f, 0);
    std::vector<int32_t> bt((size_t)B * pages), pos(B, ctx - 1), lens(B, ctx);
    for (size_t i = 0; i < bt.size(); ++i) bt[i] = (int32_t)((i * 7919) % bt.size());  // scattered pages
    std::vector<AttnWork> work;
    for (int b = 0; b < B; ++b) work.push_back(AttnWork{b, b, 1, 0});
    cudaDeviceProp prop{};
    OI_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const int max_split_rows = 1 << 16;
    if (num_splits <= 0)
      num_splits = attn_num_splits(B, num_kv_heads, ctx, B, prop.multiProcessorCount, max_split_rows,
                                   num_heads / num_kv_heads, variant);
    Dev dbt(bt.size() * 4), dpos((size_t)B * 4), dlen((size_t)B * 4), dwork(work.size() * sizeof(AttnWork));
    Dev dwo((size_t)num_splits * B * num_heads * D * 4), dwl((size_t)num_splits * B * num_heads * 4), dcnt((size_t)B * num_kv_heads * 4);
    OI_CUDA_CHECK(cudaMemcpy(dbt.p, bt.data(), bt.size() * 4, cudaMemcpyHostToDevice));
    OI_CUDA_CHECK(cudaMemcpy(dpos.p, pos.data(), B * 4, cudaMemcpyHostToDevice));
    OI_CUDA_CHECK(cudaMemcpy(dlen.p, lens.data(), B * 4, cudaMemcpyHostToDevice));
    OI_CUDA_CHECK(cudaMemcpy(dwork.p, work.data(), work.size() * sizeof(AttnWork), cudaMemcpyHostToDevice));
    OI_CUDA_CHECK(cudaMemset(dcnt.p, 0, dcnt.n));
    AttnArgs a{};
    a.q = q.as<bf16>(); a.q_stride = qw; a.kv_cache = cache.as<bf16>(); a.kv = kv;
    a.block_tables = dbt.as<int32_t>(); a.bt_stride = pages; a.positions = dpos.as<int32_t>();
    a.context_lens = dlen.as<int32_t>(); a.work = dwork.as<AttnWork>(); a.num_work = B; a.num_tokens = B;
    a.num_heads = num_heads; a.num_splits = num_splits; a.max_rows = num_heads / num_kv_heads;
    a.out = out.as<bf16>(); a.ws_o = dwo.as<float>(); a.ws_lse = dwl.as<float>(); a.counters = dcnt.as<int>();
    a.variant = variant;
    const double us = graph_median_us([&](cudaStream_t st) {
      for (int l = 0; l < layers; ++l) {
        a.layer = l;
        paged_attention(a, st);
      }
    }, reps);
    return py::make_tuple(us / layers, attn_launch_shape(B, a.max_rows, num_splits, variant).splits);
  }, py::arg("B"), py::arg("ctx"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("layers"), py::arg("num_splits"),
     py::arg("reps"), py::arg("key_warps") = true, py::arg("cluster_cap") = 0,
     "(us per launch, splits launched) of decode attention; expected: KV bytes / ~3.5 TB/s once the grid fills the GPU "
     "(batch 1 at 1k context is latency-bound: ~9 us)");
  m.def("prefill_attention", [](int T, int prefix, int num_heads, int num_kv_heads, int layers, int reps,
                                int prefill_wgmma) {
    // Median time (us) of one prompt chunk's attention launch (T tokens at positions prefix .. prefix + T - 1 of one
    // sequence, causal, unsplit, in items of attn_tokens_per_item tokens as the engine makes them) inside a CUDA graph
    // of `layers` launches over as many layers of the cache.
    OI_CHECK(T >= 1 && prefix >= 0 && layers >= 1 && num_kv_heads >= 1 && num_heads % num_kv_heads == 0 &&
                 num_heads / num_kv_heads <= kAttnMaxRowsPerBlock,
             "prefill_attention: need T, layers >= 1, prefix >= 0 and a query group of at most "
                 << kAttnMaxRowsPerBlock << " heads");
    const int D = 128, ctx = prefix + T, pages = (ctx + 15) / 16, qw = (num_heads + 2 * num_kv_heads) * D;
    const int group = num_heads / num_kv_heads, per = attn_tokens_per_item(group);
    const KvLayout kv{layers, num_kv_heads, 16, D};
    Dev cache((size_t)pages * kv.block_stride() * 2), q((size_t)T * qw * 2), out((size_t)T * num_heads * D * 2);
    fill_normal(cache.as<bf16>(), (int64_t)(cache.n / 2), 5, 0.f, 1.f, 0);
    fill_normal(q.as<bf16>(), (int64_t)T * qw, 6, 0.f, 1.f, 0);
    std::vector<int32_t> bt(pages), pos(T), lens(1, ctx);
    for (int i = 0; i < pages; ++i) bt[i] = (int32_t)(((int64_t)i * 7919) % pages);  // scattered pages (7919 is prime)
    for (int t = 0; t < T; ++t) pos[t] = prefix + t;
    std::vector<AttnWork> work;
    int max_rows = 1;
    for (int t0 = 0; t0 < T; t0 += per) {
      work.push_back(AttnWork{0, t0, std::min(per, T - t0), t0});
      max_rows = std::max(max_rows, work.back().num_tok * group);
    }
    Dev dbt(bt.size() * 4), dpos((size_t)T * 4), dlen(4), dwork(work.size() * sizeof(AttnWork));
    OI_CUDA_CHECK(cudaMemcpy(dbt.p, bt.data(), bt.size() * 4, cudaMemcpyHostToDevice));
    OI_CUDA_CHECK(cudaMemcpy(dpos.p, pos.data(), (size_t)T * 4, cudaMemcpyHostToDevice));
    OI_CUDA_CHECK(cudaMemcpy(dlen.p, lens.data(), 4, cudaMemcpyHostToDevice));
    OI_CUDA_CHECK(cudaMemcpy(dwork.p, work.data(), work.size() * sizeof(AttnWork), cudaMemcpyHostToDevice));
    AttnArgs a{};
    a.q = q.as<bf16>(); a.q_stride = qw; a.kv_cache = cache.as<bf16>(); a.kv = kv;
    a.block_tables = dbt.as<int32_t>(); a.bt_stride = pages; a.positions = dpos.as<int32_t>();
    a.context_lens = dlen.as<int32_t>(); a.work = dwork.as<AttnWork>(); a.num_work = (int)work.size(); a.num_tokens = T;
    a.num_heads = num_heads; a.num_splits = 1; a.max_rows = max_rows; a.out = out.as<bf16>();
    a.variant.prefill_wgmma = prefill_wgmma;
    const bool wgmma = prefill_wgmma_takes(a, prefill_wgmma_mode(a.variant));
    const double us = graph_median_us([&](cudaStream_t st) {
      for (int l = 0; l < layers; ++l) {
        a.layer = l;
        paged_attention(a, st);
      }
    }, reps);
    return py::make_tuple(us / layers, wgmma);
  }, py::arg("T"), py::arg("prefix"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("layers"), py::arg("reps"),
     py::arg("prefill_wgmma") = 0,
     "(us per launch, whether the wgmma kernel ran) of a prompt chunk's attention; prefill_wgmma as "
     "AttnVariant::prefill_wgmma (0 the mma.sync kernel, 1 the Hopper wgmma kernel where it takes the launch)");
}
