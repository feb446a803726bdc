// The tensor-core matvec's weight stream in isolation (no megakernel, no dependency waits):
// 132 CTAs x 256 threads, each CTA computes its tile of nrows x K bf16 weights times NB = 8 NT
// bf16 activation rows (mma.sync m16n8k16, NT n-tiles; NT = PROBE_NT, 4 by default: batch 32;
// -DPROBE_NT=16: batch 128), for L layers back to back (layers rotate through more than L2
// holds). Prints per-layer us and weight TB/s per variant:
//   0 megakernel: weights in registers, one group of U k blocks ahead (mk_mma.cuh: U = 4 below
//     NT 8, else 2), the activations cp.async'd per KC-column chunk into two buffers, one
//     barrier per chunk
//   1 the same with 2 U
//   2 the same without the activation copies (B from one fixed chunk): their L2 traffic's cost
//   3 the weight loads alone (no MMA, no activations): the access pattern's ceiling
//   4 a per-thread cp.async ring of weights, D groups of U = 2 in flight, then the MMAs read them
//   5 a block ring of weights: S stages of 64 rows x 128 columns, one warp issuing bulk copies
//     (cp.async.bulk, mbarrier completion), every warp reading its rows from shared memory
//   6 variant 0 with three activation chunk buffers (two chunks in flight instead of one)
//   7 the activation copies alone, two buffers (one chunk in flight, as in variant 0)
//   8 the activation copies alone, three buffers
//   9 the megakernel's own matvec_mma_nt (mk_mma.cuh), its knobs as built (e.g. -DMMA_MT=1 -DMMA_XD=2)
//     ... time the kernel's code itself (its fixed-order K-part sums, its epilogue into shared
//     memory), so a knob can be measured here before the megakernel's sweep
// Variants 7 and 8 also run on fewer CTAs (66, 33): whether an SM's copies are limited by its
// own bytes in flight (same time per CTA) or by L2 as a whole (faster with fewer CTAs).
// Variants 4 and 5 run at NT 4 only (their rings and NT 16's chunk buffers exceed shared memory).
// Every variant that computes is checked against float64 sums of sampled outputs (last layer),
// relative to sum |w x|; its largest difference from variant 0's outputs is printed too.
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a [-DPROBE_NT=16] -o /tmp/mma_probe bench/mma_probe.cu
//   /tmp/mma_probe [layers]
// The megakernel's own pieces: its loads, copies and mma.sync wrapper, so variant 0 checks and
// times that code, not a copy of it. (Variants with wgmma, A from registers and B from shared
// memory, ran 1.5x (batch 32) to 2x (batch 128) slower than variant 0, with one group in flight
// or two: bench/NOTES.md, eleventh session; removed with the kernel's MK_WGMMA.)
#include "../tpmk/kernels/csrc/mk_mma.cuh"
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <algorithm>

#ifndef PROBE_NT
#define PROBE_NT 4
#endif
// Variants 0-8: the two-buffer chunk (mma_kc2), as the megakernel had before MMA_XD 4; variant 9
// takes the kernel's own (mma_kc).
constexpr int NT = PROBE_NT, NB = NT * 8, NTH = NTHREADS, NW = NWARPS, KC = mma_kc2<NT>(), XS = KC + 32, NKB = KC / 32;
constexpr int U0 = NT >= 8 ? MMA_U_BIG : MMA_U_SMALL;   // the megakernel's k blocks per load group
static_assert(NTH == 256, "the megakernel's geometry");
constexpr int XWORDS = NB * XS / 2;                  // one activation chunk buffer, f32 words
constexpr int RING_K = 128, RING_ROWS = 64, RING_STRIDE = RING_K + 32;   // mode 5 stage, bf16
constexpr int RING_S = 4;                            // mode 5 stages
constexpr int TRING_U = 2, TRING_D = 5;              // mode 4: groups of U k blocks, D in flight

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned long long* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned parity) {   // bounded: traps
  unsigned ok, spins = 0;
  do
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(ok) : "r"(smem_addr(b)), "r"(parity) : "memory");
  while (!ok && ++spins < (1u << 26));
  if (!ok) __trap();   // a ring that never fills: the launch fails and main() reports it
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// One k block (32 columns, permuted: lane t holds k 8t..8t+7 of rows g and g + 8) times the
// chunk's activations at block kb.
__device__ __forceinline__ void mma_kblock(float (&acc)[NT][4], const uint4& a, const uint4& b,
                                           const __nv_bfloat16* xc, int kb, int g, int t) {
#pragma unroll
  for (int n = 0; n < NT; n++) {
    const uint4 bx = *reinterpret_cast<const uint4*>(xc + (n * 8 + g) * XS + kb * 32 + 8 * t);
    mma_bf16(acc[n], a.x, b.x, a.y, b.y, bx.x, bx.y);
    mma_bf16(acc[n], a.z, b.z, a.w, b.w, bx.z, bx.w);
  }
}

