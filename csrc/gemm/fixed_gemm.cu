// The batch-invariant GEMM of --deterministic: Y[M, N] = X[M, K] · W[N, K]^T (+ Y), bf16 in, fp32 accumulate.
//
// Every output element is one fp32 accumulator that takes the m16n8k16 MMAs over K in ascending order, and
// nothing else touches it before the epilogue (no split-K). The tile shape, the K step per stage and the
// number of CTAs change with M and N for speed, but none of them changes that order, so a row's result
// is the same whatever M is: a token computed alone, in a batch of 64 or inside a 2048-token prefill gets
// the same bits. (cuBLASLt picks other kernels at other M, whose sums differ in their last bits, and one
// fixed cuBLASLt algorithm at every M streams weights far below bandwidth at decode's few rows.)
#include "../kernels/async_copy.cuh"
#include "../kernels/launch.cuh"
#include "../kernels/mma.cuh"
#include "fixed_gemm.h"

namespace oi {
namespace {

// BM x BN output tile per CTA, BK of K per pipeline stage, WM x WN per warp.
template <int BM, int BN, int BK, int WM, int WN, int STAGES>
struct Tile {
  static constexpr int kWarps = (BM / WM) * (BN / WN);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kLd = BK + 8;  // padded row: 16-byte chunks at an odd stride, ldmatrix conflict-free
  static constexpr int kStageElems = (BM + BN) * kLd;
  static constexpr size_t kSmem = size_t(STAGES) * kStageElems * sizeof(bf16);
  static_assert(WM % 16 == 0 && WN % 16 == 0 && BK % 16 == 0 && BM % WM == 0 && BN % WN == 0, "tile shape");
};

template <int BM, int BN, int BK, int WM, int WN, int STAGES>
__global__ void __launch_bounds__(Tile<BM, BN, BK, WM, WN, STAGES>::kThreads)
    fixed_gemm_kernel(const bf16* __restrict__ X, const bf16* __restrict__ W, void* Y, int M, int N, int K,
                      bool accumulate, bool out_f32) {
  using T = Tile<BM, BN, BK, WM, WN, STAGES>;
  constexpr int MT = WM / 16, NT = WN / 8, kChunks = BK / 8;  // 16-byte chunks per smem row
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* smem = reinterpret_cast<bf16*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / (BN / WN), wn = warp % (BN / WN);
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  const int num_k = (K + BK - 1) / BK;

  // One stage's X rows (`x`) or W rows, BK of K from kt * BK, 16 bytes a copy; zero past M, N and K.
  auto load = [&](int slot, int kt, bool x) {
    bf16* dst = smem + slot * T::kStageElems + (x ? 0 : BM * T::kLd);
    const bf16* src = x ? X : W;
    const int rows = x ? BM : BN, lim = x ? M : N, r0 = x ? m0 : n0, k0 = kt * BK;
    for (int c = tid; c < rows * kChunks; c += T::kThreads) {
      const int row = c / kChunks, k = k0 + (c % kChunks) * 8, r = r0 + row;
      const bool ok = r < lim && k < K;
      cp_async16(dst + row * T::kLd + (c % kChunks) * 8, src + (size_t)(ok ? r : 0) * K + (ok ? k : 0), ok);
    }
  };

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

  // No kernel writes the weights once they are loaded: their first stages are requested before the wait
  // on the previous kernel (PDL), so their DRAM latency hides under its tail. Commit group s then holds
  // X's stage s (group 0 these weight stages too): stage s is complete once group s is.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < num_k) load(s, s, false);
  pdl_wait();
  pdl_trigger();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_k) load(s, s, true);
    cp_async_commit();
  }
  for (int kt = 0; kt < num_k; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage kt landed for every thread; the slot refilled below was read by all last round
    if (kt + STAGES - 1 < num_k) {
      load((kt + STAGES - 1) % STAGES, kt + STAGES - 1, true);
      load((kt + STAGES - 1) % STAGES, kt + STAGES - 1, false);
    }
    cp_async_commit();
    const bf16* a = smem + (kt % STAGES) * T::kStageElems;
    const bf16* b = a + BM * T::kLd;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {  // K ascending: the one order every tile shape shares
      if (kt * BK + kk >= K) break;  // past K: every config takes exactly ceil(K / 16) steps
      uint32_t af[MT][4], bfr[NT][2];
#pragma unroll
      for (int i = 0; i < MT; ++i)
        ldmatrix_x4(af[i], a + (wm * WM + i * 16 + (lane & 15)) * T::kLd + kk + (lane >> 4) * 8);
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        uint32_t r[4];
        ldmatrix_x4(r, b + (wn * WN + j * 8 + (lane & 7) + (lane >> 4) * 8) * T::kLd + kk + ((lane >> 3) & 1) * 8);
        bfr[j][0] = r[0], bfr[j][1] = r[1], bfr[j + 1][0] = r[2], bfr[j + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) mma_bf16(acc[i][j], af[i][0], af[i][1], af[i][2], af[i][3], bfr[j][0], bfr[j][1]);
    }
  }
  cp_async_wait<0>();

