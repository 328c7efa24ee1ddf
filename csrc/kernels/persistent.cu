#include <algorithm>

#include "launch.cuh"
#include "mma.cuh"  // mbarriers, bulk copies
#include "persistent.cuh"

namespace oi {
namespace {

constexpr int kSlots = 6;                    // most ring slots
constexpr int kHalves = 2;                   // compute warps per slot: w and w + kSlots own slot w
constexpr int kCWarps = kSlots * kHalves;
constexpr int kThreads = (kCWarps + 1) * 32;  // the compute warps, then the copy warp
constexpr int kCThreads = kCWarps * 32;       // compute threads (named barrier 1; 2 + s: slot s's pair)
constexpr int kD = 128;                      // head_dim
constexpr int kGroup = 4;                    // query heads per KV head
constexpr int kMaxSplits = 16;               // key splits per KV head
constexpr int kKeysPerWarp = 8;              // keys a warp holds in registers per chunk
constexpr int kChunk = kCWarps * kKeysPerWarp;
constexpr int kMinSplitKeys = 64;
constexpr int kMaxRowsPerBlock = 64;         // of the residual projections (hidden / blocks)
constexpr int kPartial = kGroup * (kD + 2);  // one split's partial: o [4][128], then m [4], l [4]
constexpr float kNegInf = -__builtin_huge_valf();
// Attention scratch (floats), aliased with the staged GEMV input: q [4][128], scores [4][kChunk], running
// m / l / rescale [3][4] (+4 pad), the new token's k and v [2][128], per-warp P.V sums [kSlots][4][128].
constexpr int kScratchFloats = kGroup * kD + kGroup * kChunk + 16 + 2 * kD + kSlots * kGroup * kD;
enum { kQkv, kO, kGu, kDown, kProjs };
// Counters per layer: qkv done (blocks), attention merged (KV heads), o done, gate_up done, down done
// (blocks), then one split-arrival counter per KV head.
constexpr int kCtr = 5;

struct Plan {
  int slots, slot_bytes, x_bytes, smem;
  int units[kProjs];  // rows (gate_up: gate/up row pairs) per ring slot
};

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }
__device__ __forceinline__ float bf16r(float v) { return __bfloat162float(__float2bfloat16(v)); }
__device__ __forceinline__ void compute_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(kCThreads) : "memory"); }
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__host__ __device__ __forceinline__ int range_begin(int n, int b, int G) { return (int)((int64_t)n * b / G); }

struct Proj {
  const bf16* W;
  int units, K;  // gate_up: units = intermediate, gate row u and up row units + u
};
__device__ __forceinline__ Proj proj_of(const PersistentArgs& a, const LayerWeights& w, int P) {
  if (P == kQkv) return {w.qkv, (a.heads + 2 * a.kv_heads) * kD, a.hidden};
  if (P == kO) return {w.o, a.hidden, a.heads * kD};
  if (P == kGu) return {w.gate_up, a.intermediate, a.hidden};
  return {w.down, a.hidden, a.intermediate};
}

