#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>

#include "async_copy.cuh"
#include "attention.cuh"
#include "attention_sm90.cuh"
#include "launch.cuh"
#include "mma.cuh"

namespace oi {
namespace {

constexpr int kD = 128;
constexpr int kLd = kD + 8;  // padded smem row (272 B): fragment loads and ldmatrix stay conflict-free
constexpr float kNegInf = -INFINITY;
constexpr int kStages = 2;  // K/V tiles in shared memory: one in flight while one is computed (3 measured no faster)

// D += A(16x16, bf16, row) * B(16x8, bf16, col), fp32 accumulate.
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t lds32(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Chunk-invariant folding (AttnArgs::segment): a segment's normalized partial v (its log-sum-exp lse) joins
// the running (M, D, A) of its row, in segment order. The block that folds as it goes and the merge kernel
// of a split launch both use exactly these operations (no contraction left to the compiler), so the two
// give the same bits.
__device__ __forceinline__ void seg_weights(float& M, float& D, float lse, float& wa, float& wb) {
  const float mn = fmaxf(M, lse);
  wa = exp2f(M - mn);  // 0 for the first segment (M = -inf)
  wb = exp2f(lse - mn);
  D = __fmaf_rn(D, wa, wb);
  M = mn;
}
__device__ __forceinline__ float seg_fold(float A, float wa, float wb, float v) { return __fmaf_rn(A, wa, __fmul_rn(wb, v)); }
// A row of one segment is written as it is, but with -0 made +0: folding it once (0 * 0 + v) would.
__device__ __forceinline__ float seg_one(float v) { return __fadd_rn(v, 0.f); }

template <int NW, int KT, bool KW = false>
constexpr size_t smem_main_bytes() {  // Q rows and the K/V stages (reused by the merges after the key loop)
  return KW ? (size_t)(16 + NW * 2 * kStages * KT) * kLd * sizeof(bf16) : (size_t)(16 * NW + 2 * kStages * KT) * kLd * sizeof(bf16);
}
// Cluster decode blocks receive the other splits' partials of their slice of dims in an area of their own
// (the others may write it while this block still streams keys): 16 rows x kD floats, and C x 16 lse.
constexpr size_t kRecvBytes = (16 * kD + kAttnMaxCluster * 16) * sizeof(float);
template <int NW, int KT, bool CLU, bool KW = false>
constexpr size_t smem_bytes() { return smem_main_bytes<NW, KT, KW>() + (CLU ? kRecvBytes : 0); }

__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive_release() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait_acquire() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// A block serves one work item x one KV head x one key split. Each warp owns 16 query rows
// (row r = token r / group, head r % group of this KV head); all warps share every K/V tile of KT keys.
// Scores and P.V run on tensor cores (m16n8k16); softmax is online, in the log2 domain.
// CLU: the splits form thread-block clusters (grid z, C = cluster size) that merge through distributed
// shared memory: no workspace round trip, fence or counter unless more than one cluster holds keys.
// KW (decode, with CLU): the NW warps share the same 16 query rows and split the block's keys in NW
// contiguous parts, each streaming its own tiles; the block merges them in shared memory before the
// cluster merge. A batch-1 block then has NW tiles in flight where a one-warp block has one, and the
// split count falls by NW, so a cluster of 16 covers the keys without the workspace merge.
// Under PDL (decode of up to kAttnMaxEarlyItems items) the block reads the step's metadata and requests
// its first K/V tile before `pdl_wait()` when that tile holds only keys of earlier steps: the kernels
// before it write q and this step's keys alone (the qkv projection; without fuse_rope, then the q/k
// norm + RoPE + KV write kernel; with it, this kernel writes the newest keys itself). No early
// trigger: the o projection's weight requests would compete with the merge (a trigger after the key
// loop measured 3-6% slower per step at batch 1).
// SEG (a.segment > 0, row-warp blocks of 64-key tiles only): chunk-invariant keys, see AttnArgs::segment.
// An unsplit block folds each row's finished segment into a running total kept in the workspace (split 0's
// rows, free in an unsplit launch), a split block computes one segment.
// SEG 2 (dim warps, items of up to 16 rows): the NW warps of a block share its 16 query rows and each computes the
// scores and softmax of every key (the same instructions as one row warp) but P.V for its kD / NW dims only: every
// output element takes the same sums in the same order as in a one-warp block (bits unchanged), with NW warps
// streaming the tiles.
constexpr int kAttnDimWarps = 4;  // dim warps of a chunk-invariant block of up to 16 rows (SEG 2)
template <int NW, int KT, bool CLU, bool KW, int SEG>
__global__ void __launch_bounds__(NW * 32) paged_attention_kernel(AttnArgs a, float scale_log2) {
  static_assert(!KW || CLU, "key warps merge through the cluster path");
  static_assert(!SEG || (KT == 64 && !CLU && !KW), "chunk-invariant keys take row-warp blocks of 64-key tiles");
  static_assert(!KW || (KT == 16 && kAttnChunkAlign % (NW * 16) == 0), "key-warp ranges start on whole pages");
  constexpr bool kDW = SEG == 2;  // dim warps
  static_assert(!kDW || (kD / 8) % (2 * NW) == 0, "dim warps take whole pairs of 8-dim n-tiles");
  constexpr int kRows = KW || kDW ? 16 : 16 * NW, kThreads = NW * 32, kNT = KT / 8;
  constexpr int kND = kDW ? kD / 8 / NW : kD / 8;  // this warp's 8-dim n-tiles of P.V and the output
  // Tile loaders: the whole block (row warps share tiles) or each warp alone (key warps).
  constexpr int kLoaders = KW ? 32 : kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int ltid = KW ? lane : tid;
  bf16(*sQ)[kLd] = reinterpret_cast<bf16(*)[kLd]>(smem_raw);
  // K then V stages: one set per block, or one per warp for key warps.
  bf16* stages = reinterpret_cast<bf16*>(smem_raw) + (kRows + (KW ? warp : 0) * 2 * kStages * KT) * kLd;
  bf16(*sK)[KT][kLd] = reinterpret_cast<bf16(*)[KT][kLd]>(stages);
  bf16(*sV)[KT][kLd] = reinterpret_cast<bf16(*)[KT][kLd]>(stages + kStages * KT * kLd);
  __shared__ int s_last;
  // Unsplit launches of multi-token items (prompt chunks) take their items longest first: blocks start in
  // launch order, and a causal chunk's last items hold the most keys (in item order they started last and
  // ran alone at the end). Clusters and split launches keep the grid's order.
  int wi = blockIdx.x, kvh = blockIdx.y;
  if (!CLU && !KW && gridDim.z == 1) {
    const int lin = blockIdx.y * gridDim.x + blockIdx.x;
    wi = gridDim.x - 1 - lin / gridDim.y, kvh = lin % gridDim.y;
  }
  const AttnWork w = a.work[wi];
  const int split = blockIdx.z;
  const int group = a.num_heads / a.kv.num_kv_heads;
  const int rows = w.num_tok * group;
  const int ctx = a.context_lens[w.seq];
  const int kv_end = a.positions[w.tok_start + w.num_tok - 1] + 1;  // causal bound of the item's last token
  // Whole aligned chunks: a short context under a graph's (long-context) split count uses few splits.
  const int chunk = SEG ? (a.num_splits == 1 ? kv_end : a.segment)
                        : ((ctx + a.num_splits - 1) / a.num_splits + kAttnChunkAlign - 1) / kAttnChunkAlign * kAttnChunkAlign;
  // Splits past this item's keys do nothing: they exit before touching memory, and the item's merge
  // counts and reads only the `used` ones (one used split writes the output directly).
  const int used = min(a.num_splits, (kv_end + chunk - 1) / chunk);
  // Clusters: C consecutive splits merge first; `parts` partials remain for the workspace merge.
  const int C = CLU ? (int)cooperative_groups::this_cluster().num_blocks() : 1;
  const int cidx = split / C, parts = (used + C - 1) / C;
  if (cidx * C >= used) {  // the whole cluster is past the keys (a cluster exits together)
    pdl_wait();            // an early grid finishes only after its predecessor (launch.cuh)
    return;
  }
  // Every block of the cluster has started once this barrier completes (waited on before the first
  // remote store); arriving now costs nothing.
  if constexpr (CLU) cluster_arrive_relaxed();
  const bool direct = !CLU && used == 1;
  const int lo = split * chunk;
  const int hi = min(lo + chunk, kv_end);
  // This warp's keys: the split's, or its part of them (chunk is a multiple of 64 = NW key warps x 16).
  const int klo = KW ? min(lo + warp * (chunk / NW), hi) : lo;
  const int khi = KW ? min(klo + chunk / NW, hi) : hi;

  const int32_t* bt = a.block_tables + (int64_t)w.seq * a.bt_stride;
  const int64_t head_off = (int64_t)kvh * a.kv.block_size * kD;
  const int64_t v_off = (int64_t)a.kv.num_kv_heads * a.kv.block_size * kD;
  const bf16* layer_base = a.kv_cache + a.layer * a.kv.layer_stride() + head_off;
  // The first 32 page ids of the warp's keys, one per lane, read in one go: the tile loads below need
  // no dependent global read (pages past 32, in ranges of over 512 keys, are read when needed).
  const int first_page = klo >> 4;
  const int lane_page = lane < (khi - klo + 15) >> 4 ? bt[first_page + lane] : 0;
  // A tile is KT/16 pages; one page of one head is 16 keys x 128 dims, contiguous (4 KB) for K and for V.
  auto load_tile = [&](int stage, int k0) {
#pragma unroll
    for (int pg = 0; pg < KT / 16; ++pg) {
      const int idx = ((k0 - klo) >> 4) + pg;  // warp-uniform
      int page = __shfl_sync(0xffffffffu, lane_page, idx & 31);
      if (idx >= 32 && k0 + pg * 16 < khi) page = bt[first_page + idx];
#pragma unroll
      for (int i = ltid; i < 512; i += kLoaders) {  // {K,V} x 16-byte chunks of the page
        const int is_v = i >> 8, e = i & 255;
        const int key = pg * 16 + (e >> 4), col = (e & 15) * 8;
        const bool valid = k0 + key < khi;
        const bf16* src = layer_base + (int64_t)page * a.kv.block_stride() + (is_v ? v_off : 0) + (e >> 4) * kD + col;
        cp_async16(is_v ? &sV[stage][key][col] : &sK[stage][key][col], valid ? src : a.kv_cache, valid);
      }
    }
    cp_async_commit();
  };

  // The first kStages - 1 tiles go out before Q is read (a group per tile, empty past the split's keys),
  // before the wait when they hold only keys of earlier steps: below the first position of the sequence's tokens
  // in this step (an item of a cut chunk starts w.lead tokens past it), less own_keys_below.
  auto prologue = [&] {
#pragma unroll
    for (int t = 0; t < kStages - 1; ++t) {
      if (klo + t * KT < khi) load_tile(t, klo + t * KT);
      else cp_async_commit();
    }
  };
  const bool old_keys = klo + (kStages - 1) * KT <= a.positions[w.tok_start - w.lead] - a.own_keys_below;
  if (old_keys) prologue();
  pdl_wait();
  if (!old_keys) prologue();
  if (a.fuse_rope) {  // a row per warp at a time, 4 dims per lane (r < rows is warp-uniform)
    for (int r = warp; r < kRows; r += NW) {
      uint2 v = make_uint2(0, 0);
      if (r < rows) {
        const int t = w.tok_start + r / group, h = kvh * group + r % group;
        const uint2 raw = *reinterpret_cast<const uint2*>(a.q + (int64_t)t * a.q_stride + h * kD + lane * 4);
        v = qk_norm_rope_lane(raw, a.q_norm_w, a.cos_sin + (int64_t)a.positions[t] * (kD / 2), a.eps, lane);
      }
      *reinterpret_cast<uint2*>(&sQ[r][lane * 4]) = v;
    }
  } else {
    for (int i = tid; i < kRows * (kD / 8); i += kThreads) {
      const int r = i / (kD / 8), col = (i % (kD / 8)) * 8;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < rows) {
        const int t = w.tok_start + r / group, h = kvh * group + r % group;
        v = *reinterpret_cast<const uint4*>(a.q + (int64_t)t * a.q_stride + h * kD + col);
      }
      *reinterpret_cast<uint4*>(&sQ[r][col]) = v;
    }
  }
  // fuse_rope: the warp whose keys hold the item's newest (its own token's) makes that K/V, writes it to
  // the cache for later steps and patches it into its tile below (the tile's copy of that slot may
  // predate the write). No other warp or block reads the slot: key ranges are whole pages apart.
  const int newest = kv_end - 1;
  const bool owns_newest = a.fuse_rope && klo <= newest && newest < khi;  // warp-uniform (one warp per block without KW)
  uint2 new_k = make_uint2(0, 0), new_v = make_uint2(0, 0);
  if (owns_newest) {
    const int t = w.tok_start;
    const bf16* row = a.q + (int64_t)t * a.q_stride;
    new_k = qk_norm_rope_lane(*reinterpret_cast<const uint2*>(row + (a.num_heads + kvh) * kD + lane * 4), a.k_norm_w,
                              a.cos_sin + (int64_t)a.positions[t] * (kD / 2), a.eps, lane);
    new_v = *reinterpret_cast<const uint2*>(row + (a.num_heads + a.kv.num_kv_heads + kvh) * kD + lane * 4);
    const int slot = a.slots[t];
    if (slot >= 0) {
      *reinterpret_cast<uint2*>(a.kv_cache + kv_row_offset(a.kv, a.layer, slot, kvh, false) + lane * 4) = new_k;
      *reinterpret_cast<uint2*>(a.kv_cache + kv_row_offset(a.kv, a.layer, slot, kvh, true) + lane * 4) = new_v;
    }
  }
  // This thread's two rows (g and g + 8 of the warp): -1 masks every key (rows past the item).
  int pos[2];
  const int wrow = KW || kDW ? 0 : warp * 16;  // the warp's first query row
  const int dbase = kDW ? warp * kND : 0;       // its first 8-dim n-tile (dim warps)
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    const int r = wrow + g + 8 * h2;
    pos[h2] = r < rows ? a.positions[w.tok_start + r / group] : -1;
  }
  const bool warp_active = wrow < rows;
  // Keys up to this position are visible to every row of the warp: a tile wholly below it and inside the
  // range needs no mask. Rows past the item do not count (their Q rows are zeros, nothing reads their output).
  const int warp_visible = __reduce_min_sync(0xffffffffu, min(pos[0] < 0 ? INT_MAX : pos[0], pos[1] < 0 ? INT_MAX : pos[1]));
  __syncthreads();
  uint32_t qf[kD / 16][4];
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
    const int r0 = wrow + g, d0 = ks * 16 + 2 * c;
    qf[ks][0] = lds32(&sQ[r0][d0]);
    qf[ks][1] = lds32(&sQ[r0 + 8][d0]);
    qf[ks][2] = lds32(&sQ[r0][d0 + 8]);
    qf[ks][3] = lds32(&sQ[r0 + 8][d0 + 8]);
  }

