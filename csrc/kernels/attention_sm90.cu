// Prefill attention on Hopper (sm_90a) with warpgroup MMA: prompt chunks of the paged KV cache, in place of
// paged_attention's mma.sync kernel (attention.cu), which runs them at ~140-210 TFLOP/s against this one's ~250-450
// (4B on an H100, 2026-12-07: 1,024-token chunk 60 -> 35 us a layer, 8,192 2.66 -> 1.28 ms).
//
//  - Block: one work item (up to 128 query rows = tokens x the group's heads, as attention_work makes them) x one KV
//    head, unsplit: every key of the item's causal range, 0 .. the last row's position. Items longest first, as the
//    mma.sync kernel takes them. 288 threads: warpgroups 0 and 1 each own 64 query rows (row r = token r / group,
//    head r % group), warp 8 copies.
//  - Tiles of 128 keys. A page of one head is 16 keys x 128 dims, contiguous (4 KB, rope_kv.cuh's layout), so a tile
//    is 8 pages anywhere in the cache: the copy warp's lanes 0-7 each bring one page as two 16 x 64 boxes of K and two
//    of V through the tensor copy engine (one 3-D tensor map over the whole cache: dims, rows of a cache block,
//    blocks), in the 128-byte swizzle, K and V completing on separate mbarriers so Q·Kᵀ starts before V lands. Two
//    stages (Q 32 KB + 2 x 64 KB: one block per SM; expected, not measured: the tensor cores, not the copies, bound
//    a tile, so a third stage would not pay).
//  - Per tile and warpgroup: S[64 x 128] = Q·Kᵀ as 8 wgmma m64n128k16 (Q and K K-major from shared memory), the
//    online softmax in fp32 registers (log2 domain, masks only on the causal diagonal), P to bf16 in registers (the
//    accumulator fragment is the A fragment of the next product), O[64 x 128] += P·V as 8 wgmma m64n128k16 with A from
//    registers and V N-major from shared memory. Registers: S 64 + O 64 + P 32 a thread (ptxas: 168, no spills).
//    Within a warpgroup the two products and the softmax run one after the other; the two warpgroups overlap.
//  - Causal skipping: no tile past the item's last position is loaded; a warpgroup whose rows all precede a tile
//    skips it (it still releases the stage).
//  - Keys past the item's end inside the last tile (the rest of the last page, or pages not loaded): their scores
//    are masked, and their V rows are zeroed in shared memory before P·V (unwritten cache slots may hold any bits, and
//    0 x NaN would reach the sums).
//
// It takes (prefill_wgmma_takes): unsplit, non-segment launches (AttnArgs::segment == 0, num_splits == 1) without
// fuse_rope or own_keys_below, head_dim 128, block_size 16, 16-byte aligned q rows, on a compute capability 9.0
// device; items of more than 16 rows (max_rows > 16: prompt chunks and verify rows) unless forced (variant 2).
// Positions must rise along an item (the last row's is its largest), as in attention.cu.
// Tests: tests/test_gpu_prefill_wgmma.py (layouts with exact answers, model shapes, prefixes, several sequences, 32k).
#include <algorithm>
#include <climits>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>

#include "attention_sm90.cuh"
#include "launch.cuh"
#include "sm90.cuh"

