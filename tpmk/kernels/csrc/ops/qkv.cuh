// qkv: must match tpmk/kernels/ops/qkv.py (Qkv). RMSNorm(x) @ rows of one local head's
// rotary pairs [ARG0, ARG0+NROWS) (rows i and i + D/2), RoPE for q/k heads; q -> q buffer,
// k/v -> paged cache [L, pages, Hkv, page_size, D].
#pragma once
#include "mk_linear.cuh"

__device__ LINEAR_OP void op_qkv(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = step_batch(), l = ins[isa::F_LAYER], head = ins[isa::F_ROW0];
  const int n = ins[isa::F_NROWS], p0 = ins[isa::F_ARG0];
  const int H = a.hidden, D = a.head_dim, half = D / 2, hq = a.q_heads, hkv = a.kv_heads;
  if (batch > 0) prof_mark(a, 7);   // the op's entry
  const int* pos = hdr + isa::HDR_TOKENS + a.bucket;
  const int* pages = pos + a.bucket;
  Tile tile;
  linear_tile(a, ins, isa::OP_QKV, tile);   // rows p0 + i, then half + p0 + i, of this head
  const XSrc src = normed_x(a, reinterpret_cast<const wtype*>(a.input_norm) + (size_t)l * H);
  const float* inv_freq = reinterpret_cast<const float*>(a.rope_inv_freq);
  const int chunk = linear_chunk(batch, 2 * n);
  for (int b0 = 0; b0 < batch; b0 += chunk) {
    const int nb = min(chunk, batch - b0);
    const float* outs = linear(a, batch, H, b0, nb, 2 * n, src, tile.rows, smem);   // [nb, 2n]
    for (int idx = threadIdx.x; idx < nb * n; idx += NTHREADS) {
      const int b = idx / n, i = idx % n, t = pos[b0 + b];
      float y1 = outs[b * 2 * n + i], y2 = outs[b * 2 * n + n + i];
      if (head < hq + hkv) {
        float s, c;
        sincosf((float)t * inv_freq[p0 + i], &s, &c);
        const float x1 = y1, x2 = y2;
        y1 = x1 * c - x2 * s;
        y2 = x2 * c + x1 * s;
      }
      if (head < hq) {
        float* q = reinterpret_cast<float*>(a.q) + (size_t)(b0 + b) * hq * D + head * D;
        q[p0 + i] = y1;
        q[half + p0 + i] = y2;
      } else {
        const bool is_k = head < hq + hkv;
        const int g = is_k ? head - hq : head - hq - hkv;
        const int page = pages[(b0 + b) * a.max_pages + t / a.page_size];
        wtype* c = reinterpret_cast<wtype*>(is_k ? a.k_cache : a.v_cache) +
                   ((((size_t)l * a.num_pages + page) * hkv + g) * a.page_size + t % a.page_size) * D;
        c[p0 + i] = from_f(y1);
        c[half + p0 + i] = from_f(y2);
      }
    }
    __syncthreads();
  }
}
