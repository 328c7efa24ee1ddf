// skinny_gemm: Y[M, N] = X[M, K] · W[N, K]^T (+ Y) for 1-64 rows on Hopper (sm_90a), bf16 in, fp32 accumulate.
//
// At few rows a projection is a weight stream (N*K*2 bytes, read once), so the kernel is built around keeping HBM
// busy, not around the multiplies:
//  - Tile: 128 weight rows (two wgmma row blocks of 64; with silu_up 64 gate rows and their 64 up rows) x all of the
//    block's K range. A stage is 64 of K: two 8 KB weight boxes and one MP x 64 input box (MP = M rounded up to 8,
//    16, 32 or 64, the wgmma N; the box is M rows), brought by the tensor copy engine (cp.async.bulk.tensor, 128-byte
//    swizzle) and
//    completing on the stage's mbarrier. The weights are the A operand (K-major), the input rows the B operand
//    (K-major), so each stage is 2 x 4 wgmma m64nMPk16 of one warpgroup into fp32 registers.
//  - Block: warps 0-3 multiply (one warpgroup), warp 4 copies (one lane issues). Ring of 6/6/5/4 stages at MP
//    8/16/32/64: 64-96 KB of weights in flight per block, ~100-109 KB of shared memory per block, so two blocks, or
//    this block and the next kernel's, fit an SM (228 KB). 160 threads, no register cap needed (~100 at MP 64).
//  - Split-K: a tile's K range is cut into S = 1, 2, 4 or 8 splits, the smallest power of two with tiles x S >= the
//    SM count (4B o and down: 20 tiles x 8; qkv: 48 x 4; gate_up: 152 x 1). The S blocks of a tile are one
//    thread-block cluster: after the main loop each writes its fp32 partial tile to its own shared memory (the ring,
//    now free), a cluster barrier, then block r sums 1/S of the tile's outputs over all S partials in split order
//    (distributed shared memory loads), applies the epilogue and stores; a second cluster barrier keeps every
//    partial alive until it has been read. The sum order depends only on (N, K), never on timing or M, and there
//    is no workspace or counter (nothing to reset between launches or graph replays); the reduction is spread over
//    the S blocks instead of falling on the last one (a last-arriving block would read S x 32 KB at 64 rows).
//  - PDL: the copy warp requests the first stages' weights before griddepcontrol.wait (no kernel writes them), the
//    inputs only after it; the epilogue (which reads Y to accumulate and writes Y) runs after every thread's wait.
//  - Epilogues: bf16 store, residual add (Y += X·Wᵀ in fp32, rounded once), fp32 out (lm_head), SiLU·up.
//  - Batch-invariant mode (skinny_gemm_invariant, --deterministic, an experiment): the MP = 64 kernel for every M, a
//    grid dimension over 64-row chunks, a 64-row input box whose rows past M the copy engine fills with zeros, and
//    the split count from (N, K) alone. A row's outputs then take the same wgmma steps over the same K ranges and the
//    same split sum whatever M is (skinny_gemm.h states what is assumed of the hardware). From 65 rows a block takes
//    WG = 2 or 4 chunks with one multiplying warpgroup each (288 / 544 threads): the copy warp brings one weight
//    stage and WG input boxes, every warpgroup runs the single-chunk wgmma sequence on the shared weight stage, and
//    the WG partial tiles go through the same split sum and epilogue. A 1,024-row prefill read each tile's weights
//    16 times from L2 (one 64-row block each; ~2/3 of the L2 traffic, X the rest) at 25.9 ms for a 4B step's GEMMs
//    against cuBLASLt's 11.9 (H100, 2026-12-07); WG 2 / 4 cut the L2 bytes per multiply-add to 2/3 / 1/2.
// Not measured yet (written without a GPU): see tests/test_gpu_skinny_gemm.py and `bench_kernels.py --gemm-chain
// ... --configs=-2,-3` for the A/B against cuBLASLt.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

#include "../kernels/launch.cuh"
#include "../kernels/mma.cuh"
#include "../kernels/sm90.cuh"
#include "skinny_gemm.h"

