#include <cfloat>
#include <climits>

#include "hash.cuh"
#include "launch.cuh"
#include "mma.cuh"
#include "sampling.cuh"

namespace oi {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarpsPerBlock = kThreads / 32;

__device__ __forceinline__ float gumbel(uint64_t seed, int pos, int i) {
  const uint64_t h = mix64(seed * 0x9E3779B97F4A7C15ull + (uint64_t)(pos + 1) * 0xD1B54A32D192ED03ull + (uint64_t)i);
  // 23 bits + 0.5 is exact in fp32, so u < 1 always (24 bits would round the top value up to u = 1, g = inf)
  const float u = ((float)(h >> 41) + 0.5f) * 1.1920928955078125e-07f;  // 2^-23
  return -logf(-logf(u));
}

// Order-preserving map of a float to uint32 (larger float -> larger key).
__device__ __forceinline__ uint32_t fkey(float f) {
  uint32_t u = __float_as_uint(f);
  if (u == 0x80000000u) u = 0;  // -0 ties with +0, as in the reference's comparisons
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The draw's score of logit v: the reference's l = v / t, then + g, each rounded as NumPy rounds it
// (a multiply by 1/t, or an FMA, differs in the last bit and can flip a near-tie).
__device__ __forceinline__ float score(float v, float temp, uint64_t seed, int pos, int i) {
  return __fadd_rn(__fdiv_rn(v, temp), gumbel(seed, pos, i));
}

struct ArgMax {
  float v;
  int i;
};
__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
  return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

__device__ ArgMax block_argmax(ArgMax x, ArgMax* red) {
  for (int o = 16; o > 0; o >>= 1) {
    ArgMax y{__shfl_xor_sync(0xffffffffu, x.v, o), __shfl_xor_sync(0xffffffffu, x.i, o)};
    x = better(x, y);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) red[warp] = x;
  __syncthreads();
  x = red[lane];  // kThreads / 32 == 32 warps
  for (int o = 16; o > 0; o >>= 1) {
    ArgMax y{__shfl_xor_sync(0xffffffffu, x.v, o), __shfl_xor_sync(0xffffffffu, x.i, o)};
    x = better(x, y);
  }
  return x;
}

__device__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = red[lane];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Radix select over float keys, 8 bits a pass, over n values get(0..n-1). By count (kth largest key)
// or by mass (largest key K such that the weights of keys >= K reach `target`). Only keys >= floor_key
// take part. Each warp counts into its own histogram, the lanes of one bin adding once, with no
// atomics (logits crowd into a few bins of the top bytes: one block-wide histogram serialized ~150k
// atomics on them, ~1.2 ms per batch-1 step at the releases' defaults); the warps' histograms are then
// summed in order, so the result does not depend on timing.
template <bool kMass, class Get>
__device__ uint32_t radix_select(Get get, int n, uint32_t floor_key, float target, float mx, float inv_t,
                                 float (*whist)[256], float* hist, uint32_t* shared_prefix, float* shared_rem) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint32_t prefix = 0, mask = 0;
  float rem = target;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (unsigned b = threadIdx.x; b < kWarpsPerBlock * 256u; b += kThreads) (&whist[0][0])[b] = 0.f;
    __syncthreads();
    for (int i0 = warp * 32; i0 < n; i0 += kThreads) {  // whole warps per round, for the match below
      const int i = i0 + lane;
      const float v = i < n ? get(i) : 0.f;
      const uint32_t k = fkey(v);
      const bool in = i < n && (k & mask) == prefix && k >= floor_key;
      const uint32_t bin = in ? (k >> shift) & 255u : 256u;
      const uint32_t same = __match_any_sync(0xffffffffu, bin);
      float add;
      if constexpr (kMass) {  // the group's weights, summed in lane order (a float atomic is a retry loop)
        const float w = in ? __expf((v - mx) * inv_t) : 0.f;
        add = 0.f;
        for (int j = 0; j < 32; ++j) {
          const float x = __shfl_sync(0xffffffffu, w, j);
          if ((same >> j) & 1u) add += x;
        }
      } else {
        add = (float)__popc(same);
      }
      if (in && lane == __ffs(same) - 1) whist[warp][bin] += add;
      __syncwarp();  // orders this round's histogram updates before the next round's
    }
    __syncthreads();
    for (int b = threadIdx.x; b < 256; b += kThreads) {
      float t = 0.f;
#pragma unroll 8
      for (int w = 0; w < kWarpsPerBlock; ++w) t += whist[w][b];
      hist[b] = t;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float acc = 0.f;
      int chosen = -1, lowest = 0;
      for (int b = 255; b >= 0; --b) {
        if (hist[b] > 0.f) lowest = b;
        if (hist[b] > 0.f && acc + hist[b] >= rem) {
          chosen = b;
          break;
        }
        acc += hist[b];
      }
      if (chosen < 0) chosen = lowest;  // rounding left the target unreached: keep everything left
      else rem -= acc;
      *shared_prefix = prefix | ((uint32_t)chosen << shift);
      *shared_rem = rem;
    }
    __syncthreads();
    prefix = *shared_prefix;
    rem = *shared_rem;
    mask |= 255u << shift;
  }
  return prefix;
}

