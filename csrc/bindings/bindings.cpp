// pybind11 only: NumPy <-> Engine, plus `ops`, thin wrappers that run single kernels on host arrays
// (for the kernel tests against the NumPy reference). GPU work runs with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "../engine/engine.h"
#include "../kernels/elementwise.cuh"
#include "../kernels/gemv.cuh"
#include "../kernels/launch.cuh"
#include "../kernels/random_init.cuh"

#include <cuda_profiler_api.h>

#include <algorithm>
#include <array>
#include <cstring>

namespace py = pybind11;
using namespace oi;

namespace {

template <typename T>
using Arr = py::array_t<T, py::array::c_style | py::array::forcecast>;

template <typename T>
const T* ptr(const Arr<T>& a) { return a.data(); }

template <typename T>
void need(const Arr<T>& a, int64_t n, const char* name) {
  if (a.size() != n) throw std::invalid_argument(std::string(name) + ": expected " + std::to_string(n) + " elements, got " + std::to_string(a.size()));
}

template <typename T>
py::array_t<T> to_numpy(const std::vector<T>& v, std::vector<py::ssize_t> shape) {
  py::array_t<T> out(shape);
  if (!v.empty()) std::memcpy(out.mutable_data(), v.data(), v.size() * sizeof(T));
  return out;
}

// RAII device buffer for ops.
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

ModelDims dims_from(const py::dict& c) {
  ModelDims d{};
  d.hidden = c["hidden_size"].cast<int>();
  d.intermediate = c["intermediate_size"].cast<int>();
  d.layers = c["num_hidden_layers"].cast<int>();
  d.heads = c["num_attention_heads"].cast<int>();
  d.kv_heads = c["num_key_value_heads"].cast<int>();
  d.head_dim = c["head_dim"].cast<int>();
  d.vocab = c["vocab_size"].cast<int>();
  d.eps = c["rms_norm_eps"].cast<float>();
  d.rope_theta = c["rope_theta"].cast<double>();
  d.tied = c["tie_word_embeddings"].cast<bool>();
  return d;
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

Gemm& ops_gemm() {
  static std::unique_ptr<Gemm> g;
  if (!g) g = std::make_unique<Gemm>("");
  return *g;
}

HostStep host_step(const Arr<int32_t>& input_ids, const Arr<int32_t>& positions, const Arr<int32_t>& qsl,
                   const Arr<int32_t>& context_lens, const Arr<int32_t>& block_tables, const Arr<int32_t>& slot_mapping,
                   const Arr<int32_t>& sample_idx, const Arr<float>& temperature, const Arr<float>& top_p,
                   const Arr<int32_t>& top_k, const Arr<uint64_t>& seeds, int num_logprobs, bool return_logits,
                   bool force_eager) {
  HostStep h;
  h.T = (int)input_ids.size();
  h.B = (int)context_lens.size();
  h.S = (int)sample_idx.size();
  if (block_tables.ndim() != 2 || block_tables.shape(0) != h.B) throw std::invalid_argument("block_tables must be [B, M]");
  h.bt_stride = (int)block_tables.shape(1);
  need(positions, h.T, "positions");
  need(slot_mapping, h.T, "slot_mapping");
  need(qsl, h.B + 1, "query_start_loc");
  need(temperature, h.S, "temperature");
  need(top_p, h.S, "top_p");
  need(top_k, h.S, "top_k");
  need(seeds, h.S, "seeds");
  h.ids = ptr(input_ids); h.positions = ptr(positions); h.query_start_loc = ptr(qsl);
  h.context_lens = ptr(context_lens); h.block_tables = ptr(block_tables); h.slots = ptr(slot_mapping);
  h.sample_idx = ptr(sample_idx); h.temperature = ptr(temperature); h.top_p = ptr(top_p);
  h.top_k = ptr(top_k); h.seeds = ptr(seeds); h.num_logprobs = num_logprobs; h.return_logits = return_logits;
  h.force_eager = force_eager;
  return h;
}

py::tuple result_tuple(const StepResult& r, py::ssize_t S, py::ssize_t N, bool logits_wanted) {
  py::object logits = py::none();
  if (logits_wanted) logits = to_numpy(r.logits, {S, (py::ssize_t)(r.logits.size() / std::max<py::ssize_t>(S, 1))});
  return py::make_tuple(to_numpy(r.tokens, {S}), to_numpy(r.logprobs, {S}), to_numpy(r.top_ids, {S, N}),
                        to_numpy(r.top_logprobs, {S, N}), logits, r.gpu_ms);
}

#define STEP_ARGS                                                                                                   \
  py::arg("input_ids"), py::arg("positions"), py::arg("query_start_loc"), py::arg("context_lens"),                 \
      py::arg("block_tables"), py::arg("slot_mapping"), py::arg("sample_idx"), py::arg("temperature"),             \
      py::arg("top_p"), py::arg("top_k"), py::arg("seeds"), py::arg("num_logprobs") = 0, py::arg("return_logits") = false, \
      py::arg("force_eager") = false

}  // namespace


PYBIND11_MODULE(_engine, m) {
  m.doc() = "openinfer CUDA engine";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.def("device_count", [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return n;
  }, "number of visible CUDA devices (0 when there is no driver or GPU)");

  m.def("profiler_start", [] { OI_CUDA_CHECK(cudaProfilerStart()); }, "start the profiler's capture (ncu --profile-from-start off)");
  m.def("profiler_stop", [] { OI_CUDA_CHECK(cudaProfilerStop()); });

  py::class_<Engine>(m, "Engine")
      .def(py::init([](const py::dict& model, const py::dict& opts) {
             EngineOptions o;
             o.max_num_tokens = opts["max_num_batched_tokens"].cast<int>();
             o.max_num_seqs = opts["max_num_seqs"].cast<int>();
             o.max_model_len = opts["max_model_len"].cast<int>();
             o.block_size = opts["kv_block_size"].cast<int>();
             o.gpu_memory_utilization = opts["gpu_memory_utilization"].cast<double>();
             o.num_kv_blocks = opts["num_kv_blocks"].cast<int>();
             o.cublaslt_path = opts["cublaslt_path"].cast<std::string>();
             o.cuda_graph = opts["cuda_graph"].cast<bool>();
             o.pdl = opts["pdl"].cast<bool>();
             o.gemm_autotune = opts["gemm_autotune"].cast<bool>();
             ModelDims d = dims_from(model);
             py::gil_scoped_release nogil;
             return std::make_unique<Engine>(d, o);
           }),
           py::arg("model"), py::arg("options"))
      .def("load_tensor",
           [](Engine& e, const std::string& kind, int layer, const Arr<uint16_t>& a, int64_t row_offset) {
             const int64_t rows = a.ndim() == 2 ? a.shape(0) : 1, cols = a.ndim() == 2 ? a.shape(1) : a.size();
             const uint16_t* p = a.data();
             py::gil_scoped_release nogil;
             e.load_tensor(kind, layer, p, rows, cols, row_offset);
           },
           py::arg("kind"), py::arg("layer"), py::arg("data"), py::arg("row_offset") = 0)
      .def("init_random", [](Engine& e, uint64_t seed) { py::gil_scoped_release nogil; e.init_random(seed); })
      .def("finalize", [](Engine& e) { py::gil_scoped_release nogil; return e.finalize(); })
      .def_property_readonly("num_kv_blocks", &Engine::num_kv_blocks)
      .def_property_readonly("kv_block_bytes", &Engine::kv_block_bytes)
      .def_property_readonly("weight_bytes", &Engine::weight_bytes)
      .def_property_readonly("activation_bytes", &Engine::activation_bytes)
      .def_property_readonly("num_sms", &Engine::num_sms)
      .def_property_readonly("device_name", &Engine::device_name)
      .def_property_readonly("graph_batches", &Engine::graph_batches)
      .def_property_readonly("graph_steps", &Engine::graph_steps)
      .def_property("pdl", &Engine::pdl, &Engine::set_pdl)
      .def("step",
           [](Engine& e, const Arr<int32_t>& input_ids, const Arr<int32_t>& positions, const Arr<int32_t>& qsl,
              const Arr<int32_t>& context_lens, const Arr<int32_t>& block_tables, const Arr<int32_t>& slot_mapping,
              const Arr<int32_t>& sample_idx, const Arr<float>& temperature, const Arr<float>& top_p,
              const Arr<int32_t>& top_k, const Arr<uint64_t>& seeds, int num_logprobs, bool return_logits,
              bool force_eager) {
             const HostStep h = host_step(input_ids, positions, qsl, context_lens, block_tables, slot_mapping, sample_idx,
                                          temperature, top_p, top_k, seeds, num_logprobs, return_logits, force_eager);
             StepResult r;
             {
               py::gil_scoped_release nogil;
               r = e.step(h);
             }
             return result_tuple(r, h.S, num_logprobs, return_logits);
           },
           STEP_ARGS)
      .def("launch",
           [](Engine& e, const Arr<int32_t>& input_ids, const Arr<int32_t>& positions, const Arr<int32_t>& qsl,
              const Arr<int32_t>& context_lens, const Arr<int32_t>& block_tables, const Arr<int32_t>& slot_mapping,
              const Arr<int32_t>& sample_idx, const Arr<float>& temperature, const Arr<float>& top_p,
              const Arr<int32_t>& top_k, const Arr<uint64_t>& seeds, int num_logprobs, bool return_logits,
              bool force_eager, const py::object& prev_rows) {
             HostStep h = host_step(input_ids, positions, qsl, context_lens, block_tables, slot_mapping, sample_idx,
                                    temperature, top_p, top_k, seeds, num_logprobs, return_logits, force_eager);
             Arr<int32_t> prev;
             if (!prev_rows.is_none()) {
               prev = prev_rows.cast<Arr<int32_t>>();
               need(prev, h.B, "prev_rows");
               h.prev_rows = ptr(prev);
             }
             py::gil_scoped_release nogil;  // inputs are staged before launch() returns
             e.launch(h);
           },
           STEP_ARGS, py::arg("prev_rows") = py::none(),
           "queue a step (at most two pending); prev_rows[b] >= 0 feeds row b (one token, at index b) the previous launch's sampled token prev_rows[b]")
      .def("collect",
           [](Engine& e) {
             StepResult r;
             {
               py::gil_scoped_release nogil;
               r = e.collect();
             }
             const py::ssize_t S = (py::ssize_t)r.tokens.size(), N = S ? (py::ssize_t)(r.top_ids.size() / S) : 0;
             return result_tuple(r, S, N, !r.logits.empty());
           },
           "wait for the oldest launched step: (tokens, logprobs, top_ids, top_logprobs, logits or None, gpu_ms)")
      .def_property_readonly("pending", &Engine::pending);

  // ---- single-kernel wrappers for tests (host arrays in, host arrays out; bf16 as uint16) ----
  py::module_ ops = m.def_submodule("ops", "single kernels on host arrays, for tests");
  ops.def("attention_cluster_cap", [](int n) {
    OI_CHECK(n >= 0 && n <= kAttnMaxCluster, "attention_cluster_cap: " << n << " (0.." << kAttnMaxCluster << ")");
    attention_cluster_cap() = n;
  }, "tests: limit decode clusters below the device's limit (0: the device's)");
  ops.def("attention_key_warps", [](int on) { attention_key_warps() = on != 0; },
          "decode attention blocks of four warps splitting the keys (1, default) or one warp per block (0)");
  ops.def("attention_fuse_rope", [](int on) { attention_fuse_rope() = on != 0; },
          "A/B: decode buckets do q/k norm + RoPE + K/V write inside attention (1, default) or in their own "
          "kernel (0); read when a bucket is launched or captured");
  ops.def("gemv_tensor_cores", [](int mode) {
    OI_CHECK(mode >= 0 && mode <= 2, "gemv_tensor_cores: " << mode << " (0 never, 1 where faster, 2 always)");
    gemv_tensor_cores() = mode;
  }, "the GEMV's dot products on the tensor cores: 0 never, 1 (default) where they measured faster, 2 always (tests)");
  ops.def("gemv_takes_tensor_cores", [](int M, int K, int in_mode, int out_mode) {
    return gemv_takes_tensor_cores(M, K, (GemvIn)in_mode, (GemvOut)out_mode);
  }, "whether the fused GEMV takes the tensor-core kernel for M rows, K and the prologue/epilogue (host only)");
  ops.def("persistent_decode", [](int on) { persistent_decode() = on != 0; },
          "batch-1 decode buckets run every layer in one persistent kernel where it fits (1, default) or kernel by "
          "kernel (0); read when a bucket is launched or captured");
  ops.def("persistent_fits", [](int hidden, int intermediate, int heads, int kv_heads, int head_dim) {
    return persistent_fits(hidden, intermediate, heads, kv_heads, head_dim);
  }, "whether persistent_layers() serves this geometry on the current device");
  ops.def("persistent_inflight", [](int n) { persistent_inflight() = n; },
          "stages a block of persistent_layers() keeps requested and not yet landed (-1: ~64 KB, the default; 0: the ring bounds them)");
  ops.def("persistent_trace", [](bool on) {
    persistent_trace_enable(on);
    py::array_t<uint64_t> out;
    if (!on && persistent_trace_data()) {
      int sms = 0, dev = 0;
      OI_CUDA_CHECK(cudaGetDevice(&dev));
      OI_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
      out = py::array_t<uint64_t>({sms, kPersistentEvents});
      OI_CUDA_CHECK(cudaDeviceSynchronize());
      OI_CUDA_CHECK(cudaMemcpy(out.mutable_data(), persistent_trace_data(), out.nbytes(), cudaMemcpyDeviceToHost));
    }
    return out;
  }, "profiling: trace layer 10 of later persistent launches (True), or stop and return [SMs, 32] globaltimer ns (False)");
  ops.def("gemv_fp32_input", [](int on) { gemv_fp32_input() = on != 0; },
          "A/B: the fused GEMV's input staged as fp32 where it fits (1, default) or as bf16 (0)");
  ops.def("model_skip_kernels", [](int mask) { model_skip_kernels() = mask; },
          "profiling only, wrong outputs: skip q/k norm + RoPE + KV write (1) and/or attention (2) in every layer");
  ops.def("attention_launch_shape", [](int num_work, int max_rows, int num_splits) {
    const AttnLaunch l = attn_launch_shape(num_work, max_rows, num_splits);
    return py::dict(py::arg("key_warps") = l.key_warps, py::arg("early") = l.early, py::arg("splits") = l.splits,
                    py::arg("cluster") = l.cluster);
  }, "how paged_attention launches for these counts: key_warps, early, splits (launched), cluster");
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
  ops.def("gemm", [](const Arr<uint16_t>& x, const Arr<uint16_t>& w, int M, int N, int K, py::object y_init, bool out_f32) {
    const size_t ob = (size_t)M * N * (out_f32 ? 4 : 2);
    Dev dx(x), dw(w), dy(ob);
    const bool acc = !y_init.is_none();
    if (acc) {
      py::array a = y_init.cast<py::array>();
      if ((size_t)a.nbytes() != ob) throw std::invalid_argument("gemm: y_init has the wrong size");
      OI_CUDA_CHECK(cudaMemcpy(dy.p, a.data(), ob, cudaMemcpyHostToDevice));
    }
    ops_gemm().run(dx.as<bf16>(), dw.as<bf16>(), dy.p, M, N, K, acc, out_f32, 0);
    OI_CUDA_CHECK(cudaDeviceSynchronize());
    if (out_f32) return py::array(dy.get<float>({M, N}));
    return py::array(dy.get<uint16_t>({M, N}));
  });
  ops.def("gemv", [](const Arr<uint16_t>& x, py::object norm_w, const Arr<uint16_t>& w, int M, int N, int K, int in_mode,
                     int out_mode, py::object y_init, float eps) {
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
    GemvArgs g{dx.as<bf16>(), dn ? dn->as<bf16>() : nullptr, eps, dw.as<bf16>(), dy.p, M, N, K};
    const bool ran = gemv(g, (GemvIn)in_mode, (GemvOut)out_mode, prop.multiProcessorCount, 0);
    OI_CUDA_CHECK(cudaDeviceSynchronize());
    if (!ran) return py::object(py::none());
    if (f32out) return py::object(dy.get<float>({M, ncols}));
    return py::object(dy.get<uint16_t>({M, ncols}));
  });
  ops.def("bench_gemv_chain", [](int M, const std::vector<std::array<int, 4>>& shapes, int layers, int reps) {
    // Median graph-replay time (us) of `layers` repetitions of the fused GEMVs `shapes` ((N, K, prologue,
    // epilogue) each), every layer with its own weights: the decode step's weight stream without attention.
    OI_CHECK(M >= 1 && layers >= 1 && !shapes.empty(), "bench_gemv_chain: need M >= 1, layers >= 1 and a shape");
    size_t per_layer = 0, max_k = 0, max_n = 0;
    for (const auto& sh : shapes) {
      OI_CHECK(sh[0] >= 1 && sh[1] >= 1, "bench_gemv_chain: bad shape " << sh[0] << "x" << sh[1]);
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
          GemvArgs g{x.as<bf16>(), nw.as<bf16>(), 1e-6f, W, y.p, M, sh[0], sh[1]};
          if (!gemv(g, (GemvIn)sh[2], (GemvOut)sh[3], prop.multiProcessorCount, st))
            throw std::invalid_argument("bench_gemv_chain: the fused GEMV refuses a shape");
          W += (size_t)sh[0] * sh[1];
        }
    }, reps);
  });
  ops.def("bench_linear", [](int M, int N, int K, int in_mode, int out_mode, bool use_gemv, int reps) {
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
  });
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
             int num_layers, int num_heads, int num_kv_heads, int num_splits) {
            const int T = (int)positions.size(), B = (int)context_lens.size(), D = 128;
            const int group = num_heads / num_kv_heads, qt = attn_tokens_per_item(group);
            std::vector<AttnWork> work;
            int max_rows = 1, max_ctx = 0;
            for (int b = 0; b < B; ++b) {
              for (int t0 = qsl.at(b); t0 < qsl.at(b + 1); t0 += qt) {
                const int n = std::min(qt, qsl.at(b + 1) - t0);
                work.push_back(AttnWork{b, t0, n, 0});
                max_rows = std::max(max_rows, n * group);
              }
              max_ctx = std::max(max_ctx, context_lens.at(b));
            }
            cudaDeviceProp prop{};
            OI_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
            const int max_split_rows = 1 << 16;
            if (num_splits <= 0)
              num_splits = attn_num_splits((int)work.size(), num_kv_heads, max_ctx, T, prop.multiProcessorCount,
                                           max_split_rows, max_rows);
            Dev dq(qkv), dc(cache), dbt(block_tables), dpos(positions), dctx(context_lens);
            Dev dwork(work.size() * sizeof(AttnWork)), dout((size_t)T * num_heads * D * 2);
            Dev dwo((size_t)num_splits * T * num_heads * D * 4), dwl((size_t)num_splits * T * num_heads * 4);
            Dev dcnt(work.size() * num_kv_heads * sizeof(int));
            OI_CUDA_CHECK(cudaMemset(dcnt.p, 0, work.size() * num_kv_heads * sizeof(int)));
            OI_CUDA_CHECK(cudaMemcpy(dwork.p, work.data(), work.size() * sizeof(AttnWork), cudaMemcpyHostToDevice));
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
            paged_attention(a, 0);
            OI_CUDA_CHECK(cudaDeviceSynchronize());
            std::vector<int> cnt(work.size() * num_kv_heads);
            OI_CUDA_CHECK(cudaMemcpy(cnt.data(), dcnt.p, cnt.size() * sizeof(int), cudaMemcpyDeviceToHost));
            for (int v : cnt) OI_CHECK(v == 0, "paged_attention left a split counter at " << v);
            return py::make_tuple(dout.get<uint16_t>({T, num_heads * D}), num_splits);
          });
  ops.def("bench_attention", [](int B, int ctx, int num_heads, int num_kv_heads, int layers, int num_splits, int reps) {
    // Median time (us) of one decode attention launch (B rows, each `ctx` keys) inside a CUDA graph of
    // `layers` launches over as many layers of the cache (cold L2, as in a real step).
    OI_CHECK(B >= 1 && ctx >= 1 && layers >= 1 && num_kv_heads >= 1 && num_heads % num_kv_heads == 0 &&
                 num_heads / num_kv_heads <= 16 && num_splits <= kAttnMaxSplits,
             "bench_attention: need batch, ctx, layers >= 1, a query group of at most 16 heads and at most "
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
                                   num_heads / num_kv_heads);
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
    const double us = graph_median_us([&](cudaStream_t st) {
      for (int l = 0; l < layers; ++l) {
        a.layer = l;
        paged_attention(a, st);
      }
    }, reps);
    return py::make_tuple(us / layers, attn_launch_shape(B, a.max_rows, num_splits).splits);
  });
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
  ops.def("fill_normal_stats", [](int64_t n, uint64_t seed, float mean, float std) {
    // For the random-load test: moments of the GPU generator.
    Dev d((size_t)n * 2);
    fill_normal(d.as<bf16>(), n, seed, mean, std, 0);
    OI_CUDA_CHECK(cudaDeviceSynchronize());
    return d.get<uint16_t>({(py::ssize_t)n});
  });
}