namespace oi {
namespace {

constexpr int kBN = 128;                    // weight rows per output tile
constexpr int kBK = 64;                     // K per stage: one 128-byte swizzle row of bf16
constexpr int kHalfBytes = 64 * kBK * 2;    // one 64-row block of a stage (8 KB)
constexpr int kWarpgroup = 128;             // threads of one multiplying warpgroup
constexpr int kRedPitch = kBN + 4;          // floats per input row of the partial tile (conflict-free stores)
// kKeepWFlag: the weights' L2 policy is evict-normal instead of evict-first (other row groups of the tile re-read them)
constexpr int kSiluFlag = 1, kAccFlag = 2, kF32Flag = 4, kKeepWFlag = 8;

// MP: input rows per chunk (the wgmma N); WG: row chunks per block, one multiplying warpgroup each, sharing every
// weight stage (1; 2 or 4 only in the invariant mode, MP = 64). WG 2: 3 stages of 32 KB (97 KB, two blocks per SM);
// WG 4: 4 stages of 48 KB (193 KB, one block per SM).
template <int MP, int WG>
struct Cfg {
  static constexpr int kConsumers = WG * kWarpgroup;  // warps 0 .. 4 WG - 1 multiply
  static constexpr int kThreads = kConsumers + 32;    // + the copy warp
  static constexpr int kStages = WG == 4 ? 4 : WG == 2 ? 3 : MP == 64 ? 4 : MP == 32 ? 5 : 6;
  static constexpr int kMinBlocks = WG == 2 ? 2 : 1;  // WG 2: two blocks per SM (<= 112 registers)
  static constexpr int kWBytes = 2 * kHalfBytes;
  static constexpr int kXBytes = MP * kBK * 2;       // one chunk's input box
  static constexpr int kStageBytes = kWBytes + WG * kXBytes;
  static constexpr size_t kSmem = size_t(kStages) * kStageBytes + 1024;  // + slack to align the ring to 1024
  static_assert(WG * MP * kRedPitch * 4 <= kStages * kStageBytes, "the partial tiles fit the ring");
  static_assert(kXBytes % 1024 == 0, "every 128-byte-swizzled box starts on a 1024-byte boundary");
  static_assert(WG == 1 || MP == 64, "several row chunks per block: the invariant mode's 64-row chunks only");
};

struct Params {
  void* Y;
  int M, N, K;
  int kblocks;  // ceil(K / 64)
  int splits;   // K splits per tile = the cluster size
  int flags;    // kSiluFlag | kAccFlag | kF32Flag
  int xbox;     // input rows per stage box: M (plain mode, M <= 64) or 64 (invariant mode: rows past M zero-filled)
};

// ---- device helpers (sm_90a; left out of other architectures' passes, where the kernel is a stub; the wgmma, TMA
// and descriptor helpers are in kernels/sm90.cuh) ----
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The multiplying warpgroups alone (the copy warp may still be in its loop).
template <int kConsumers>
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumers) : "memory");
}

// Every thread of every block of the cluster; shared-memory writes before it are visible to all after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// The same meeting without ordering memory (no release fence behind the output stores): only keeps a block's shared
// memory alive until every block has consumed its remote loads.
__device__ __forceinline__ void cluster_sync_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
}

__device__ __forceinline__ float4 ld_shared4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr)
               : "memory");
  return v;
}
// 16 bytes at the same shared-memory offset in block `rank` of the cluster.
__device__ __forceinline__ float4 ld_cluster4(uint32_t addr, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}

// The tile's four partial sums at `addr` added over the S splits of the cluster in split order (all loads first).
__device__ __forceinline__ float4 sum_splits(uint32_t addr, int S) {
  if (S == 1) return ld_shared4(addr);
  float4 part[kSkinnyMaxSplits];
#pragma unroll
  for (int r = 0; r < kSkinnyMaxSplits; ++r)
    if (r < S) part[r] = ld_cluster4(addr, r);
  float4 v = part[0];
#pragma unroll
  for (int r = 1; r < kSkinnyMaxSplits; ++r)
    if (r < S) {
      v.x += part[r].x;
      v.y += part[r].y;
      v.z += part[r].z;
      v.w += part[r].w;
    }
  return v;
}

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }
__device__ __forceinline__ float bf16r(float v) { return __bfloat162float(__float2bfloat16(v)); }
__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ float2 unpack_bf16(uint32_t u) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
}

