#include <algorithm>

#include "launch.cuh"
#include "mma.cuh"  // mbarriers, bulk copies
#include "persistent.cuh"

namespace oi {
namespace {

constexpr int kCW = 8;                      // compute warps: all of them consume every ring slot (log2: 3)
constexpr int kMaxSlots = 16;                // most ring slots (their mbarriers: the first 256 bytes)
constexpr int kBarBytes = 2 * kMaxSlots * 8;
constexpr int kThreads = (kCW + 1) * 32;     // the compute warps, then the copy warp
constexpr int kCThreads = kCW * 32;          // compute threads (named barrier 1)
constexpr int kRed = 1024;                   // per-warp partial sums of one projection's rows in a block
constexpr int kD = 128;                      // head_dim
constexpr int kGroup = 4;                    // query heads per KV head
constexpr int kMaxSplits = 16;               // key splits per KV head
constexpr int kKeysPerWarp = 8;              // keys of one scores MMA (a warp's group of keys)
constexpr int kMinSplitKeys = kCW * kKeysPerWarp;  // a split fills every warp before another split is made
constexpr int kMaxRowsPerBlock = 64;         // of the residual projections (hidden / blocks)
constexpr int kPartial = kGroup * (kD + 2);  // one split's partial (LL words): o [4][128], then (m, l) [4]
constexpr float kNegInf = -__builtin_huge_valf();
// Attention scratch (in floats), aliased with the staged GEMV input: q [4][128] (bf16 in the first half), each
// warp's running max and sum per head [kCW][2][4], the new token's k and v [2][128] (bf16), each warp's P.V
// [kCW][4][128] (after the partial is out: the merge's exchange).
constexpr int kScratchFloats = kGroup * kD + kCW * 2 * kGroup + 2 * kD + kCW * kGroup * kD;
enum { kQkv, kO, kGu, kDown, kProjs };

struct Plan {
  int slots, slot_bytes, x_bytes, smem;
  int pairs[kProjs];   // row pairs per ring stage (gate_up: a gate row and its up row); kCW / pairs warps per pair
  int ksplit[kProjs];  // pieces of K per row pair (pairs == 1 where > 1): a pair too large for one stage
  int inflight;       // most stages requested and not yet landed (0: the ring bounds them)
  int ck;             // attention's keys per ring stage (K rows, then V rows at ck rows)
};

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }
__device__ __forceinline__ float bf16r(float v) { return __bfloat162float(__float2bfloat16(v)); }
__device__ __forceinline__ void compute_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(kCThreads) : "memory"); }
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
// Block b's share of n units (n even): even bounds, so that an LL word's two values have one writer.
__host__ __device__ __forceinline__ int range_begin(int n, int b, int G) { return 2 * (int)((int64_t)(n / 2) * b / G); }

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

// The step's sequence, read once per launch: each read from global memory costs a loaded round trip, and
// attention chained three of them (length -> key -> block table -> K/V) in every layer.
struct StepInfo {
  int L, pos, slot_new;
  int S, kvh, sp, k0, k1;  // attention: splits per KV head, this block's KV head, split and keys [k0, k1)
};
__device__ __forceinline__ void attn_split(const PersistentArgs& a, int L, int& S, int& kvh, int& sp, int& k0, int& k1) {
  S = max(1, min(min(kMaxSplits, (int)gridDim.x / a.kv_heads), (L + kMinSplitKeys - 1) / kMinSplitKeys));
  kvh = blockIdx.x % a.kv_heads, sp = blockIdx.x / a.kv_heads;
  const int per = (L + S - 1) / S;
  k0 = sp * per, k1 = min(L, k0 + per);
}
__device__ StepInfo step_info(const PersistentArgs& a) {
  StepInfo si;
  si.L = a.context_lens[0], si.pos = a.positions[0], si.slot_new = a.slots[0];
  attn_split(a, si.L, si.S, si.kvh, si.sp, si.k0, si.k1);
  return si;
}