// The copy warp's lane 0: every stage of every layer, in the order the compute warps consume them. Each
// stage issued into the ring also asks L2 for the stage one ring later (debug bit 5: not), so the HBM
// stream runs a second ring's worth ahead while the compute warps wait on a dependency.
__device__ void produce(const PersistentArgs& a, const Plan& p, unsigned char* ring, uint64_t* full, uint64_t* empty) {
  const uint64_t policy = l2_evict_first();
  int base[kProjs + 1], u0[kProjs];
  base[0] = 0;
  for (int P = 0; P < kProjs; ++P) {  // a block's stages per layer (the same in every layer)
    const Proj pr = proj_of(a, a.layers[0], P);
    u0[P] = range_begin(pr.units, blockIdx.x, gridDim.x);
    const int n = range_begin(pr.units, blockIdx.x + 1, gridDim.x) - u0[P];
    base[P + 1] = base[P] + (n + p.units[P] - 1) / p.units[P];
  }
  const int per_layer = base[kProjs], total = per_layer * a.num_layers;
  // Stage i: its source rows (gate_up: and the matching up rows) and bytes per copy.
  auto stage = [&](int i, const bf16*& src, const bf16*& src2, uint32_t& bytes, int& P) {
    const int l = i / per_layer;
    int r = i - l * per_layer;
    P = 0;
    while (r >= base[P + 1]) ++P;
    const Proj pr = proj_of(a, a.layers[l], P);
    const int u = u0[P] + (r - base[P]) * p.units[P];
    const int n = min(p.units[P], range_begin(pr.units, blockIdx.x + 1, gridDim.x) - u);
    bytes = (uint32_t)n * pr.K * 2;
    src = pr.W + (int64_t)u * pr.K;
    src2 = P == kGu ? pr.W + ((int64_t)pr.units + u) * pr.K : nullptr;
  };
  int slot = 0;
  uint32_t phase = 0;
  for (int i = 0; i < total; ++i) {
    const bf16 *src, *src2;
    uint32_t bytes;
    int P;
    stage(i, src, src2, bytes, P);
    mbar_wait(&empty[slot], phase ^ 1);  // the first pass finds every slot free
    if (a.trace && i / per_layer == kPersistentTraceLayer && (i % per_layer == base[kQkv] || i % per_layer == base[kGu]))
      a.trace[blockIdx.x * kPersistentEvents + (P == kQkv ? 14 : 15)] = now_ns();
    unsigned char* dst = ring + (size_t)slot * p.slot_bytes;
    mbar_expect_tx(&full[slot], src2 ? 2 * bytes : bytes);
    bulk_load(dst, src, bytes, &full[slot], policy);
    if (src2) bulk_load(dst + bytes, src2, bytes, &full[slot], policy);
    if (!(a.debug & 32) && i + p.slots < total) {
      stage(i + p.slots, src, src2, bytes, P);
      bulk_prefetch_l2(src, bytes);
      if (src2) bulk_prefetch_l2(src2, bytes);
    }
    if (++slot == p.slots) slot = 0, phase ^= 1;
  }
}

// A counter is kWays sub-counters on separate 128-byte lines: a block adds to sub-counter b % kWays, so
// the 132 arrivals and the pollers do not all meet on one L2 line.
constexpr int kWays = 8, kStride = 32;  // ints
constexpr int kCounterInts = kWays * kStride;

// Warp 0 polls the sub-counters (acquire) until they sum to target; the barrier passes it on (the
// pattern of CUTLASS's generic barrier). debug bit 0: no wait; bit 2: back off between polls; bit 3: one
// sub-counter only.
__device__ __forceinline__ void wait_counter(const int* c, int target, int debug) {
  if (threadIdx.x < 32 && !(debug & 1)) {
    const int lane = threadIdx.x, ways = (debug & 8) ? 1 : kWays;
    for (;;) {
      int v = lane < ways ? ld_acquire(c + lane * kStride) : 0;
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (v >= target) break;
      if (debug & 4) __nanosleep(64);
    }
  }
  compute_sync();
}
// After every compute thread's writes: one release per block.
__device__ __forceinline__ void signal_counter(int* c, int debug) {
  compute_sync();
  if (threadIdx.x == 0) {
    int* p = c + (blockIdx.x % ((debug & 8) ? 1 : kWays)) * kStride;
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(p) : "memory");
  }
}

// A GEMV's input in shared memory as bf16, RMSNorm applied with the rmsnorm kernel's roundings (each
// thread on the elements it staged). Another block wrote src: read through L2.
// For a residual add (res != null) the block's rows of x are read here too, into sres, so that the
// epilogue does not wait on L2 for each.
template <bool NORM>
__device__ void stage_input(const bf16* src, const bf16* nw, int K, float eps, bf16* sx, float* red,
                            const bf16* res = nullptr, int res_units = 0, float* sres = nullptr) {
  const int tid = threadIdx.x, lane = tid & 31;
  if (res) {
    const int u0 = range_begin(res_units, blockIdx.x, gridDim.x), n = range_begin(res_units, blockIdx.x + 1, gridDim.x) - u0;
    if (tid < n) sres[tid] = __bfloat162float(__ldcg(res + u0 + tid));
  }
  float ss = 0.f;
  for (int k = tid * 8; k < K; k += kCThreads * 8) {
    const uint4 v = __ldcg(reinterpret_cast<const uint4*>(src + k));
    *reinterpret_cast<uint4*>(sx + k) = v;
    if (NORM) {
      const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(p[q]);
        ss += f.x * f.x + f.y * f.y;
      }
    }
  }
  if (NORM) {
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) red[tid >> 5] = ss;
    compute_sync();
    float tot = 0.f;
