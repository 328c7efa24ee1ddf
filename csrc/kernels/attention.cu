#include <algorithm>
#include <cmath>

#include "attention.cuh"

namespace oi {
namespace {

constexpr int kD = 128;
constexpr int kRowsPerWarp = 4;
constexpr int kPad = 8;              // bf16 of padding per smem row: 16-byte reads stay conflict-free
constexpr int kLd = kD + kPad;
constexpr float kNegInf = -INFINITY;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int NW>
__global__ void __launch_bounds__(NW * 32) paged_attention_kernel(AttnArgs a, float scale_log2) {
  constexpr int kRows = NW * kRowsPerWarp;
  __shared__ __align__(16) bf16 sK[2][kAttnTile][kLd];
  __shared__ __align__(16) bf16 sV[2][kAttnTile][kLd];
  __shared__ __align__(16) bf16 sQ[kRows][kD];  // all lanes read one row at a time: broadcast

  const AttnWork w = a.work[blockIdx.x];
  const int kvh = blockIdx.y, split = blockIdx.z;
  const int group = a.num_heads / a.kv.num_kv_heads;
  const int rows = w.num_tok * group;
  const int ctx = a.context_lens[w.seq];
  const int kv_end = a.positions[w.tok_start + w.num_tok - 1] + 1;  // causal bound of the last token
  const int chunk = ((ctx + a.num_splits - 1) / a.num_splits + kAttnTile - 1) / kAttnTile * kAttnTile;
  const int lo = split * chunk;
  const int hi = min(lo + chunk, kv_end);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  // Query rows: row r is token tok_start + r / group, head kvh * group + r % group.
  for (int i = threadIdx.x; i < rows * (kD / 8); i += NW * 32) {
    const int r = i / (kD / 8), c = (i % (kD / 8)) * 8;
    const int t = w.tok_start + r / group, h = kvh * group + r % group;
    *reinterpret_cast<uint4*>(&sQ[r][c]) = *reinterpret_cast<const uint4*>(a.q + (int64_t)t * a.q_stride + h * kD + c);
  }

  const int32_t* bt = a.block_tables + (int64_t)w.seq * a.bt_stride;
  const int64_t head_off = (int64_t)kvh * a.kv.block_size * kD;
  const int64_t v_off = (int64_t)a.kv.num_kv_heads * a.kv.block_size * kD;
  auto load_tile = [&](int stage, int k0) {
    // 32 keys = two 16-token pages; each page's K (and V) for one head is 4 KB contiguous.
    for (int i = threadIdx.x; i < 2 * kAttnTile * (kD / 8); i += NW * 32) {
      const int is_v = i >= kAttnTile * (kD / 8);
      const int j = i % (kAttnTile * (kD / 8));
      const int key = j / (kD / 8), c = (j % (kD / 8)) * 8;
      if (k0 + key < hi) {
        const int page = bt[(k0 + key) / a.kv.block_size];
        const bf16* src = a.kv_cache + page * a.kv.block_stride() + a.layer * a.kv.layer_stride() +
                          (is_v ? v_off : 0) + head_off + ((k0 + key) % a.kv.block_size) * kD + c;
        cp_async16(is_v ? &sV[stage][key][c] : &sK[stage][key][c], src);
      }
    }
    cp_async_commit();
  };

  float m[kRowsPerWarp], l[kRowsPerWarp], o[kRowsPerWarp][4];
  int pos[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    m[rr] = kNegInf;
    l[rr] = 0.f;
    o[rr][0] = o[rr][1] = o[rr][2] = o[rr][3] = 0.f;
    const int r = warp * kRowsPerWarp + rr;
    pos[rr] = r < rows ? a.positions[w.tok_start + r / group] : -1;  // -1: inactive row, masks every key
  }
  const bool warp_active = warp * kRowsPerWarp < rows;

  if (lo < hi) load_tile(0, lo);
  int stage = 0;
  for (int k0 = lo; k0 < hi; k0 += kAttnTile, stage ^= 1) {
    if (k0 + kAttnTile < hi) {
      load_tile(stage ^ 1, k0 + kAttnTile);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (warp_active) {
      const int key = k0 + lane;
      float s[kRowsPerWarp] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
      for (int d = 0; d < kD; d += 8) {
        const uint4 kr = *reinterpret_cast<const uint4*>(&sK[stage][lane][d]);
        const __nv_bfloat162* kp = reinterpret_cast<const __nv_bfloat162*>(&kr);
        float kf[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __bfloat1622float2(kp[j]);
          kf[2 * j] = f.x;
          kf[2 * j + 1] = f.y;
        }
#pragma unroll
        for (int rr = 0; rr < kRowsPerWarp; ++rr) {
          const uint4 qr = *reinterpret_cast<const uint4*>(&sQ[warp * kRowsPerWarp + rr][d]);
          const __nv_bfloat162* qp = reinterpret_cast<const __nv_bfloat162*>(&qr);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 q = __bfloat1622float2(qp[j]);
            s[rr] += q.x * kf[2 * j] + q.y * kf[2 * j + 1];
          }
        }
      }
      float p[kRowsPerWarp];
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) {
        const float sv = (key < hi && key <= pos[rr]) ? s[rr] * scale_log2 : kNegInf;
        const float m_new = fmaxf(m[rr], warp_max(sv));
        if (m_new == kNegInf) {  // nothing visible yet for this row
          p[rr] = 0.f;
          continue;
        }
        p[rr] = exp2f(sv - m_new);
        const float alpha = exp2f(m[rr] - m_new);
        l[rr] = l[rr] * alpha + warp_sum(p[rr]);
#pragma unroll
        for (int i = 0; i < 4; ++i) o[rr][i] *= alpha;
        m[rr] = m_new;
      }
      const int nvalid = min(kAttnTile, hi - k0);  // never touch slots past the range (may be uninitialised)
      for (int j = 0; j < nvalid; ++j) {
        const uint2 vr = *reinterpret_cast<const uint2*>(&sV[stage][j][lane * 4]);
        const float2 v01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&vr.x));
        const float2 v23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&vr.y));
#pragma unroll
        for (int rr = 0; rr < kRowsPerWarp; ++rr) {
          const float pj = __shfl_sync(0xffffffffu, p[rr], j);
          o[rr][0] += pj * v01.x;
          o[rr][1] += pj * v01.y;
          o[rr][2] += pj * v23.x;
          o[rr][3] += pj * v23.y;
        }
      }
    }
    __syncthreads();  // the next iteration's prefetch overwrites this stage
  }