// The copy warp's lane 0: every stage of every layer, in the order the compute warps consume them. A stage
// is `pairs` row pairs: rows 2j and 2j + 1 at 2j and 2j + 1 row lengths, or (gate_up) gate row j at j and its
// up row at pairs + j. With p.inflight > 0 a stage is requested only once the one p.inflight stages earlier
// has landed, so that fewer bytes queue in the memory system ahead of the LL reads.
__device__ void produce(const PersistentArgs& a, const Plan& p, unsigned char* ring, uint64_t* full, uint64_t* empty,
                        const int2* rng) {
  const uint64_t policy = l2_evict_first();
  int slot = 0, k = 0;
  uint32_t phase = 0;
  auto acquire = [&](int inflight) {  // the next slot, once free and (inflight > 0) once the stage inflight back landed
    mbar_wait(&empty[slot], phase ^ 1);  // the first pass finds every slot free
    if (inflight > 0 && k >= inflight) {  // stage k - inflight: its slot and phase without a division
      int es = slot - inflight;
      uint32_t ep = phase;
      if (es < 0) es += p.slots, ep ^= 1;
      mbar_wait(&full[es], ep);
    }
  };
  const int L = a.context_lens[0];
  int S, kvh, sp, k0, k1;
  attn_split(a, L, S, kvh, sp, k0, k1);
  const bool item = (int)blockIdx.x < a.kv_heads * S;
  const int bs = a.kv.block_size, ck = p.ck;
  for (int l = 0; l < a.num_layers; ++l) {
    const LayerWeights w = a.layers[l];
    uint64_t* tr = a.trace && l == kPersistentTraceLayer ? a.trace + blockIdx.x * kPersistentEvents : nullptr;
    for (int P = 0; P < kProjs; ++P) {
      const Proj pr = proj_of(a, w, P);
      const int u0 = rng[P].x, u1 = rng[P].y;
      const uint32_t row_bytes = pr.K * 2;
      const int U = P == kGu ? p.pairs[P] : 2 * p.pairs[P], ks = p.ksplit[P], chunks = pr.K / 256;
      for (int u = u0; u < u1; u += U)
      for (int kp = 0; kp < ks; ++kp, ++k) {
        // The stage's copies worked out first: once the throttle lets it go, the stage is only issued (at one
        // stage in flight, every cycle from a landing to the next request idles this SM's stream).
        // Row A's bytes (or pieces of K: ks > 1, of a stride of the largest piece), then gate_up's up rows or
        // row B's piece at offB.
        uint32_t nA = min(U, u1 - u) * row_bytes, offB = 0;
        const bf16 *srcA = pr.W + (int64_t)u * pr.K, *srcB = nullptr;
        if (ks > 1) {
          const int cA = kp * chunks / ks, cB = (kp + 1) * chunks / ks;
          nA = (cB - cA) * 512, offB = (chunks + ks - 1) / ks * 512;
          srcA += cA * 256;
          srcB = pr.W + (P == kGu ? (int64_t)pr.units + u : u + 1) * pr.K + cA * 256;
        } else if (P == kGu) {
          offB = U * row_bytes, srcB = pr.W + ((int64_t)pr.units + u) * pr.K;
        }
        unsigned char* dst = ring + (size_t)slot * p.slot_bytes;
        acquire(p.inflight);
        if (tr && u == u0 && P != kDown) tr[P == kQkv ? 14 : P == kGu ? 15 : 18] = now_ns();
        mbar_expect_tx(&full[slot], srcB ? 2 * nA : nA);
        bulk_load(dst, srcA, nA, &full[slot], policy);
        if (srcB) bulk_load(dst + offB, srcB, nA, &full[slot], policy);
        if (++slot == p.slots) slot = 0, phase ^= 1;
      }
      // After qkv: this block's keys of earlier steps for attention, p.ck per stage (K rows, then V rows at
      // p.ck rows), page by page; the newest key is this step's and comes from shared memory. Only the first
      // stage waits for the in-flight limit: the later ones are on attention's path.
      // (The engine never runs a row with no context: attention consumes at least one chunk per item, as here.)
      if (P == kQkv && item) {
        const bf16* layer_kv = a.kv_cache + (int64_t)l * a.kv.layer_stride() + (int64_t)kvh * bs * kD;
        const int64_t v_off = (int64_t)a.kv_heads * bs * kD;
        for (int c0 = k0; c0 < k1; c0 += ck, ++k) {
          const int cn = min(min(k1, c0 + ck), L - 1);
          acquire(c0 == k0 ? p.inflight : 0);  // a split's later stages: requested together
          if (tr && c0 == k0) tr[16] = now_ns();
          unsigned char* dst = ring + (size_t)slot * p.slot_bytes;
          if (cn > c0) {
            mbar_expect_tx(&full[slot], 2u * (cn - c0) * kD * 2);
            for (int key = c0; key < cn;) {
              const int pg = key / bs, kend = min(cn, (pg + 1) * bs);
              const bf16* src = layer_kv + (int64_t)__ldg(a.block_tables + pg) * a.kv.block_stride() + (int64_t)(key - pg * bs) * kD;
              const uint32_t off = (key - c0) * kD * 2, bytes = (kend - key) * kD * 2;
              bulk_load(dst + off, src, bytes, &full[slot], policy);
              bulk_load(dst + ck * kD * 2 + off, src + v_off, bytes, &full[slot], policy);
              key = kend;
            }
          } else {
            mbar_arrive(&full[slot]);  // nothing cached in this chunk: the phase completes empty
          }
          if (tr && c0 == k0) tr[17] = now_ns();
          if (++slot == p.slots) slot = 0, phase ^= 1;
        }
      }
    }
  }
}