#pragma unroll
    for (int w = 0; w < kCWarps; ++w) tot += red[w];
    const float rstd = rsqrtf(tot / K + eps);
    for (int k = tid * 8; k < K; k += kCThreads * 8) {
      const uint4 wv = __ldg(reinterpret_cast<const uint4*>(nw + k));
      const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wv);
      uint4 v = *reinterpret_cast<const uint4*>(sx + k);
      __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(o[q]), g = __bfloat1622float2(wp[q]);
        const float2 n = __bfloat1622float2(__floats2bfloat162_rn(f.x * rstd, f.y * rstd));
        o[q] = __floats2bfloat162_rn(n.x * g.x, n.y * g.y);
      }
      *reinterpret_cast<uint4*>(sx + k) = v;
    }
  }
  compute_sync();
}

// 8 bf16 (one 16-byte load) to fp32.
__device__ __forceinline__ void bf16x8(const uint4& v, float (&f)[8]) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 t = __bfloat1622float2(p[q]);
    f[2 * q] = t.x, f[2 * q + 1] = t.y;
  }
}

// One step of a reduction of 2N of T values per lane across the warp: lanes with bit O of their index set
// keep the upper N sums, the others the lower N (exchanging the halves they drop with lane ^ O).
template <int N, int O, int T>
__device__ __forceinline__ void halve(float (&v)[T], int lane) {
  const bool up = lane & O;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float send = up ? v[i] : v[i + N], keep = up ? v[i + N] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
  }
}

// One projection: the block's rows [u0, u1), ring slot by ring slot; warps s and s + kSlots take slot
// s, each half of the chunks, and the second hands its sums to the first (xch, double-buffered by the
// slot's phase so that a write never meets the previous read).
// A slot holds R <= 8 rows (gate_up: n gate rows, then their n up rows). The warp works on 8 items
// without branches, so that a chunk's loads go out together: the rows (a padded row repeats the last),
// or each of R <= 4 rows in 8 / R parts of K (an item past the last chunk reads a valid one with a zero
// input). Dot products on CUDA cores: the MMA-diagonal form (gemv.cu) ran ~50 cycles per 512 bytes
// here, with one warp per slot and four per SM.
__device__ __forceinline__ void gemv_phase(int P, const PersistentArgs& a, const Plan& p, const Proj& pr, const bf16* sx,
                                           const float* sres, const unsigned char* ring, uint64_t* full, uint64_t* empty,
                                           int& slot, uint32_t& phase, float* xch, uint64_t* tr) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, half = warp / kSlots;
  const int u0 = range_begin(pr.units, blockIdx.x, gridDim.x), u1 = range_begin(pr.units, blockIdx.x + 1, gridDim.x);
  const int K = pr.K, chunks = K / 256, U = p.units[P];
  for (int u = u0; u < u1; u += U) {
    if (slot == warp % kSlots) {
      const int n = min(U, u1 - u), R = P == kGu ? 2 * n : n;
      const int np = R >= 5 ? 8 : R >= 3 ? 4 : R, per = (chunks * np + 7) / 8;
      const bf16* st = reinterpret_cast<const bf16*>(ring + (size_t)slot * p.slot_bytes);
      int roff[8], cb[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) roff[j] = min(j % np, R - 1) * K, cb[j] = (j / np) * per;
      mbar_wait(&full[slot], phase);
      const bool trw = tr && lane == 0 && warp == 1 && P == kO;
      const int c_lo = half * (np == 8 ? chunks : per) / kHalves, c_hi = (half + 1) * (np == 8 ? chunks : per) / kHalves;
      if (trw) tr[29] = now_ns();
      float acc[8];
      for (int rep = 0; rep < ((a.debug & 16) ? 2 : 1); ++rep) {  // profiling: twice, the second warm
        if (trw && rep == 1) tr[30] = now_ns();
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = 0.f;
        if (np == 8) {  // every item on the same chunk: the input converted once
          for (int c = c_lo; c < c_hi; ++c) {
            const int e = c * 256 + lane * 8;
            float xf[8];
            bf16x8(*reinterpret_cast<const uint4*>(sx + e), xf);
            uint4 wv[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) wv[j] = *reinterpret_cast<const uint4*>(st + roff[j] + e);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              float wf[8];
              bf16x8(wv[j], wf);
#pragma unroll
              for (int i = 0; i < 8; ++i) acc[j] = fmaf(wf[i], xf[i], acc[j]);
            }
          }
        } else {
          for (int c = c_lo; c < c_hi; ++c) {
            uint4 xv[8], wv[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              const int cc = cb[j] + c, e = min(cc, chunks - 1) * 256 + lane * 8;
              xv[j] = cc < chunks ? *reinterpret_cast<const uint4*>(sx + e) : make_uint4(0, 0, 0, 0);
              wv[j] = *reinterpret_cast<const uint4*>(st + roff[j] + e);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              float wf[8], xf[8];
              bf16x8(wv[j], wf);
              bf16x8(xv[j], xf);
#pragma unroll
              for (int i = 0; i < 8; ++i) acc[j] = fmaf(wf[i], xf[i], acc[j]);
            }
          }
        }
      }
      if (trw) tr[31] = now_ns();
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[slot]);  // the copy warp may refill it
      // Lane l ends with item (l >> 2) & 7 summed over the warp; the K parts of a row then fold in.
      halve<4, 16, 8>(acc, lane);
      halve<2, 8, 8>(acc, lane);
      halve<1, 4, 8>(acc, lane);
      float v = acc[0];
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      if (np <= 4) v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (np <= 2) v += __shfl_xor_sync(0xffffffffu, v, 8);
      if (np == 1) v += __shfl_xor_sync(0xffffffffu, v, 4);
      float* xs = xch + (phase * kSlots + slot) * 32;
      if (half) xs[lane] = v;
      asm volatile("bar.sync %0, %1;\n" ::"r"(2 + slot), "n"(2 * 32) : "memory");
      if (!half) {  // the first warp of the pair writes the slot's outputs
      v += xs[lane];
      const int r = (lane >> 2) & 7;  // this lane's row of the slot
      const float up = __shfl_sync(0xffffffffu, v, ((r + n) & 7) << 2);  // gate_up: row r's up row
      if ((lane & 3) == 0 && r < min(np, R)) {
        if (P == kGu) {
          if (r < n) a.act[u + r] = __float2bfloat16(silu(bf16r(v)) * bf16r(up));
        } else if (P == kQkv) {
          a.qkv[u + r] = __float2bfloat16(v);
        } else {  // o, down: the residual add (x's rows staged with the input)
          a.x[u + r] = __float2bfloat16(v + sres[u - u0 + r]);
        }
      }
      }
    }
    if (++slot == p.slots) slot = 0, phase ^= 1;
  }
}

