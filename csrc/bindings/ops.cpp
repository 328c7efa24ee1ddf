// Kernel test ops: host arrays in, one kernel (or launcher) on the GPU, host arrays out (bf16 as uint16),
// so that tests/test_gpu_kernels.py checks each kernel family against the NumPy reference.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>

#include "../engine/plan.h"
#include "../gemm/fixed_gemm.h"
#include "../gemm/gemm.h"
#include "../gemm/skinny_gemm.h"
#include "../kernels/attention.cuh"
#include "../kernels/attention_sm90.cuh"
#include "../kernels/elementwise.cuh"
#include "../kernels/gemv.cuh"
#include "../kernels/launch.cuh"
#include "../kernels/persistent.cuh"
#include "../kernels/random_init.cuh"
#include "../kernels/rope_kv.cuh"
#include "../kernels/sampling.cuh"

namespace py = pybind11;
using namespace oi;

namespace {

template <typename T>
using Arr = py::array_t<T, py::array::c_style | py::array::forcecast>;

// RAII device buffer.
struct Dev {
  void* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t bytes) : n(bytes) { OI_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 16))); }
  template <typename T>
  Dev(const Arr<T>& a) : Dev(a.size() * sizeof(T)) { OI_CUDA_CHECK(cudaMemcpy(p, a.data(), n, cudaMemcpyHostToDevice)); }
  ~Dev() { cudaFree(p); }
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
  template <typename T>
  py::array_t<T> get(std::vector<py::ssize_t> shape) const {
    py::array_t<T> out(shape);
    OI_CUDA_CHECK(cudaMemcpy(out.mutable_data(), p, out.size() * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }
};

Gemm& ops_gemm() {
  static std::unique_ptr<Gemm> g;
  if (!g) g = std::make_unique<Gemm>("");
  return *g;
}

GemvKernel gemv_kernel(int k) {
  OI_CHECK(k >= 0 && k <= 3, "gemv kernel " << k << " (0 auto, 1 CUDA cores, 2 CUDA cores with bf16 input, 3 tensor cores)");
  return (GemvKernel)k;
}

}  // namespace