// Top-p and the draw over the tokens kept so far (keys >= floor_key) among n of them: value get(j),
// token id id(j). Returns the drawn token.
template <class Get, class Id>
__device__ int nucleus_draw(Get get, Id id, int n, uint32_t floor_key, float p, float mx, float inv_t, float temp,
                            uint64_t seed, int pos, ArgMax* red, float* fred, float (*whist)[256], float* hist,
                            uint32_t* sprefix, float* srem) {
  if (p < 1.f) {
    float z = 0.f;
    for (int j = threadIdx.x; j < n; j += kThreads) {
      const float v = get(j);
      if (fkey(v) >= floor_key) z += __expf((v - mx) * inv_t);
    }
    z = block_sum(z, fred);
    floor_key = radix_select<true>(get, n, floor_key, p * z, mx, inv_t, whist, hist, sprefix, srem);
  }
  ArgMax draw{-INFINITY, 0x7fffffff};
  for (int j = threadIdx.x; j < n; j += kThreads) {
    const float v = get(j);
    const int i = id(j);
    if (fkey(v) >= floor_key) draw = better(draw, ArgMax{score(v, temp, seed, pos, i), i});
  }
  return block_argmax(draw, red).i;
}

// A logit and its id as one sortable key: larger logit first, then lower id.
__device__ __forceinline__ uint64_t pack(uint32_t k, int i) { return (uint64_t)k << 32 | ~(uint32_t)i; }
__device__ __forceinline__ float unkey(uint64_t key) {
  const uint32_t k = (uint32_t)(key >> 32);
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ int key_id(uint64_t key) { return (int)~(uint32_t)key; }

// The k-th largest of the block's keys, one per thread (1 <= k <= kThreads): bit by bit from the top,
// the largest x with at least k keys >= x (one counting barrier per bit).
__device__ __forceinline__ uint32_t kth_largest(uint32_t key, int k) {
  uint32_t x = 0;
  for (int b = 31; b >= 0; --b) {
    const uint32_t c = x | (1u << b);
    if (__syncthreads_count(key >= c) >= k) x = c;
  }
  return x;
}

// This thread's place among the gathered keys at or above `floor` (their logit part), largest first.
__device__ __forceinline__ int place_of(const uint64_t* key, int n, uint64_t mine, uint32_t floor) {
  int place = 0;
  for (int j = 0; j < n; ++j) {
    const uint64_t o = key[j];
    place += (uint32_t)(o >> 32) >= floor && o > mine;
  }
  return place;
}

// Inclusive prefix sum over the block, in thread order.
__device__ __forceinline__ float block_scan(float v, float* red) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int o = 1; o < 32; o <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  __syncthreads();
  if (lane == 31) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = red[lane];
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    red[lane] = s;
  }
  __syncthreads();
  return warp > 0 ? v + red[warp - 1] : v;
}