// Four adjacent outputs (m, n..n+3) of a tile, v their fp32 sums (up: the matching up rows' sums with silu_up).
__device__ __forceinline__ void store4(const Params& p, int m, int tile, int c, float4 v, float4 up) {
  if (p.flags & kSiluFlag) {
    const int I = p.N / 2, i = tile * 64 + c;
    if (i >= I) return;  // I % 4 == 0: all four or none
    const float y0 = silu(bf16r(v.x)) * bf16r(up.x), y1 = silu(bf16r(v.y)) * bf16r(up.y);
    const float y2 = silu(bf16r(v.z)) * bf16r(up.z), y3 = silu(bf16r(v.w)) * bf16r(up.w);
    *reinterpret_cast<uint2*>(static_cast<bf16*>(p.Y) + (size_t)m * I + i) =
        make_uint2(pack_bf16(y0, y1), pack_bf16(y2, y3));
    return;
  }
  const int n = tile * kBN + c;
  if (n >= p.N) return;  // N % 8 == 0: all four or none
  const size_t o = (size_t)m * p.N + n;
  if (p.flags & kF32Flag) {
    float4* y = reinterpret_cast<float4*>(static_cast<float*>(p.Y) + o);
    if (p.flags & kAccFlag) {
      const float4 old = __ldcg(y);  // L2: written by an earlier kernel
      v.x += old.x;
      v.y += old.y;
      v.z += old.z;
      v.w += old.w;
    }
    *y = v;
  } else {
    uint2* y = reinterpret_cast<uint2*>(static_cast<bf16*>(p.Y) + o);
    if (p.flags & kAccFlag) {
      const uint2 old = __ldcg(y);
      const float2 a = unpack_bf16(old.x), b = unpack_bf16(old.y);
      v.x += a.x;
      v.y += a.y;
      v.z += b.x;
      v.w += b.y;
    }
    *y = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
  }
}

#endif  // device helpers

