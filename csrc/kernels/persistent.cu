#include <algorithm>

#include "launch.cuh"
#include "mma.cuh"
#include "persistent.cuh"

namespace oi {
namespace {

constexpr int kSlots = 6;                   // most ring slots; compute warp w owns slot w
constexpr int kThreads = (kSlots + 1) * 32;  // the compute warps, then the copy warp
constexpr int kCThreads = kSlots * 32;       // compute threads (named barrier 1)
constexpr int kD = 128;                      // head_dim
constexpr int kGroup = 4;                    // query heads per KV head
constexpr int kMaxSplits = 16;               // key splits per KV head
constexpr int kKeysPerWarp = 16;             // keys a warp holds in registers per chunk
constexpr int kChunk = kSlots * kKeysPerWarp;
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

// The copy warp's lane 0: every stage of every layer, in the order the compute warps consume them.
__device__ void produce(const PersistentArgs& a, const Plan& p, unsigned char* ring, uint64_t* full, uint64_t* empty) {
  const uint64_t policy = l2_evict_first();
  int slot = 0;
  uint32_t phase = 0;
  for (int l = 0; l < a.num_layers; ++l) {
    const LayerWeights w = a.layers[l];
    for (int P = 0; P < kProjs; ++P) {
      const Proj pr = proj_of(a, w, P);
      const int u0 = range_begin(pr.units, blockIdx.x, gridDim.x), u1 = range_begin(pr.units, blockIdx.x + 1, gridDim.x);
      const uint32_t row_bytes = pr.K * 2;
      for (int u = u0; u < u1; u += p.units[P]) {
        const uint32_t bytes = min(p.units[P], u1 - u) * row_bytes;
        mbar_wait(&empty[slot], phase ^ 1);  // the first pass finds every slot free
        if (a.trace && u == u0 && (P == kQkv || P == kGu) && l == kPersistentTraceLayer)
          a.trace[blockIdx.x * kPersistentEvents + (P == kQkv ? 14 : 15)] = now_ns();
        unsigned char* dst = ring + (size_t)slot * p.slot_bytes;
        if (P == kGu) {
          mbar_expect_tx(&full[slot], 2 * bytes);
          bulk_load(dst, pr.W + (int64_t)u * pr.K, bytes, &full[slot], policy);
          bulk_load(dst + bytes, pr.W + ((int64_t)pr.units + u) * pr.K, bytes, &full[slot], policy);
        } else {
          mbar_expect_tx(&full[slot], bytes);
          bulk_load(dst, pr.W + (int64_t)u * pr.K, bytes, &full[slot], policy);
        }
        if (++slot == p.slots) slot = 0, phase ^= 1;
      }
    }
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
    for (int w = 0; w < kSlots; ++w) tot += red[w];
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

// One projection: the block's rows [u0, u1), ring slot by ring slot; warp w takes the slots it owns. A
// slot's rows go through the MMA diagonal in pairs (gemv.cu, gemv_tc_kernel): lane (g, t) puts row A's
// 16 bytes per 256-column chunk in MMA row g, row B's in row g + 8, its input elements in B column g.
__device__ __forceinline__ void gemv_phase(int P, const PersistentArgs& a, const Plan& p, const Proj& pr, const bf16* sx, const float* sres,
                           const unsigned char* ring, uint64_t* full, uint64_t* empty, int& slot, uint32_t& phase,
                           uint64_t* tr) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int u0 = range_begin(pr.units, blockIdx.x, gridDim.x), u1 = range_begin(pr.units, blockIdx.x + 1, gridDim.x);
  const int K = pr.K, chunks = K / 256, U = p.units[P];
  for (int u = u0; u < u1; u += U) {
    if (slot == warp) {
      const int n = min(U, u1 - u), npairs = P == kGu ? n : (n + 1) / 2;
      const bf16* st = reinterpret_cast<const bf16*>(ring + (size_t)slot * p.slot_bytes);
      mbar_wait(&full[slot], phase);
      const bool trw = tr && lane == 0 && warp == 1 && P == kO;
      if (trw) tr[29] = now_ns();
      for (int q0 = 0; q0 < npairs; q0 += 4) {
        // Four work items without branches, so that a chunk's shared-memory loads go out together: up
        // to four pairs (a fourth repeats the third), or two pairs in two halves of K, or one pair in
        // four quarters; an item past the last chunk reads a valid one with a zero input.
        const int rem = npairs - q0, np = rem >= 3 ? 4 : rem, per = (chunks * np + 3) / 4;
        int ra[4], rb[4], cb[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int pp = q0 + min(j % np, rem - 1);
          ra[j] = (P == kGu ? pp : 2 * pp) * K;
          rb[j] = (P == kGu ? n + pp : min(2 * pp + 1, n - 1)) * K;
          cb[j] = (j / np) * per;
        }
        float acc[4][2][4];
        for (int rep = 0; rep < ((a.debug & 16) ? 2 : 1); ++rep) {  // profiling: twice, the second warm
          if (trw && rep == 1) tr[30] = now_ns();
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) acc[j][h][0] = acc[j][h][1] = acc[j][h][2] = acc[j][h][3] = 0.f;
          // Software-pipelined: chunk c + 1's shared-memory loads go out before chunk c's MMAs (an LDS
          // feeding the next MMA directly cost its latency each time: ~3 us per 40 KB slot).
          uint4 xv[4], wa[4], wb[4];
          auto load = [&](int c) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const int cc = cb[j] + c, e = min(cc, chunks - 1) * 256 + lane * 8;
              xv[j] = *reinterpret_cast<const uint4*>(sx + e);
              if (cc >= chunks) xv[j] = make_uint4(0, 0, 0, 0);
              wa[j] = *reinterpret_cast<const uint4*>(st + ra[j] + e);
              wb[j] = *reinterpret_cast<const uint4*>(st + rb[j] + e);
            }
          };
          load(0);
          for (int c = 0; c < per; ++c) {
            const uint4 x0[4] = {xv[0], xv[1], xv[2], xv[3]}, a0[4] = {wa[0], wa[1], wa[2], wa[3]},
                        b0[4] = {wb[0], wb[1], wb[2], wb[3]};
            if (c + 1 < per) load(c + 1);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              mma_bf16(acc[j][0], a0[j].x, b0[j].x, a0[j].y, b0[j].y, x0[j].x, x0[j].y);
              mma_bf16(acc[j][1], a0[j].z, b0[j].z, a0[j].w, b0[j].w, x0[j].z, x0[j].w);
            }
          }
        }
        if (trw) tr[31] = now_ns();
        // Item j's sums belong to pair j % np.
        float f[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) f[j][e] = acc[j][0][e] + acc[j][1][e];
        if (np <= 2)
#pragma unroll
          for (int e = 0; e < 4; ++e) f[0][e] += f[2][e], f[1][e] += f[3][e];
        if (np == 1)
#pragma unroll
          for (int e = 0; e < 4; ++e) f[0][e] += f[1][e];
        // The diagonal: lane (g, g / 2) holds C[g][g] in d[g & 1] (row A) and C[g+8][g] in d[2 + (g & 1)].
        const bool diag = t == (g >> 1);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int pp = q0 + q;
          if (q >= min(np, rem)) break;
          float va = diag ? ((g & 1) ? f[q][1] : f[q][0]) : 0.f, vb = diag ? ((g & 1) ? f[q][3] : f[q][2]) : 0.f;
          for (int o = 16; o > 0; o >>= 1) {
            va += __shfl_xor_sync(0xffffffffu, va, o);
            vb += __shfl_xor_sync(0xffffffffu, vb, o);
          }
          if (lane == 0) {
            if (P == kGu) {
              a.act[u + pp] = __float2bfloat16(silu(bf16r(va)) * bf16r(vb));
            } else if (P == kQkv) {
              a.qkv[u + 2 * pp] = __float2bfloat16(va);
              if (2 * pp + 1 < n) a.qkv[u + 2 * pp + 1] = __float2bfloat16(vb);
            } else {  // o, down: the residual add (x's rows staged with the input)
              const int i = u - u0 + 2 * pp;
              a.x[u0 + i] = __float2bfloat16(va + sres[i]);
              if (2 * pp + 1 < n) a.x[u0 + i + 1] = __float2bfloat16(vb + sres[i + 1]);
            }
          }
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[slot]);  // the copy warp may refill it
    }
    if (++slot == p.slots) slot = 0, phase ^= 1;
  }
}