// Calls f(v, i) for this thread's elements of a row, in increasing i, with kRowLoads 16-byte loads in
// flight per thread. One block reads a row of 152k logits: with one scalar load at a time per thread the
// pass was latency-bound (the greedy sampler added 40 us to a 4B batch-1 step, 18 us now). Rows not
// 16-byte aligned or sized take scalar loads.
constexpr int kRowLoads = 8;
template <typename F>
__device__ __forceinline__ void for_row(const float* l, int V, F&& f) {
  if ((V & 3) != 0 || (reinterpret_cast<uintptr_t>(l) & 15) != 0) {
    for (int i = threadIdx.x; i < V; i += kThreads) f(l[i], i);
    return;
  }
  const float4* l4 = reinterpret_cast<const float4*>(l);
  const int V4 = V >> 2;
  for (int j0 = threadIdx.x; j0 < V4; j0 += kRowLoads * kThreads) {
    float4 v[kRowLoads];
#pragma unroll
    for (int u = 0; u < kRowLoads; ++u) {
      const int j = j0 + u * kThreads;
      v[u] = j < V4 ? l4[j] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kRowLoads; ++u) {
      const int j = j0 + u * kThreads;
      if (j >= V4) break;
      f(v[u].x, 4 * j);
      f(v[u].y, 4 * j + 1);
      f(v[u].z, 4 * j + 2);
      f(v[u].w, 4 * j + 3);
    }
  }
}

// Gathers the logits at or above the rank-th largest of the threads' maxima (rank <= kThreads): at
// least `rank` of them, and every logit that can be among the top `rank`. Into key[] in no particular
// order; returns how many, or -1 when more than kThreads tie or crowd above the pivot. With kSum, also
// the sum of exp((v - mx) * inv_t) over the whole row into *z.
template <bool kSum>
__device__ __forceinline__ int gather_top(const float* l, int V, float thread_max, int rank, uint64_t* key, int* count,
                                          float* red, float mx, float inv_t, float* z) {
  const uint32_t pivot = kth_largest(fkey(thread_max), rank);
  if (threadIdx.x == 0) *count = 0;
  __syncthreads();
  float sum = 0.f;
  for_row(l, V, [&](float v, int i) {
    const uint32_t k = fkey(v);
    if (k >= pivot) {
      const int c = atomicAdd(count, 1);
      if (c < kThreads) key[c] = pack(k, i);
    }
    if constexpr (kSum) sum += __expf((v - mx) * inv_t);
  });
  if constexpr (kSum) *z = block_sum(sum, red);
  __syncthreads();
  const int n = *count;
  return n > kThreads ? -1 : n;
}

// Top-k over the n gathered keys (the survivors go to the front of key[], largest first), then top-p
// over them and the draw: -1 when they hold less than top_p of the row's mass (only without a top-k,
// when the nucleus is wider than the gather).
__device__ __forceinline__ int draw_from_gathered(uint64_t* key, int n, int k, float p, float z_row, float mx,
                                                  float inv_t, float temp, uint64_t seed, int pos, float* scan, int* cut,
                                                  ArgMax* red, float* fred) {
  const int t = threadIdx.x;
  const uint64_t mine = t < n ? key[t] : 0;
  const uint32_t floor = k > 0 ? kth_largest((uint32_t)(mine >> 32), k) : 0u;  // ties at the k-th are kept
  const bool kept = t < n && (uint32_t)(mine >> 32) >= floor;
  const int place = kept ? place_of(key, n, mine, floor) : 0;
  __syncthreads();
  if (kept) key[place] = mine;
  const int m = __syncthreads_count(kept);
  const bool in = t < m;
  const float v = in ? unkey(key[t]) : 0.f;
  uint32_t cut_key = floor;
  if (p < 1.f) {
    const float c = block_scan(in ? __expf((v - mx) * inv_t) : 0.f, fred);  // in sorted order, like the reference
    scan[t] = c;
    if (t == 0) *cut = INT_MAX;
    __syncthreads();
    const float target = p * (k > 0 ? scan[m - 1] : z_row);  // (the last survivor's sum: reached)
    // the first to reach it (the tree sums of neighbours may round out of order: the lowest place wins)
    if (in && c >= target) atomicMin(cut, t);
    __syncthreads();
    if (*cut == INT_MAX) return -1;
    cut_key = (uint32_t)(key[*cut] >> 32);  // ties at the cut are kept
  }
  ArgMax draw{-INFINITY, 0x7fffffff};
  if (in && (uint32_t)(key[t] >> 32) >= cut_key) {
    const int id = key_id(key[t]);
    draw = ArgMax{score(v, temp, seed, pos, id), id};
  }
  return block_argmax(draw, red).i;
}

// The sampler's shared memory (one block of kThreads per row).
struct SampleSmem {
  ArgMax red[32];
  float fred[32];
  float hist[256];
  float whist[kWarpsPerBlock][256];
  uint32_t sprefix;
  float srem;
  uint64_t key[kThreads];
  float scan[kThreads];
  int s_count, s_cut;
  float s_z;
};