// Decode attention of this layer for the one sequence: block b < kv_heads * S takes KV head b % kv_heads
// and key split b / kv_heads, with the group's 4 query heads. q/k RMSNorm + RoPE and the K/V write of the
// new token happen here; its k and v are used from shared memory. Splits merge in the last block to
// arrive per KV head. Scores and P.V run on CUDA cores: a warp holds 16 keys' K and V rows (4 dims per
// lane), requested before this layer's qkv is complete.
__device__ void attention_phase(const PersistentArgs& a, int l, const LayerWeights& w, int* ctr, float* scratch,
                                int* flag, uint64_t* tr) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  auto mark = [&](int e) {
    if (tr) tr[e] = now_ns();
  };
  const int KVH = a.kv_heads, L = a.context_lens[0], pos = a.positions[0];
  const int S = max(1, min(min(kMaxSplits, (int)gridDim.x / KVH), (L + kMinSplitKeys - 1) / kMinSplitKeys));
  const bool item = (int)blockIdx.x < KVH * S;
  const int kvh = blockIdx.x % KVH, sp = blockIdx.x / KVH;
  const int per = (L + S - 1) / S, k0 = sp * per, k1 = min(L, k0 + per);
  const int bs = a.kv.block_size;

  // K/V rows of a warp's 16 keys: lane r < 16 finds key r's row (one division), the loop broadcasts it.
  const int64_t kv_base = (int64_t)l * a.kv.layer_stride() + (int64_t)kvh * bs * kD;
  const int64_t v_off = (int64_t)KVH * bs * kD, page_stride = a.kv.block_stride();
  uint2 kr[kKeysPerWarp], vr[kKeysPerWarp];
  auto load_chunk = [&](int c0) {
    const int key = c0 + warp * kKeysPerWarp + (lane & (kKeysPerWarp - 1));
    long long off = -1;
    if (key < k1 && key < L - 1) {  // the newest key comes from shared memory
      const int pg = key / bs;
      off = a.block_tables[pg] * page_stride + kv_base + (int64_t)(key - pg * bs) * kD;
    }
#pragma unroll
    for (int r = 0; r < kKeysPerWarp; ++r) {
      const long long o = __shfl_sync(0xffffffffu, off, r);
      kr[r] = o >= 0 ? __ldcg(reinterpret_cast<const uint2*>(a.kv_cache + o + lane * 4)) : make_uint2(0, 0);
      vr[r] = o >= 0 ? __ldcg(reinterpret_cast<const uint2*>(a.kv_cache + o + v_off + lane * 4)) : make_uint2(0, 0);
    }
  };
  if (item) load_chunk(k0);  // keys of earlier steps: no dependency on this layer
  wait_counter(ctr + 0 * kCounterInts, gridDim.x, a.debug);
  if (!item) return;
  mark(22);

  float* sq = scratch;                // [4][128]
  float* ssc = sq + kGroup * kD;      // [4][kChunk]
  float* stat = ssc + kGroup * kChunk;  // m [4], l [4], rescale [4]
  float* snew = stat + 16;            // k [128], v [128]
  float* sacc = snew + 2 * kD;        // [kSlots][4][128]
  const float2* cs = a.cos_sin + (int64_t)pos * (kD / 2);
  auto put4 = [&](float* dst, uint2 r) {
    const float2 x = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&r.x));
    const float2 y = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&r.y));
    *reinterpret_cast<float4*>(dst + lane * 4) = make_float4(x.x, x.y, y.x, y.y);
  };
  const int slot_new = a.slots[0];
  if (warp < kGroup) {
    const uint2 raw = __ldcg(reinterpret_cast<const uint2*>(a.qkv + (kvh * kGroup + warp) * kD + lane * 4));
    put4(sq + warp * kD, qk_norm_rope_lane(raw, w.q_norm, cs, a.eps, lane));
  } else if (warp < kGroup + 2 && k1 == L) {  // the split that holds the new token: its k (warp 4) and v (warp 5)
    const bool is_v = warp == kGroup + 1;
    const uint2 raw =
        __ldcg(reinterpret_cast<const uint2*>(a.qkv + (a.heads + (is_v ? KVH : 0) + kvh) * kD + lane * 4));
    const uint2 r = is_v ? raw : qk_norm_rope_lane(raw, w.k_norm, cs, a.eps, lane);
    put4(snew + (is_v ? kD : 0), r);
    if (slot_new >= 0)
      *reinterpret_cast<uint2*>(a.kv_cache + kv_row_offset(a.kv, l, slot_new, kvh, is_v) + lane * 4) = r;
  }
  if (tid < kGroup) stat[tid] = kNegInf, stat[4 + tid] = 0.f;
  compute_sync();
  mark(23);

  const float scale_log2 = 1.4426950408889634f / sqrtf((float)kD);
  float q[kGroup][4], acc[kGroup][4];