namespace oi {
namespace {

constexpr int kD = 128;
constexpr int kKT = 128;                        // keys per tile
constexpr int kStages = 2;                      // K/V tiles in shared memory
constexpr int kWarpGroups = 2;                  // consumer warpgroups, 64 query rows each
constexpr int kConsumers = kWarpGroups * 128;
constexpr int kThreads = kConsumers + 32;       // + the copy warp
constexpr int kQWgBytes = 64 * kD * 2;          // one warpgroup's Q rows: two 64-dim halves of 64 x 128 bytes
constexpr int kQBytes = kWarpGroups * kQWgBytes;
constexpr int kHalfBytes = kKT * 128;           // one 64-dim half of a K or V tile: kKT rows of 128 bytes
constexpr int kTileBytes = 2 * kHalfBytes;      // K (or V) of one tile
constexpr int kPageBytes = 16 * kD * 2;         // one page of one head, K or V
constexpr size_t kSmem = kQBytes + size_t(kStages) * 2 * kTileBytes + 1024;  // + slack to align to 1024
static_assert(kSmem <= 227 * 1024, "shared memory per block");
static_assert(kKT % 16 == 0 && kKT / 16 <= 32, "a tile is whole pages, one per copy lane");

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d[64 x 128] (+)= A[64 x 16] · B[16 x 128], both operands from shared memory through descriptors, K-major (trans 0);
// scale_d == 0 overwrites d instead of adding to it. Accumulator layout as wgmma<N> (sm90.cuh).
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], uint64_t a, uint64_t b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(scale_d));
}
// d[64 x 128] += A[64 x 16] · B[16 x 128] with A from registers (warp w of the warpgroup holds rows 16w..16w+15 as
// an m16n8k16 A fragment: a[0] (row g, k 2t..2t+1), a[1] (row g + 8, same k), a[2] (row g, k 2t+8..), a[3] (row g + 8,
// k 2t+8..)) and B from shared memory N-major (imm-trans-b 1: the tile is [k][n], n contiguous).
__device__ __forceinline__ void wgmma_rs_n128_tn(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// Descriptor of an N-major (MN-major) operand in the 128-byte swizzle, as B of P·V: rows of 128 bytes (64 n values)
// per k, 8-k groups 1024 bytes apart (stride byte offset), successive 64-wide n blocks `lbo` bytes apart (leading byte
// offset: for a swizzled MN-major operand it is the step between n blocks of the swizzle width, CUTLASS's
// make_gmma_desc<Major::MN>). Start on a 1024-byte boundary (base offset 0); a k16 step is 16 rows (2048 bytes) on.
__device__ __forceinline__ uint64_t smem_desc_mn(uint32_t addr, uint32_t lbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

// A 3-D box of the tensor map (c0 along the contiguous dimension) into shared memory at dst, counted on bar in bytes.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Shared-memory writes of the generic proxy (st.shared) made visible to the async proxy (wgmma operand reads).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// The 128 threads of warpgroup wg alone (named barriers 1 and 2; 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_sync(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
}
__device__ __forceinline__ void st_shared16(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

#endif  // sm_90a helpers

// grid (num_work x num_kv_heads), 1-D: block b takes item num_work - 1 - b / kv_heads (longest first) and KV head
// b % kv_heads.
__global__ void __launch_bounds__(kThreads, 1) prefill_wgmma_kernel(const __grid_constant__ CUtensorMap tm_kv,
                                                                      const AttnArgs a, float scale_log2) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full_k[kStages], full_v[kStages], empty[kStages];
  // From a 1024-byte boundary (the swizzle pattern repeats every 1024 bytes and the descriptors assume tiles start on
  // one): Q [warpgroup][half][64 rows][128 B], then per stage K [half][kKT keys][128 B] and V likewise.
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t s_k0 = base + kQBytes;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int H = a.kv.num_kv_heads;
  const int wi = a.num_work - 1 - (int)blockIdx.x / H, kvh = (int)blockIdx.x % H;
  pdl_wait();  // launched normally (no early start): the wait costs nothing, kept for launch.cuh's rule
  const AttnWork w = a.work[wi];
  const int group = a.num_heads / H, rows = w.num_tok * group;
  const int kv_end = a.positions[w.tok_start + w.num_tok - 1] + 1;  // keys 0 .. the item's last position
  const int ntiles = (kv_end + kKT - 1) / kKT, npages = (kv_end + 15) / 16;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full_k[s], 1);               // the copy lane's arrive (+ the bytes)
      mbar_init(&full_v[s], 1);
      mbar_init(&empty[s], kConsumers / 32);  // one arrive per consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (warp == kConsumers / 32) {
    // Copy warp. Tile i goes to stage i % kStages once every consumer warp has released tile i - kStages there. Lane p
    // brings page p of the tile (fewer in the last tile: pages past the item's keys are not read).
    const int32_t* bt = a.block_tables + (int64_t)w.seq * a.bt_stride;
    const int row_k = ((a.layer * 2) * H + kvh) * 16, row_v = ((a.layer * 2 + 1) * H + kvh) * 16;
    if (lane == 0) prefetch_map(&tm_kv);
    int page = lane < kKT / 16 && lane < npages ? bt[lane] : 0;
    for (int i = 0; i < ntiles; ++i) {
      const int s = i % kStages, np = min(kKT / 16, npages - i * (kKT / 16));
      const int nxt = (i + 1) * (kKT / 16) + lane;  // the next tile's page ids, read before the wait
      const int page_next = lane < kKT / 16 && nxt < npages ? bt[nxt] : 0;
      if (lane == 0) {
        if (i >= kStages) mbar_wait(&empty[s], ((i / kStages) - 1) & 1);
        mbar_expect_tx(&full_k[s], np * kPageBytes);
        mbar_expect_tx(&full_v[s], np * kPageBytes);
      }
      __syncwarp();
      if (lane < np) {
        const uint32_t dk = s_k0 + s * 2 * kTileBytes + lane * 16 * 128, dv = dk + kTileBytes;
        tma_load_3d(dk, &tm_kv, 0, row_k, page, &full_k[s]);
        tma_load_3d(dk + kHalfBytes, &tm_kv, 64, row_k, page, &full_k[s]);
        tma_load_3d(dv, &tm_kv, 0, row_v, page, &full_v[s]);
        tma_load_3d(dv + kHalfBytes, &tm_kv, 64, row_v, page, &full_v[s]);
      }
      page = page_next;
    }
    return;  // no block-wide barrier follows; the copies complete on the mbarriers
  }

  // Consumer warpgroup wg: rows wg * 64 .. + 63; this thread's are wg * 64 + 16 wq + g and + 8 (the accumulator
  // layout: d[4j + e] is row g + 8 (e / 2), column 8j + 2t + (e % 2) of the warp's 16 rows).
  const int wg = warp / 4, wq = warp % 4, tid = threadIdx.x % 128, g = lane >> 2, t = lane & 3;
  const uint32_t s_q = base + wg * kQWgBytes;
  // Q rows into shared memory in the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)), zeros past
  // the item's rows.
  for (int i = tid; i < 64 * (kD / 8); i += 128) {
    const int r = i >> 4, c = i & 15, row = wg * 64 + r;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row < rows) {
      const int tok = w.tok_start + row / group, h = kvh * group + row % group;
      v = *reinterpret_cast<const uint4*>(a.q + (int64_t)tok * a.q_stride + h * kD + c * 8);
    }
    st_shared16(s_q + (c >> 3) * (kQWgBytes / 2) + r * 128 + (((c & 7) ^ (r & 7)) << 4), v);
  }
  fence_proxy_async();
  warpgroup_sync(wg);

  int pos[2];  // -1: a row past the item (every key masked, never stored)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = wg * 64 + wq * 16 + g + 8 * h;
    pos[h] = r < rows ? a.positions[w.tok_start + r / group] : -1;
  }
  // Keys up to warp_min are visible to every live row of the warp (no mask); tiles past wg_max to none of the
  // warpgroup's rows (skipped).
  const int warp_min = __reduce_min_sync(0xffffffffu, min(pos[0] < 0 ? INT_MAX : pos[0], pos[1] < 0 ? INT_MAX : pos[1]));
  const int wg_last = min(rows, (wg + 1) * 64) - 1;
  const int wg_max = wg_last >= wg * 64 ? a.positions[w.tok_start + wg_last / group] : -1;

  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const uint64_t dq = smem_desc(s_q);
  for (int i = 0; i < ntiles; ++i) {
    const int s = i % kStages, k0 = i * kKT;
    const uint32_t ph = (i / kStages) & 1, s_k = s_k0 + s * 2 * kTileBytes, s_v = s_k + kTileBytes;
    mbar_wait(&full_k[s], ph);
    if (k0 > wg_max) {  // warpgroup-uniform: nothing of this tile is visible to its rows
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[s]);
      continue;
    }
    // S = Q·Kᵀ: k step kk is dims 16kk..16kk+15, in half kk / 4 at byte 32 (kk % 4) of each 128-byte row.
    float sc[64];
    const uint64_t dk = smem_desc(s_k);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk)
      wgmma_ss_n128(sc, dq + (kk >> 2) * ((kQWgBytes / 2) >> 4) + (kk & 3) * 2,
                    dk + (kk >> 2) * (kHalfBytes >> 4) + (kk & 3) * 2, kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(sc);

    // Online softmax of this thread's two rows (a row's 128 scores lie in one quad of lanes).
    float mx[2] = {-INFINITY, -INFINITY};
    if (k0 + kKT <= kv_end && k0 + kKT - 1 <= warp_min) {  // warp-uniform: the causal interior, no key past the item
#pragma unroll
      for (int e = 0; e < 64; ++e) {
        sc[e] *= scale_log2;
        mx[(e >> 1) & 1] = fmaxf(mx[(e >> 1) & 1], sc[e]);
      }
    } else {  // select, not multiply: scores of keys past the item may come from any bits
#pragma unroll
      for (int e = 0; e < 64; ++e) {
        const int key = k0 + 8 * (e >> 2) + 2 * t + (e & 1), h = (e >> 1) & 1;
        sc[e] = key <= pos[h] ? sc[e] * scale_log2 : -INFINITY;
        mx[h] = fmaxf(mx[h], sc[e]);
      }
    }
    float base_m[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      const float m_new = fmaxf(m[h], mx[h]);
      base_m[h] = m_new == -INFINITY ? 0.f : m_new;  // nothing visible yet: every p is 0, the state stays
      const float alpha = exp2f(m[h] - base_m[h]);
      m[h] = m_new;
      l[h] *= alpha;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        o[4 * j + 2 * h] *= alpha;
        o[4 * j + 2 * h + 1] *= alpha;
      }
    }
    // P in bf16 as the A fragments of P·V: k step kk is keys 16kk.., columns 8 (2kk) and 8 (2kk + 1) of S.
    uint32_t pa[kKT / 16][4];