// grid (S, groups, tiles), cluster (S, 1, 1): block (split, group, tile) multiplies tile `tile`'s 128 weight rows by
// the input rows of WG chunks of MP, [WG MP group, WG MP (group + 1)), over the split's K blocks
// [kblocks * split / S, kblocks * (split + 1) / S). The plain mode has one group of one chunk; the invariant mode
// (MP = 64) ceil(M / 64) chunks, WG to a block, the splits of one tile's groups next to each other in launch order so
// that the tile's weights are read from HBM about once and from L2 by the other groups. Warpgroup c of a block
// multiplies chunk c exactly as a block of one chunk does (the same wgmma m64n64k16 sequence over the same stages,
// the weights' descriptors the same, only the input box its own), writes the same partial tile rows and goes through
// the same split sum and epilogue: a row's bits do not depend on WG. A chunk starting at or past M is idle (its
// warpgroup skips the multiplies; its box is not loaded).
template <int MP, int WG>
__global__ void __launch_bounds__(Cfg<MP, WG>::kThreads, Cfg<MP, WG>::kMinBlocks)
    skinny_gemm_kernel(const __grid_constant__ CUtensorMap tm_w, const __grid_constant__ CUtensorMap tm_x,
                       const Params p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Cfg<MP, WG>;
  constexpr int ST = C::kStages;
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[ST], empty[ST];
  // Ring: ST weight stages of 16 KB, then ST input stages of WG boxes of MP x 128 bytes, from a 1024-byte boundary
  // (the swizzle pattern repeats every 1024 bytes and the descriptors assume tiles start on one).
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t w_ring = base, x_ring = base + ST * C::kWBytes;
  constexpr uint32_t kXStage = WG * C::kXBytes;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int S = p.splits, split = blockIdx.x, tile = blockIdx.z;     // split == the block's rank in its cluster
  const int m0 = (int)blockIdx.y * WG * MP, rows = min(WG * MP, p.M - m0);  // this group's input rows
  const int active = (rows + MP - 1) / MP;                                   // its chunks with rows (1..WG)
  const int kb0 = (int)((long)p.kblocks * split / S), nk = (int)((long)p.kblocks * (split + 1) / S) - kb0;
  const bool silu_up = p.flags & kSiluFlag;
  // The two 64-row weight blocks: consecutive rows, or gate rows and their up rows (I = N / 2 further).
  const int row0 = silu_up ? tile * 64 : tile * kBN;
  const int row1 = silu_up ? p.N / 2 + tile * 64 : tile * kBN + 64;

  if (threadIdx.x == 0) {
    for (int s = 0; s < ST; ++s) {
      mbar_init(&full[s], 1);           // the copy lane's arrive (+ the stage's bytes)
      mbar_init(&empty[s], 4 * active);  // one arrive per multiplying warp of an active chunk
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (warp == C::kConsumers / 32) {
    // Copy warp. Stage i of the split holds K block kb0 + i in ring slot i % ST; its full barrier expects the weight
    // and input bytes together, so the weights of the first ST stages can go out before the PDL wait (no kernel
    // writes them) and the inputs after it (the previous kernel writes X). Every box starts inside its tensor (the
    // launcher asks for N, K >= 64; the input box is M rows, or 64 from row m0 + 64 c < M): a last half tile past N
    // is not loaded; in the plain mode input rows M..MP-1 of a slot keep stale bytes, which reach only accumulator
    // columns that are never stored (a column of the product depends on that input row alone), and in the invariant
    // mode the copy engine writes zeros for rows past M (and counts them in the stage's bytes).
    const bool second = row1 < p.N;
    const uint32_t stage_bytes = kHalfBytes * (second ? 2 : 1) + (uint32_t)(active * p.xbox * kBK * 2);
    const int pre = min(ST, nk);
    uint64_t policy = 0;
    auto load_w = [&](int i, int s) {
      tma_load(w_ring + s * C::kWBytes, &tm_w, (kb0 + i) * kBK, row0, &full[s], policy);
      if (second) tma_load(w_ring + s * C::kWBytes + kHalfBytes, &tm_w, (kb0 + i) * kBK, row1, &full[s], policy);
    };
    auto load_x = [&](int i, int s) {
      for (int c = 0; c < active; ++c)
        tma_load(x_ring + s * kXStage + c * C::kXBytes, &tm_x, (kb0 + i) * kBK, m0 + c * MP, &full[s]);
    };
    if (lane == 0) {
      prefetch_map(&tm_w);
      prefetch_map(&tm_x);
      policy = (p.flags & kKeepWFlag) ? l2_evict_normal() : l2_evict_first();
      for (int i = 0; i < pre; ++i) {
        mbar_expect_tx(&full[i], stage_bytes);
        load_w(i, i);
      }
    }
    pdl_wait();
    pdl_trigger();
    if (lane == 0) {
      for (int i = 0; i < pre; ++i) load_x(i, i);
      for (int i = pre; i < nk; ++i) {
        const int s = i % ST;
        mbar_wait(&empty[s], ((i / ST) - 1) & 1);  // the multiplies of stage i - ST have read the slot
        mbar_expect_tx(&full[s], stage_bytes);
        load_w(i, s);
        load_x(i, s);
      }
    }
    __syncwarp();
  } else {
    // Multiplying warpgroup `wg` (chunk wg of the group): 2 x 4 wgmma per stage, one commit group per stage, a
    // stage released once the group after it is in flight (wait_group 1), so the tensor cores always have the next
    // stage's work queued.
    pdl_wait();
    pdl_trigger();
    const int wg = warp >> 2, wwarp = warp & 3;  // the warpgroup, the warp within it
    float acc0[MP / 2], acc1[MP / 2];
#pragma unroll
    for (int i = 0; i < MP / 2; ++i) acc0[i] = acc1[i] = 0.f;
    if (wg < active) {
      for (int i = 0; i < nk; ++i) {
        const int s = i % ST;
        mbar_wait(&full[s], (i / ST) & 1);
        const uint64_t dw = smem_desc(w_ring + s * C::kWBytes), dx = smem_desc(x_ring + s * kXStage + wg * C::kXBytes);
        fence_acc(acc0);
        fence_acc(acc1);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          wgmma<MP>(acc0, dw + 2 * kk, dx + 2 * kk);
          wgmma<MP>(acc1, dw + (kHalfBytes >> 4) + 2 * kk, dx + 2 * kk);
        }
        wgmma_commit();
        fence_acc(acc0);
        fence_acc(acc1);
        if (i > 0) {
          wgmma_wait<1>();
          if (lane == 0) mbar_arrive(&empty[(i - 1) % ST]);
        }
      }
      wgmma_wait<0>();
      fence_acc(acc0);
      fence_acc(acc1);
    }
    consumers_sync<C::kConsumers>();  // every warp's multiplies have finished reading the ring: it holds the partials
    if (wg < active) {
      // Partial tiles, [WG MP input rows][kRedPitch floats] (chunk c's rows from MP c): column n < 64 is row block
      // 0's row n, 64 + n block 1's.
      float* red = reinterpret_cast<float*>(smem_raw + (base - smem_u32(smem_raw)));
      const int g = lane >> 2, t = lane & 3;
#pragma unroll
      for (int j = 0; j < MP / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int m = MP * wg + 8 * j + 2 * t + (e & 1), n = 16 * wwarp + g + 8 * (e >> 1);
          red[m * kRedPitch + n] = acc0[4 * j + e];
          red[m * kRedPitch + 64 + n] = acc1[4 * j + e];
        }
    }
  }

  // Block `split` finishes 1/S of the group's outputs: units of four adjacent outputs of one input row, summed over
  // the S partials in split order (which block sums a unit changes nothing in its bits). All threads.
  if (S > 1)
    cluster_sync();
  else
    __syncthreads();
  const int upm = silu_up ? 16 : kBN / 4;  // units per input row
  const int total = rows * upm, per = (total + S - 1) / S, u1 = min(total, (split + 1) * per);
  for (int u = split * per + (int)threadIdx.x; u < u1; u += C::kThreads) {
    const int m = u / upm, c = (u % upm) * 4;
    const uint32_t a = base + (uint32_t)(m * kRedPitch + c) * 4;
    const float4 v = sum_splits(a, S);
    const float4 up = silu_up ? sum_splits(a + 64 * 4, S) : v;
    store4(p, m0 + m, tile, c, v, up);
  }
  if (S > 1) cluster_sync_relaxed();  // no block leaves while another may still read its partial
#else
  __trap();  // built for another architecture: the launcher takes compute capability 9.0 only
#endif
}

// ---- host side ----

struct DeviceInfo {
  int sms = 0;
  bool hopper = false;
};

const DeviceInfo& device_info() {
  constexpr int kMaxDevices = 64;
  static DeviceInfo info[kMaxDevices];
  static bool ready[kMaxDevices] = {};
  int dev = 0;
  OI_CUDA_CHECK(cudaGetDevice(&dev));
  OI_CHECK(dev < kMaxDevices, "skinny_gemm: device " << dev);
  if (!ready[dev]) {
    int major = 0, minor = 0;
    OI_CUDA_CHECK(cudaDeviceGetAttribute(&info[dev].sms, cudaDevAttrMultiProcessorCount, dev));
    OI_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    OI_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    info[dev].hopper = major == 9 && minor == 0;
    ready[dev] = true;
  }
  return info[dev];
}


// The tensor map of a bf16 matrix [rows, cols] (cols contiguous) read in boxes of box_rows x 64 with the 128-byte
// swizzle; the part of a box past the last row or column reads as zeros (boxes never exceed the tensor and always
// start inside it). Cached per (pointer, shape, box, kind): maps are 128-byte host values passed by value to each
// launch, and a (pointer, shape) always encodes to the same map.
CUtensorMap tensor_map(const void* ptr, int rows, int cols, int box_rows, bool weights, cudaStream_t s) {
  using Key = std::tuple<const void*, int, int, int, bool>;
  static std::mutex mu;
  static std::map<Key, CUtensorMap> cache;
  const Key key{ptr, rows, cols, box_rows, weights};
  std::lock_guard<std::mutex> lock(mu);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  OI_CUDA_CHECK(cudaStreamIsCapturing(s, &capturing));
  OI_CHECK(capturing == cudaStreamCaptureStatusNone,
           "skinny_gemm: no tensor map yet for " << (weights ? "W" : "X") << " at " << ptr << " [" << rows << ", "
                                                 << cols << "] while the stream is being captured; run the same call "
                                                 << "once outside capture first (a warm-up)");
  CUtensorMap map{};
  const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
  const cuuint64_t strides[1] = {(cuuint64_t)cols * sizeof(bf16)};
  const cuuint32_t box[2] = {(cuuint32_t)kBK, (cuuint32_t)box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = tma_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(ptr), dims, strides, box,
                               elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               weights ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B : CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  OI_CHECK(r == CUDA_SUCCESS, "skinny_gemm: cuTensorMapEncodeTiled failed (" << (int)r << ") for "
                                  << (weights ? "W" : "X") << " [" << rows << ", " << cols << "] box " << box_rows);
  cache.emplace(key, map);
  return map;
}

cudaLaunchAttribute cluster_attr(int size) {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = size;
  a.val.clusterDim.y = 1;
  a.val.clusterDim.z = 1;
  return a;
}

// Once per instantiation, from the first (uncaptured) call: the dynamic shared-memory limit, and the largest
// cluster (8, 4, 2) this device holds at this block size (MPS or MIG limits may hold fewer than 8).
template <int MP, int WG = 1>
int max_splits() {
  static int cap = 0;
  if (cap > 0) return cap;
  auto* kernel = skinny_gemm_kernel<MP, WG>;
  OI_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)Cfg<MP, WG>::kSmem));
  int c = kSkinnyMaxSplits;
  for (; c > 1; c /= 2) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(c, 1, 1);
    cfg.blockDim = dim3(Cfg<MP, WG>::kThreads);
    cfg.dynamicSmemBytes = Cfg<MP, WG>::kSmem;
    cudaLaunchAttribute clu = cluster_attr(c);
    cfg.attrs = &clu;
    cfg.numAttrs = 1;
    int n = 0;
    const cudaError_t e = cudaOccupancyMaxActiveClusters(&n, kernel, &cfg);
    if (e == cudaSuccess && n >= 1) break;
    cudaGetLastError();  // not this size: try the next smaller one
  }
  cap = c;
  return cap;
}