  float o[kND][4];  // n-tile j holds dims (dbase + j) * 8 ..
#pragma unroll
  for (int i = 0; i < kND; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  auto row_index = [&](int r) { return (int64_t)(w.tok_start + r / group) * a.num_heads + kvh * group + r % group; };
  // SEG, unsplit: each row's segments folded so far (M, D here, A in the workspace); M = -inf: none yet.
  float seg_m[2] = {kNegInf, kNegInf}, seg_d[2] = {0.f, 0.f};
  // Folds the segment just finished into the running totals and starts the next from a fresh state
  // (warp-uniform call: the row sums' shuffles).
  auto fold_segment = [&] {
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      float lt = l[h2];
      lt += __shfl_xor_sync(0xffffffffu, lt, 1);
      lt += __shfl_xor_sync(0xffffffffu, lt, 2);
      const int r = wrow + g + 8 * h2;
      if (lt > 0.f && r < rows) {  // a segment past the row's position holds nothing: no fold
        const float inv = 1.f / lt, lse = m[h2] + log2f(lt);
        const bool first = seg_m[h2] == kNegInf;
        float wa, wb;
        seg_weights(seg_m[h2], seg_d[h2], lse, wa, wb);
        float* acc = a.ws_o + row_index(r) * kD + dbase * 8 + 2 * c;
#pragma unroll
        for (int dn = 0; dn < kND; ++dn) {
          const float2 prev = first ? make_float2(0.f, 0.f) : *reinterpret_cast<const float2*>(acc + dn * 8);
          *reinterpret_cast<float2*>(acc + dn * 8) = make_float2(seg_fold(prev.x, wa, wb, o[dn][2 * h2] * inv),
                                                                 seg_fold(prev.y, wa, wb, o[dn][2 * h2 + 1] * inv));
        }
      }
#pragma unroll
      for (int dn = 0; dn < kND; ++dn) o[dn][2 * h2] = o[dn][2 * h2 + 1] = 0.f;
      m[h2] = kNegInf;
      l[h2] = 0.f;
    }
  };

