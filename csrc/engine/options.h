// What an Engine is built with. Every field has the name of an openinfer.EngineConfig attribute (the
// one place their defaults and validation live); the binding copies them by that name, so nothing here
// has a default of its own.
#pragma once
#include <cstdint>
#include <string>

namespace oi {

// X(type, name): EngineConfig attributes the engine reads.
#define OI_ENGINE_OPTIONS(X)          \
  X(int, max_num_batched_tokens)      \
  X(int, max_num_seqs)                \
  X(int, max_model_len)               \
  X(int, kv_block_size)               \
  X(double, gpu_memory_utilization)   \
  X(int64_t, gpu_num_kv_blocks)       \
  X(int64_t, host_kv_bytes)           \
  X(bool, cuda_graph)                 \
  X(bool, pdl)                        \
  X(bool, gemm_autotune)              \
  X(bool, persistent_decode)          \
  X(bool, deterministic)

struct EngineOptions {
#define OI_DECLARE_OPTION(type, name) type name{};
  OI_ENGINE_OPTIONS(OI_DECLARE_OPTION)
#undef OI_DECLARE_OPTION
  std::string cublaslt_path;  // where libcublasLt.so.13 was found (empty: the loader's search path)
  int max_sampled_rows = 0;   // sampled rows one step may hold (speculative verify samples k + 1 per sequence); 0: max_num_seqs
};

}  // namespace oi