// Activations pass between blocks as LL words (the flag-in-data protocol): 8 bytes {two bf16, flag}, each
// word one 64-bit access (single-copy atomic), so a reader that sees the flag sees the data. The flag names
// (step, layer, phase); a reader polls the words themselves, with no fence, counter or second round trip.
__device__ __forceinline__ uint4 ll_load(const uint2* p, uint32_t flag) {  // two words; spins until both carry flag
  unsigned long long w0, w1;
  do {
    asm volatile("ld.relaxed.gpu.global.v2.u64 {%0,%1}, [%2];\n" : "=l"(w0), "=l"(w1) : "l"(p) : "memory");
  } while ((uint32_t)(w0 >> 32) != flag || (uint32_t)(w1 >> 32) != flag);
  return make_uint4((uint32_t)w0, flag, (uint32_t)w1, flag);  // data in .x and .z
}
__device__ __forceinline__ unsigned long long ll_word(uint32_t data, uint32_t flag) {
  return (unsigned long long)flag << 32 | data;
}
__device__ __forceinline__ void ll_store(uint2* p, uint32_t data, uint32_t flag) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;\n" ::"l"(p), "l"(ll_word(data, flag)) : "memory");
}
__device__ __forceinline__ void ll_store2(uint2* p, uint32_t d0, uint32_t d1, uint32_t flag) {
  asm volatile("st.relaxed.gpu.global.v2.u64 [%0], {%1,%2};\n" ::"l"(p), "l"(ll_word(d0, flag)), "l"(ll_word(d1, flag))
               : "memory");
}
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// A GEMV's input in shared memory as bf16, polled from the LL words every block wrote (flag), RMSNorm
// applied with the rmsnorm kernel's roundings (each thread on the elements it staged). A round of loads is
// issued at once, then only the words not yet flagged are polled again: one trip through L2 per round once
// the last writer is done (a load at a time took one per 1024 elements).
constexpr int kStageLoads = 6;  // LL loads per thread in flight (RMSNorm's K: at most one round of them)
template <bool NORM>
__device__ void stage_input(const uint2* src, uint32_t flag, const bf16* nw, int K, float eps, bf16* sx, float* red) {
  const int tid = threadIdx.x, lane = tid & 31;
  for (int kr = 0; kr < K; kr += kStageLoads * kCThreads * 4) {
    unsigned long long w[kStageLoads][2];
    uint2 g[kStageLoads];
    auto in = [&](int i) { return kr + (tid + i * kCThreads) * 4 < K; };
    auto ld = [&](int i) {
      asm volatile("ld.relaxed.gpu.global.v2.u64 {%0,%1}, [%2];\n"
                   : "=l"(w[i][0]), "=l"(w[i][1]) : "l"(src + (kr + (tid + i * kCThreads) * 4) / 2) : "memory");
    };
#pragma unroll
    for (int i = 0; i < kStageLoads; ++i)
      if (in(i)) {
        ld(i);
        if (NORM) g[i] = __ldg(reinterpret_cast<const uint2*>(nw + kr + (tid + i * kCThreads) * 4));
      }
    bool again;
    do {
      again = false;
#pragma unroll
      for (int i = 0; i < kStageLoads; ++i)
        if (in(i) && ((uint32_t)(w[i][0] >> 32) != flag || (uint32_t)(w[i][1] >> 32) != flag)) again = true, ld(i);
    } while (again);
    float rstd = 0.f;
    if (NORM) {
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < kStageLoads; ++i) {
        if (!in(i)) continue;
        const uint32_t d[2] = {(uint32_t)w[i][0], (uint32_t)w[i][1]};
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&d[0]));
        const float2 h = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&d[1]));
        ss += f.x * f.x + f.y * f.y + h.x * h.x + h.y * h.y;
      }
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (lane == 0) red[tid >> 5] = ss;
      compute_sync();
      float tot = 0.f;
#pragma unroll
      for (int wi = 0; wi < kCW; ++wi) tot += red[wi];
      rstd = rsqrtf(tot / K + eps);
    }
#pragma unroll
    for (int i = 0; i < kStageLoads; ++i) {
      if (!in(i)) continue;
      uint32_t d[2] = {(uint32_t)w[i][0], (uint32_t)w[i][1]};
      if (NORM) {
        const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&g[i]);
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&d[q]);
          const float2 f = __bfloat1622float2(*o), gw = __bfloat1622float2(wp[q]);
          const float2 n = __bfloat1622float2(__floats2bfloat162_rn(f.x * rstd, f.y * rstd));
          *o = __floats2bfloat162_rn(n.x * gw.x, n.y * gw.y);
        }
      }
      *reinterpret_cast<uint2*>(sx + kr + (tid + i * kCThreads) * 4) = make_uint2(d[0], d[1]);
    }
  }
  compute_sync();
}

// One projection: the block's rows [u0, u1), ring stage by ring stage, every compute warp on every stage.
// Warp w takes row pair j = w / parts of the stage over chunks [s, s + 1) * chunks / parts of K (s = w %
// parts), with the dot products on the tensor cores as in gemv.cu (the MMA diagonal: lane (g, t) puts its
// 16 bytes of row A in MMA row g and of row B in row g + 8, its input elements in B column g). Each warp's
// two sums per stage go to shared memory; after the last stage the block adds the parts in order
// (deterministic) and writes the outputs.
__device__ __forceinline__ void gemv_phase(int P, const PersistentArgs& a, const Plan& p, const Proj& pr, int2 rng, const bf16* sx,
                                           float* sres, float* red, const unsigned char* ring, uint64_t* full,
                                           uint64_t* empty, int& slot, uint32_t& phase, uint64_t* tr, uint2* out,
                                           uint32_t flag) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int u0 = rng.x, u1 = rng.y;
  // pairs and parts are powers of two: shifts, not divisions, on this phase's path
  const int K = pr.K, chunks = K / 256, pairs = p.pairs[P], lpairs = __ffs(pairs) - 1, lparts = 3 - lpairs;
  const int parts = 1 << lparts, ks = p.ksplit[P];
  const int lU = P == kGu ? lpairs : lpairs + 1, U = 1 << lU;  // units (rows, or gate/up pairs) per row group
  const int j = warp >> lparts, sp = warp & (parts - 1);
  const int rs = ks == 1 ? K : (chunks + ks - 1) / ks * 256;  // a row's stride in the stage
  const int offA = (P == kGu ? j : 2 * j) * rs, offB = (P == kGu ? pairs + j : 2 * j + 1) * rs;
  const bool trw = tr && lane == 0 && warp == 1 && P == kO;
  const bool diag = t == (g >> 1);
  // A stage's two sums per warp are reduced across lanes during the next stage's MMAs (the shuffles' latency
  // then overlaps theirs).
  float pva = 0.f, pvb = 0.f;
  int pst = -1;
  auto flush = [&]() {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      pva += __shfl_xor_sync(0xffffffffu, pva, o);
      pvb += __shfl_xor_sync(0xffffffffu, pvb, o);
    }
    if (lane == 0) *reinterpret_cast<float2*>(red + ((pst * pairs + j) * parts + sp) * 2) = make_float2(pva, pvb);
  };
  int cA = 0, c0 = (sp * chunks) >> lparts, c1 = ((sp + 1) * chunks) >> lparts;  // ks == 1: every stage alike
  int st = 0;
  for (int u = u0; u < u1; u += U)
  for (int kp = 0; kp < ks; ++kp, ++st) {
    if (ks > 1) {
      cA = kp * chunks / ks;
      const int n_c = (kp + 1) * chunks / ks - cA;  // this stage's chunks of K
      c0 = (sp * n_c) >> lparts, c1 = ((sp + 1) * n_c) >> lparts;  // this warp's, from the stage's start
    }
    const bf16* sw = reinterpret_cast<const bf16*>(ring + (size_t)slot * p.slot_bytes);
    mbar_wait(&full[slot], phase);
    if (trw && st == 0) tr[29] = now_ns();
    float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};  // two chains of MMAs
