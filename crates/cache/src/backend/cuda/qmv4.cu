// y[M, N] = x[M, K] · Wᵀ for W affine-quantized 4-bit with groups of 64 (MLX's layout: eight
// values per u32 word, lowest nibble first; one bf16 scale and bias per group), x and y bf16.
// The body of an MLX `cuda_kernel`; the launcher defines M (rows of x), R (output columns per
// warp), K and N.
//
// Each warp owns R consecutive output columns and reads each of their weights once for all M
// rows (MLX's own matrix-vector kernel runs once per row). A lane takes 16 consecutive values
// (one 8-byte load, streamed past the caches) per step; the K/16 loads of a column are spread
// over the 32 lanes so a warp's loads are contiguous. A value is dequantized once in fp32 and
// multiplied into an fp32 accumulator per (row, column); the warp sums its lanes at the end.
constexpr int V = K / 16;      // 8-byte loads per output column
constexpr int STEPS = V / 32;  // per lane
constexpr int GROUPS = K / 64;
static_assert(K % 512 == 0, "K must be a multiple of 512");

const int lane = threadIdx.x & 31;
const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
const int n0 = warp * R;
if (n0 >= N) {
  return;
}

const uint2* wv = reinterpret_cast<const uint2*>(w) + static_cast<size_t>(n0) * V;
const unsigned short* sv = reinterpret_cast<const unsigned short*>(scales);
const unsigned short* bv = reinterpret_cast<const unsigned short*>(biases);
float acc[M][R];
#pragma unroll
for (int m = 0; m < M; ++m) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    acc[m][r] = 0.0f;
  }
}

#pragma unroll
for (int step = 0; step < STEPS; ++step) {
  const int v = step * 32 + lane;
  float deq[R][16];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const uint2 q = __ldcs(wv + r * V + v);
    const int g = (n0 + r) * GROUPS + v / 4;
    const float s = __uint_as_float(static_cast<uint32_t>(__ldg(sv + g)) << 16);
    const float b = __uint_as_float(static_cast<uint32_t>(__ldg(bv + g)) << 16);
    // (word >> 4i) & 0x000F000F | 0x43004300 is the bf16 pair (128 + q_i, 128 + q_{i+4}),
    // exact; widened to fp32, s · (128 + q) + (b − 128 s) = s · q + b to within 1e-5 · s.
    const float b128 = fmaf(-128.0f, s, b);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t word = half ? q.y : q.x;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t pair = ((word >> (4 * i)) & 0x000F000Fu) | 0x43004300u;
        deq[r][half * 8 + i] = fmaf(s, __uint_as_float(pair << 16), b128);
        deq[r][half * 8 + i + 4] = fmaf(s, __uint_as_float(pair & 0xFFFF0000u), b128);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const uint4* xp = reinterpret_cast<const uint4*>(x + static_cast<size_t>(m) * K) + v * 2;
    const uint4 lo = __ldg(xp);
    const uint4 hi = __ldg(xp + 1);
    const uint32_t xw[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t h = xw[j / 2];
      const float xf = __uint_as_float((j & 1) ? (h & 0xFFFF0000u) : (h << 16));
#pragma unroll
      for (int r = 0; r < R; ++r) {
        acc[m][r] = fmaf(xf, deq[r][j], acc[m][r]);
      }
    }
  }
}

#pragma unroll
for (int m = 0; m < M; ++m) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float a = acc[m][r];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      a += __shfl_xor_sync(0xFFFFFFFFu, a, o);
    }
    if (lane == (m * R + r) % 32) {
      y[static_cast<size_t>(m) * N + n0 + r] = __float2bfloat16(a);
    }
  }
}