  // Row warps share the tiles (block barriers); key warps own theirs (warp barriers, own trip counts).
  auto tile_sync = [] {
    if (KW) __syncwarp();
    else __syncthreads();
  };
  for (int k0 = klo, it = 0; k0 < khi; k0 += KT, ++it) {
    const int stage = it % kStages;
    if constexpr (SEG != 0)  // an unsplit block at a segment boundary (a split block's keys are one segment)
      if (k0 > lo && k0 % a.segment == 0 && warp_active) fold_segment();
    // Tile it + kStages - 1 refills the stage computed in the previous iteration (freed by its closing sync).
    if (k0 + (kStages - 1) * KT < khi) load_tile((it + kStages - 1) % kStages, k0 + (kStages - 1) * KT);
    else cp_async_commit();
    cp_async_wait<kStages - 1>();
    tile_sync();
    if (owns_newest && newest >= k0 && newest < k0 + KT) {  // warp-uniform; the warp's own tile (or block's one warp)
      *reinterpret_cast<uint2*>(&sK[stage][newest - k0][lane * 4]) = new_k;
      *reinterpret_cast<uint2*>(&sV[stage][newest - k0][lane * 4]) = new_v;
      __syncwarp();
    }
    if (warp_active) {
      float s[kNT][4];
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
      // K is [key][dim] in smem: one ldmatrix.x4 gives the B fragments of an n-tile for two k-steps (lanes
      // 8j..8j+7 address dims 8j.. of the tile's 8 keys). Each s[nt] still sums the k-steps in order.
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int ks = 0; ks < kD / 16; ks += 2) {
          uint32_t b[4];
          ldmatrix_x4(b, &sK[stage][nt * 8 + (lane & 7)][ks * 16 + (lane >> 3) * 8]);
          mma16816(s[nt], qf[ks], b[0], b[1]);
          mma16816(s[nt], qf[ks + 1], b[2], b[3]);
        }
      // mask, scale and the row max (a row's 16 values per tile live in one quad of lanes)
      float mx[2] = {kNegInf, kNegInf};
      if (k0 + KT <= khi && k0 + KT - 1 <= warp_visible) {  // warp-uniform: the causal interior
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[nt][e] *= scale_log2;
            mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
          }
      } else {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = k0 + nt * 8 + 2 * c + (e & 1), h2 = e >> 1;
            const float v = (key < khi && key <= pos[h2]) ? s[nt][e] * scale_log2 : kNegInf;
            s[nt][e] = v;
            mx[h2] = fmaxf(mx[h2], v);
          }
      }
      float alpha[2], base[2];
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        mx[h2] = fmaxf(mx[h2], __shfl_xor_sync(0xffffffffu, mx[h2], 1));
        mx[h2] = fmaxf(mx[h2], __shfl_xor_sync(0xffffffffu, mx[h2], 2));
        const float m_new = fmaxf(m[h2], mx[h2]);
        base[h2] = m_new == kNegInf ? 0.f : m_new;  // nothing visible yet: every p is 0, keep the state
        alpha[h2] = exp2f(m[h2] - base[h2]);
        m[h2] = m_new;
        l[h2] *= alpha[h2];
      }