// One step of a reduction of 2N values per lane across the warp: lanes with bit N/2 of their index set
// keep the upper N sums, the others the lower N (exchanging the halves they drop with lane ^ (N / 2)).
template <int N>
__device__ __forceinline__ void halve(float (&v)[64], int lane) {
  const bool up = lane & (N / 2);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float send = up ? v[i] : v[i + N], keep = up ? v[i + N] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, N / 2);
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
  } else if (k1 == L) {  // the split that holds the new token: its k (warp 4) and v (warp 5)
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
    // 16 keys x 4 heads partial dot products, summed across lanes by recursive halving (62 shuffles):
    // lane l ends with index 2l + j, i.e. key l / 2 and head 2 (l & 1) + j.
    float v[kKeysPerWarp * kGroup];
#pragma unroll
    for (int r = 0; r < kKeysPerWarp; ++r) {
      float kf[4];
      f4(kr[r], kb + r, 0, kf);
#pragma unroll
      for (int h = 0; h < kGroup; ++h) v[r * kGroup + h] = q[h][0] * kf[0] + q[h][1] * kf[1] + q[h][2] * kf[2] + q[h][3] * kf[3];
    }
    halve<32>(v, lane);
    halve<16>(v, lane);
    halve<8>(v, lane);
    halve<4>(v, lane);
    halve<2>(v, lane);
    {
      const int r = lane >> 1, h0 = 2 * (lane & 1);
      const bool ok = kb + r < k1;
      ssc[h0 * kChunk + warp * kKeysPerWarp + r] = ok ? v[0] * scale_log2 : kNegInf;
      ssc[(h0 + 1) * kChunk + warp * kKeysPerWarp + r] = ok ? v[1] * scale_log2 : kNegInf;
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
    *reinterpret_cast<float4*>(sacc + (warp * kGroup + h) * kD + lane * 4) = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
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
  __shared__ float red[kSlots];
  __shared__ float sres[kMaxRowsPerBlock];
  __shared__ int flag;
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.slots; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], 1);
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
      gemv_phase(P, a, p, proj_of(a, w, P), sx, sres, ring, full, empty, slot, phase,
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
      p.units[P] = sb / unit[P];
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
