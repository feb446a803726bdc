// Batch-1 matvec load patterns in isolation (no megakernel, no dependency waits):
// 132 CTAs x 512 threads, each CTA streams its tile of nrows x K bf16 weights for
// L layers back to back (layers rotate through more than L2 holds) and dots them with
// an f32 x in shared memory. Prints per-layer us and achieved TB/s per pattern, each run
// free and with a grid barrier before every layer (as after a dependency wait).
//   nvcc -O3 -arch=sm_90a -o /tmp/mv_probe bench/mv_probe.cu && /tmp/mv_probe [layers, default 12]
#include "../tpmk/kernels/csrc/mk_common.cuh"   // unpack, warp_sum
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cstdlib>

constexpr int NT = 512, NW = NT / 32, STEP = 32 * VEC;

template <int R>
__device__ __forceinline__ void fma_rows(const float* xs, int k, const uint4 (&u)[R], float (&acc)[R]) {
  float xv[VEC];
  const float4* xb = reinterpret_cast<const float4*>(xs + k);
  float4 t0 = xb[0], t1 = xb[1];
  xv[0] = t0.x; xv[1] = t0.y; xv[2] = t0.z; xv[3] = t0.w; xv[4] = t1.x; xv[5] = t1.y; xv[6] = t1.z; xv[7] = t1.w;
#pragma unroll
  for (int j = 0; j < R; j++) {
    float f[VEC];
    unpack(u[j], f);
#pragma unroll
    for (int e = 0; e < VEC; e++) acc[j] += f[e] * xv[e];
  }
}

// mode 0: the megakernel's pattern: warp w takes 4-row groups w, w + 16, ... (K split over
// warps only when groups <= 8), U = 4 loads per row in flight, loads then FMAs per loop trip.
// mode 1: (group, K-slice of 1024) work items dealt over all 16 warps, same loads per item.
// mode 2: work items of 4 rows x 512, the next item's loads issued before this one's FMAs.
// mode 3: pure read (no x, xor of the words), each warp a contiguous share, 16 loads in flight.
// mode 4: mode 0 with cp.async.bulk.prefetch.L2 of the tile's first 96 KB per layer.
template <int MODE>
__global__ void __launch_bounds__(NT, 1)
probe(const __nv_bfloat16* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int K, int nrows,
      int layers, size_t layer_stride, unsigned* bar) {
  extern __shared__ float xs[];
  __shared__ float part[NW * 64];
  for (int i = threadIdx.x; i < K; i += NT) xs[i] = x[i];
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float sink = 0.f;
  for (int l = 0; l < layers; l++) {
    const __nv_bfloat16* W = w + l * layer_stride + (size_t)blockIdx.x * nrows * K;
    if (MODE == 4 && threadIdx.x == 0) {
      const unsigned n = min((size_t)96 * 1024, (size_t)nrows * K * 2);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(W), "r"(n) : "memory");
    }
    if (bar) {   // every CTA starts layer l together, as after a dependency wait
      __syncthreads();
      if (threadIdx.x == 0) {
        atomicAdd(bar, 1u);
        const unsigned long long t0 = globaltimer();
        unsigned v;
        do asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(bar));
        while (v < (l + 1) * gridDim.x && globaltimer() - t0 < 1000000000ull);
        if (v < (l + 1) * gridDim.x) atomicExch(bar + 1, 1u);   // bounded: 1 s, reported by main()
      }
      __syncthreads();
    }
    if (MODE == 0 || MODE == 4) {
      constexpr int U = 4, R = 4;
      const int groups = (nrows + R - 1) / R;
      int ks = 1;
      while (ks * 2 * groups <= NW) ks *= 2;
      const int kslice = (K + ks * STEP - 1) / (ks * STEP) * STEP;
      const int kbeg = warp % ks * kslice, kend = min(K, kbeg + kslice);
      for (int g = warp / ks; g < groups; g += NW / ks) {
        const __nv_bfloat16* wr[R];
#pragma unroll
        for (int j = 0; j < R; j++) wr[j] = W + (size_t)min(g * R + j, nrows - 1) * K;
        float acc[R] = {0.f, 0.f, 0.f, 0.f};
        for (int k0 = kbeg + lane * VEC; k0 < kend; k0 += STEP * U) {
          uint4 u[U][R];
#pragma unroll
          for (int i = 0; i < U; i++)
#pragma unroll
            for (int j = 0; j < R; j++)
              u[i][j] = k0 + i * STEP < kend ? __ldg(reinterpret_cast<const uint4*>(wr[j] + k0 + i * STEP))
                                             : make_uint4(0, 0, 0, 0);
#pragma unroll
          for (int i = 0; i < U; i++)
            if (k0 + i * STEP < kend) fma_rows<R>(xs, k0 + i * STEP, u[i], acc);
        }
#pragma unroll
        for (int j = 0; j < R; j++) sink += warp_sum(acc[j]);
      }
    } else if (MODE == 1 || MODE == 2) {
      constexpr int R = 4, U = MODE == 1 ? 4 : 2, SL = STEP * U;
      const int groups = (nrows + R - 1) / R, nks = (K + SL - 1) / SL, items = groups * nks;
      auto load = [&](int it, uint4 (&u)[U][R]) {
        const int g = it / nks, kb = it % nks * SL;
#pragma unroll
        for (int i = 0; i < U; i++)
#pragma unroll
          for (int j = 0; j < R; j++) {
            const int k = kb + i * STEP + lane * VEC;
            u[i][j] = k < K ? __ldg(reinterpret_cast<const uint4*>(W + (size_t)min(g * R + j, nrows - 1) * K + k))
                            : make_uint4(0, 0, 0, 0);
          }
      };
      uint4 u[U][R], v[U][R];
      int it = warp;
      if (it < items) load(it, u);
      for (; it < items; it += NW) {
        if (MODE == 2 && it + NW < items) load(it + NW, v);
        if (MODE == 1 && it != warp) load(it, u);
        const int kb = it % nks * SL;
        float acc[R] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < U; i++)
          if (kb + i * STEP + lane * VEC < K) fma_rows<R>(xs, kb + i * STEP + lane * VEC, u[i], acc);
#pragma unroll
        for (int j = 0; j < R; j++) sink += warp_sum(acc[j]);
        if (MODE == 2) {
#pragma unroll
          for (int i = 0; i < U; i++)
#pragma unroll
            for (int j = 0; j < R; j++) u[i][j] = v[i][j];
        }
      }
    } else if (MODE == 3) {
      const size_t n16 = (size_t)nrows * K / 8, per = (n16 + NW - 1) / NW;
      const uint4* p = reinterpret_cast<const uint4*>(W) + warp * per;
      const size_t cnt = min(per, n16 - min(n16, warp * per));
      unsigned acc = 0;
      for (size_t i = lane; i < cnt; i += 32 * 16) {
        uint4 u[16];
#pragma unroll
        for (int j = 0; j < 16; j++) u[j] = i + j * 32 < cnt ? __ldg(p + i + j * 32) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < 16; j++) acc ^= u[j].x ^ u[j].y ^ u[j].z ^ u[j].w;
      }
      sink += (float)(acc & 1);
    }
    __syncthreads();
  }
  if (lane == 0) part[warp] = sink;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int i = 0; i < NW; i++) s += part[i];
    y[blockIdx.x] = s;
  }
}

