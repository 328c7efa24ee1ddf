// pybind11 only: openinfer.StepInput / EngineConfig / ModelConfig objects <-> the C++ Engine, and the
// kernel test ops (ops.cpp). GPU work runs with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_profiler_api.h>

#include <cstring>

#include "../engine/engine.h"
#include "../kernels/launch.cuh"

namespace py = pybind11;
using namespace oi;

void bind_ops(py::module_& m);  // ops.cpp

namespace {

template <typename T>
using Arr = py::array_t<T, py::array::c_style | py::array::forcecast>;

template <typename T>
py::array_t<T> to_numpy(const std::vector<T>& v, std::vector<py::ssize_t> shape) {
  py::array_t<T> out(shape);
  if (!v.empty()) std::memcpy(out.mutable_data(), v.data(), v.size() * sizeof(T));
  return out;
}

ModelDims dims_from(const py::object& c) {
  ModelDims d{};
  d.hidden = c.attr("hidden_size").cast<int>();
  d.intermediate = c.attr("intermediate_size").cast<int>();
  d.layers = c.attr("num_hidden_layers").cast<int>();
  d.heads = c.attr("num_attention_heads").cast<int>();
  d.kv_heads = c.attr("num_key_value_heads").cast<int>();
  d.head_dim = c.attr("head_dim").cast<int>();
  d.vocab = c.attr("vocab_size").cast<int>();
  d.eps = c.attr("rms_norm_eps").cast<float>();
  d.rope_theta = c.attr("rope_theta").cast<double>();
  d.tied = c.attr("tie_word_embeddings").cast<bool>();
  return d;
}

// openinfer.drafter.DrafterConfig -> the engine's drafter geometry (its head layout is the target's: the
// Python side refuses others for the CUDA engine).
DrafterDims drafter_from(const py::object& c) {
  DrafterDims dd;
  dd.layers = c.attr("num_hidden_layers").cast<int>();
  dd.block_size = c.attr("block_size").cast<int>();
  dd.first_slot = c.attr("first_slot").cast<int>();
  dd.num_drafts = c.attr("num_drafts").cast<int>();
  dd.mask_token = c.attr("mask_token_id").cast<int>();
  dd.markov_rank = c.attr("markov_rank").cast<int>();
  dd.taps = c.attr("target_layer_ids").cast<std::vector<int>>();
  return dd;
}

EngineOptions options_from(const py::object& c, const std::string& cublaslt_path) {
  EngineOptions o;
#define OI_READ_OPTION(type, name) o.name = c.attr(#name).cast<type>();
  OI_ENGINE_OPTIONS(OI_READ_OPTION)
#undef OI_READ_OPTION
  o.cublaslt_path = cublaslt_path;
  return o;
}

// A StepInput's arrays, converted (and kept alive) for one call.
struct BoundStep {
  StepInput in;
  std::vector<py::array> keep;
};

enum class Rule { T, B, B1, S, BxM, B_OPT, PAIRS, ANY };

template <typename T>
void read_array(const py::object& step, const char* name, Rule rule, BoundStep& bs, const T** ptr, int64_t* n,
                std::vector<std::pair<const char*, std::pair<Rule, const py::array*>>>& rules) {
  py::object v = step.attr(name);
  if (v.is_none()) {
    if (rule != Rule::B_OPT && rule != Rule::ANY && rule != Rule::PAIRS)
      throw std::invalid_argument(std::string("step: ") + name + " is required");
    return;
  }
  Arr<T> a = v.cast<Arr<T>>();
  bs.keep.push_back(a);
  *ptr = a.data();
  *n = rule == Rule::BxM || rule == Rule::PAIRS ? (a.ndim() == 2 ? a.shape(0) : (a.size() == 0 ? 0 : -1)) : a.size();
  rules.push_back({name, {rule, &bs.keep.back()}});
}

void check_rules(const BoundStep& bs, const std::vector<std::pair<const char*, std::pair<Rule, const py::array*>>>& rules) {
  const StepInput& in = bs.in;
  const int64_t T = in.n_input_ids, B = in.n_context_lens, S = in.n_sample_idx;
  for (const auto& [name, r] : rules) {
    const py::array& a = *r.second;
    bool ok = true;
    switch (r.first) {
      case Rule::T: ok = a.size() == T; break;
      case Rule::B: ok = a.size() == B; break;
      case Rule::B1: ok = a.size() == B + 1; break;
      case Rule::S: ok = a.size() == S; break;
      case Rule::B_OPT: ok = a.size() == B; break;
      case Rule::BxM: ok = a.ndim() == 2 && a.shape(0) == B && a.shape(1) >= 1; break;
      case Rule::PAIRS: ok = a.size() == 0 || (a.ndim() == 2 && a.shape(1) == 2); break;
      case Rule::ANY: ok = a.ndim() == 1; break;
    }
    if (!ok) throw std::invalid_argument(std::string("step: ") + name + " has the wrong shape");
  }
}

// Reads every field of openinfer.StepInput by the names of step.h's lists.
BoundStep bind_step(const py::object& step) {
  BoundStep bs;
  bs.keep.reserve(32);  // pointers into keep stay valid
  std::vector<std::pair<const char*, std::pair<Rule, const py::array*>>> rules;
  StepInput& in = bs.in;
#define OI_READ_ARRAY(type, name, rule) read_array<type>(step, #name, Rule::rule, bs, &in.name, &in.n_##name, rules);
  OI_STEP_ARRAYS(OI_READ_ARRAY)
#undef OI_READ_ARRAY
#define OI_READ_SCALAR(type, name) in.name = step.attr(#name).cast<type>();
  OI_STEP_SCALARS(OI_READ_SCALAR)
#undef OI_READ_SCALAR
  check_rules(bs, rules);
  const py::array& bt = py::cast<py::array>(step.attr("block_tables"));
  in.bt_stride = bt.ndim() == 2 ? (int)bt.shape(1) : 0;
  return bs;
}

// StepResult -> a dict of StepOutput's fields (Python builds the dataclass); outputs not asked for are None.
py::dict result_dict(const StepResult& r) {
  py::dict d;
#define OI_WRITE_OUTPUT(type, name, present, rows, cols)                              \
  if (!(present)) d[#name] = py::none();                                              \
  else if (cols) d[#name] = to_numpy(r.name, {(py::ssize_t)(rows), (py::ssize_t)(cols)}); \
  else d[#name] = to_numpy(r.name, {(py::ssize_t)(rows)});
  OI_STEP_OUTPUTS(OI_WRITE_OUTPUT)
#undef OI_WRITE_OUTPUT
  d["gpu_ms"] = r.gpu_ms;
  d["draft_ms"] = r.draft_ms;
  return d;
}

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
  m.def("mem_get_info", [] {
    size_t free_b = 0, total_b = 0;
    OI_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return py::make_tuple(free_b, total_b);
  }, "(free, total) bytes of device 0, as cudaMemGetInfo reports them (every process's allocations count)");
  m.def("profiler_start", [] { OI_CUDA_CHECK(cudaProfilerStart()); }, "start the profiler's capture (ncu --profile-from-start off)");
  m.def("profiler_stop", [] { OI_CUDA_CHECK(cudaProfilerStop()); });
  m.def("build_info", [] {
    py::dict d;
    d["cuda_archs"] = OI_CUDA_ARCHS;  // ';'-separated, as CMake lists them
    d["git_commit"] = OI_GIT_COMMIT;
    return d;
  }, "what this engine was built from: its CUDA architectures and git commit");

  py::class_<Engine>(m, "Engine")
      .def(py::init([](const py::object& model, const py::object& config, const std::string& cublaslt_path,
                       int max_sampled_rows) {
             const ModelDims d = dims_from(model);
             EngineOptions o = options_from(config, cublaslt_path);
             o.max_sampled_rows = max_sampled_rows;
             py::gil_scoped_release nogil;
             return std::make_unique<Engine>(d, o);
           }),
           py::arg("model"), py::arg("config"), py::arg("cublaslt_path") = "", py::arg("max_sampled_rows") = 0,
           "model: an openinfer.ModelConfig; config: an openinfer.EngineConfig (attributes read by name); "
           "max_sampled_rows: sampled rows one step may hold (0: max_num_seqs; a verify step samples k + 1 per sequence)")
      .def("set_drafter", [](Engine& e, const py::object& cfg) { e.set_drafter(drafter_from(cfg)); }, py::arg("config"),
           "before finalize(): an openinfer.drafter.DrafterConfig; its tensors then load as draft.<kind>")
      .def_property_readonly("has_drafter", &Engine::has_drafter)
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
      .def_property_readonly("num_host_blocks", &Engine::num_host_blocks)
      .def_property_readonly("kv_block_bytes", &Engine::kv_block_bytes)
      .def_property_readonly("weight_bytes", &Engine::weight_bytes)
      .def_property_readonly("activation_bytes", &Engine::activation_bytes)
      .def_property_readonly("num_sms", &Engine::num_sms)
      .def_property_readonly("device_name", &Engine::device_name)
      .def_property_readonly("graph_batches", [](const Engine& e) { return e.graph_batches(false); })
      .def_property_readonly("graph_steps", &Engine::graph_steps)
      .def_property_readonly("verify_graph_batches", [](const Engine& e) { return e.graph_batches(true); })
      .def_property_readonly("graph_bytes", &Engine::graph_bytes)
      .def_property_readonly("finalize_seconds", &Engine::finalize_seconds)
      .def_property_readonly("persistent_capable", &Engine::persistent_capable)
      .def_property_readonly("pending", &Engine::pending)
      .def_property("pdl", &Engine::pdl, &Engine::set_pdl)
      .def("launch",
           [](Engine& e, const py::object& step) {
             const BoundStep bs = bind_step(step);
             py::gil_scoped_release nogil;  // inputs are staged before launch() returns
             e.launch(bs.in);
           },
           py::arg("step"), "queue an openinfer.StepInput (at most two pending)")
      .def("collect",
           [](Engine& e) {
             StepResult r;
             {
               py::gil_scoped_release nogil;
               r = e.collect();
             }
             return result_dict(r);
           },
           "wait for the oldest launched step: a dict of openinfer.StepOutput's fields")
      .def("step",
           [](Engine& e, const py::object& step) {
             const BoundStep bs = bind_step(step);
             StepResult r;
             {
               py::gil_scoped_release nogil;
               r = e.step(bs.in);
             }
             return result_dict(r);
           },
           py::arg("step"))
      .def("copy_progress", &Engine::copy_progress,
           "(s, l): the KV copies of every launch numbered <= s (saves) and <= l (loads) have landed")
      .def("wait_copies", [](Engine& e) { py::gil_scoped_release nogil; e.wait_copies(); })
      .def_property_readonly("copy_stats",
                             [](const Engine& e) {
                               const Engine::CopyStats s = e.copy_stats();
                               return py::dict(py::arg("saved_bytes") = s.saved_bytes,
                                               py::arg("restored_bytes") = s.restored_bytes,
                                               py::arg("restore_seconds") = s.restore_seconds,
                                               py::arg("layer_waits") = s.layer_waits);
                             })
      .def("read_kv_block", [](const Engine& e, int64_t b, bool drafter) { const auto v = e.read_kv_block(b, drafter); return to_numpy(v, {(py::ssize_t)v.size()}); },
           py::arg("block"), py::arg("drafter") = false)
      .def("read_host_block", [](const Engine& e, int64_t s) { const auto v = e.read_host_block(s); return to_numpy(v, {(py::ssize_t)v.size()}); })
      .def("set_kernel_choice",
           [](Engine& e, bool persistent, bool fuse_rope, bool key_warps, int cluster_cap, int gemv) {
             OI_CHECK(gemv >= 0 && gemv <= 3, "gemv kernel " << gemv << " (0 auto, 1 CUDA cores, 2 CUDA cores with bf16 input, 3 tensor cores)");
             KernelChoice k;
             k.persistent = persistent;
             k.fuse_rope = fuse_rope;
             k.attention.key_warps = key_warps;
             k.attention.cluster_cap = cluster_cap;
             k.gemv = (GemvKernel)gemv;
             e.set_kernel_choice(k);
           },
           py::arg("persistent") = true, py::arg("fuse_rope") = true, py::arg("key_warps") = true,
           py::arg("cluster_cap") = 0, py::arg("gemv") = 0,
           "tests: the kernels of later eager launches (force_eager); graphs keep the defaults")
      .def("persistent_trace",
           [](Engine& e, bool on) {
             const auto v = e.persistent_trace(on);
             return to_numpy(v, {v.empty() ? 0 : (py::ssize_t)e.num_sms(), v.empty() ? 0 : (py::ssize_t)kPersistentEvents});
           },
           "profiling: later eager persistent steps stamp one layer (True); False returns [SMs, 32] globaltimer ns");

  bind_ops(m);
}