#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int r = warp * kRowsPerWarp + rr;
    if (r >= rows) break;
    const int t = w.tok_start + r / group, h = kvh * group + r % group;
    const float inv = l[rr] > 0.f ? 1.f / l[rr] : 0.f;
    if (a.num_splits == 1) {
      bf16* dst = a.out + ((int64_t)t * a.num_heads + h) * kD + lane * 4;
      const __nv_bfloat162 x = __floats2bfloat162_rn(o[rr][0] * inv, o[rr][1] * inv);
      const __nv_bfloat162 y = __floats2bfloat162_rn(o[rr][2] * inv, o[rr][3] * inv);
      uint2 packed;
      packed.x = *reinterpret_cast<const uint32_t*>(&x);
      packed.y = *reinterpret_cast<const uint32_t*>(&y);
      *reinterpret_cast<uint2*>(dst) = packed;
    } else {
      const int64_t idx = ((int64_t)split * a.num_tokens + t) * a.num_heads + h;
      *reinterpret_cast<float4*>(a.ws_o + idx * kD + lane * 4) =
          make_float4(o[rr][0] * inv, o[rr][1] * inv, o[rr][2] * inv, o[rr][3] * inv);
      if (lane == 0) a.ws_lse[idx] = l[rr] > 0.f ? m[rr] + log2f(l[rr]) : kNegInf;
    }
  }
}