#pragma unroll
    for (int kk = 0; kk < kKT / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int e = 8 * kk + 2 * r, h = r & 1;
        const float p0 = exp2f(sc[e] - base_m[h]), p1 = exp2f(sc[e + 1] - base_m[h]);
        l[h] += p0 + p1;
        pa[kk][r] = pack_bf16(p0, p1);
      }

    mbar_wait(&full_v[s], ph);
    if (k0 + kKT > kv_end) {  // block-uniform: the last tile; zero V rows past the item's keys (both halves)
      const int r0 = kv_end - k0;
      for (int idx = tid; idx < (kKT - r0) * 16; idx += 128) {
        const int r = r0 + (idx >> 4), c = idx & 15;
        st_shared16(s_v + (c >> 3) * kHalfBytes + r * 128 + (c & 7) * 16, make_uint4(0, 0, 0, 0));
      }
      fence_proxy_async();
      warpgroup_sync(wg);  // the other warpgroup may write the same zeros: the same bits, no order needed
    }
    // O += P·V: V is [key][dim] (N-major B); k step kk is keys 16kk.. (2048 bytes on), the halves kHalfBytes apart.
    const uint64_t dv = smem_desc_mn(s_v, kHalfBytes);
    // the rescaled O and the packed P are register operands of the wgmmas: their writes may not sink below the fence
    fence_acc(o);