#pragma unroll 4
    for (int c = c0; c < c1; ++c) {
      const int e = c * 256 + lane * 8;
      const uint4 wa = *reinterpret_cast<const uint4*>(sw + offA + e);
      const uint4 wb = *reinterpret_cast<const uint4*>(sw + offB + e);
      const uint4 xv = *reinterpret_cast<const uint4*>(sx + cA * 256 + e);
      mma_bf16(d0, wa.x, wb.x, wa.y, wb.y, xv.x, xv.y);
      mma_bf16(d1, wa.z, wb.z, wa.w, wb.w, xv.z, xv.w);
    }
    if (pst >= 0) flush();
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);  // every warp's loads are done: the copy warp may refill it
    if (++slot == p.slots) slot = 0, phase ^= 1;
    // The diagonal: lane (g, g / 2) holds C[g][g] (row A) in d[g & 1] and C[g + 8][g] (row B) in d[2 + (g & 1)].
    pva = diag ? ((g & 1) ? d0[1] + d1[1] : d0[0] + d1[0]) : 0.f;
    pvb = diag ? ((g & 1) ? d0[3] + d1[3] : d0[2] + d1[2]) : 0.f;
    pst = st;
    if (trw) tr[31] = now_ns();
  }
  if (pst >= 0) flush();
  compute_sync();
  // One thread per two outputs (one LL word): the parts summed in order.
  const int n = u1 - u0;
  for (int q0 = 2 * tid; q0 < n; q0 += 2 * kCThreads) {
    float y[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int q = q0 + h, s0 = q >> lU, r = q & (U - 1);
      const int jj = P == kGu ? r : r >> 1, which = P == kGu ? 0 : r & 1;
      float v = 0.f, up = 0.f;
      for (int kp = 0; kp < ks; ++kp) {
        const float* rp = red + (((s0 * ks + kp) * pairs + jj) * parts) * 2;
        for (int s2 = 0; s2 < parts; ++s2) v += rp[2 * s2 + which], up += rp[2 * s2 + 1];
      }
      if (P == kGu) {
        y[h] = silu(bf16r(v)) * bf16r(up);
      } else if (P == kQkv) {
        y[h] = v;
      } else {  // o, down: the residual add; the block keeps its rows of x in shared memory
        y[h] = bf16r(v + sres[q]);
        sres[q] = y[h];
        if (P == kDown) a.x[u0 + q] = __float2bfloat16(y[h]);  // the plain stream, for lm_head after the last layer
      }
    }
    ll_store(out + (u0 + q0) / 2, pack2(y[0], y[1]), flag);
  }
}