  // m16n8 accumulator: this lane holds rows lane/4 and lane/4 + 8, columns 2 * (lane % 4) + {0, 1}.
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = m0 + wm * WM + i * 16 + (lane >> 2) + h * 8;
        const int n = n0 + wn * WN + j * 8 + (lane & 3) * 2;
        if (m >= M || n >= N) continue;  // N is even: a pair is in or out whole
        float v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
        const size_t o = (size_t)m * N + n;
        if (out_f32) {
          float2* y = reinterpret_cast<float2*>(static_cast<float*>(Y) + o);
          if (accumulate) v0 += y->x, v1 += y->y;
          *y = make_float2(v0, v1);
        } else {
          __nv_bfloat162* y = reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(Y) + o);
          if (accumulate) {
            const float2 old = __bfloat1622float2(*y);
            v0 += old.x, v1 += old.y;
          }
          *y = __floats2bfloat162_rn(v0, v1);
        }
      }
}

template <int BM, int BN, int BK, int WM, int WN, int STAGES>
void launch(const bf16* X, const bf16* W, void* Y, int M, int N, int K, bool accumulate, bool out_f32, cudaStream_t s) {
  using T = Tile<BM, BN, BK, WM, WN, STAGES>;
  auto* kernel = fixed_gemm_kernel<BM, BN, BK, WM, WN, STAGES>;
  static bool attr_set = false;  // per instantiation, set once from the launching thread
  if (!attr_set) {
    OI_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)T::kSmem));
    attr_set = true;
  }
  const dim3 grid((N + BN - 1) / BN, (M + BM - 1) / BM);
  // Few rows: launched early (PDL; small blocks, so the placement stays balanced), weights requested at once.
  OI_CUDA_CHECK(launch_kernel(M <= 64, kernel, grid, dim3(T::kThreads), T::kSmem, s, nullptr, X, W, Y, M, N, K,
                              accumulate, out_f32));
}

}  // namespace

int fixed_gemm_config(int M, int N) {
  static const int sms = [] {
    int dev = 0, n = 0;
    OI_CUDA_CHECK(cudaGetDevice(&dev));
    OI_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }();
  const long tiles = (long)((N + 127) / 128);
  // Many rows: 128 x 128 tiles once they fill the GPU twice over, 64 x 64 before (N = 2560 at M = 65 would
  // be 20 CTAs).
  if (M > 64) return ((M + 127) / 128) * tiles >= 2L * sms ? 3 : 2;
  // Few rows: the weights are the traffic. Narrow tiles give enough CTAs to keep every SM streaming
  // (N = 2560 at 16 columns: 160), wide ones where N allows (less re-reading of X).
  if (N >= 64 * 2 * sms) return M > 16 ? 2 : 1;
  return 0;
}

void fixed_gemm(const bf16* X, const bf16* W, void* Y, int M, int N, int K, bool accumulate, bool out_f32,
                cudaStream_t s, int config) {
  if (M == 0) return;
  OI_CHECK(K % 8 == 0 && N % 2 == 0, "fixed_gemm needs K % 8 == 0 and even N (M=" << M << " N=" << N << " K=" << K << ")");
  OI_CHECK(reinterpret_cast<uintptr_t>(X) % 16 == 0 && reinterpret_cast<uintptr_t>(W) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(Y) % (out_f32 ? 8 : 4) == 0,
           "fixed_gemm: X and W must be 16-byte aligned, Y 4 (bf16) or 8 (fp32)");
  if (config < 0) config = fixed_gemm_config(M, N);
  switch (config) {
    case 0:  // 16 columns, a warp per 16 rows of M (up to 64), 128 of K per stage, 6 or 4 stages in flight
      if (M <= 16) launch<16, 16, 128, 16, 16, 6>(X, W, Y, M, N, K, accumulate, out_f32, s);
      else launch<64, 16, 128, 16, 16, 4>(X, W, Y, M, N, K, accumulate, out_f32, s);
      break;
    case 1: launch<16, 64, 128, 16, 16, 4>(X, W, Y, M, N, K, accumulate, out_f32, s); break;
    case 2: launch<64, 64, 64, 64, 16, 4>(X, W, Y, M, N, K, accumulate, out_f32, s); break;
    case 3: launch<128, 128, 64, 64, 64, 3>(X, W, Y, M, N, K, accumulate, out_f32, s); break;
    default: OI_CHECK(false, "fixed_gemm: no config " << config);
  }
}

}  // namespace oi