#pragma unroll
  for (int h = 0; h < kGroup; ++h) {
    const float4 v = *reinterpret_cast<const float4*>(sq + h * kD + lane * 4);
    q[h][0] = v.x, q[h][1] = v.y, q[h][2] = v.z, q[h][3] = v.w;
    acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = 0.f;
  }
  auto f4 = [&](uint2 r, int key, int off, float (&x)[4]) {
    if (key == L - 1) {
      const float4 v = *reinterpret_cast<const float4*>(snew + off + lane * 4);
      x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
    } else {
      const float2 p = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&r.x));
      const float2 s = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&r.y));
      x[0] = p.x, x[1] = p.y, x[2] = s.x, x[3] = s.y;
    }
  };
  for (int c0 = k0; c0 < k1; c0 += kChunk) {
    if (c0 != k0) load_chunk(c0);
    const int kb = c0 + warp * kKeysPerWarp;  // this warp's first key
    // 8 keys x 4 heads partial dot products, summed across lanes by recursive halving (31 shuffles):
    // lane l ends with index l, i.e. key l / 4 and head l % 4.
    float v[kKeysPerWarp * kGroup];
#pragma unroll
    for (int r = 0; r < kKeysPerWarp; ++r) {
      float kf[4];
      f4(kr[r], kb + r, 0, kf);
#pragma unroll
      for (int h = 0; h < kGroup; ++h) v[r * kGroup + h] = q[h][0] * kf[0] + q[h][1] * kf[1] + q[h][2] * kf[2] + q[h][3] * kf[3];
    }
    halve<16, 16, kKeysPerWarp * kGroup>(v, lane);
    halve<8, 8, kKeysPerWarp * kGroup>(v, lane);
    halve<4, 4, kKeysPerWarp * kGroup>(v, lane);
    halve<2, 2, kKeysPerWarp * kGroup>(v, lane);
    halve<1, 1, kKeysPerWarp * kGroup>(v, lane);
    {
      const int r = lane >> 2, h = lane & 3;
      ssc[h * kChunk + warp * kKeysPerWarp + r] = kb + r < k1 ? v[0] * scale_log2 : kNegInf;
    }
    compute_sync();
    mark(24);
    if (warp < kGroup) {  // online softmax of head `warp` over the chunk
      float* row = ssc + warp * kChunk;
      float cm = kNegInf;
#pragma unroll
      for (int j = lane; j < kChunk; j += 32) cm = fmaxf(cm, row[j]);
      for (int o = 16; o > 0; o >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, o));
      const float m_old = stat[warp], m_new = fmaxf(m_old, cm);
      float sum = 0.f;
#pragma unroll
      for (int j = lane; j < kChunk; j += 32) {
        const float pj = row[j] == kNegInf ? 0.f : exp2f(row[j] - m_new);
        row[j] = pj;
        sum += pj;
      }
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      __syncwarp();
      if (lane == 0) {
        const float alpha = m_old == kNegInf ? 0.f : exp2f(m_old - m_new);
        stat[warp] = m_new;
        stat[4 + warp] = stat[4 + warp] * alpha + sum;
        stat[8 + warp] = alpha;
      }
    }
    compute_sync();
    mark(25);