// Merge the splits of one (token, head): weights 2^(lse_s - max).
__global__ void attention_merge_kernel(const float* __restrict__ ws_o, const float* __restrict__ ws_lse,
                                       bf16* __restrict__ out, int num_splits, int T, int nH) {
  const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
  float mx = kNegInf;
  for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, ws_lse[((int64_t)s * T + t) * nH + h]);
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, den = 0.f;
  if (mx != kNegInf) {
    for (int s = 0; s < num_splits; ++s) {
      const int64_t idx = ((int64_t)s * T + t) * nH + h;
      const float lse = ws_lse[idx];
      if (lse == kNegInf) continue;
      const float wgt = exp2f(lse - mx);
      const float4 v = *reinterpret_cast<const float4*>(ws_o + idx * kD + lane * 4);
      acc[0] += wgt * v.x;
      acc[1] += wgt * v.y;
      acc[2] += wgt * v.z;
      acc[3] += wgt * v.w;
      den += wgt;
    }
  }
  const float inv = den > 0.f ? 1.f / den : 0.f;
  bf16* dst = out + ((int64_t)t * nH + h) * kD + lane * 4;
  const __nv_bfloat162 x = __floats2bfloat162_rn(acc[0] * inv, acc[1] * inv);
  const __nv_bfloat162 y = __floats2bfloat162_rn(acc[2] * inv, acc[3] * inv);
  uint2 packed;
  packed.x = *reinterpret_cast<const uint32_t*>(&x);
  packed.y = *reinterpret_cast<const uint32_t*>(&y);
  *reinterpret_cast<uint2*>(dst) = packed;
}

}  // namespace

int attn_num_splits(int num_work, int num_kv_heads, int max_context, int num_tokens, int num_sms, int max_split_rows) {
  const int blocks = std::max(1, num_work * num_kv_heads);
  const int target = 4 * num_sms;
  if (blocks >= target || num_tokens <= 0) return 1;
  int splits = (target + blocks - 1) / blocks;
  splits = std::min(splits, std::max(1, max_context / (2 * kAttnTile)));  // at least two tiles per split
  splits = std::min(splits, std::max(1, max_split_rows / num_tokens));
  return std::max(1, std::min(splits, 128));
}

void paged_attention(const AttnArgs& a, cudaStream_t s) {
  OI_CHECK(a.kv.head_dim == kD, "paged_attention: head_dim " << a.kv.head_dim << " is not supported (only 128)");
  OI_CHECK(a.kv.block_size == 16, "paged_attention: block_size must be 16 (one tile = two pages)");
  OI_CHECK(a.num_heads % a.kv.num_kv_heads == 0, "paged_attention: query heads not a multiple of KV heads");
  OI_CHECK(a.max_rows >= 1 && a.max_rows <= kAttnMaxRowsPerBlock,
           "paged_attention: " << a.max_rows << " rows per work item (max " << kAttnMaxRowsPerBlock << ")");
  OI_CHECK(a.num_splits >= 1, "paged_attention: num_splits must be >= 1");
  if (a.num_work == 0) return;
  const float scale_log2 = 1.4426950408889634f / sqrtf((float)kD);
  dim3 grid(a.num_work, a.kv.num_kv_heads, a.num_splits);
  const int nw = (a.max_rows + kRowsPerWarp - 1) / kRowsPerWarp;
  if (nw <= 1) paged_attention_kernel<1><<<grid, 32, 0, s>>>(a, scale_log2);
  else if (nw <= 2) paged_attention_kernel<2><<<grid, 64, 0, s>>>(a, scale_log2);
  else if (nw <= 4) paged_attention_kernel<4><<<grid, 128, 0, s>>>(a, scale_log2);
  else paged_attention_kernel<8><<<grid, 256, 0, s>>>(a, scale_log2);
  OI_LAUNCH_CHECK("paged_attention_kernel");
  if (a.num_splits > 1) {
    attention_merge_kernel<<<dim3(a.num_tokens, a.num_heads), 32, 0, s>>>(a.ws_o, a.ws_lse, a.out, a.num_splits,
                                                                           a.num_tokens, a.num_heads);
    OI_LAUNCH_CHECK("attention_merge_kernel");
  }
}

}  // namespace oi