// Chunk c's activations (32 rows x KC) into buf: 16 bytes per cp.async, one group.
__device__ __forceinline__ void stage_x(const __nv_bfloat16* x, int K, int c, __nv_bfloat16* buf) {
  for (int i = threadIdx.x; i < NB * KC / 8; i += NTH) {
    const int r = i / (KC / 8), kk = i % (KC / 8) * 8;
    cp_async16(buf + r * XS + kk, x + (size_t)r * K + c * KC + kk);
  }
  cp_async_commit();
}

__host__ __device__ constexpr int xbufs(int mode) { return mode == 6 || mode == 8 ? 3 : 2; }
__device__ KernelArgs probe_args;   // variant 9's (zero: no profile, no norm)

template <int MODE>
__global__ void __launch_bounds__(NTH, 1)
probe(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ x, float* y, int K, int nrows,
      int layers, size_t layer_stride, unsigned* bar) {
  extern __shared__ __align__(128) float sm[];
  __nv_bfloat16* xbuf = reinterpret_cast<__nv_bfloat16*>(sm);                    // XD chunk buffers
  __nv_bfloat16* ring = reinterpret_cast<__nv_bfloat16*>(sm + 2 * XWORDS);       // mode 4 / 5
  __shared__ unsigned long long full[RING_S], empty[RING_S];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int mtiles = (nrows + 15) / 16, ks = NW / mtiles, mt = warp / ks, kp = warp % ks;
  const bool active = mt < mtiles;
  const int nchunks = K / KC;
  if (MODE == 5 && threadIdx.x == 0) {
    for (int s = 0; s < RING_S; s++) { mbar_init(&full[s], 1); mbar_init(&empty[s], NW); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (MODE == 2) {   // one fixed chunk of activations for every k
    stage_x(x, K, 0, xbuf);
    cp_async_wait<0>();
  }
  __syncthreads();
  unsigned ring_it = 0;   // mode 5: stages consumed so far (all layers), for slots and parities
  unsigned sink = 0;
  for (int l = 0; l < layers; l++) {
    const __nv_bfloat16* W = w + l * layer_stride + (size_t)blockIdx.x * nrows * K;
    if (bar) {   // every CTA starts layer l together, as after a dependency wait
      __syncthreads();
      if (threadIdx.x == 0) {
        atomicAdd(bar, 1u);
        unsigned v;
        long long spins = 0;
        do asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(bar));
        while (v < (l + 1) * gridDim.x && ++spins < 100000000ll);
        if (v < (l + 1) * gridDim.x) atomicExch(bar + 1, 1u);
      }
      __syncthreads();
    }
    const __nv_bfloat16* wa = W + (size_t)min(mt * 16 + g, nrows - 1) * K;
    const __nv_bfloat16* wb = W + (size_t)min(mt * 16 + g + 8, nrows - 1) * K;
    float acc[NT][4] = {};
    if (MODE <= 3 || (MODE >= 6 && MODE <= 8)) {
      constexpr int U = MODE == 1 ? 2 * U0 : U0, XD = xbufs(MODE);
      constexpr bool LOADS = MODE <= 3 || MODE == 6, MMAS = MODE <= 2 || MODE == 6, COPIES = MODE <= 1 || MODE >= 6;
      const int groups = (NKB + ks * U - 1) / (ks * U), ngroups = nchunks * groups;
      auto load_group = [&](int gi, uint4 (&ua)[U], uint4 (&ub)[U]) {
        const int kc0 = gi / groups * KC, kb0 = kp + gi % groups * U * ks;
#pragma unroll
        for (int u = 0; u < U; u++) {
          const int kb = kb0 + u * ks;
          const bool ok = LOADS && active && gi < ngroups && kb < NKB;
          ua[u] = ok ? ldg_w<true>(wa + kc0 + kb * 32 + 8 * t) : make_uint4(0, 0, 0, 0);
          ub[u] = ok ? ldg_w<true>(wb + kc0 + kb * 32 + 8 * t) : make_uint4(0, 0, 0, 0);
        }
      };
      uint4 ca[U], cb[U];
      load_group(0, ca, cb);
      if (COPIES)
        for (int c = 0; c < XD - 1 && c < nchunks; c++) stage_x(x, K, c, xbuf + c * NB * XS);
      for (int c = 0; c < nchunks; c++) {
        if (COPIES || MODE == 2) {
          if (XD == 3 && c + 1 < nchunks) cp_async_wait<1>();   // chunk c + 1 may stay in flight
          else cp_async_wait<0>();
          __syncthreads();
        }
        if (COPIES && c + XD - 1 < nchunks) stage_x(x, K, c + XD - 1, xbuf + (c + XD - 1) % XD * NB * XS);
        const __nv_bfloat16* xc = MODE == 2 ? xbuf : xbuf + c % XD * NB * XS;
        for (int gc = 0; gc < groups; gc++) {
          uint4 na[U], nb[U];
          load_group(c * groups + gc + 1, na, nb);
          if (active) {
#pragma unroll
            for (int u = 0; u < U; u++) {
              const int kb = kp + (gc * U + u) * ks;
              if (kb < NKB) {
                if (MODE == 3) sink ^= ca[u].x ^ cb[u].y ^ ca[u].z ^ cb[u].w;
                else if (MMAS) mma_kblock(acc, ca[u], cb[u], xc, kb, g, t);
              }
            }
          }
#pragma unroll
          for (int u = 0; u < U; u++) { ca[u] = na[u]; cb[u] = nb[u]; }
        }
      }
      if (MODE != 3) __syncthreads();
    } else if (MODE == 4) {
      // Per-thread ring: group i = k blocks kp + (i * U + u) * ks of the whole K (chunk by
      // chunk); slot i % D holds this lane's 2 U x 16 bytes.
      constexpr int U = TRING_U, D = TRING_D;
      const int groups = (NKB + ks * U - 1) / (ks * U), ngroups = nchunks * groups;
      uint4* slot0 = reinterpret_cast<uint4*>(ring) + threadIdx.x * 2 * U;   // slot s at + s * NTH * 2U
      auto issue = [&](int gi) {
        if (gi < ngroups && active) {
          const int kc0 = gi / groups * KC, kb0 = kp + gi % groups * U * ks;
          uint4* d = slot0 + (gi % D) * NTH * 2 * U;
#pragma unroll
          for (int u = 0; u < U; u++) {
            const int kb = min(kb0 + u * ks, NKB - 1);
            cp_async16(d + 2 * u, wa + kc0 + kb * 32 + 8 * t);
            cp_async16(d + 2 * u + 1, wb + kc0 + kb * 32 + 8 * t);
          }
        }
        cp_async_commit();   // empty groups keep the count uniform
      };
      for (int i = 0; i < D - 1; i++) issue(i);
      stage_x(x, K, 0, xbuf);
      for (int c = 0; c < nchunks; c++) {
        // chunk c's activations: at c = 0 the newest group; later, `groups` weight groups
        // (chunk c - 1's issues) came after them
        if (c == 0 || groups != 8) cp_async_wait<0>();
        else cp_async_wait<8>();
        __syncthreads();
        if (c + 1 < nchunks) stage_x(x, K, c + 1, xbuf + (c + 1) % 2 * NB * XS);
        const __nv_bfloat16* xc = xbuf + c % 2 * NB * XS;
        for (int gc = 0; gc < groups; gc++) {
          const int gi = c * groups + gc;
          issue(gi + D - 1);
          cp_async_wait<D - 1>();   // group gi landed (D - 1 newer ones, plus maybe the next chunk's x)
          if (active) {
            const uint4* s = slot0 + (gi % D) * NTH * 2 * U;
#pragma unroll
            for (int u = 0; u < U; u++) {
              const int kb = kp + (gc * U + u) * ks;
              if (kb < NKB) mma_kblock(acc, s[2 * u], s[2 * u + 1], xc, kb, g, t);
            }
          }
        }
      }
      cp_async_wait<0>();
      __syncthreads();
    } else if (MODE == 5) {
      // Block ring: stage j = columns [j RING_K, (j + 1) RING_K) of all rows; warp 0 refills a slot
      // once every warp has arrived on its empty barrier.
      constexpr int KB_PER = RING_K / 32, PER_CHUNK = KC / RING_K;
      const int nstages = K / RING_K;
      const unsigned base = ring_it;
      auto issue = [&](int j) {   // warp 0: stage j of this layer into slot (base + j) % S
        const unsigned it = base + j, s = it % RING_S;
        if (it >= RING_S) mbar_wait(&empty[s], ((it / RING_S) - 1) & 1);
        if (lane == 0) mbar_expect(&full[s], nrows * RING_K * 2);
        __syncwarp();
        for (int r = lane; r < nrows; r += 32)
          bulk_copy(ring + (s * RING_ROWS + r) * RING_STRIDE, W + (size_t)r * K + j * RING_K, RING_K * 2, &full[s]);
      };
      if (warp == 0)
        for (int j = 0; j < RING_S && j < nstages; j++) issue(j);
      stage_x(x, K, 0, xbuf);
      for (int c = 0; c < nchunks; c++) {
        cp_async_wait<0>();
        __syncthreads();
        if (c + 1 < nchunks) stage_x(x, K, c + 1, xbuf + (c + 1) % 2 * NB * XS);
        const __nv_bfloat16* xc = xbuf + c % 2 * NB * XS;
        for (int jj = 0; jj < PER_CHUNK; jj++) {
          const int j = c * PER_CHUNK + jj;
          const unsigned it = base + j, s = it % RING_S;
          mbar_wait(&full[s], (it / RING_S) & 1);
          if (active) {
            const __nv_bfloat16* st = ring + (s * RING_ROWS + mt * 16 + g) * RING_STRIDE;
            for (int kb = kp; kb < KB_PER; kb += ks) {
              const uint4 a = *reinterpret_cast<const uint4*>(st + kb * 32 + 8 * t);
              const uint4 b = *reinterpret_cast<const uint4*>(st + 8 * RING_STRIDE + kb * 32 + 8 * t);
              mma_kblock(acc, a, b, xc, jj * KB_PER + kb, g, t);
            }
          }
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[s]);
          if (warp == 0 && j + RING_S < nstages) issue(j + RING_S);
        }
      }
      ring_it = base + nstages;
      __syncthreads();
    } else {   // 9: the megakernel's matvec_mma_nt itself (with its knobs, e.g. -DMMA_MT=1)
      const XSrc src{nullptr, K, nullptr, x, nullptr, 0};   // bf16 activations [NB][K], no norm
      float* outs = sm + MMA_OUT_AT;                          // [NB][nrows], as linear() places them
      matvec_mma_nt<NT>(probe_args, K, 0, NB, nrows, src, RowMap{W, W, nrows, K}, outs, sm);
      if (l == layers - 1)
        for (int i = threadIdx.x; i < NB * nrows; i += NTH)
          y[(size_t)(i / nrows) * gridDim.x * nrows + blockIdx.x * nrows + i % nrows] = outs[i];
      __syncthreads();   // outs is read before the next layer's chunks land under it
    }
    if (MODE != 9 && l == layers - 1 && active) {   // C fragment: rows g / g + 8, batch rows 2t, 2t + 1 of each n-tile
#pragma unroll
      for (int n = 0; n < NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
          const int r = mt * 16 + g + (i >> 1) * 8, b = n * 8 + 2 * t + (i & 1);
          if (r < nrows) atomicAdd(&y[(size_t)b * gridDim.x * nrows + blockIdx.x * nrows + r], acc[n][i]);
        }
    }
  }
  if (MODE == 3 && sink == 0x12345678u) y[0] = 1.f;   // keeps the loads
}