#pragma unroll
    for (int h = 0; h < kGroup; ++h) {
      const float al = stat[8 + h];
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[h][i] *= al;
    }
#pragma unroll
    for (int r = 0; r < kKeysPerWarp; ++r) {
      if (kb + r >= k1) continue;
      float vf[4];
      f4(vr[r], kb + r, kD, vf);
#pragma unroll
      for (int h = 0; h < kGroup; ++h) {
        const float pr = ssc[h * kChunk + warp * kKeysPerWarp + r];
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[h][i] += pr * vf[i];
      }
    }
    compute_sync();  // the scores are rewritten by the next chunk
  }
  mark(26);

  // This split's partial: the warps' P.V summed, with m and l.
#pragma unroll
  for (int h = 0; h < kGroup; ++h)
    if (warp >= kSlots)  // two rounds: the second half of the warps stores, the first adds
      *reinterpret_cast<float4*>(sacc + ((warp - kSlots) * kGroup + h) * kD + lane * 4) =
          make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
  compute_sync();
#pragma unroll
  for (int h = 0; h < kGroup; ++h)
    if (warp < kSlots) {
      float4* d = reinterpret_cast<float4*>(sacc + (warp * kGroup + h) * kD + lane * 4);
      const float4 o = *d;
      *d = make_float4(o.x + acc[h][0], o.y + acc[h][1], o.z + acc[h][2], o.w + acc[h][3]);
    }
  compute_sync();
  float* part = a.ws + (int64_t)(kvh * kMaxSplits + sp) * kPartial;
  for (int e = tid; e < kGroup * kD; e += kCThreads) {
    float s = 0.f;
#pragma unroll
    for (int w2 = 0; w2 < kSlots; ++w2) s += sacc[w2 * kGroup * kD + e];
    part[e] = s;
  }
  if (tid < kGroup) part[kGroup * kD + tid] = stat[tid], part[kGroup * kD + kGroup + tid] = stat[4 + tid];
  compute_sync();
  if (tid == 0) {  // acq_rel: releases this block's partial, acquires the others' for the last
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(ctr + (kCtr + kvh) * kCounterInts) : "memory");
    *flag = old == S - 1;
  }
  compute_sync();
  mark(27);
  if (!*flag) return;
  // The merge: thread t < 128 takes 4 elements of head t / 32, with every split's m, l and partial
  // requested at once (one round trip).
  const float* base = a.ws + (int64_t)kvh * kMaxSplits * kPartial;
  if (tid < kGroup * kD / 4) {
    const int h = tid / (kD / 4);
    float m[kMaxSplits], ls[kMaxSplits];
    float4 o[kMaxSplits];
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) {
      const float* ps = base + s * kPartial;
      m[s] = s < S ? __ldcg(ps + kGroup * kD + h) : kNegInf;
      ls[s] = s < S ? __ldcg(ps + kGroup * kD + kGroup + h) : 0.f;
      o[s] = s < S ? __ldcg(reinterpret_cast<const float4*>(ps) + tid) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float M = kNegInf, den = 0.f;
    float4 num = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) M = fmaxf(M, m[s]);
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) {
      const float wgt = m[s] == kNegInf ? 0.f : exp2f(m[s] - M);
      den += wgt * ls[s];
      num.x += wgt * o[s].x, num.y += wgt * o[s].y, num.z += wgt * o[s].z, num.w += wgt * o[s].w;
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
    __nv_bfloat162 lo = __floats2bfloat162_rn(num.x * inv, num.y * inv), hi = __floats2bfloat162_rn(num.z * inv, num.w * inv);
    *reinterpret_cast<uint2*>(a.attn + kvh * kGroup * kD + tid * 4) =
        make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
  }
  signal_counter(ctr + 1 * kCounterInts, a.debug);
  mark(28);
}