#pragma unroll
      for (int i = 0; i < kND; ++i) {
        o[i][0] *= alpha[0];
        o[i][1] *= alpha[0];
        o[i][2] *= alpha[1];
        o[i][3] *= alpha[1];
      }
      // P (bf16) reuses the score fragments as the A operand of P.V: keys 16t..16t+15 are n-tiles 2t, 2t+1.
#pragma unroll
      for (int t = 0; t < KT / 16; ++t) {
        uint32_t pa[4];
        float p[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            p[j][e] = exp2f(s[2 * t + j][e] - base[e >> 1]);
            l[e >> 1] += p[j][e];
          }
        pa[0] = pack_bf16(p[0][0], p[0][1]);
        pa[1] = pack_bf16(p[0][2], p[0][3]);
        pa[2] = pack_bf16(p[1][0], p[1][1]);
        pa[3] = pack_bf16(p[1][2], p[1][3]);
        // V is [key][dim] in smem: ldmatrix.trans yields the col-major B fragments of two dim n-tiles.
        const int vr = 16 * t + (lane & 7) + ((lane >> 3) & 1) * 8, vc = (lane >> 4) * 8;
#pragma unroll
        for (int dn = 0; dn < kND; dn += 2) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, &sV[stage][vr][(dbase + dn) * 8 + vc]);
          mma16816(o[dn], pa, b[0], b[1]);
          mma16816(o[dn + 1], pa, b[2], b[3]);
        }
      }
    }
    tile_sync();  // the next iteration's prefetch overwrites this stage
  }

  // Row sums are spread over the quad.
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    l[h2] += __shfl_xor_sync(0xffffffffu, l[h2], 1);
    l[h2] += __shfl_xor_sync(0xffffffffu, l[h2], 2);
  }
  const int64_t split_stride = (int64_t)a.num_tokens * a.num_heads;
  if constexpr (CLU) {
    // Each block's normalized partial and log-sum-exp go to its own shared memory (free now) ...
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    static_assert(!CLU || NW == 1 || KW, "the cluster merge takes one warp's rows per block");
    float* sO = reinterpret_cast<float*>(smem_raw);  // [kRows][kD]
    float* sL = sO + kRows * kD;                     // [kRows]
    // Key warps first put their partials after sO / sL (NW x [16][kD], then NW x [16]).
    float* pO = sL + kRows;
    float* pL = pO + (KW ? NW : 0) * 16 * kD;
    cp_async_wait<0>();  // the overwritten Q/K region: no copy may still land there, no read be pending
    __syncthreads();
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int r = g + 8 * h2;
      float* dstO = KW ? pO + warp * 16 * kD : sO + warp * 16 * kD;
      float* dstL = KW ? pL + warp * 16 : sL + warp * 16;
      const float inv = l[h2] > 0.f ? 1.f / l[h2] : 0.f;
#pragma unroll
      for (int dn = 0; dn < kD / 8; ++dn)
        *reinterpret_cast<float2*>(dstO + r * kD + dn * 8 + 2 * c) = make_float2(o[dn][2 * h2] * inv, o[dn][2 * h2 + 1] * inv);
      if (c == 0) dstL[r] = l[h2] > 0.f ? m[h2] + log2f(l[h2]) : kNegInf;
    }
    if constexpr (KW) {  // the block's partial per row: the key warps merged in warp order
      // Each row's warp weights once (one thread per row), then the weighted sums, several elements per
      // thread in flight (the per-element softmax over all 16 rows cost ~5 us of a ~11 us launch).
      float* pW = pL + NW * 16;  // [NW][16]
      __syncthreads();
      if (tid < rows) {
        float mx = kNegInf, wgt[NW], den = 0.f;
#pragma unroll
        for (int j = 0; j < NW; ++j) mx = fmaxf(mx, pL[j * 16 + tid]);
#pragma unroll
        for (int j = 0; j < NW; ++j) {
          const float lse = pL[j * 16 + tid];
          wgt[j] = lse == kNegInf ? 0.f : exp2f(lse - mx);
          den += wgt[j];
        }
        const float inv = den > 0.f ? 1.f / den : 0.f;
#pragma unroll
        for (int j = 0; j < NW; ++j) pW[j * 16 + tid] = wgt[j] * inv;
        sL[tid] = den > 0.f ? mx + log2f(den) : kNegInf;
      }
      __syncthreads();
#pragma unroll 4
      for (int i = tid; i < rows * kD; i += kThreads) {
        const int r = i / kD, d = i % kD;
        float v = 0.f;
#pragma unroll
        for (int j = 0; j < NW; ++j) v += pW[j * 16 + r] * pO[(j * 16 + r) * kD + d];
        sO[i] = v;
      }
    }
    __syncthreads();  // the block's partial is in sO / sL
    // ... then block `rank` merges dims [rank * nd, +nd) of every row over the cluster's splits. Each block
    // pushes that slice of its partial and its log-sum-exps into block rank's receive area (remote stores,
    // no round trip), and one barrier later every block merges from its own shared memory, in split
    // order. (Merging by remote loads took two cluster barriers, the second to keep the shared memory
    // alive until every remote read had finished.)
    float* rO = reinterpret_cast<float*>(smem_raw + smem_main_bytes<NW, KT, KW>());  // [C][16][nd]
    float* rL = rO + 16 * kD;                                                        // [C][16]
    const int rank = split % C, nsub = min(C, used - cidx * C), nd = kD / C;
    cluster_wait_acquire();  // the arrive at the start: every block of the cluster is running
    for (int i = tid; i < rows * (kD / 4); i += kThreads) {
      const int r = i / (kD / 4), d = (i % (kD / 4)) * 4;
      *reinterpret_cast<float4*>(cluster.map_shared_rank(rO, d / nd) + (rank * 16 + r) * nd + d % nd) =
          *reinterpret_cast<const float4*>(sO + r * kD + d);
    }
    for (int i = tid; i < rows * C; i += kThreads) cluster.map_shared_rank(rL, i / rows)[rank * 16 + i % rows] = sL[i % rows];
    cluster_arrive_release();
    cluster_wait_acquire();
    for (int i = tid; i < rows * nd; i += kThreads) {
      const int r = i / nd, dd = i % nd, d = rank * nd + dd;
      float lse[kAttnMaxCluster], val[kAttnMaxCluster];
#pragma unroll
      for (int j = 0; j < kAttnMaxCluster; ++j) {
        lse[j] = j < nsub ? rL[j * 16 + r] : kNegInf;
        val[j] = j < nsub ? rO[(j * 16 + r) * nd + dd] : 0.f;
      }
      float mx = kNegInf;
#pragma unroll
      for (int j = 0; j < kAttnMaxCluster; ++j) mx = fmaxf(mx, lse[j]);
      float num = 0.f, den = 0.f;
#pragma unroll
      for (int j = 0; j < kAttnMaxCluster; ++j) {
        const float wgt = lse[j] == kNegInf ? 0.f : exp2f(lse[j] - mx);
        den += wgt;
        num += wgt * val[j];
      }
      const float v = den > 0.f ? num / den : 0.f;
      if (parts == 1) {
        a.out[row_index(r) * kD + d] = __float2bfloat16(v);
      } else {
        a.ws_o[((int64_t)cidx * split_stride + row_index(r)) * kD + d] = v;
        if (rank == 0 && d == 0) a.ws_lse[(int64_t)cidx * split_stride + row_index(r)] = den > 0.f ? mx + log2f(den) : kNegInf;
      }
    }
    if (parts == 1) return;
  }