int padded_rows(int M) { return M <= 8 ? 8 : M <= 16 ? 16 : M <= 32 ? 32 : 64; }

int max_splits_for(int MP) {
  switch (MP) {
    case 8: return max_splits<8>();
    case 16: return max_splits<16>();
    case 32: return max_splits<32>();
    default: return max_splits<64>();
  }
}

// Everything but the row count (the invariant mode's answer must not depend on M).
bool takes_shape(const bf16* X, const bf16* W, const void* Y, int N, int K, bool accumulate, bool out_f32,
                 bool silu_up) {
  const auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  if (N < 64 || K < kBK || N % 8 != 0 || K % 8 != 0) return false;
  if (!aligned(X) || !aligned(W) || !aligned(Y)) return false;
  if (silu_up && (accumulate || out_f32)) return false;
  return device_info().hopper;
}

int tiles_of(int N, bool silu_up) { return silu_up ? (N / 2 + 63) / 64 : (N + kBN - 1) / kBN; }

// Splits per tile: forced (clamped), or the smallest power of two that gives every SM a block (at most 8: a portable
// cluster; 4B o and down 20 tiles x 8, qkv 48 x 4, gate_up and lm_head 1). Never more than the K blocks.
int splits_for(int tiles, int kblocks, int MP, int forced) {
  int s = 1;
  if (forced > 0) {
    s = forced;
  } else {
    const int sms = device_info().sms;
    while (s < kSkinnyMaxSplits && tiles * s < sms) s *= 2;
  }
  return std::max(1, std::min({s, kSkinnyMaxSplits, kblocks, max_splits_for(MP)}));
}