#pragma unroll
    for (int kk = 0; kk < kKT / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(pa[kk][r])::"memory");
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKT / 16; ++kk) wgmma_rs_n128_tn(o, pa[kk], dv + kk * ((16 * 128) >> 4));
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(o);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);  // this warp has read the stage
  }

  // Row sums are spread over the quad; each thread stores its two rows' 2 x 16 column pairs.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    const int r = wg * 64 + wq * 16 + g + 8 * h;
    if (r >= rows) continue;
    const int tok = w.tok_start + r / group, head = kvh * group + r % group;
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    bf16* dst = a.out + ((int64_t)tok * a.num_heads + head) * kD + 2 * t;
#pragma unroll
    for (int j = 0; j < 16; ++j)
      *reinterpret_cast<uint32_t*>(dst + 8 * j) = pack_bf16(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
  }
#else
  __trap();  // built for another architecture: the launcher takes compute capability 9.0 only
#endif
}

// ---- host side ----

// The whole cache as a 3-D bf16 tensor: 128 dims, the rows of one cache block ([layer][K|V][kv_head][16 keys], L x 2 x
// H x 16 of them, 256 bytes apart), blocks (block_stride apart). Boxes of 64 dims x 16 rows x 1 block in the 128-byte
// swizzle. The block count is not known here (AttnArgs has none): the dimension is given as a bound no pool reaches
// (2^30 blocks, or fewer so that the extent stays under 2^46 bytes of address space); boxes are only ever requested
// at pages of the block tables, so it bounds nothing in practice.
// Cached per (pointer, layers, KV heads): a map is a 128-byte host value passed by value to each launch; encoding is
// host work alone, so it may happen while a stream is being captured.
CUtensorMap kv_map(const AttnArgs& a) {
  using Key = std::tuple<const void*, int, int>;
  static std::mutex mu;
  static std::map<Key, CUtensorMap> cache;
  const Key key{a.kv_cache, a.kv.num_layers, a.kv.num_kv_heads};
  std::lock_guard<std::mutex> lock(mu);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  CUtensorMap map{};
  const cuuint64_t rows = (cuuint64_t)a.kv.num_layers * 2 * a.kv.num_kv_heads * 16;
  const cuuint64_t block_bytes = (cuuint64_t)a.kv.block_stride() * sizeof(bf16);
  const cuuint64_t blocks = std::min<cuuint64_t>((cuuint64_t)1 << 30, ((cuuint64_t)1 << 46) / block_bytes);
  const cuuint64_t dims[3] = {(cuuint64_t)kD, rows, blocks};
  const cuuint64_t strides[2] = {(cuuint64_t)kD * sizeof(bf16), block_bytes};
  const cuuint32_t box[3] = {64, 16, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = tma_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, a.kv_cache, dims, strides, box,
                                   elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  OI_CHECK(r == CUDA_SUCCESS, "prefill_attention_sm90: cuTensorMapEncodeTiled failed (" << (int)r << ") for the KV cache at "
                                  << (const void*)a.kv_cache << ", " << a.kv.num_layers << " layers x "
                                  << a.kv.num_kv_heads << " KV heads");
  cache.emplace(key, map);
  return map;
}

}  // namespace