__global__ void __launch_bounds__(kThreads, 1) persistent_kernel(PersistentArgs a, Plan p) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kSlots;
  bf16* sx = reinterpret_cast<bf16*>(smem + 128);  // staged input, or the attention scratch
  unsigned char* ring = smem + 128 + p.x_bytes;
  __shared__ float red[kCWarps];
  __shared__ float xch[2 * kSlots * 32];  // gemv_phase: [phase][slot][lane]
  __shared__ float sres[kMaxRowsPerBlock];
  __shared__ int flag;
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.slots; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], kHalves);
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x >= kCThreads) {
    if (threadIdx.x == kCThreads) produce(a, p, ring, full, empty);
    return;
  }
  const int G = gridDim.x, H = a.hidden, per_layer = (kCtr + a.kv_heads) * kCounterInts;
  int slot = 0;
  uint32_t phase = 0;
  const int dbg = a.debug;
  for (int l = 0; l < a.num_layers; ++l) {
    const LayerWeights w = a.layers[l];
    int* ctr = a.counters + l * per_layer;
    uint64_t* tr = a.trace && l == kPersistentTraceLayer && threadIdx.x == 0 ? a.trace + blockIdx.x * kPersistentEvents : nullptr;
    auto mark = [&](int e) {
      if (tr) tr[e] = now_ns();
    };
    mark(0);
    // One call site per phase function, so that each is inlined once: the projections in order, each
    // waiting for its input (qkv: the previous layer's down; o: the attention merges; gate_up: o; down:
    // gate_up), staging it (with RMSNorm for qkv and gate_up), streaming its slots and signalling.
    for (int P = 0; P < kProjs; ++P) {
      const int ev = P == kQkv ? 1 : P == kO ? 5 : P == kGu ? 8 : 11;  // trace events of this phase
      if (P == kQkv && l > 0) wait_counter(ctr - per_layer + 4 * kCounterInts, G, dbg);
      if (P == kO) wait_counter(ctr + 1 * kCounterInts, a.kv_heads, dbg | ((dbg >> 1) & 1));
      if (P >= kGu) wait_counter(ctr + P * kCounterInts, G, dbg);
      mark(ev);
      if (P == kQkv || P == kGu)
        stage_input<true>(a.x, P == kQkv ? w.input_norm : w.post_norm, H, a.eps, sx, red);
      else
        stage_input<false>(P == kO ? a.attn : a.act, nullptr, P == kO ? a.heads * kD : a.intermediate, a.eps, sx, red,
                           a.x, H, sres);
      mark(ev + 1);
      gemv_phase(P, a, p, proj_of(a, w, P), sx, sres, ring, full, empty, slot, phase, xch,
                 a.trace && l == kPersistentTraceLayer ? a.trace + blockIdx.x * kPersistentEvents : nullptr);
      mark(ev + 2);
      if (P == kO && a.trace && l == kPersistentTraceLayer && (threadIdx.x & 31) == 0)
        a.trace[blockIdx.x * kPersistentEvents + 16 + (threadIdx.x >> 5)] = now_ns();
      signal_counter(ctr + (P == kQkv ? 0 : P + 1) * kCounterInts, dbg);
      if (P == kQkv) {
        if (!(dbg & 2)) attention_phase(a, l, w, ctr, reinterpret_cast<float*>(sx), &flag, tr);
        mark(4);
      }
    }
  }
}