template <int MP, int WG = 1>
void launch(const CUtensorMap& tw, const CUtensorMap& tx, const Params& p, int groups, int tiles, cudaStream_t s) {
  const cudaLaunchAttribute clu = cluster_attr(p.splits);
  OI_CUDA_CHECK(launch_kernel(true, skinny_gemm_kernel<MP, WG>, dim3(p.splits, groups, tiles),
                              dim3(Cfg<MP, WG>::kThreads), Cfg<MP, WG>::kSmem, s, p.splits > 1 ? &clu : nullptr, tw,
                              tx, p));
}

// The invariant mode's splits: the plain rule with a fixed SM count instead of the device's, so that the split count,
// and with it every output bit, is a function of (N, K) alone (the same on a 132-SM H100 or H200 and a 114-SM H100
// PCIe). 4B: qkv 48 tiles x 4, o and down 20 x 8, gate_up 152 x 1; 8B o and down 32 x 8; 32B qkv 80 x 2, o and
// down 40 x 4; every gate_up and the lm_head 1.
constexpr int kInvariantFill = 132;
int invariant_splits(int N, int K, bool silu_up) {
  const int tiles = tiles_of(N, silu_up), kblocks = (K + kBK - 1) / kBK;
  int s = 1;
  while (s < kSkinnyMaxSplits && tiles * s < kInvariantFill) s *= 2;
  return std::min(s, kblocks);
}