// Samples row `row` of a.logits with the whole block.
__device__ void sample_row(const SampleArgs& a, int row, SampleSmem& sm) {
  ArgMax* red = sm.red;
  float* fred = sm.fred;
  float* hist = sm.hist;
  float(*whist)[256] = sm.whist;
  uint32_t& sprefix = sm.sprefix;
  float& srem = sm.srem;
  uint64_t* key = sm.key;
  float* scan = sm.scan;
  int& s_count = sm.s_count;
  int& s_cut = sm.s_cut;
  float& s_z = sm.s_z;
  const float* l = a.logits + (int64_t)row * a.vocab;
  const int V = a.vocab;

  // One pass for the argmax and the log-sum-exp: each thread keeps its sum relative to its own running
  // maximum, rescaled when the maximum moves (ties keep the first, lowest id).
  ArgMax best{-INFINITY, 0x7fffffff};
  float se = 0.f;
  for_row(l, V, [&](float v, int i) {
    if (v > best.v) {
      se = se * __expf(best.v - v) + 1.f;
      best = ArgMax{v, i};
    } else if (v > -INFINITY) {
      se += __expf(v - best.v);
    }
  });
  const float m_t = best.v;
  best = block_argmax(best, red);
  const float mx = best.v;
  const float lse = mx + logf(block_sum(m_t > -INFINITY ? se * __expf(m_t - mx) : 0.f, fred));

  int token = best.i;
  const float temp = a.temperature[row];
  if (temp > 0.f) {
    const float inv_t = 1.f / temp;
    const int k = a.top_k[row] > 0 && a.top_k[row] < V ? a.top_k[row] : 0;
    const float p = a.top_p[row];
    const uint64_t seed = a.seeds[row];
    const int pos = a.positions[row];
    auto vocab_v = [l](int i) { return l[i]; };
    auto vocab_id = [](int i) { return i; };
    // Usually the survivors are few: gather the logits above a pivot from the threads' maxima, rank them
    // and cut there (two passes over the row). Without a top-k the pivot is the 256th maximum, enough
    // when the nucleus is narrow.
    token = -1;
    if (k > 0 ? k <= kThreads : p < 1.f) {
      const int n = k > 0 ? gather_top<false>(l, V, m_t, k, key, &s_count, fred, mx, inv_t, &s_z)
                          : gather_top<true>(l, V, m_t, 256, key, &s_count, fred, mx, inv_t, &s_z);
      if (n >= 0) token = draw_from_gathered(key, n, k, p, s_z, mx, inv_t, temp, seed, pos, scan, &s_cut, red, fred);
    }
    if (token < 0) {  // radix selects over the whole row: many ties, a large top-k, a wide nucleus, or neither
      const uint32_t floor_key =
          k > 0 ? radix_select<false>(vocab_v, V, 0, (float)k, mx, inv_t, whist, hist, &sprefix, &srem) : 0u;
      token = nucleus_draw(vocab_v, vocab_id, V, floor_key, p, mx, inv_t, temp, seed, pos, red, fred, whist, hist,
                           &sprefix, &srem);
    }
  }
  if (token < 0 || token >= V) token = 0;  // a row of -inf or NaN only: no maximum (the reference's argmax: 0)
  if (threadIdx.x == 0) {
    a.tokens[row] = token;
    a.logprobs[row] = l[token] - lse;
  }
  if (a.num_logprobs == 0) return;
  // Top-N by (logit desc, id asc): the gathered keys in order; past the gather, N passes.
  const int n = gather_top<false>(l, V, m_t, a.num_logprobs, key, &s_count, fred, 0.f, 0.f, &s_z);
  if (n >= 0) {
    if (threadIdx.x < n) {
      const uint64_t mine = key[threadIdx.x];
      const int place = place_of(key, n, mine, 0u);
      if (place < a.num_logprobs) {
        a.top_ids[(int64_t)row * a.num_logprobs + place] = key_id(mine);
        a.top_logprobs[(int64_t)row * a.num_logprobs + place] = unkey(mine) - lse;
      }
    }
    return;
  }
  ArgMax prev{INFINITY, -1};
  for (int r = 0; r < a.num_logprobs; ++r) {
    ArgMax c{-INFINITY, 0x7fffffff};
    for_row(l, V, [&](float v, int i) {
      if (v < prev.v || (v == prev.v && i > prev.i)) c = better(c, ArgMax{v, i});
    });
    c = block_argmax(c, red);
    if (threadIdx.x == 0) {
      a.top_ids[(int64_t)row * a.num_logprobs + r] = c.i;
      a.top_logprobs[(int64_t)row * a.num_logprobs + r] = c.v - lse;
    }
    prev = c;
  }
}

