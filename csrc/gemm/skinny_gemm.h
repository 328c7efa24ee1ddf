// skinny_gemm (skinny_gemm.cu): Y[M, N] = X[M, K] · W[N, K]^T (+ Y) for 1-64 rows on Hopper (sm_90a), bf16 in, fp32
// accumulate. Decode, speculative verify and prefix-hit tail steps are pure weight streams: the tensor copy engine
// (TMA) brings 128 weight rows x 64 of K per stage into a shared-memory ring, one warpgroup multiplies them by the
// input rows with wgmma, and K is split so that every shape fills the SMs; the splits of an output tile form a
// thread-block cluster and add their sums through distributed shared memory in split order (deterministic; no
// workspace, no counters, nothing to reset between launches or graph replays).
#pragma once
#include "../common.h"

namespace oi {

constexpr int kSkinnyMaxRows = 64;
constexpr int kSkinnyMaxSplits = 8;  // a portable cluster

// Launches Y = X·Wᵀ and returns true, or returns false having launched nothing for what it does not take: M outside
// 1..64, N or K below 64 or not a multiple of 8, a pointer not 16-byte aligned, silu_up with accumulate or out_f32, a
// device other than compute capability 9.0. X is [M, K], W [N, K], Y [M, N] (fp32 with out_f32), all contiguous.
//  - accumulate: Y += X·Wᵀ (the residual add), summed in fp32 and rounded once;
//  - silu_up: W is [gate; up] (N = 2I rows) and Y is [M, I] = SiLU(gate)·up with gate and up each rounded to bf16
//    first, as gemv.cu's fused epilogue and silu_mul after a bf16 GEMM do;
//  - splits: the K splits per output tile (0: the launch rule, skinny_gemm_splits; tests force 1-8).
// Launched with programmatic dependent launch: the first weight stages are requested before the wait on the previous
// kernel, X and Y are touched only after it.
// Tensor maps (TMA descriptors) are encoded on the host and cached per (pointer, shape); the first call for a pointer
// and shape must run outside stream capture (a miss during capture fails with a message that says so): the engine's
// warm-up forward before each capture, and the harnesses' first uncaptured run, make them. A captured graph keeps the
// maps by value in its kernel nodes and stays valid as long as the buffers do.
bool skinny_gemm(const bf16* X, const bf16* W, void* Y, int M, int N, int K, bool accumulate, bool out_f32,
                 cudaStream_t s, bool silu_up = false, int splits = 0);

// The K splits a call of this shape launches (the rule, or the forced count as the launcher clamps it; 0 where the
// shape is refused). For tests and benchmarks.
int skinny_gemm_splits(int M, int N, int K, bool silu_up = false, int splits = 0);

// The batch-invariant mode (--deterministic; in place of fixed_gemm.h where it takes the shape): Y = X·Wᵀ for any M
// >= 1 whose rows' bits do not depend on M, on a row's place in X or on the other rows. Rows go in chunks of 64, each
// chunk through the same kernel as a 64-row plain call (wgmma N = 64 whatever the number of real rows, input rows
// past M zero-filled by the copy engine, only real rows stored), and the split count is skinny_gemm_invariant_splits
// (N, K), never a function of M. So every output element is the same sequence of wgmma k16 steps over the same K
// ranges, then the same in-order sum of the splits and the same epilogue, whatever M is. Assumed of the hardware, and
// checked by tests/test_gpu_det_skinny.py: a wgmma output column depends only on its own B column (the row's input),
// and not on where that column sits among the 64. Epilogues and refusals as skinny_gemm's, except that any M >= 1 is
// taken, and whether a shape is taken never depends on M (a refused shape goes elsewhere at every M).
// From 65 rows a block takes 2 or 4 chunks (chunks_per_block: 0 the rule, skinny_gemm_invariant_chunks; 1, 2 or 4
// forced, for tests and A/B), one multiplying warpgroup each, sharing every weight stage in shared memory: each
// warpgroup issues the single-chunk block's wgmma sequence for its own 64 rows and its rows go through the same split
// sum and epilogue, so the bits are those of one chunk per block (tests/test_gpu_det_skinny.py compares them); only
// the L2 traffic changes (the weights are read by a tile's ceil(chunks / 2 or 4) blocks, not by each chunk).
bool skinny_gemm_invariant(const bf16* X, const bf16* W, void* Y, int M, int N, int K, bool accumulate, bool out_f32,
                           cudaStream_t s, bool silu_up = false, int chunks_per_block = 0);
// The row chunks per block a call of this shape launches (chunks_per_block: 0 the rule, or the forced 1, 2 or 4; 1
// where the device cannot hold the split cluster at the larger block), 0 where the shape is refused.
int skinny_gemm_invariant_chunks(int M, int N, int K, bool silu_up = false, int chunks_per_block = 0);
// Its K splits for this shape (0 where refused): the smallest power of two with tiles x S >= 132, at most 8 and at
// most the K blocks; a function of (N, K) alone.
int skinny_gemm_invariant_splits(int N, int K, bool silu_up = false);

// The engine's GEMMs of 3 to this many rows come here (fewer go to gemv.cu): in a graph of a 4B step's GEMMs it is
// 10-13% faster than cuBLASLt at 4-32 rows and 2% slower at 64 (H100, bench/results/experiments_h100_2026-12-07).
constexpr int kSkinnyEngineRows = 32;

}  // namespace oi