// Decode attention of this layer for the one sequence: block b < kv_heads * S takes KV head b % kv_heads
// and key split b / kv_heads, with the group's 4 query heads. q/k RMSNorm + RoPE and the K/V write of the
// new token happen here; its k and v are used from shared memory. The keys of earlier steps come through
// the ring (stages of p.ck keys the copy warp filled). Each split publishes its partial (P.V, max and sum
// per head) as LL words, and every split's block merges a slice of the group's outputs from all of them.
__device__ void attention_phase(const PersistentArgs& a, int l, const LayerWeights& w, float* scratch, const float2* scs,
                                uint64_t* tr, const uint2* qkv_ll, uint32_t f_qkv, uint2* attn_ll,
                                uint32_t f_attn, uint32_t f_part, const StepInfo& si, const Plan& p, const unsigned char* ring,
                                uint64_t* full, uint64_t* empty, int& slot, uint32_t& phase) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  auto mark = [&](int e) {
    if (tr) tr[e] = now_ns();
  };
  const int KVH = a.kv_heads, L = si.L, S = si.S, kvh = si.kvh, sp = si.sp, k0 = si.k0, k1 = si.k1;
  const bool item = (int)blockIdx.x < KVH * S;

  if (!item) return;
  // Scratch: q [4][128] bf16, each warp's running max and sum per head [kCW][2][4], the new token's k and v
  // [2][128] bf16, each warp's P.V [kCW][4][128].
  bf16* sqb = reinterpret_cast<bf16*>(scratch);
  float* wstat = scratch + kGroup * kD;
  bf16* snew = reinterpret_cast<bf16*>(wstat + kCW * 2 * kGroup);
  float* sacc = wstat + kCW * 2 * kGroup + 2 * kD;
  // The norm weights are read and the RoPE row was staged (scs) before the wait for q, k and v.
  const int slot_new = si.slot_new;
  const float2 c[4] = {scs[(lane & 15) * 4], scs[(lane & 15) * 4 + 1], scs[(lane & 15) * 4 + 2], scs[(lane & 15) * 4 + 3]};
  if (warp < kGroup) {
    const uint2 nw = __ldg(reinterpret_cast<const uint2*>(w.q_norm + lane * 4));
    const uint4 v = ll_load(qkv_ll + ((kvh * kGroup + warp) * kD + lane * 4) / 2, f_qkv);
    *reinterpret_cast<uint2*>(sqb + warp * kD + lane * 4) = qk_norm_rope_vals(make_uint2(v.x, v.z), nw, c, a.eps, lane);
  } else if (k1 == L && warp < kGroup + 2) {  // the split that holds the new token: its k (warp 4) and v (warp 5)
    const bool is_v = warp == kGroup + 1;
    const uint2 nw = is_v ? make_uint2(0, 0) : __ldg(reinterpret_cast<const uint2*>(w.k_norm + lane * 4));
    const uint4 v = ll_load(qkv_ll + ((a.heads + (is_v ? KVH : 0) + kvh) * kD + lane * 4) / 2, f_qkv);
    const uint2 raw = make_uint2(v.x, v.z);
    const uint2 r = is_v ? raw : qk_norm_rope_vals(raw, nw, c, a.eps, lane);
    *reinterpret_cast<uint2*>(snew + (is_v ? kD : 0) + lane * 4) = r;
    if (slot_new >= 0)
      *reinterpret_cast<uint2*>(a.kv_cache + kv_row_offset(a.kv, l, slot_new, kvh, is_v) + lane * 4) = r;
  }
  compute_sync();
  mark(23);

  // Scores on the tensor cores, 8 keys per MMA: A = the 4 query heads (rows 0-3 of 16), B = 8 keys' K rows
  // (column g: key g), over 16 dims per k step. Dims map to k indices alike for A and B, in an order that
  // lets lane (g, t) read 16 contiguous bytes per two k steps: dims 32 p + 8 t + [0, 8) for k steps 2p and
  // 2p + 1. C: lane (g < 4, t) holds head g's scores of keys 2t and 2t + 1. P.V stays on CUDA cores (lane: 4
  // dims of every head), the probabilities broadcast from the C lanes.
  const int g = lane >> 2, t = lane & 3;
  uint4 qa[4];
#pragma unroll
  for (int q4 = 0; q4 < 4; ++q4)
    qa[q4] = g < kGroup ? *reinterpret_cast<const uint4*>(sqb + g * kD + 32 * q4 + 8 * t) : make_uint4(0, 0, 0, 0);
  const float scale_log2 = 1.4426950408889634f / sqrtf((float)kD);
  float acc[kGroup][4];
#pragma unroll
  for (int h = 0; h < kGroup; ++h) acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = 0.f;
  float m_run = kNegInf, l_run = 0.f;  // of head g (lanes g < 4)
  // Groups of 8 keys go round robin over the warps across the split's stages; each warp keeps its own
  // running max and sum (the warps merge at the end, as splits do).
  const int ck = p.ck;
  bool first = true;
  for (int sk = k0; sk < k1; sk += ck) {
    mbar_wait(&full[slot], phase);
    if (first) mark(22);
    const unsigned char* st = ring + (size_t)slot * p.slot_bytes;
    const int se = min(k1, sk + ck), ng = (se - sk + kKeysPerWarp - 1) / kKeysPerWarp;
    const int j0 = ((warp - (sk - k0) / kKeysPerWarp) % kCW + kCW) % kCW;
    for (int j = j0; j < ng; j += kCW) {
      const int kb = sk + j * kKeysPerWarp;
      // B: key kb + g's K row (the new token's from shared memory; past the stage's end any row, masked).
      const int key = kb + g;
      const unsigned char* krow = key < se && key < L - 1 ? st + (key - sk) * kD * 2 : reinterpret_cast<const unsigned char*>(snew);
      float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int q4 = 0; q4 < 4; ++q4) {
        const uint4 kv = *reinterpret_cast<const uint4*>(krow + 64 * q4 + 16 * t);
        mma_bf16(d0, qa[q4].x, 0u, qa[q4].y, 0u, kv.x, kv.y);
        mma_bf16(d1, qa[q4].z, 0u, qa[q4].w, 0u, kv.z, kv.w);
      }
      if (first && j == j0) mark(24);
      const float sa = kb + 2 * t < se ? (d0[0] + d1[0]) * scale_log2 : kNegInf;
      const float sb = kb + 2 * t + 1 < se ? (d0[1] + d1[1]) * scale_log2 : kNegInf;
      float cm = fmaxf(sa, sb);
      cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 1));
      cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 2));
      const float m_new = fmaxf(m_run, cm);  // finite: a group has a key
      const float pa = sa == kNegInf ? 0.f : exp2f(sa - m_new), pb = sb == kNegInf ? 0.f : exp2f(sb - m_new);
      float sum = pa + pb;
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float alpha = m_run == kNegInf ? 0.f : exp2f(m_run - m_new);
      l_run = l_run * alpha + sum;
      m_run = m_new;
#pragma unroll
      for (int h = 0; h < kGroup; ++h) {
        const float al = __shfl_sync(0xffffffffu, alpha, 4 * h);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[h][i] *= al;
      }