__global__ void __launch_bounds__(kThreads, 1) sample_kernel(SampleArgs a) {
  __shared__ SampleSmem sm;
  pdl_wait();  // the logits come from the lm_head
  pdl_trigger();
  sample_row(a, blockIdx.x, sm);
}

}  // namespace

void sample(const SampleArgs& a, cudaStream_t s) {
  OI_CHECK(a.num_logprobs >= 0 && a.num_logprobs <= kMaxLogprobs,
           "sample: num_logprobs " << a.num_logprobs << " outside 0.." << kMaxLogprobs);
  if (a.num_rows == 0) return;
  OI_CUDA_CHECK(launch_kernel(true, sample_kernel, dim3(a.num_rows), dim3(kThreads), 0, s, nullptr, a));
}

namespace {
__global__ void count_accepted_kernel(const int32_t* ids, const int32_t* sample_idx, const int32_t* tokens,
                                      const int32_t* seq_rows, int B, int32_t* accepted) {
  pdl_wait();
  pdl_trigger();
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= B) return;
  const int r0 = seq_rows[b], r1 = seq_rows[b + 1];
  int n = r1 > r0 ? 1 : 0;  // the first sampled row's token is always kept (the bonus when nothing matches)
  while (r0 + n < r1 && tokens[r0 + n - 1] == ids[sample_idx[r0 + n - 1] + 1]) ++n;
  accepted[b] = n;
}
}  // namespace

void count_accepted(const int32_t* ids, const int32_t* sample_idx, const int32_t* tokens, const int32_t* seq_rows,
                    int B, int32_t* accepted, cudaStream_t s) {
  if (B <= 0) return;
  OI_CUDA_CHECK(launch_kernel(true, count_accepted_kernel, dim3((B + 127) / 128), dim3(128), 0, s, nullptr, ids,
                              sample_idx, tokens, seq_rows, B, accepted));
}

namespace {

constexpr int kMarkovSeg = 32;  // rank elements per 16-byte lane load of a W2 row (a lane's MMA fragments)

// Grid-wide barrier for a grid whose blocks are all resident (one per SM at most): the last block to
// arrive resets the count and moves the generation on; the others wait for it to move.
__device__ __forceinline__ void grid_sync(unsigned* count, unsigned* gen) {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned g;
    asm volatile("ld.relaxed.gpu.u32 %0, [%1];" : "=r"(g) : "l"(gen) : "memory");  // before arriving: cannot move yet
    __threadfence();
    if (atomicAdd(count, 1u) == gridDim.x - 1) {
      atomicExch(count, 0u);
      __threadfence();
      atomicAdd(gen, 1u);
    } else {
      unsigned now;
      do asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(now) : "l"(gen) : "memory");
      while (now == g);
    }
    __threadfence();
  }
  __syncthreads();
}