int smem_optin() {
  static int v = 0;
  if (v == 0) {
    int dev = 0;
    OI_CUDA_CHECK(cudaGetDevice(&dev));
    OI_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  }
  return v;
}

// The ring slot size that holds the most bytes of the least-filled projection (whole rows per slot).
Plan make_plan(int H, int I, int heads) {
  Plan best{};
  const int unit[kProjs] = {H * 2, heads * kD * 2, 2 * H * 2, I * 2};
  const int x_elems = std::max({H, heads * kD, I});
  const int x_bytes = (std::max<int>(x_elems * 2, kScratchFloats * 4) + 127) / 128 * 128;
  const int budget = smem_optin() - 128 - x_bytes - 1024;  // 1 KB: static shared memory
  int best_cap = 0;
  for (int sb = 16 * 1024; sb <= 96 * 1024; sb += 1024) {
    const int slots = std::min(kSlots, budget / sb);
    if (slots < 2) continue;
    int least = sb;
    Plan p{slots, sb, x_bytes, 128 + x_bytes + slots * sb, {}};
    for (int P = 0; P < kProjs; ++P) {
      p.units[P] = std::min(sb / unit[P], P == kGu ? 4 : 8);  // at most 8 rows per slot (gemv_phase)
      least = std::min(least, p.units[P] * unit[P]);
    }
    if (least * slots > best_cap) best_cap = least * slots, best = p;
  }
  return best;
}

}  // namespace

int& persistent_debug() {
  static int mask = 0;
  return mask;
}

namespace {
uint64_t* g_trace = nullptr;
bool g_trace_on = false;
int g_trace_sms() {
  int dev = 0, sms = 0;
  OI_CUDA_CHECK(cudaGetDevice(&dev));
  OI_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}
}  // namespace

void persistent_trace_enable(bool on) {
  if (on && !g_trace) OI_CUDA_CHECK(cudaMalloc(&g_trace, (size_t)g_trace_sms() * kPersistentEvents * sizeof(uint64_t)));
  if (on) OI_CUDA_CHECK(cudaMemset(g_trace, 0, (size_t)g_trace_sms() * kPersistentEvents * sizeof(uint64_t)));
  g_trace_on = on;
}

uint64_t* persistent_trace() { return g_trace_on ? g_trace : nullptr; }
const uint64_t* persistent_trace_data() { return g_trace; }

int& persistent_decode() {
  static int mode = 1;
  return mode;
}

bool persistent_fits(int hidden, int intermediate, int heads, int kv_heads, int head_dim) {
  if (head_dim != kD || heads != kGroup * kv_heads || hidden % 256 || intermediate % 256) return false;
  return make_plan(hidden, intermediate, heads).slots >= 2;
}

int64_t persistent_counter_ints(int num_layers, int kv_heads) {
  return (int64_t)num_layers * (kCtr + kv_heads) * kCounterInts;
}
int64_t persistent_ws_floats(int kv_heads, int) { return (int64_t)kv_heads * kMaxSplits * kPartial; }

void persistent_layers(const PersistentArgs& a, int num_sms, cudaStream_t s) {
  const Plan p = make_plan(a.hidden, a.intermediate, a.heads);
  OI_CHECK(p.slots >= 2 && num_sms >= a.kv_heads && a.hidden <= kMaxRowsPerBlock * num_sms,
           "persistent_layers: geometry does not fit");
  static int configured = 0;  // one attribute call for the largest plan seen (capture safe afterwards)
  if (p.smem > configured) {
    OI_CUDA_CHECK(cudaFuncSetAttribute(persistent_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, p.smem));
    configured = p.smem;
  }
  OI_CUDA_CHECK(cudaMemsetAsync(a.counters, 0, persistent_counter_ints(a.num_layers, a.kv_heads) * sizeof(int), s));
  cudaLaunchAttribute coop{};
  coop.id = cudaLaunchAttributeCooperative;  // every block resident: the counters are waited on
  coop.val.cooperative = 1;
  OI_CUDA_CHECK(launch_kernel(false, persistent_kernel, dim3(num_sms), dim3(kThreads), p.smem, s, &coop, a, p));
}

}  // namespace oi