#pragma unroll
      for (int r = 0; r < kKeysPerWarp; ++r) {
        if (kb + r >= se) break;  // warp-uniform
        const unsigned char* vrow = kb + r == L - 1 ? reinterpret_cast<const unsigned char*>(snew + kD)
                                                    : st + (ck + kb + r - sk) * kD * 2;
        const uint2 vv = *reinterpret_cast<const uint2*>(vrow + lane * 8);
        const float2 v01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&vv.x));
        const float2 v23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&vv.y));
#pragma unroll
        for (int h = 0; h < kGroup; ++h) {
          const float pr = __shfl_sync(0xffffffffu, (r & 1) ? pb : pa, 4 * h + r / 2);
          acc[h][0] += pr * v01.x, acc[h][1] += pr * v01.y, acc[h][2] += pr * v23.x, acc[h][3] += pr * v23.y;
        }
      }
      if (first && j == j0) mark(25);
    }
    first = false;
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);
    if (++slot == p.slots) slot = 0, phase ^= 1;
  }
  mark(26);

  // This split's partial: the warps' P.V rescaled to the block's max and summed, with m and l.
#pragma unroll
  for (int h = 0; h < kGroup; ++h)
    *reinterpret_cast<float4*>(sacc + (warp * kGroup + h) * kD + lane * 4) = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
  if (t == 0 && g < kGroup) wstat[warp * 8 + g] = m_run, wstat[warp * 8 + 4 + g] = l_run;
  compute_sync();
  uint2* part_ll = reinterpret_cast<uint2*>(a.ws) + (int64_t)(kvh * kMaxSplits + sp) * kPartial;
  for (int e = tid; e < kGroup * kD; e += kCThreads) {
    const int h = e / kD;
    float M = kNegInf;
#pragma unroll
    for (int w2 = 0; w2 < kCW; ++w2) M = fmaxf(M, wstat[w2 * 8 + h]);
    float s = 0.f;
#pragma unroll
    for (int w2 = 0; w2 < kCW; ++w2) {
      const float mw = wstat[w2 * 8 + h];
      s += mw == kNegInf ? 0.f : exp2f(mw - M) * sacc[w2 * kGroup * kD + e];
    }
    ll_store(part_ll + e, __float_as_uint(s), f_part);
  }
  if (tid < kGroup) {
    float M = kNegInf, l = 0.f;
#pragma unroll
    for (int w2 = 0; w2 < kCW; ++w2) M = fmaxf(M, wstat[w2 * 8 + tid]);
#pragma unroll
    for (int w2 = 0; w2 < kCW; ++w2) {
      const float mw = wstat[w2 * 8 + tid];
      l += mw == kNegInf ? 0.f : exp2f(mw - M) * wstat[w2 * 8 + 4 + tid];
    }
    ll_store2(part_ll + kGroup * kD + 2 * tid, __float_as_uint(M), __float_as_uint(l), f_part);
  }
  // Every split's block merges a slice of the group's 256 value pairs, polling the partial words of every
  // split for it: one trip once the slowest split is done (a counter and a last arriver cost two).
  mark(27);
  const int np = kGroup * kD / 2, j0 = np * sp / S, n = np * (sp + 1) / S - j0;
  const uint2* base = reinterpret_cast<const uint2*>(a.ws) + (int64_t)kvh * kMaxSplits * kPartial;
  compute_sync();  // sacc is free: the exchange, [S][n] pairs and [S][kGroup] (m, l)
  float2* xo = reinterpret_cast<float2*>(sacc);
  float2* xm = xo + np + kMaxSplits;
  for (int it = tid; it < n * S; it += kCThreads) {
    const int s2 = it / n, j = j0 + it % n, h = 2 * j / kD;
    const uint2* po = base + s2 * kPartial + 2 * j;
    const uint2* pm = base + s2 * kPartial + kGroup * kD + 2 * h;
    unsigned long long o0, o1, m0, m1;
    asm volatile("ld.relaxed.gpu.global.v2.u64 {%0,%1}, [%2];\n" : "=l"(o0), "=l"(o1) : "l"(po) : "memory");
    asm volatile("ld.relaxed.gpu.global.v2.u64 {%0,%1}, [%2];\n" : "=l"(m0), "=l"(m1) : "l"(pm) : "memory");
    for (;;) {
      const bool oo = (uint32_t)(o0 >> 32) == f_part && (uint32_t)(o1 >> 32) == f_part;
      const bool om = (uint32_t)(m0 >> 32) == f_part && (uint32_t)(m1 >> 32) == f_part;
      if (oo && om) break;
      if (!oo) asm volatile("ld.relaxed.gpu.global.v2.u64 {%0,%1}, [%2];\n" : "=l"(o0), "=l"(o1) : "l"(po) : "memory");
      if (!om) asm volatile("ld.relaxed.gpu.global.v2.u64 {%0,%1}, [%2];\n" : "=l"(m0), "=l"(m1) : "l"(pm) : "memory");
    }
    xo[it] = make_float2(__uint_as_float((uint32_t)o0), __uint_as_float((uint32_t)o1));
    xm[s2 * kGroup + h] = make_float2(__uint_as_float((uint32_t)m0), __uint_as_float((uint32_t)m1));  // alike where repeated
  }
  compute_sync();
  for (int jj = tid; jj < n; jj += kCThreads) {
    const int h = 2 * (j0 + jj) / kD;
    float M = kNegInf, den = 0.f, n0 = 0.f, n1 = 0.f;
    for (int s2 = 0; s2 < S; ++s2) M = fmaxf(M, xm[s2 * kGroup + h].x);
    for (int s2 = 0; s2 < S; ++s2) {
      const float2 ml = xm[s2 * kGroup + h], o = xo[s2 * n + jj];
      const float wgt = ml.x == kNegInf ? 0.f : exp2f(ml.x - M);
      den += wgt * ml.y, n0 += wgt * o.x, n1 += wgt * o.y;
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
    ll_store(attn_ll + (kvh * kGroup * kD) / 2 + j0 + jj, pack2(n0 * inv, n1 * inv), f_attn);
  }
  compute_sync();  // the exchange aliases the o projection's staged input
  mark(28);
}