// The invariant mode's row chunks per block at M rows (a speed choice only: the bits are the same at 1, 2 and 4).
// Up to 64 rows one (decode: two blocks per SM); then 2, whose two warpgroups share each weight stage, two blocks per
// SM; from kInvariantWideRows 4 (one block per SM). A 4B step's GEMMs in one graph (H100, 2026-12-07), us at 1 / 2 /
// 4 chunks: 128 rows 4,824 / 4,087 / 4,843; 256 rows 7,345 / 6,814 / 6,555; 1,024 26,131 / 21,766 / 19,742 (8B
// alike; bench/results/h100_2026-12-07_c5/dprefill).
constexpr int kInvariantWideRows = 256;
int invariant_chunks_per_block(int M) { return M <= kSkinnyMaxRows ? 1 : M < kInvariantWideRows ? 2 : 4; }

Params make_params(void* Y, int M, int N, int K, bool accumulate, bool out_f32, bool silu_up) {
  Params p{};
  p.Y = Y;
  p.M = M;
  p.N = N;
  p.K = K;
  p.kblocks = (K + kBK - 1) / kBK;
  p.flags = (silu_up ? kSiluFlag : 0) | (accumulate ? kAccFlag : 0) | (out_f32 ? kF32Flag : 0);
  return p;
}

}  // namespace

int skinny_gemm_splits(int M, int N, int K, bool silu_up, int splits) {
  if (M < 1 || M > kSkinnyMaxRows || N < 64 || K < kBK || N % 8 != 0 || K % 8 != 0 || !device_info().hopper) return 0;
  return splits_for(tiles_of(N, silu_up), (K + kBK - 1) / kBK, padded_rows(M), splits);
}