#pragma unroll
  for (int h2 = 0; h2 < 2 && !CLU; ++h2) {
    const int r = wrow + g + 8 * h2;
    if (r >= rows) continue;
    const int t = w.tok_start + r / group, h = kvh * group + r % group;
    const float inv = l[h2] > 0.f ? 1.f / l[h2] : 0.f;
    if (SEG && direct && seg_m[h2] != kNegInf) {  // folded before: fold the last segment, write A / D
      bf16* dst = a.out + ((int64_t)t * a.num_heads + h) * kD + dbase * 8 + 2 * c;
      const float* acc = a.ws_o + row_index(r) * kD + dbase * 8 + 2 * c;
      float wa = 1.f, wb = 0.f;
      if (l[h2] > 0.f) seg_weights(seg_m[h2], seg_d[h2], m[h2] + log2f(l[h2]), wa, wb);
      const float dinv = 1.f / seg_d[h2];
#pragma unroll
      for (int dn = 0; dn < kND; ++dn) {
        const float2 prev = *reinterpret_cast<const float2*>(acc + dn * 8);
        float x = prev.x, y = prev.y;
        if (l[h2] > 0.f) {
          x = seg_fold(x, wa, wb, o[dn][2 * h2] * inv);
          y = seg_fold(y, wa, wb, o[dn][2 * h2 + 1] * inv);
        }
        *reinterpret_cast<uint32_t*>(dst + dn * 8) = pack_bf16(__fmul_rn(x, dinv), __fmul_rn(y, dinv));
      }
    } else if (direct) {
      bf16* dst = a.out + ((int64_t)t * a.num_heads + h) * kD + dbase * 8 + 2 * c;
#pragma unroll
      for (int dn = 0; dn < kND; ++dn)
        *reinterpret_cast<uint32_t*>(dst + dn * 8) =
            SEG ? pack_bf16(seg_one(o[dn][2 * h2] * inv), seg_one(o[dn][2 * h2 + 1] * inv))
                : pack_bf16(o[dn][2 * h2] * inv, o[dn][2 * h2 + 1] * inv);
    } else {
      const int64_t idx = ((int64_t)split * a.num_tokens + t) * a.num_heads + h;
      float* dst = a.ws_o + idx * kD + dbase * 8 + 2 * c;
      if (lo < hi)  // an empty split's zero weight keeps the merge from reading it
#pragma unroll
        for (int dn = 0; dn < kND; ++dn)
          *reinterpret_cast<float2*>(dst + dn * 8) = make_float2(o[dn][2 * h2] * inv, o[dn][2 * h2 + 1] * inv);
      if (c == 0 && (!kDW || warp == 0)) a.ws_lse[idx] = l[h2] > 0.f ? m[h2] + log2f(l[h2]) : kNegInf;
    }
  }
  if (direct) return;
  // Without clusters the partials are merged by merge_splits_kernel, launched next: the last block to
  // finish merging them all itself was one small block's latency-bound loop over every split of 16-64
  // rows (51 us of a 4B verify step's layer at 1k context, 190 us for a 16-token chunk at 16k).
  if constexpr (!CLU) return;

  // Clusters: the last block of this (item, KV head) to finish merges the clusters' partials (decode
  // rows: few). The sum runs in partial order whichever block is last, so results do not depend on timing.
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int* cnt = a.counters + wi * gridDim.y + kvh;
    const int prev = atomicAdd(cnt, 1);
    s_last = prev == parts * C - 1;
    if (s_last) *cnt = 0;  // ready for the next launch
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  // Merge. The splits' log-sum-exps of every row go to shared memory in one parallel read (sQ is free
  // now), then each thread merges 4 dims of up to 4 rows with all their loads in flight together.
  float* s_w = reinterpret_cast<float*>(smem_raw);  // [rows][used] weights, then [rows] 1/sum
  float* s_inv = s_w + kRows * kAttnMaxSplits;
  const int S = parts;
  for (int i = tid; i < rows * S; i += kThreads) s_w[i] = __ldcg(a.ws_lse + (i % S) * split_stride + row_index(i / S));
  __syncthreads();
  for (int r = warp; r < rows; r += NW) {  // lse -> weights, per row
    float mx = kNegInf;
    for (int sp = lane; sp < S; sp += 32) mx = fmaxf(mx, s_w[r * S + sp]);
    mx = warp_max(mx);
    float den = 0.f;
    for (int sp = lane; sp < S; sp += 32) {
      const float lse = s_w[r * S + sp];
      const float wgt = lse == kNegInf ? 0.f : exp2f(lse - mx);
      s_w[r * S + sp] = wgt;
      den += wgt;
    }
    den = warp_sum(den);
    if (lane == 0) s_inv[r] = den > 0.f ? 1.f / den : 0.f;
  }
  __syncthreads();
  constexpr int kR = 4;  // rows per thread
  for (int i = tid; i < (rows + kR - 1) / kR * 32; i += kThreads) {
    const int d = (i % 32) * 4, r0 = (i / 32) * kR;
    float acc[kR][4] = {};
    constexpr int kU = 4;  // splits per round: kU * kR loads in flight per thread, summed in split order
    for (int sp0 = 0; sp0 < S; sp0 += kU) {
      float4 v[kU][kR];
      float wg[kU][kR];
#pragma unroll
      for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int q = 0; q < kR; ++q) {
          const int sp = sp0 + u;
          wg[u][q] = sp < S && r0 + q < rows ? s_w[(r0 + q) * S + sp] : 0.f;
          v[u][q] = wg[u][q] != 0.f  // empty splits wrote nothing: skip the read
                        ? __ldcg(reinterpret_cast<const float4*>(a.ws_o + (sp * split_stride + row_index(r0 + q)) * kD + d))
                        : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
      for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int q = 0; q < kR; ++q) {
          acc[q][0] += wg[u][q] * v[u][q].x;
          acc[q][1] += wg[u][q] * v[u][q].y;
          acc[q][2] += wg[u][q] * v[u][q].z;
          acc[q][3] += wg[u][q] * v[u][q].w;
        }
    }