__global__ void __launch_bounds__(kThreads, 1) persistent_kernel(PersistentArgs a, Plan p) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kMaxSlots;
  bf16* sx = reinterpret_cast<bf16*>(smem + kBarBytes);  // staged input, or the attention scratch
  unsigned char* ring = smem + kBarBytes + p.x_bytes;
  __shared__ float red[kCW];
  __shared__ __align__(16) float gred[kRed];
  __shared__ float sres[kMaxRowsPerBlock];
  __shared__ float2 scs[kD / 2];  // the step's RoPE cos/sin row (one position for every layer)
  __shared__ int2 rng[kProjs];    // the block's units [u0, u1) of each projection: divisions once per launch
  __shared__ StepInfo ssi;        // the step's sequence and this block's attention split
  if (threadIdx.x == 0) {
    ssi = step_info(a);
    for (int s = 0; s < p.slots; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], kCW);
    for (int P = 0; P < kProjs; ++P) {
      const int n = proj_of(a, LayerWeights{}, P).units;
      rng[P] = make_int2(range_begin(n, blockIdx.x, gridDim.x), range_begin(n, blockIdx.x + 1, gridDim.x));
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x >= kCThreads) {
    if (threadIdx.x == kCThreads) produce(a, p, ring, full, empty, rng);
    return;
  }
  const int G = gridDim.x, H = a.hidden, tid = threadIdx.x;
  // LL buffers after the attention partials (persistent_ws_floats()), then the step counter.
  uint2* x_ll = reinterpret_cast<uint2*>(a.ws) + (int64_t)a.kv_heads * kMaxSplits * kPartial;  // after the partials' words
  uint2* qkv_ll = x_ll + H / 2;
  uint2* attn_ll = qkv_ll + (a.heads + 2 * a.kv_heads) * kD / 2;
  uint2* act_ll = attn_ll + a.heads * kD / 2;
  uint32_t* epoch = reinterpret_cast<uint32_t*>(act_ll + a.intermediate / 2);
  // Flags: layer l's phases are base + 8 l + {1: x in, 2: qkv, 3: attention, 4: x after o, 5: SiLU·up}; every
  // block reads base before any block can finish (each needs every block's words), and block 0 moves it on.
  const uint32_t base = *reinterpret_cast<volatile uint32_t*>(epoch);
  const StepInfo& si = ssi;
  if (tid < kD / 2) scs[tid] = a.cos_sin[(int64_t)si.pos * (kD / 2) + tid];  // read after the next compute_sync
  // The block's rows of x (o and down own the same rows): kept in shared memory, published for qkv.
  {
    const int r0 = range_begin(H, blockIdx.x, G), nr = range_begin(H, blockIdx.x + 1, G) - r0;
    for (int q = 2 * tid; q < nr; q += 2 * kCThreads) {
      const float x0 = __bfloat162float(__ldcg(a.x + r0 + q)), x1 = __bfloat162float(__ldcg(a.x + r0 + q + 1));
      sres[q] = x0, sres[q + 1] = x1;
      ll_store(x_ll + (r0 + q) / 2, pack2(x0, x1), base + 1);
    }
  }
  int slot = 0;
  uint32_t phase = 0;
  for (int l = 0; l < a.num_layers; ++l) {
    const LayerWeights w = a.layers[l];
    const uint32_t F = base + 8u * l;
    uint64_t* tr = a.trace && l == kPersistentTraceLayer && tid == 0 ? a.trace + blockIdx.x * kPersistentEvents : nullptr;
    auto mark = [&](int e) {
      if (tr) tr[e] = now_ns();
    };
    mark(0);
    // One call site per phase function, so that each is inlined once: the projections in order, each
    // staging its input from the LL words of every block (with RMSNorm for qkv and gate_up), then streaming
    // its stages and publishing its outputs; attention after qkv.
    for (int P = 0; P < kProjs; ++P) {
      const int ev = P == kQkv ? 1 : P == kO ? 5 : P == kGu ? 8 : 11;  // trace events of this phase
      mark(ev);
      if (P == kQkv || P == kGu)
        stage_input<true>(x_ll, P == kQkv ? F + 1 : F + 4, P == kQkv ? w.input_norm : w.post_norm, H, a.eps, sx, red);
      else
        stage_input<false>(P == kO ? attn_ll : act_ll, P == kO ? F + 3 : F + 5, nullptr,
                           P == kO ? a.heads * kD : a.intermediate, a.eps, sx, red);
      mark(ev + 1);
      uint2* out = P == kQkv ? qkv_ll : P == kGu ? act_ll : x_ll;
      const uint32_t f_out = P == kQkv ? F + 2 : P == kO ? F + 4 : P == kGu ? F + 5 : F + 8 + 1;
      gemv_phase(P, a, p, proj_of(a, w, P), rng[P], sx, sres, gred, ring, full, empty, slot, phase,
                 a.trace && l == kPersistentTraceLayer ? a.trace + blockIdx.x * kPersistentEvents : nullptr, out, f_out);
      mark(ev + 2);
      if (P == kQkv) {
        attention_phase(a, l, w, reinterpret_cast<float*>(sx), scs, tr, qkv_ll, F + 2, attn_ll, F + 3, F + 6, si, p, ring,
                        full, empty, slot, phase);
        mark(4);
      }
    }
  }
  if (blockIdx.x == 0 && tid == 0) *epoch = base + 8u * (a.num_layers + 2);
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