bool skinny_gemm(const bf16* X, const bf16* W, void* Y, int M, int N, int K, bool accumulate, bool out_f32,
                 cudaStream_t s, bool silu_up, int splits) {
  if (M < 1 || M > kSkinnyMaxRows || !takes_shape(X, W, Y, N, K, accumulate, out_f32, silu_up)) return false;
  const int MP = padded_rows(M);
  const int tiles = tiles_of(N, silu_up);
  OI_CHECK(tiles <= 65535, "skinny_gemm: N = " << N << " is more tiles than a grid holds");
  Params p = make_params(Y, M, N, K, accumulate, out_f32, silu_up);
  p.xbox = M;
  const CUtensorMap tw = tensor_map(W, N, K, 64, true, s);  // first: a miss under capture stops here, with a message
  const CUtensorMap tx = tensor_map(X, M, K, M, false, s);
  p.splits = splits_for(tiles, p.kblocks, MP, splits);
  switch (MP) {
    case 8: launch<8>(tw, tx, p, 1, tiles, s); break;
    case 16: launch<16>(tw, tx, p, 1, tiles, s); break;
    case 32: launch<32>(tw, tx, p, 1, tiles, s); break;
    default: launch<64>(tw, tx, p, 1, tiles, s); break;
  }
  return true;
}

int skinny_gemm_invariant_splits(int N, int K, bool silu_up) {
  if (N < 64 || K < kBK || N % 8 != 0 || K % 8 != 0 || !device_info().hopper) return 0;
  const int S = invariant_splits(N, K, silu_up);
  return S <= max_splits<64>() ? S : 0;
}

int skinny_gemm_invariant_chunks(int M, int N, int K, bool silu_up, int chunks_per_block) {
  OI_CHECK(chunks_per_block == 0 || chunks_per_block == 1 || chunks_per_block == 2 || chunks_per_block == 4,
           "skinny_gemm_invariant: chunks_per_block " << chunks_per_block << " (0: the rule, or 1, 2, 4)");
  const int S = skinny_gemm_invariant_splits(N, K, silu_up);
  if (M < 1 || S == 0) return 0;
  const int wg = chunks_per_block > 0 ? chunks_per_block : invariant_chunks_per_block(M);
  // A block size whose cluster the device cannot hold (MPS, MIG) falls back to one chunk per block: the same bits, so
  // the refusal above stays a function of the shape alone.
  if (wg == 4 && S > max_splits<64, 4>()) return 1;
  if (wg == 2 && S > max_splits<64, 2>()) return 1;
  return wg;
}

bool skinny_gemm_invariant(const bf16* X, const bf16* W, void* Y, int M, int N, int K, bool accumulate, bool out_f32,
                           cudaStream_t s, bool silu_up, int chunks_per_block) {
  if (M < 1 || !takes_shape(X, W, Y, N, K, accumulate, out_f32, silu_up)) return false;
  // 0 where the device cannot hold the split cluster (MPS, MIG): the shape is refused at every M, so the caller's
  // other batch-invariant kernel takes all of its calls.
  const int wg = skinny_gemm_invariant_chunks(M, N, K, silu_up, chunks_per_block);
  if (wg == 0) return false;
  const int tiles = tiles_of(N, silu_up), chunks = (M + kSkinnyMaxRows - 1) / kSkinnyMaxRows;
  const int groups = (chunks + wg - 1) / wg;
  Params p = make_params(Y, M, N, K, accumulate, out_f32, silu_up);
  p.xbox = kSkinnyMaxRows;
  p.splits = invariant_splits(N, K, silu_up);
  // Several row groups of a multi-chunk block re-read each weight tile soon: keep it in L2 at the normal priority.
  // The single-chunk kernel keeps evict-first at every M (exactly the measured baseline of 2026-12-07).
  if (wg > 1 && groups > 1) p.flags |= kKeepWFlag;
  OI_CHECK(tiles <= 65535 && groups <= 65535,
           "skinny_gemm_invariant: M = " << M << ", N = " << N << " is more tiles than a grid holds");
  const CUtensorMap tw = tensor_map(W, N, K, 64, true, s);  // first: a miss under capture stops here, with a message
  const CUtensorMap tx = tensor_map(X, M, K, kSkinnyMaxRows, false, s);
  switch (wg) {
    case 4: launch<64, 4>(tw, tx, p, groups, tiles, s); break;
    case 2: launch<64, 2>(tw, tx, p, groups, tiles, s); break;
    default: launch<64, 1>(tw, tx, p, groups, tiles, s); break;
  }
  return true;
}

}  // namespace oi