bool prefill_wgmma_device() { return sm90_device(); }

bool prefill_wgmma_takes(const AttnArgs& a, int mode) {
  if (mode <= 0 || a.segment != 0 || a.num_splits != 1 || a.fuse_rope || a.own_keys_below != 0) return false;
  if (a.max_rows < 1 || a.max_rows > kWarpGroups * 64 || (mode == 1 && a.max_rows <= 16)) return false;
  if (a.kv.head_dim != kD || a.kv.block_size != 16 || a.kv.num_kv_heads < 1 || a.num_heads % a.kv.num_kv_heads != 0)
    return false;
  if (reinterpret_cast<uintptr_t>(a.q) % 16 != 0 || a.q_stride % 8 != 0 || reinterpret_cast<uintptr_t>(a.kv_cache) % 16 != 0)
    return false;
  if ((int64_t)a.num_work * a.kv.num_kv_heads > INT_MAX) return false;
  return sm90_device();
}

void prefill_attention_sm90(const AttnArgs& a, cudaStream_t s) {
  if (a.num_work == 0) return;
  const CUtensorMap map = kv_map(a);
  static bool configured = false;  // one attribute call (graph capture safe afterwards)
  if (!configured) {
    OI_CUDA_CHECK(cudaFuncSetAttribute(prefill_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmem));
    configured = true;
  }
  const float scale_log2 = 1.4426950408889634f / sqrtf((float)kD);
  OI_CUDA_CHECK(launch_kernel(false, prefill_wgmma_kernel, dim3(a.num_work * a.kv.num_kv_heads), dim3(kThreads), kSmem,
                              s, nullptr, map, a, scale_log2));
}

}  // namespace oi