// The Markov head's pass over a chunk of D drafting sequences, slot by slot in one launch: slot j's logits
// (the lm_head's, slot-major rows j * D + d) += W2 · W1[token before it], then the slot is sampled. Phase
// A: every block adds the term over its share of the vocabulary (16 W2 rows per warp tile, W2 as the MMA's
// A operand with K permuted so that a lane's 16-byte load of a row is its fragment, W1's D rows as B)
// and keeps each row's greedy maximum; phase B: greedy rows take the maximum of the blocks' maxima,
// every block alike; other rows are drawn by sample_row, one block per row, then a second barrier.
// The logits are updated in place, so a sampled row sees exactly what sample() would.
template <int NT>  // 8-sequence MMA tiles: D <= 8 * NT
__global__ void __launch_bounds__(kThreads, 1) markov_kernel(MarkovArgs a) {
  __shared__ union {
    struct {
      uint4 u[NT * 8][kMaxMarkovRank / 8];  // W1 rows of the tokens before this slot
      ArgMax part[kWarpsPerBlock][NT * 8];
    } p;
    SampleSmem sm;
  } sh;
  __shared__ int s_tok[NT * 8];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int D = a.D, V = a.V, R = a.R, segs = R / kMarkovSeg;
  pdl_wait();  // the logits come from the lm_head
  if (threadIdx.x < D) s_tok[threadIdx.x] = a.anchors[threadIdx.x];
  // Any sampled row in any slot (the engine's rows of a sequence share its temperature; the kernel does not
  // rely on it): the same answer in every block, so every block takes the second barrier or none does.
  int any = 0;
  for (int r = threadIdx.x; r < a.num_drafts * D; r += kThreads) any |= a.temperature[r] > 0.f;
  const bool sampled = __syncthreads_or(any);
  const int tiles = (V + 15) / 16, gwarps = gridDim.x * kWarpsPerBlock;
  for (int j = 0; j < a.num_drafts; ++j) {
    float* logits = a.logits + (int64_t)j * D * V;
    for (int i = threadIdx.x; i < NT * 8 * (R / 8); i += kThreads) {
      const int d = i / (R / 8), c = i % (R / 8);
      sh.p.u[d][c] = d < D ? reinterpret_cast<const uint4*>(a.w1 + (int64_t)s_tok[d] * R)[c] : make_uint4(0, 0, 0, 0);
    }
    __syncthreads();
    // Phase A. best[n][e]: this lane's maximum for sequence n * 8 + 2t + e (lowest id among ties).
    ArgMax best[NT][2];
#pragma unroll
    for (int n = 0; n < NT; ++n) best[n][0] = best[n][1] = ArgMax{-INFINITY, 0x7fffffff};
    for (int tile = blockIdx.x * kWarpsPerBlock + warp; tile < tiles; tile += gwarps) {
      const int v0 = tile * 16 + g, v1 = v0 + 8;
      const uint4* r0 = reinterpret_cast<const uint4*>(a.w2 + (int64_t)min(v0, V - 1) * R) + t;
      const uint4* r1 = reinterpret_cast<const uint4*>(a.w2 + (int64_t)min(v1, V - 1) * R) + t;
      float acc[NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
      // Software-pipelined two segments deep: segments sg + 1 and sg + 2 are in flight (64 B a lane, 64 KB an
      // SM) while segment sg's MMAs run. The loop stays rolled: unrolled (as first written) the compiler ran
      // loads further ahead and spilled the tile loop's state, 64 registers being the cap at 1024 threads.
      uint4 x0 = __ldg(r0), y0 = __ldg(r1), x1 = __ldg(r0 + 4), y1 = __ldg(r1 + 4);  // segs >= 2 (R >= 64)
#pragma unroll 1
      for (int sg = 0; sg < segs; ++sg) {
        uint4 x2 = x1, y2 = y1;
        if (sg + 2 < segs) x2 = __ldg(r0 + (sg + 2) * 4), y2 = __ldg(r1 + (sg + 2) * 4);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const uint4 u = sh.p.u[n * 8 + g][sg * 4 + t];
          mma_bf16(acc[n], x0.x, y0.x, x0.y, y0.y, u.x, u.y);
          mma_bf16(acc[n], x0.z, y0.z, x0.w, y0.w, u.z, u.w);
        }
        x0 = x1, y0 = y1, x1 = x2, y1 = y2;
      }
      // acc[n]: rows v0 (0, 1) and v1 (2, 3), sequences n * 8 + 2t (0, 2) and + 1 (1, 3)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int d = n * 8 + 2 * t + e;
          if (d >= D) continue;
          // through L2 only: another block's sample_row reads these lines next (no stale L1 copies)
          float* row = logits + d * V;  // (int: d < 16)
          if (v0 < V) {
            const float l = __ldcg(row + v0) + acc[n][e];
            __stcg(row + v0, l);
            if (l > best[n][e].v) best[n][e] = ArgMax{l, v0};
          }
          if (v1 < V) {
            const float l = __ldcg(row + v1) + acc[n][2 + e];
            __stcg(row + v1, l);
            if (l > best[n][e].v) best[n][e] = ArgMax{l, v1};
          }
        }
    }
    // The block's maximum per sequence, then the grid's partials.
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        ArgMax x = best[n][e];
        for (int o = 4; o < 32; o <<= 1)
          x = better(x, ArgMax{__shfl_xor_sync(0xffffffffu, x.v, o), __shfl_xor_sync(0xffffffffu, x.i, o)});
        if (g == 0) sh.p.part[warp][n * 8 + 2 * t + e] = x;
      }
    __syncthreads();
    // Two buffers by slot parity: a block can be one slot ahead of another still reading the partials.
    float2* part = a.part + (int64_t)(j & 1) * gridDim.x * D;
    if (threadIdx.x < D) {
      ArgMax x{-INFINITY, 0x7fffffff};
      for (int w = 0; w < kWarpsPerBlock; ++w) x = better(x, sh.p.part[w][threadIdx.x]);
      part[(int64_t)blockIdx.x * D + threadIdx.x] = make_float2(x.v, __int_as_float(x.i));
    }
    grid_sync(a.sync, a.sync + 1);
    // Phase B: warp d reduces sequence d's partials across its lanes (one thread's serial pass over
    // gridDim.x of them sat behind every barrier). better() is a total order on the partials (no NaN: a
    // lane keeps only l > best), so the maximum, and the token, is the same in every block in any order.
    if (warp < D) {
      ArgMax x{-INFINITY, 0x7fffffff};
      for (int b = lane; b < (int)gridDim.x; b += 32) {
        const float2 p = __ldcg(part + (int64_t)b * D + warp);
        x = better(x, ArgMax{p.x, __float_as_int(p.y)});
      }
      for (int o = 16; o > 0; o >>= 1)
        x = better(x, ArgMax{__shfl_xor_sync(0xffffffffu, x.v, o), __shfl_xor_sync(0xffffffffu, x.i, o)});
      if (lane == 0) {
        const int tok = x.i >= 0 && x.i < V ? x.i : 0;  // a row of -inf or NaN only: 0, as sample()
        s_tok[warp] = tok;
        const int r = j * D + warp;
        if (blockIdx.x == 0 && !(sampled && a.temperature[r] > 0.f)) {
          a.tokens[r] = tok;
          a.logprobs[r] = 0.f;  // (drafts need no log-probability)
        }
      }
    }
    if (sampled) {
      __syncthreads();  // phase B's s_tok writes (lane 0 of warp d) before thread d's below
      SampleArgs sa{};
      sa.logits = a.logits;
      sa.vocab = V;
      sa.temperature = a.temperature;
      sa.top_p = a.top_p;
      sa.top_k = a.top_k;
      sa.seeds = a.seeds;
      sa.positions = a.positions;
      sa.tokens = a.tokens;
      sa.logprobs = a.logprobs;
      for (int d = blockIdx.x; d < D; d += gridDim.x)
        if (a.temperature[j * D + d] > 0.f) sample_row(sa, j * D + d, sh.sm);
      grid_sync(a.sync, a.sync + 1);
      if (threadIdx.x < D && a.temperature[j * D + threadIdx.x] > 0.f) s_tok[threadIdx.x] = __ldcg(a.tokens + j * D + threadIdx.x);
    }
    __syncthreads();
  }
  pdl_trigger();  // at the end: the grid's blocks must all stay resident until the last barrier
}

}  // namespace

bool markov_sample(const MarkovArgs& a, int num_sms, cudaStream_t s) {
  if (a.D < 1 || a.D > kMaxMarkovSeqs || a.R < 2 * kMarkovSeg || a.R % (2 * kMarkovSeg) != 0 || a.R > kMaxMarkovRank ||
      a.num_drafts < 1)
    return false;
  const dim3 grid(num_sms), block(kThreads);  // one block per SM (64 registers x 1024 threads fill one)
  // The grid barriers need every block resident at once, which a plain launch does not promise: two such
  // grids on two streams (two engines) can each take part of the SMs and wait on each other's spinning
  // blocks for ever. Cooperative (as persistent.cu): all blocks scheduled together, or a launch error.
  cudaLaunchAttribute coop{};
  coop.id = cudaLaunchAttributeCooperative;
  coop.val.cooperative = 1;
  if (a.D <= 8) OI_CUDA_CHECK(launch_kernel(false, markov_kernel<1>, grid, block, 0, s, &coop, a));
  else OI_CUDA_CHECK(launch_kernel(false, markov_kernel<2>, grid, block, 0, s, &coop, a));
  return true;
}

}  // namespace oi