template <int MODE>
float run(const __nv_bfloat16* w, const __nv_bfloat16* x, float* y, size_t ny, int K, int nrows, int layers,
          size_t stride, int sms, unsigned* bar) {
  auto kern = probe<MODE>;
  const int smem = MODE == 9 ? (MMA_OUT_AT + NB * nrows) * 4 : xbufs(MODE) * XWORDS * 4 + (MODE == 5 ? RING_S * RING_ROWS * RING_STRIDE * 2 : MODE == 4 ? TRING_D * NTH * 2 * TRING_U * 16 : 0);
  cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> ts;
  for (int r = 0; r < 6; r++) {
    if (bar) cudaMemset(bar, 0, 4);
    cudaMemset(y, 0, ny * 4);
    cudaEventRecord(e0);
    kern<<<sms, NTH, smem>>>(w, x, y, K, nrows, layers, stride, bar);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    if (cudaError_t e = cudaGetLastError()) {   // a launch that did not run: no time, not a fast one
      printf("variant %d: %s\n", MODE, cudaGetErrorString(e));
      exit(1);
    }
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    if (r) ts.push_back(ms);   // the first run warms up
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2] * 1000.f / layers;   // us per layer
}

// Variant m (chosen at run time) timed on sms CTAs: run<m>.
float run_variant(int m, const __nv_bfloat16* w, const __nv_bfloat16* x, float* y, size_t ny, int K, int nrows,
                  int layers, size_t stride, int sms, unsigned* bar) {
  switch (m) {
    case 0: return run<0>(w, x, y, ny, K, nrows, layers, stride, sms, bar);
    case 1: return run<1>(w, x, y, ny, K, nrows, layers, stride, sms, bar);
    case 2: return run<2>(w, x, y, ny, K, nrows, layers, stride, sms, bar);
    case 3: return run<3>(w, x, y, ny, K, nrows, layers, stride, sms, bar);
    case 4: return run<4>(w, x, y, ny, K, nrows, layers, stride, sms, bar);
    case 5: return run<5>(w, x, y, ny, K, nrows, layers, stride, sms, bar);
    case 6: return run<6>(w, x, y, ny, K, nrows, layers, stride, sms, bar);
    case 7: return run<7>(w, x, y, ny, K, nrows, layers, stride, sms, bar);
    case 8: return run<8>(w, x, y, ny, K, nrows, layers, stride, sms, bar);
    case 9: return run<9>(w, x, y, ny, K, nrows, layers, stride, sms, bar);
  }
  printf("no variant %d\n", m);
  exit(1);
}