// Row pairs per stage: the most (1, 2, 4 or 8) whose bytes fit kStageTarget, or a pair's piece of K where one pair
// is larger; the slot is the largest stage (or a chunk of attention's K and V). Smaller stages measured slower
// (20 KB: 4B batch 1 3.3 ms against 2.7 at the time; docs/benchmarks.md).
constexpr int kStageTarget = 40 * 1024;
Plan make_plan(int H, int I, int heads) {
  const int stage_target = kStageTarget;
  Plan p{};
  const int K[kProjs] = {H, heads * kD, H, I};
  const int x_elems = std::max({H, heads * kD, I});
  p.x_bytes = (std::max<int>(x_elems * 2, kScratchFloats * 4) + 127) / 128 * 128;
  const int budget = smem_optin() - kBarBytes - p.x_bytes - (kRed + 2 * kCW + kMaxRowsPerBlock + kD + 2 * kProjs + 64) * 4;  // static shared
  for (int P = 0; P < kProjs; ++P) {
    const int pair_bytes = 2 * K[P] * 2, chunks = K[P] / 256;
    int n = 1, ks = 1;
    while (n < kCW && 2 * n * pair_bytes <= stage_target) n *= 2;
    while (pair_bytes / ks > stage_target && ks < chunks) ++ks;
    p.pairs[P] = n, p.ksplit[P] = ks;
    p.slot_bytes = std::max(p.slot_bytes, ks == 1 ? n * pair_bytes : 2 * ((chunks + ks - 1) / ks) * 512);
  }
  p.slot_bytes = std::max(p.slot_bytes, 2 * kMinSplitKeys * kD * 2);  // attention's K and V of a split's keys
  p.slots = std::min(kMaxSlots, budget / p.slot_bytes);
  p.smem = kBarBytes + p.x_bytes + p.slots * p.slot_bytes;
  // Stages in flight: enough for ~64 KB per SM (4B: one 40 KB stage, 8B: two of 32 KB measured fastest; more
  // queue in the memory system ahead of the latency-bound reads, fewer leave it idle). Below the slot count: the
  // throttle waits on the latest stage of a slot.
  const int inflight = std::max(1, 64 * 1024 / (p.pairs[kQkv] * 2 * H * 2));
  p.inflight = inflight < p.slots ? inflight : 0;
  p.ck = p.slot_bytes / (2 * kD * 2);
  return p;
}

// Whether one projection's per-warp sums fit gred in every block.
bool plan_red_fits(const Plan& p, int H, int I, int heads, int qkv_rows, int num_sms) {
  const int units[kProjs] = {qkv_rows, H, I, H};
  for (int P = 0; P < kProjs; ++P) {
    const int U = P == kGu ? p.pairs[P] : 2 * p.pairs[P];
    const int per_block = (units[P] + num_sms - 1) / num_sms + 1;  // even bounds: one more at most
    if ((per_block + U - 1) / U * p.ksplit[P] * kCW * 2 > kRed) return false;
  }
  return true;
}

}  // namespace

bool persistent_fits(int hidden, int intermediate, int heads, int kv_heads, int head_dim) {
  if (hidden <= 0 || intermediate <= 0 || kv_heads <= 0) return false;
  if (head_dim != kD || heads != kGroup * kv_heads || hidden % 256 || intermediate % 256) return false;
  if (hidden > kStageLoads * kCThreads * 4) return false;  // RMSNorm's input staged in one round
  return make_plan(hidden, intermediate, heads).slots >= 2;
}

int64_t persistent_ws_floats(int hidden, int intermediate, int heads, int kv_heads) {
  const int64_t ll_words = hidden / 2 + (heads + 2 * kv_heads) * kD / 2 + heads * kD / 2 + intermediate / 2;
  return 2 * ((int64_t)kv_heads * kMaxSplits * kPartial + ll_words) + 4;  // + the step counter
}

void persistent_layers(const PersistentArgs& a, int num_sms, cudaStream_t s) {
  const Plan p = make_plan(a.hidden, a.intermediate, a.heads);
  OI_CHECK(p.slots >= 2 && p.slot_bytes >= 2 * kMinSplitKeys * kD * 2 && num_sms >= a.kv_heads && a.hidden <= kMaxRowsPerBlock * num_sms &&
               plan_red_fits(p, a.hidden, a.intermediate, a.heads, (a.heads + 2 * a.kv_heads) * kD, num_sms),
           "persistent_layers: geometry does not fit");
  static int configured = 0;  // one attribute call for the largest plan seen (capture safe afterwards)
  if (p.smem > configured) {
    OI_CUDA_CHECK(cudaFuncSetAttribute(persistent_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, p.smem));
    configured = p.smem;
  }
  cudaLaunchAttribute coop{};
  coop.id = cudaLaunchAttributeCooperative;  // every block resident: blocks wait on each other's words
  coop.val.cooperative = 1;
  OI_CUDA_CHECK(launch_kernel(false, persistent_kernel, dim3(num_sms), dim3(kThreads), p.smem, s, &coop, a, p));
}

}  // namespace oi