void bind_ops(py::module_& m) {
  py::module_ ops = m.def_submodule("ops", "single kernels on host arrays, for tests");
  ops.def("gemv_takes_tensor_cores", [](int M, int K, int in_mode, int out_mode, int kernel) {
    return gemv_takes_tensor_cores(M, K, (GemvIn)in_mode, (GemvOut)out_mode, gemv_kernel(kernel));
  }, py::arg("M"), py::arg("K"), py::arg("in_mode"), py::arg("out_mode"), py::arg("kernel") = 0,
     "whether the fused GEMV takes the tensor-core kernel for M rows, K, the prologue/epilogue and kernel choice");
  ops.def("persistent_fits", [](int hidden, int intermediate, int heads, int kv_heads, int head_dim) {
    return persistent_fits(hidden, intermediate, heads, kv_heads, head_dim);
  }, "whether persistent_layers() serves this geometry on the current device");
  ops.def("attention_launch_shape", [](int num_work, int max_rows, int num_splits, bool key_warps, int cluster_cap) {
    const AttnLaunch l = attn_launch_shape(num_work, max_rows, num_splits, AttnVariant{key_warps, cluster_cap});
    return py::dict(py::arg("key_warps") = l.key_warps, py::arg("early") = l.early, py::arg("splits") = l.splits,
                    py::arg("cluster") = l.cluster);
  }, py::arg("num_work"), py::arg("max_rows"), py::arg("num_splits"), py::arg("key_warps") = true, py::arg("cluster_cap") = 0,
     "how paged_attention launches for these counts and variant: key_warps, early, splits (launched), cluster");
  ops.def("set_pdl", [](bool on) { pdl_enabled() = on; },
          "programmatic dependent launch for this thread's later launches and captures (engines set it too)");
  ops.def("rmsnorm", [](const Arr<uint16_t>& x, const Arr<uint16_t>& w, float eps) {
    const int H = (int)w.size(), T = (int)(x.size() / H);
    Dev dx(x), dw(w), dout(x.size() * 2);
    rmsnorm(dx.as<bf16>(), dw.as<bf16>(), dout.as<bf16>(), T, H, eps, 0);
    OI_CUDA_CHECK(cudaDeviceSynchronize());
    return dout.get<uint16_t>({T, H});
  });
  ops.def("silu_mul", [](const Arr<uint16_t>& gu, int I) {
    const int T = (int)(gu.size() / (2 * I));
    Dev dg(gu), dout((size_t)T * I * 2);
    silu_mul(dg.as<bf16>(), dout.as<bf16>(), T, I, 0);
    OI_CUDA_CHECK(cudaDeviceSynchronize());
    return dout.get<uint16_t>({T, I});
  });
  ops.def("embedding", [](const Arr<uint16_t>& table, const Arr<int32_t>& ids, int H) {
    const int T = (int)ids.size();
    Dev dt(table), di(ids), dout((size_t)T * H * 2);
    embedding_lookup(dt.as<bf16>(), di.as<int32_t>(), dout.as<bf16>(), T, H, 0);
    OI_CUDA_CHECK(cudaDeviceSynchronize());
    return dout.get<uint16_t>({T, H});
  });
  ops.def("gemm", [](const Arr<uint16_t>& x, const Arr<uint16_t>& w, int M, int N, int K, py::object y_init, bool out_f32,
                     bool fixed, int config) {
    const size_t ob = (size_t)M * N * (out_f32 ? 4 : 2);
    Dev dx(x), dw(w), dy(ob);
    const bool acc = !y_init.is_none();
    if (acc) {
      py::array a = y_init.cast<py::array>();
      if ((size_t)a.nbytes() != ob) throw std::invalid_argument("gemm: y_init has the wrong size");
      OI_CUDA_CHECK(cudaMemcpy(dy.p, a.data(), ob, cudaMemcpyHostToDevice));
    } else {  // NaN-filled: an element the kernel skips cannot pass as the last call's result left in reused memory
      OI_CUDA_CHECK(cudaMemset(dy.p, 0xFF, ob));
    }
    ops_gemm().run(dx.as<bf16>(), dw.as<bf16>(), dy.p, M, N, K, acc, out_f32, 0, fixed, config);
    OI_CUDA_CHECK(cudaDeviceSynchronize());
    if (out_f32) return py::array(dy.get<float>({M, N}));
    return py::array(dy.get<uint16_t>({M, N}));
  }, py::arg("x"), py::arg("w"), py::arg("M"), py::arg("N"), py::arg("K"), py::arg("y_init"), py::arg("out_f32"),
     py::arg("fixed") = false, py::arg("config") = -1,
     "Y = X Wᵀ (+ y_init); fixed: the batch-invariant path (rows do not depend on M: skinny_gemm's invariant mode where "
     "it takes the shape, else fixed_gemm), config GEMM_FIXED forcing fixed_gemm's pick, >= 0 one of its families");
  ops.attr("FIXED_GEMM_CONFIGS") = kFixedGemmConfigs;
  ops.attr("GEMM_SKINNY") = kGemmSkinny;
  ops.attr("GEMM_FIXED") = kGemmFixed;
  ops.def("skinny_gemm", [](const Arr<uint16_t>& x, const Arr<uint16_t>& w, int M, int N, int K, py::object y_init,
                            bool out_f32, bool silu_up, int splits, int graph_replays, bool invariant,
                            int chunks_per_block) -> py::object {
    if (invariant && splits != 0) throw std::invalid_argument("skinny_gemm: the invariant mode's splits are its own");
    if (chunks_per_block != 0 && (!invariant || (chunks_per_block != 1 && chunks_per_block != 2 && chunks_per_block != 4)))
      throw std::invalid_argument("skinny_gemm: chunks_per_block is the invariant mode's, 1, 2 or 4 (0: its rule)");
    const int ncols = silu_up ? N / 2 : N;
    const size_t ob = (size_t)M * ncols * (out_f32 ? 4 : 2);
    Dev dx(x), dw(w), dy(ob), dy0(ob);
    const bool acc = !y_init.is_none();
    if (acc) {
      py::array a = y_init.cast<py::array>();
      if ((size_t)a.nbytes() != ob) throw std::invalid_argument("skinny_gemm: y_init has the wrong size");
      OI_CUDA_CHECK(cudaMemcpy(dy0.p, a.data(), ob, cudaMemcpyHostToDevice));
    } else {  // NaN-filled: an output the kernel skips cannot pass
      OI_CUDA_CHECK(cudaMemset(dy0.p, 0xFF, ob));
    }
    OI_CUDA_CHECK(cudaMemcpy(dy.p, dy0.p, ob, cudaMemcpyDeviceToDevice));
    auto call = [&](cudaStream_t st) {
      return invariant ? skinny_gemm_invariant(dx.as<bf16>(), dw.as<bf16>(), dy.p, M, N, K, acc, out_f32, st, silu_up,
                                               chunks_per_block)
                       : skinny_gemm(dx.as<bf16>(), dw.as<bf16>(), dy.p, M, N, K, acc, out_f32, st, silu_up, splits);
    };
    if (!call(0)) return py::none();
    OI_CUDA_CHECK(cudaDeviceSynchronize());
    auto fetch = [&]() { return out_f32 ? py::array(dy.get<float>({M, ncols})) : py::array(dy.get<uint16_t>({M, ncols})); };
    py::array eager = fetch();
    if (graph_replays <= 0) return eager;
    // The same call captured in a graph (Y reset from y_init inside it) and replayed graph_replays times.
    OI_CUDA_CHECK(cudaMemset(dy.p, 0, ob));
    cudaStream_t st;
    OI_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaGraph_t graph = nullptr;
    OI_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    try {
      OI_CUDA_CHECK(cudaMemcpyAsync(dy.p, dy0.p, ob, cudaMemcpyDeviceToDevice, st));
      call(st);
    } catch (...) {
      cudaStreamEndCapture(st, &graph);
      if (graph) cudaGraphDestroy(graph);
      cudaStreamDestroy(st);
      throw;
    }
    OI_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
    cudaGraphExec_t exec;
    OI_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < graph_replays; ++i) OI_CUDA_CHECK(cudaGraphLaunch(exec, st));
    OI_CUDA_CHECK(cudaStreamSynchronize(st));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(st);
    return py::make_tuple(eager, fetch());
  }, py::arg("x"), py::arg("w"), py::arg("M"), py::arg("N"), py::arg("K"), py::arg("y_init"), py::arg("out_f32"),
     py::arg("silu_up") = false, py::arg("splits") = 0, py::arg("graph_replays") = 0, py::arg("invariant") = false,
     py::arg("chunks_per_block") = 0,
     "skinny_gemm: Y = X Wᵀ (+ y_init; silu_up: SiLU(gate)·up of W = [gate; up], [M, N / 2]); None where it refuses "
     "the shape; splits forces the K splits; graph_replays > 0: (eager, the same call replayed in a CUDA graph); "
     "invariant: the batch-invariant mode (skinny_gemm_invariant: any M, rows independent of M); chunks_per_block: "
     "its 64-row chunks per block forced (1: the single-chunk kernel, 2, 4; 0: the rule; the same bits)");
  ops.def("skinny_gemm_splits", [](int M, int N, int K, bool silu_up, int splits, bool invariant) {
    int dev = 0, sms = 0;
    OI_CUDA_CHECK(cudaGetDevice(&dev));
    OI_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const int s = invariant ? skinny_gemm_invariant_splits(N, K, silu_up) : skinny_gemm_splits(M, N, K, silu_up, splits);
    const int chunks = invariant ? skinny_gemm_invariant_chunks(M, N, K, silu_up) : (s > 0 ? 1 : 0);
    return py::dict(py::arg("splits") = s, py::arg("num_sms") = sms, py::arg("chunks_per_block") = chunks);
  }, py::arg("M"), py::arg("N"), py::arg("K"), py::arg("silu_up") = false, py::arg("splits") = 0,
     py::arg("invariant") = false,
     "the K splits skinny_gemm launches for this shape (0: refused; invariant: the batch-invariant mode's, which "
     "ignore M), the device's SM count and the 64-row chunks per block (invariant: its rule at M, else 1)");
  ops.def("skinny_gemm_chain", [](const Arr<uint16_t>& x, const Arr<uint16_t>& w1, const Arr<uint16_t>& w2, int M, int N1,
                                  int K, int N2, int mode) {
    // h = x·w1ᵀ [M, N1]; o = h·w2ᵀ [M, N2]; o += h·w2ᵀ: each launch reads what the one before wrote (X, then Y).
    // mode 0: every launch alone (no PDL, a device sync after each); 1: back to back on one stream (PDL);
    // 2: captured in a CUDA graph (programmatic edges) after a mode-1 warm-up, replayed twice.
    OI_CHECK(mode >= 0 && mode <= 2, "skinny_gemm_chain: mode " << mode);
    Dev dx(x), dw1(w1), dw2(w2), dh((size_t)M * N1 * 2), dout((size_t)M * N2 * 2);
    cudaStream_t st;
    OI_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const bool pdl_before = pdl_enabled();
    auto chain = [&](bool sync) {
      OI_CUDA_CHECK(cudaMemsetAsync(dh.p, 0xFF, dh.n, st));
      OI_CUDA_CHECK(cudaMemsetAsync(dout.p, 0xFF, dout.n, st));
      auto run = [&](const void* X, const void* W, void* Y, int n, int k, bool acc) {
        OI_CHECK(skinny_gemm(static_cast<const bf16*>(X), static_cast<const bf16*>(W), Y, M, n, k, acc, false, st),
                 "skinny_gemm_chain: skinny_gemm refused M=" << M << " N=" << n << " K=" << k);
        if (sync) OI_CUDA_CHECK(cudaStreamSynchronize(st));
      };
      run(dx.p, dw1.p, dh.p, N1, K, false);
      run(dh.p, dw2.p, dout.p, N2, N1, false);
      run(dh.p, dw2.p, dout.p, N2, N1, true);
    };
    pdl_enabled() = mode != 0;
    try {
      chain(mode == 0);
      if (mode == 2) {
        OI_CUDA_CHECK(cudaStreamSynchronize(st));
        cudaGraph_t graph = nullptr;
        OI_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        try {
          chain(false);
        } catch (...) {
          cudaStreamEndCapture(st, &graph);
          if (graph) cudaGraphDestroy(graph);
          throw;
        }
        OI_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
        cudaGraphExec_t exec;
        OI_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        for (int i = 0; i < 2; ++i) OI_CUDA_CHECK(cudaGraphLaunch(exec, st));
        OI_CUDA_CHECK(cudaStreamSynchronize(st));
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      }
      OI_CUDA_CHECK(cudaStreamSynchronize(st));
    } catch (...) {
      pdl_enabled() = pdl_before;
      cudaStreamDestroy(st);
      throw;
    }
    pdl_enabled() = pdl_before;
    cudaStreamDestroy(st);
    return py::make_tuple(dh.get<uint16_t>({M, N1}), dout.get<uint16_t>({M, N2}));
  }, py::arg("x"), py::arg("w1"), py::arg("w2"), py::arg("M"), py::arg("N1"), py::arg("K"), py::arg("N2"),
     py::arg("mode"), "(h, o) of three dependent skinny_gemm launches, alone, back to back under PDL, or replayed in a graph");
  ops.def("gemv", [](const Arr<uint16_t>& x, py::object norm_w, const Arr<uint16_t>& w, int M, int N, int K, int in_mode,
                     int out_mode, py::object y_init, float eps, int kernel) {
    const bool f32out = out_mode == (int)GemvOut::kF32;
    const int ncols = out_mode == (int)GemvOut::kSiluMul ? N / 2 : N;
    const size_t ob = (size_t)M * ncols * (f32out ? 4 : 2);
    Dev dx(x), dw(w), dy(ob);
    std::unique_ptr<Dev> dn;
    if (!norm_w.is_none()) dn = std::make_unique<Dev>(norm_w.cast<Arr<uint16_t>>());
    if (!y_init.is_none()) {
      py::array a = y_init.cast<py::array>();
      if ((size_t)a.nbytes() != ob) throw std::invalid_argument("gemv: y_init has the wrong size");
      OI_CUDA_CHECK(cudaMemcpy(dy.p, a.data(), ob, cudaMemcpyHostToDevice));
    }
    cudaDeviceProp prop{};
    OI_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    GemvArgs g{dx.as<bf16>(), dn ? dn->as<bf16>() : nullptr, eps, dw.as<bf16>(), dy.p, M, N, K, gemv_kernel(kernel)};
    const bool ran = gemv(g, (GemvIn)in_mode, (GemvOut)out_mode, prop.multiProcessorCount, 0);
    OI_CUDA_CHECK(cudaDeviceSynchronize());
    if (!ran) return py::object(py::none());
    if (f32out) return py::object(dy.get<float>({M, ncols}));
    return py::object(dy.get<uint16_t>({M, ncols}));
  }, py::arg("x"), py::arg("norm_w"), py::arg("w"), py::arg("M"), py::arg("N"), py::arg("K"), py::arg("in_mode"),
     py::arg("out_mode"), py::arg("y_init"), py::arg("eps"), py::arg("kernel") = 0,
     "the fused GEMV (None where it refuses the shape); kernel: 0 auto, 1 CUDA cores, 2 CUDA cores with bf16 input, 3 tensor cores");
  ops.def("qk_norm_rope_kv_write",
          [](const Arr<uint16_t>& qkv, const Arr<uint16_t>& qw, const Arr<uint16_t>& kw, const Arr<int32_t>& positions,
             const Arr<int32_t>& slots, const Arr<uint16_t>& cache, int layer, int num_layers, int num_heads,
             int num_kv_heads, double theta, float eps, int max_pos) {
            const int T = (int)positions.size(), D = 128;
            KvLayout kv{num_layers, num_kv_heads, 16, D};
            Dev dq(qkv), dqw(qw), dkw(kw), dp(positions), ds(slots), dc(cache);
            Dev rope((size_t)max_pos * (D / 2) * sizeof(float2));
            rope_table_init(rope.as<float2>(), max_pos, D, theta, 0);
            qk_norm_rope_kv_write(dq.as<bf16>(), dqw.as<bf16>(), dkw.as<bf16>(), dp.as<int32_t>(), ds.as<int32_t>(),
                                  rope.as<float2>(), dc.as<bf16>(), layer, kv, T, num_heads, eps, 0);
            OI_CUDA_CHECK(cudaDeviceSynchronize());
            return py::make_tuple(dq.get<uint16_t>({T, (py::ssize_t)(qkv.size() / std::max(T, 1))}),
                                  dc.get<uint16_t>({(py::ssize_t)cache.size()}));
          });
  ops.def("paged_attention",
          [](const Arr<uint16_t>& qkv, const Arr<uint16_t>& cache, const Arr<int32_t>& block_tables,
             const Arr<int32_t>& qsl, const Arr<int32_t>& context_lens, const Arr<int32_t>& positions, int layer,
             int num_layers, int num_heads, int num_kv_heads, int num_splits, bool key_warps, int cluster_cap,
             int segment, int prefill_wgmma, bool short_items) {
            const int T = (int)positions.size(), B = (int)context_lens.size(), D = 128;
            if (qsl.size() != B + 1) throw std::invalid_argument("paged_attention: query_start_loc must have B + 1 entries");
            const AttnVariant variant{key_warps, cluster_cap, prefill_wgmma};
            int max_rows = 1, max_ctx = 0;
            // short_items: cut whatever the context, as a verify graph captures them
            const std::vector<AttnWork> work = attention_work(qsl.data(), B, num_heads / num_kv_heads, &max_rows, short_items);
            for (int b = 0; b < B; ++b) max_ctx = std::max(max_ctx, context_lens.at(b));
            cudaDeviceProp prop{};
            OI_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
            const int max_split_rows = 1 << 16;
            if (num_splits <= 0)
              num_splits = segment > 0 ? attn_segment_splits((int)work.size(), num_kv_heads, max_ctx, T,
                                                             prop.multiProcessorCount, max_split_rows)
                                       : attn_num_splits((int)work.size(), num_kv_heads, max_ctx, T,
                                                         prop.multiProcessorCount, max_split_rows, max_rows, variant);
            if (segment > 0 && num_splits > 1 && num_splits < (max_ctx + segment - 1) / segment)
              throw std::invalid_argument("paged_attention: a segmented split launch needs a split per segment");
            Dev dq(qkv), dc(cache), dbt(block_tables), dpos(positions), dctx(context_lens);
            Dev dwork(work.size() * sizeof(AttnWork)), dout((size_t)T * num_heads * D * 2);
            Dev dwo((size_t)std::max(num_splits, 1) * T * num_heads * D * 4), dwl((size_t)num_splits * T * num_heads * 4);
            Dev dcnt(work.size() * num_kv_heads * sizeof(int));
            OI_CUDA_CHECK(cudaMemset(dcnt.p, 0, work.size() * num_kv_heads * sizeof(int)));
            OI_CUDA_CHECK(cudaMemcpy(dwork.p, work.data(), work.size() * sizeof(AttnWork), cudaMemcpyHostToDevice));
            // NaN-filled: a row the kernel skips cannot pass as an earlier call's result left in reused memory
            OI_CUDA_CHECK(cudaMemset(dout.p, 0xFF, dout.n));
            AttnArgs a{};
            a.q = dq.as<bf16>();
            a.q_stride = (int)(qkv.size() / std::max(T, 1));
            a.kv_cache = dc.as<bf16>();
            a.kv = KvLayout{num_layers, num_kv_heads, 16, D};
            a.layer = layer;
            a.block_tables = dbt.as<int32_t>();
            a.bt_stride = block_tables.ndim() == 2 ? (int)block_tables.shape(1) : (int)block_tables.size();
            a.positions = dpos.as<int32_t>();
            a.context_lens = dctx.as<int32_t>();
            a.work = dwork.as<AttnWork>();
            a.num_work = (int)work.size();
            a.num_tokens = T;
            a.num_heads = num_heads;
            a.num_splits = num_splits;
            a.max_rows = max_rows;
            a.out = dout.as<bf16>();
            a.ws_o = dwo.as<float>();
            a.ws_lse = dwl.as<float>();
            a.counters = dcnt.as<int>();
            a.variant = variant;
            a.segment = segment;
            if (prefill_wgmma == 2 && !prefill_wgmma_takes(a, 2))
              throw std::invalid_argument("paged_attention: prefill_wgmma=2 (forced) but the wgmma kernel does not take "
                                          "this launch (splits, segment, alignment or the device)");
            paged_attention(a, 0);
            OI_CUDA_CHECK(cudaDeviceSynchronize());
            std::vector<int> cnt(work.size() * num_kv_heads);
            OI_CUDA_CHECK(cudaMemcpy(cnt.data(), dcnt.p, cnt.size() * sizeof(int), cudaMemcpyDeviceToHost));
            for (int v : cnt) OI_CHECK(v == 0, "paged_attention left a split counter at " << v);
            return py::make_tuple(dout.get<uint16_t>({T, num_heads * D}), num_splits);
          },
          py::arg("qkv"), py::arg("cache"), py::arg("block_tables"), py::arg("query_start_loc"), py::arg("context_lens"),
          py::arg("positions"), py::arg("layer"), py::arg("num_layers"), py::arg("num_heads"), py::arg("num_kv_heads"),
          py::arg("num_splits"), py::arg("key_warps") = true, py::arg("cluster_cap") = 0, py::arg("segment") = 0,
          py::arg("prefill_wgmma") = 1, py::arg("short_items") = false,
          "(out, splits used); num_splits <= 0: the launch heuristic; key_warps False: one-warp decode blocks; "
          "cluster_cap > 0: decode clusters of at most that many blocks; segment > 0: chunk-invariant keys in segments of "
          "that many (AttnArgs::segment), num_splits <= 0 then attn_segment_splits' count; prefill_wgmma: "
          "AttnVariant::prefill_wgmma (0 off, 1 on where it takes the launch, 2 forced: raises where it is refused); "
          "short_items: chunks of up to ATTN_SHORT_CHUNK tokens in items of 16 rows at any context (attention_work)");
  ops.def("attention_work", [](const Arr<int32_t>& qsl, int group, bool short_items, py::object context_lens) {
    const int B = (int)qsl.size() - 1;
    if (B < 0 || group < 1) throw std::invalid_argument("attention_work: query_start_loc needs B + 1 entries, group >= 1");
    Arr<int32_t> ctx;
    if (!context_lens.is_none()) {
      ctx = context_lens.cast<Arr<int32_t>>();
      if (ctx.size() != B) throw std::invalid_argument("attention_work: context_lens must have B entries");
    }
    int max_rows = 1;
    const std::vector<AttnWork> work = attention_work(qsl.data(), B, group, &max_rows, short_items,
                                                      context_lens.is_none() ? nullptr : ctx.data());
    py::list items;
    for (const AttnWork& w : work) items.append(py::make_tuple(w.seq, w.tok_start, w.num_tok, w.lead));
    return py::make_tuple(items, max_rows);
  }, py::arg("query_start_loc"), py::arg("group"), py::arg("short_items") = false, py::arg("context_lens") = py::none(),
     "(items [(seq, tok_start, num_tok, lead)], max_rows): a step's attention items as plan_step makes them (host only)");
  ops.attr("ATTN_SHORT_CHUNK") = kAttnShortChunk;
  ops.attr("ATTN_SHORT_ITEMS_MAX_CTX") = kAttnShortItemsMaxCtx;
  ops.def("prefill_wgmma_device", [] { return prefill_wgmma_device(); },
          "whether the current device runs the sm_90a wgmma kernels (compute capability 9.0)");
  ops.attr("ATTN_SEGMENT") = kAttnSegment;
  ops.def("sample", [](const Arr<float>& logits, const Arr<float>& temperature, const Arr<float>& top_p,
                       const Arr<int32_t>& top_k, const Arr<uint64_t>& seeds, const Arr<int32_t>& positions,
                       int num_logprobs) {
    const int S = (int)temperature.size(), V = (int)(logits.size() / std::max(S, 1));
    Dev dl(logits), dt(temperature), dp(top_p), dk(top_k), ds(seeds), dpos(positions);
    Dev tok((size_t)S * 4), lp((size_t)S * 4), tid((size_t)S * num_logprobs * 4), tlp((size_t)S * num_logprobs * 4);
    SampleArgs a{};
    a.logits = dl.as<float>(); a.num_rows = S; a.vocab = V;
    a.temperature = dt.as<float>(); a.top_p = dp.as<float>(); a.top_k = dk.as<int32_t>(); a.seeds = ds.as<uint64_t>();
    a.positions = dpos.as<int32_t>(); a.num_logprobs = num_logprobs;
    a.tokens = tok.as<int32_t>(); a.logprobs = lp.as<float>(); a.top_ids = tid.as<int32_t>(); a.top_logprobs = tlp.as<float>();
    sample(a, 0);
    OI_CUDA_CHECK(cudaDeviceSynchronize());
    return py::make_tuple(tok.get<int32_t>({S}), lp.get<float>({S}), tid.get<int32_t>({S, num_logprobs}),
                          tlp.get<float>({S, num_logprobs}));
  });
  ops.def("markov_sample", [](const Arr<float>& logits, const Arr<uint16_t>& w1, const Arr<uint16_t>& w2,
                              const Arr<int32_t>& anchors, const Arr<float>& temperature, const Arr<float>& top_p,
                              const Arr<int32_t>& top_k, const Arr<uint64_t>& seeds, const Arr<int32_t>& positions,
                              int num_drafts, int V, int R) {
    // The Markov head's one-launch pass; returns (tokens [num_drafts * D], logits after the Markov terms), or
    // None where the launcher does not take the chunk.
    const int D = (int)anchors.size(), S = num_drafts * D;
    const int64_t VR = (int64_t)V * R;
    if ((int64_t)temperature.size() != S || (int64_t)top_p.size() != S || (int64_t)top_k.size() != S ||
        (int64_t)seeds.size() != S || (int64_t)positions.size() != S || (int64_t)logits.size() != (int64_t)S * V ||
        (int64_t)w1.size() != VR || (int64_t)w2.size() != VR)
      throw std::invalid_argument("markov_sample: inconsistent sizes");
    for (py::ssize_t d = 0; d < anchors.size(); ++d)  // the kernel gathers W1 rows by them unchecked
      if (anchors.data()[d] < 0 || anchors.data()[d] >= V) throw std::invalid_argument("markov_sample: anchor out of range");
    int dev = 0, sms = 0;
    OI_CUDA_CHECK(cudaGetDevice(&dev));
    OI_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    Dev dl(logits), d1(w1), d2(w2), da(anchors), dt(temperature), dp(top_p), dk(top_k), ds(seeds), dpos(positions);
    Dev tok((size_t)S * 4), lp((size_t)S * 4), part((size_t)2 * sms * std::max(D, 1) * 8), sync(8);
    OI_CUDA_CHECK(cudaMemset(sync.p, 0, 8));
    MarkovArgs a{};
    a.logits = dl.as<float>(); a.w1 = d1.as<bf16>(); a.w2 = d2.as<bf16>(); a.anchors = da.as<int32_t>();
    a.D = D; a.num_drafts = num_drafts; a.V = V; a.R = R;
    a.temperature = dt.as<float>(); a.top_p = dp.as<float>(); a.top_k = dk.as<int32_t>(); a.seeds = ds.as<uint64_t>();
    a.positions = dpos.as<int32_t>(); a.tokens = tok.as<int32_t>(); a.logprobs = lp.as<float>();
    a.part = static_cast<float2*>(part.p); a.sync = static_cast<unsigned*>(sync.p);
    if (!markov_sample(a, sms, 0)) return py::object(py::none());
    OI_CUDA_CHECK(cudaDeviceSynchronize());
    return py::object(py::make_tuple(tok.get<int32_t>({S}), dl.get<float>({S, V})));
  });
  ops.def("fill_normal_stats", [](int64_t n, uint64_t seed, float mean, float std) {
    // For the random-load test: moments of the GPU generator.
    Dev d((size_t)n * 2);
    fill_normal(d.as<bf16>(), n, seed, mean, std, 0);
    OI_CUDA_CHECK(cudaDeviceSynchronize());
    return d.get<uint16_t>({(py::ssize_t)n});
  });

}