template <int MODE>
float run(const __nv_bfloat16* w, const float* x, float* y, int K, int nrows, int layers, size_t stride, int sms,
          unsigned* bar) {
  auto kern = probe<MODE>;
  cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, K * 4);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  if (bar) cudaMemset(bar, 0, 4);   // the arrival count; bar[1], the timeout flag, stays
  kern<<<sms, NT, K * 4>>>(w, x, y, K, nrows, layers, stride, bar);
  std::vector<float> ts;
  for (int r = 0; r < 5; r++) {
    if (bar) cudaMemset(bar, 0, 4);
    cudaEventRecord(e0);
    kern<<<sms, NT, K * 4>>>(w, x, y, K, nrows, layers, stride, bar);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    ts.push_back(ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2] * 1000.f / layers;   // us per layer
}

int main(int argc, char** argv) {
  cudaDeviceProp p;
  cudaGetDeviceProperties(&p, 0);
  const int sms = p.multiProcessorCount;
  struct Shape { const char* name; int nrows, K; };
  const Shape shapes[] = {{"gate_up", 56, 8192}, {"down", 62, 3584}, {"qkv", 10, 8192}, {"o_proj", 62, 1024}};
  const size_t max_bytes = (size_t)sms * 62 * 8192 * 2;   // largest layer
  const int layers = argc > 1 ? atoi(argv[1]) : 12;   // 80: a 70B rank's span of weights (TLB reach)
  __nv_bfloat16* w;
  float *x, *y;
  cudaMalloc(&w, max_bytes * layers);
  cudaMemset(w, 0x3c, max_bytes * layers);
  cudaMalloc(&x, 8192 * 4);
  cudaMemset(x, 0, 8192 * 4);
  cudaMalloc(&y, sms * 4);
  {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    const size_t n = max_bytes * layers / 2;
    cudaMemcpy(w + n / 2, w, n, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e0);
    for (int i = 0; i < 5; i++) cudaMemcpy(w + n / 2, w, n, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    printf("%d layers, %s, %d SMs, copy %.2f TB/s (read + write)\n", layers, p.name, sms, 2.0 * n * 5 / (ms * 1e-3) / 1e12);
  }
  unsigned* bar;   // [0] grid-barrier arrivals, [1] set if a barrier wait timed out
  cudaMalloc(&bar, 8);
  cudaMemset(bar, 0, 8);
  for (const Shape& s : shapes) {
    const size_t stride = (size_t)sms * s.nrows * s.K, bytes = stride * 2;
    const char* names[] = {"megakernel (rows per warp)", "K-slice items", "items, next loads first", "pure read",
                           "megakernel + 96 KB L2 prefetch"};
    for (int sync = 0; sync < 2; sync++) {
      unsigned* b = sync ? bar : nullptr;
      float t[5] = {run<0>(w, x, y, s.K, s.nrows, layers, stride, sms, b), run<1>(w, x, y, s.K, s.nrows, layers, stride, sms, b),
                    run<2>(w, x, y, s.K, s.nrows, layers, stride, sms, b), run<3>(w, x, y, s.K, s.nrows, layers, stride, sms, b),
                    run<4>(w, x, y, s.K, s.nrows, layers, stride, sms, b)};
      for (int m = 0; m < 5; m++)
        printf("%-8s %4d x %5d %s %-32s %7.2f us  %5.2f TB/s\n", s.name, s.nrows, s.K, sync ? "barrier" : "free   ",
               names[m], t[m], bytes / (t[m] * 1e-6) / 1e12);
    }
  }
  unsigned timed_out = 0;
  cudaMemcpy(&timed_out, bar + 1, 4, cudaMemcpyDeviceToHost);
  cudaError_t e = cudaGetLastError();
  printf("%s\n", cudaGetErrorString(e));
  if (timed_out) printf("a grid barrier timed out: the %d CTAs were not all resident; barrier rows are void\n", sms);
  return e != cudaSuccess || timed_out;
}