#pragma unroll
    for (int q = 0; q < kR; ++q) {
      if (r0 + q >= rows) break;
      const float inv = s_inv[r0 + q];
      uint2 packed;
      packed.x = pack_bf16(acc[q][0] * inv, acc[q][1] * inv);
      packed.y = pack_bf16(acc[q][2] * inv, acc[q][3] * inv);
      *reinterpret_cast<uint2*>(a.out + row_index(r0 + q) * kD + d) = packed;
    }
  }
}

// The workspace merge of a launch without clusters: one warp per query row (8 per block), 4 dims per
// lane, the splits' weights from their log-sum-exps, summed in split order (as the cluster path's merge:
// results do not depend on timing). Rows of items that used one split were written directly.
__global__ void __launch_bounds__(256) merge_splits_kernel(AttnArgs a) {
  const AttnWork w = a.work[blockIdx.x];
  const int kvh = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = a.num_heads / a.kv.num_kv_heads, r = blockIdx.z * 8 + warp;
  if (r >= w.num_tok * group) return;
  const int ctx = a.context_lens[w.seq];
  const int kv_end = a.positions[w.tok_start + w.num_tok - 1] + 1;
  const int chunk = ((ctx + a.num_splits - 1) / a.num_splits + kAttnChunkAlign - 1) / kAttnChunkAlign * kAttnChunkAlign;
  const int used = min(a.num_splits, (kv_end + chunk - 1) / chunk);  // as the attention kernel counts them
  if (used <= 1) return;
  const int64_t row = (int64_t)(w.tok_start + r / group) * a.num_heads + kvh * group + r % group;
  const int64_t split_stride = (int64_t)a.num_tokens * a.num_heads;
  __shared__ float s_w[8][kAttnMaxSplits];
  float mx = kNegInf;
  for (int sp = lane; sp < used; sp += 32) {
    const float lse = __ldcg(a.ws_lse + sp * split_stride + row);
    s_w[warp][sp] = lse;
    mx = fmaxf(mx, lse);
  }
  mx = warp_max(mx);
  float den = 0.f;
  for (int sp = lane; sp < used; sp += 32) {
    const float lse = s_w[warp][sp];
    const float wgt = lse == kNegInf ? 0.f : exp2f(lse - mx);
    s_w[warp][sp] = wgt;
    den += wgt;
  }
  den = warp_sum(den);
  __syncwarp();
  const int d = lane * 4;
  float acc[4] = {};
  constexpr int kU = 16;  // splits per round: all their loads in flight together
  for (int sp0 = 0; sp0 < used; sp0 += kU) {
    float4 v[kU];
    float wg[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int sp = sp0 + u;
      wg[u] = sp < used ? s_w[warp][sp] : 0.f;
      v[u] = wg[u] != 0.f  // empty splits wrote nothing: skip the read
                 ? __ldcg(reinterpret_cast<const float4*>(a.ws_o + (sp * split_stride + row) * kD + d))
                 : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      acc[0] += wg[u] * v[u].x;
      acc[1] += wg[u] * v[u].y;
      acc[2] += wg[u] * v[u].z;
      acc[3] += wg[u] * v[u].w;
    }
  }
  const float inv = den > 0.f ? 1.f / den : 0.f;
  uint2 packed;
  packed.x = pack_bf16(acc[0] * inv, acc[1] * inv);
  packed.y = pack_bf16(acc[2] * inv, acc[3] * inv);
  *reinterpret_cast<uint2*>(a.out + row * kD + d) = packed;
}

// The merge of a chunk-invariant split launch (a split per segment): one warp per query row, 4 dims per
// lane, the segments folded in order with seg_weights / seg_fold, as an unsplit block folds them.
__global__ void __launch_bounds__(256) merge_segments_kernel(AttnArgs a) {
  const AttnWork w = a.work[blockIdx.x];
  const int kvh = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = a.num_heads / a.kv.num_kv_heads, r = blockIdx.z * 8 + warp;
  if (r >= w.num_tok * group) return;
  const int kv_end = a.positions[w.tok_start + w.num_tok - 1] + 1;
  const int used = (kv_end + a.segment - 1) / a.segment;  // as the attention kernel counts them
  if (used <= 1) return;                                  // written directly
  const int64_t row = (int64_t)(w.tok_start + r / group) * a.num_heads + kvh * group + r % group;
  const int64_t split_stride = (int64_t)a.num_tokens * a.num_heads;
  const int d = lane * 4;
  float M = kNegInf, Dn = 0.f, A[4] = {0.f, 0.f, 0.f, 0.f};
  constexpr int kU = 8;  // segments per round: their loads in flight together, folded in order after
  for (int sp0 = 0; sp0 < used; sp0 += kU) {
    float lse[kU];
    float4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int sp = sp0 + u;
      lse[u] = sp < used ? __ldcg(a.ws_lse + sp * split_stride + row) : kNegInf;
      v[u] = lse[u] != kNegInf ? __ldcg(reinterpret_cast<const float4*>(a.ws_o + (sp * split_stride + row) * kD + d))
                               : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (lse[u] == kNegInf) continue;  // a segment past the row's position
      float wa, wb;
      seg_weights(M, Dn, lse[u], wa, wb);
      A[0] = seg_fold(A[0], wa, wb, v[u].x);
      A[1] = seg_fold(A[1], wa, wb, v[u].y);
      A[2] = seg_fold(A[2], wa, wb, v[u].z);
      A[3] = seg_fold(A[3], wa, wb, v[u].w);
    }
  }
  const float dinv = 1.f / Dn;
  uint2 packed;
  packed.x = pack_bf16(__fmul_rn(A[0], dinv), __fmul_rn(A[1], dinv));
  packed.y = pack_bf16(__fmul_rn(A[2], dinv), __fmul_rn(A[3], dinv));
  *reinterpret_cast<uint2*>(a.out + row * kD + d) = packed;
}