static float bf2f(__nv_bfloat16 v) {
  unsigned short h;
  memcpy(&h, &v, 2);
  unsigned u = (unsigned)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {   // values in [-1, 1), hashed
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    p[i] = __float2bfloat16((float)(h & 0xffff) / 32768.f - 1.f);
  }
}

int main(int argc, char** argv) {
  cudaDeviceProp p;
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) {
    printf("no CUDA device: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  const int sms = p.multiProcessorCount;
  const int layers = argc > 1 ? atoi(argv[1]) : 12;
  struct Shape { const char* name; int nrows, K; };
  const Shape shapes[] = {{"gate_up", 56, 8192}, {"down", 62, 3584 / KC * KC}};   // K: whole chunks
  const size_t max_elems = (size_t)sms * 62 * 8192;
  __nv_bfloat16 *w, *x;
  float* y;
  cudaMalloc(&w, max_elems * 2 * layers);
  fill<<<1024, 256>>>(w, max_elems * layers, 1u);
  cudaMalloc(&x, (size_t)NB * 8192 * 2);
  fill<<<64, 256>>>(x, (size_t)NB * 8192, 2u);
  const size_t ny = (size_t)NB * sms * 62;
  cudaMalloc(&y, ny * 4);
  unsigned* bar;
  cudaMalloc(&bar, 8);
  cudaMemset(bar, 0, 8);
  printf("%d layers, %s, %d SMs, batch %d\n", layers, p.name, sms, NB);
  const char* names[] = {"megakernel (regs, U)", "regs, 2 U", "regs, no activation copies", "weight loads only",
                         "per-thread cp.async ring", "block bulk-copy ring", "regs, 3 chunk buffers",
                         "copies only, 2 buffers", "copies only, 3 buffers",
                         "the kernel's matvec_mma_nt"};
  int bad = 0;
  for (const Shape& s : shapes) {
    const size_t stride = (size_t)sms * s.nrows * s.K, bytes = stride * 2, n = (size_t)NB * sms * s.nrows;
    std::vector<float> ref(n), out(n);
    // float64 sums of 64 sampled outputs of the last layer (batch row bb, global row gr): every
    // variant that computes is checked against them, relative to sum |w x| (the scale of
    // its f32 rounding; the MMAs' K-part split changes the order and so the last bits)
    std::vector<__nv_bfloat16> wrow(s.K), xh((size_t)NB * s.K);
    for (int b = 0; b < NB; b++) cudaMemcpy(xh.data() + (size_t)b * s.K, x + (size_t)b * s.K, s.K * 2, cudaMemcpyDeviceToHost);
    constexpr int SAMPLES = 64;
    constexpr double TOL = 1e-5;   // of sum |w x|
    size_t at[SAMPLES];
    double want[SAMPLES], scale[SAMPLES];
    for (int i = 0; i < SAMPLES; i++) {
      const int bb = i * 7 % NB, gr = (i * 977) % (sms * s.nrows);
      at[i] = (size_t)bb * sms * s.nrows + gr;
      cudaMemcpy(wrow.data(), w + (layers - 1) * stride + (size_t)gr * s.K, s.K * 2, cudaMemcpyDeviceToHost);
      want[i] = scale[i] = 0;
      for (int k = 0; k < s.K; k++) {
        const double v = (double)bf2f(wrow[k]) * bf2f(xh[(size_t)bb * s.K + k]);
        want[i] += v;
        scale[i] += std::fabs(v);
      }
    }
    for (int sync = 0; sync < 2; sync++) {
      unsigned* b = sync ? bar : nullptr;
      for (int m = 0; m < 10; m++) {
        if (NT > 4 && (m == 4 || m == 5)) continue;   // their rings do not fit beside NT 16's chunks
        const float t = run_variant(m, w, x, y, ny, s.K, s.nrows, layers, stride, sms, b);
        cudaMemcpy(out.data(), y, n * 4, cudaMemcpyDeviceToHost);
        char check[64] = "";
        if (m != 2 && m != 3 && m != 7 && m != 8) {   // 2 reads one fixed chunk, 3, 7, 8 compute nothing
          double err = 0, diff = 0;
          for (int i = 0; i < SAMPLES; i++) err = std::max(err, std::fabs(want[i] - out[at[i]]) / scale[i]);
          if (m == 0 && sync == 0) ref = out;
          for (size_t i = 0; i < n; i++) diff = std::max(diff, (double)std::fabs(out[i] - ref[i]) / (1.0 + std::fabs(ref[i])));
          if (err > TOL) bad = 1;
          snprintf(check, sizeof check, "  f64 err %.1e, vs 0 %.1e%s", err, diff, err > TOL ? "  WRONG" : "");
        }
        printf("%-8s %3d x %5d %s %-28s %7.2f us  %5.2f TB/s%s\n", s.name, s.nrows, s.K, sync ? "barrier" : "free   ",
               names[m], t, bytes / (t * 1e-6) / 1e12, check);
      }
    }
  }
  // Copies on fewer CTAs (gate_up's shape, no barrier): per-CTA activation GB/s and all CTAs' TB/s.
  const Shape& s = shapes[0];
  const size_t stride = (size_t)sms * s.nrows * s.K, xbytes = (size_t)NB * s.K * 2;
  for (int grid : {sms, sms / 2, sms / 4})
    for (int m : {0, 7, 8}) {
      const float t = run_variant(m, w, x, y, ny, s.K, s.nrows, layers, stride, grid, nullptr);
      printf("%-8s %3d CTAs %-28s %7.2f us  activations %6.1f GB/s per CTA, %5.2f TB/s in all\n", s.name, grid,
             names[m], t, xbytes / (t * 1e-6) / 1e9, grid * xbytes / (t * 1e-6) / 1e12);
    }
  unsigned timed_out = 0;
  cudaMemcpy(&timed_out, bar + 1, 4, cudaMemcpyDeviceToHost);
  cudaError_t e = cudaGetLastError();
  printf("%s%s\n", cudaGetErrorString(e), timed_out ? "; a grid barrier timed out (barrier rows void)" : "");
  return e != cudaSuccess || timed_out || bad;
}