cudaLaunchAttribute cluster_attr(int cluster) {
  cudaLaunchAttribute clu{};
  clu.id = cudaLaunchAttributeClusterDimension;
  clu.val.clusterDim.x = 1;
  clu.val.clusterDim.y = 1;
  clu.val.clusterDim.z = cluster;
  return clu;
}

// One attribute call per instantiation (graph capture safe afterwards: the first launch is eager).
template <int NW, int KT, bool CLU, bool KW = false, int SEG = 0>
void configure() {
  static bool configured = false;
  if (configured) return;
  auto kernel = paged_attention_kernel<NW, KT, CLU, KW, SEG>;
  constexpr int kQNW = SEG == 2 ? 1 : NW;  // dim warps keep one warp's 16 query rows
  OI_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_bytes<kQNW, KT, CLU, KW>()));
  if (CLU) OI_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  configured = true;
}

// The largest decode cluster this device can hold: 16 is a non-portable size that MPS SM limits or a
// small MIG slice may not fit. Queried once per device and block shape; 1 means no clusters (workspace
// merge only).
template <int NW, bool KW>
int max_cluster() {
  constexpr int kMaxDevices = 64;
  static int cap[kMaxDevices] = {};  // 0: not queried yet
  int dev = 0;
  OI_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < kMaxDevices && cap[dev] > 0) return cap[dev];
  configure<NW, 16, true, KW>();
  int c = kAttnMaxCluster;
  for (; c > 1; c /= 2) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(1, 1, c);
    cfg.blockDim = dim3(NW * 32);
    cfg.dynamicSmemBytes = smem_bytes<NW, 16, true, KW>();
    cudaLaunchAttribute clu = cluster_attr(c);
    cfg.attrs = &clu;
    cfg.numAttrs = 1;
    int n = 0;
    const cudaError_t e = cudaOccupancyMaxActiveClusters(&n, paged_attention_kernel<NW, 16, true, KW, false>, &cfg);
    if (e == cudaSuccess && n >= 1) break;
    cudaGetLastError();  // an unsupported size: try the next smaller one
  }
  if (dev < kMaxDevices) cap[dev] = c;
  return c;
}

template <int NW, int KT, bool CLU, bool KW = false, int SEG = 0>
void launch(const AttnArgs& a, dim3 grid, int cluster, float scale_log2, bool early, cudaStream_t s) {
  static_assert(!CLU || smem_main_bytes<NW, KT, KW>() >= (KW ? (NW + 1) * 16 * (kD + 2) : 16 * NW * (kD + 1)) * 4,
                "cluster merge buffer");
  auto kernel = paged_attention_kernel<NW, KT, CLU, KW, SEG>;
  configure<NW, KT, CLU, KW, SEG>();
  const cudaLaunchAttribute clu = cluster_attr(cluster);
  constexpr int kQNW = SEG == 2 ? 1 : NW;  // dim warps keep one warp's 16 query rows
  OI_CUDA_CHECK(launch_kernel(early, kernel, grid, dim3(NW * 32), smem_bytes<kQNW, KT, CLU, KW>(), s, CLU ? &clu : nullptr,
                              a, scale_log2));
}

// The largest power of two up to `cap` that divides `splits`.
int cluster_for(int splits, int cap) {
  int cluster = 1;
  while (2 * cluster <= cap && splits % (2 * cluster) == 0) cluster *= 2;
  return cluster;
}

int capped(int cap, const AttnVariant& v) { return v.cluster_cap > 0 ? std::min(cap, v.cluster_cap) : cap; }

// Decode rows on a device that holds key-warp clusters, unless the variant asks for one-warp blocks.
bool key_warps_apply(int max_rows, const AttnVariant& v) {
  return max_rows <= 16 && v.key_warps && capped(max_cluster<kAttnKeyWarps, true>(), v) > 1;
}
}  // namespace

AttnLaunch attn_launch_shape(int num_work, int max_rows, int num_splits, AttnVariant v) {
  AttnLaunch l{};
  const bool decode = max_rows <= 16;
  // Early (PDL) only for decode grids of a few items: a larger grid of small blocks placed while the
  // previous kernel runs piles onto the SMs it leaves free (launch.cuh). 4B batch 1: 3.00 -> 2.95 ms
  // wall per step, 8B 4.66 -> 4.56 (docs/benchmarks.md).
  l.early = decode && num_work <= kAttnMaxEarlyItems;
  // Key warps: a quarter of the splits, each block's warps on a quarter of its keys (where the device
  // holds clusters; every split count of attn_num_splits from 4 up is a multiple of 4).
  if (key_warps_apply(max_rows, v) && num_splits % kAttnKeyWarps == 0) {
    l.key_warps = true;
    l.splits = num_splits / kAttnKeyWarps;
    l.cluster = cluster_for(l.splits, capped(max_cluster<kAttnKeyWarps, true>(), v));
    return l;
  }
  l.splits = num_splits;
  l.cluster = decode && num_splits > 1 ? cluster_for(num_splits, capped(max_cluster<1, false>(), v)) : 1;
  return l;
}

int attn_num_splits(int num_work, int num_kv_heads, int max_context, int num_tokens, int num_sms, int max_split_rows,
                    int max_rows, AttnVariant v) {
  // a block of more than 64 rows (8 warps) counts as two: the split rule was measured on 4-warp blocks
  const int blocks = std::max(1, num_work * num_kv_heads) * (max_rows > 64 ? 2 : 1);
  // About four blocks per SM: decode attention (4B heads, 36 layers in a graph, per launch) at 1k context
  // took 9.2 us for batch 1 with 128 blocks and 9.6 with 256; 18.8 us for batch 8 with 512 blocks, 22.7
  // with 1024 and 23.1 with 256; 72 us for batch 64 unsplit (512 blocks), 81 us with two splits.
  const int target = 4 * num_sms;
  if (num_tokens <= 0) return 1;
  // Decode grids of more than one and up to two blocks per SM (4B batch 17-33 on 132 SMs) with key warps: four warps
  // split each row's keys in one block (splits 4 -> key-warp blocks of one split, no cluster wait) instead of two
  // one-warp splits (batch 32 x 1,024 keys 56.7 -> 55.1 us a layer on an H100).
  if (key_warps_apply(max_rows, v) && blocks > target / 4 && blocks <= num_sms * 2 && max_context >= 4 * kAttnChunkAlign)
    return kAttnKeyWarps;
  if (blocks * 2 > target) return 1;
  int splits = target / blocks;
  // A split covers whole aligned chunks; with key warps a block's chunk is cut four ways, so each
  // warp's range may be as short as one 16-key tile.
  const int align = key_warps_apply(max_rows, v) ? kAttnChunkAlign / kAttnKeyWarps : kAttnChunkAlign;
  splits = std::min(splits, std::max(1, max_context / align));
  splits = std::min(splits, std::max(1, max_split_rows / num_tokens));
  splits = std::max(1, std::min(splits, kAttnMaxSplits));
  // Whole decode clusters: a power of two up to 16 splits, a multiple of 16 above.
  if (splits >= kAttnMaxCluster) return splits / kAttnMaxCluster * kAttnMaxCluster;
  int p = 1;
  while (2 * p <= splits) p *= 2;
  return p;
}

int attn_segment_splits(int num_work, int num_kv_heads, int max_context, int num_tokens, int num_sms, int max_split_rows) {
  const int segments = (max_context + kAttnSegment - 1) / kAttnSegment;
  // as attn_num_splits: split only a grid of fewer than two blocks per SM
  if (segments <= 1 || std::max(1, num_work * num_kv_heads) * 2 > 4 * num_sms || segments > kAttnMaxSegments ||
      (int64_t)num_tokens * segments > max_split_rows)
    return 1;
  return segments;
}

void paged_attention(const AttnArgs& a, cudaStream_t s) {
  OI_CHECK(a.kv.head_dim == kD, "paged_attention: head_dim " << a.kv.head_dim << " is not supported (only 128)");
  OI_CHECK(a.kv.block_size == 16, "paged_attention: block_size must be 16 (a tile is whole pages)");
  OI_CHECK(a.num_heads % a.kv.num_kv_heads == 0, "paged_attention: query heads not a multiple of KV heads");
  OI_CHECK(a.max_rows >= 1 && a.max_rows <= kAttnMaxRowsPerBlock,
           "paged_attention: " << a.max_rows << " rows per work item (max " << kAttnMaxRowsPerBlock << ")");
  const int max_splits = a.segment > 0 ? kAttnMaxSegments : kAttnMaxSplits;
  OI_CHECK(a.num_splits >= 1 && a.num_splits <= max_splits,
           "paged_attention: num_splits " << a.num_splits << " (1.." << max_splits << ")");
  OI_CHECK(a.num_splits == 1 || a.counters != nullptr, "paged_attention: splits need the counters");
  OI_CHECK(!a.fuse_rope || (a.max_rows == a.num_heads / a.kv.num_kv_heads && a.max_rows <= 16 && a.q_norm_w &&
                            a.k_norm_w && a.cos_sin && a.slots &&
                            a.q_stride == (a.num_heads + 2 * a.kv.num_kv_heads) * kD),
           "paged_attention: fuse_rope is for decode items of one token (max_rows == group <= 16) with its tables");
  OI_CHECK(a.segment == 0 || (a.segment % 64 == 0 && !a.fuse_rope), "paged_attention: segment " << a.segment
           << " must be a multiple of 64 keys, without fuse_rope");
  if (a.num_work == 0) return;
  // Experiment: prompt chunks through the Hopper wgmma kernel where it takes the launch (attention_sm90.cu).
  if (const int mode = prefill_wgmma_mode(a.variant); mode > 0 && prefill_wgmma_takes(a, mode)) {
    prefill_attention_sm90(a, s);
    return;
  }
  const float scale_log2 = 1.4426950408889634f / sqrtf((float)kD);
  const dim3 grid(a.num_work, a.kv.num_kv_heads, a.num_splits);
  if (a.segment > 0) {  // chunk-invariant: 64-key tiles whatever the rows; num_splits 1 or >= every item's segments
    // up to 16 rows (decode, a verify's short items): four dim warps on the one warp's rows, the same bits
    if (a.max_rows <= 16) launch<kAttnDimWarps, 64, false, false, 2>(a, grid, 1, scale_log2, false, s);
    else if (a.max_rows <= 32) launch<2, 64, false, false, 1>(a, grid, 1, scale_log2, false, s);
    else if (a.max_rows <= 64) launch<4, 64, false, false, 1>(a, grid, 1, scale_log2, false, s);
    else launch<8, 64, false, false, 1>(a, grid, 1, scale_log2, false, s);
    if (a.num_splits > 1)
      OI_CUDA_CHECK(launch_kernel(false, merge_segments_kernel, dim3(a.num_work, a.kv.num_kv_heads, (a.max_rows + 7) / 8),
                                  dim3(256), 0, s, nullptr, a));
    return;
  }
  // Decode rows (one token x group heads) fit one warp: small blocks, small tiles, many per SM (16-key
  // tiles: 4B at 64 x 1k context 6.49 ms per step against 7.16 ms with 32-key tiles, five blocks per SM).
  // Decode splits merge in clusters of the largest power of two (<= 16) that divides the split count
  // (batch 1, 1k context: 19.0 -> 9.2 us per layer against the workspace merge).
  const AttnLaunch l = attn_launch_shape(a.num_work, a.max_rows, a.num_splits, a.variant);
  if (l.key_warps) {
    AttnArgs k = a;
    k.num_splits = l.splits;
    launch<kAttnKeyWarps, 16, true, true>(k, dim3(a.num_work, a.kv.num_kv_heads, l.splits), l.cluster, scale_log2,
                                          l.early, s);
  } else if (a.max_rows <= 16 && l.cluster > 1) {
    launch<1, 16, true>(a, grid, l.cluster, scale_log2, l.early, s);
  } else {
    if (a.max_rows <= 16) launch<1, 16, false>(a, grid, 1, scale_log2, l.early, s);
    else if (a.max_rows <= 32) launch<2, 64, false>(a, grid, 1, scale_log2, false, s);
    else if (a.max_rows <= 64) launch<4, 64, false>(a, grid, 1, scale_log2, false, s);
    else launch<8, 64, false>(a, grid, 1, scale_log2, false, s);
    if (a.num_splits > 1)  // after the whole grid (no early launch): every split's partial is in the workspace
      OI_CUDA_CHECK(launch_kernel(false, merge_splits_kernel, dim3(a.num_work, a.kv.num_kv_heads, (a.max_rows + 7) / 8),
                                  dim3(256), 0, s, nullptr, a));
  }
}

}  // namespace oi
