// Paged decode attention for CPU pools, reading K/V blocks in place (no gathered copy).
//
// One work item is (sequence, KV head, context split): it walks its share of the sequence's block table,
// converts each K/V row to float32 once, and serves the G query heads of that KV head with an online
// softmax (running max and sum in float32). Splits of one sequence are merged by their log-sum-exp.
// Work items are handed out dynamically, so ragged context lengths keep both cores busy.
//
// The cache element type is float32, bfloat16, float16, float8_e5m2 or float8_e4m3fn; all arithmetic is float32. An e5m2
// byte is the top byte of a float16 (same sign/exponent layout, 2 of its 10 mantissa bits), so it widens
// exactly as (uint16)b << 8 reinterpreted as float16: no scale, and the AVX-512 path reuses the F16C
// conversion. An e4m3fn byte (bias 7, 3 mantissa bits) becomes exact float16 bits the same way: its 7
// magnitude bits shifted left by 7 read as a float16 are the value times 2^-8, subnormals included (both
// formats' subnormals line up), so widen and multiply by 256. (e4m3fn's NaN, 0x7F, reads as 480: the pool
// never stores one, since torch's conversion saturates at +-448.) At one byte per element either halves the
// DRAM traffic that bounds decode attention.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }
inline float to_float(at::Float8_e5m2 x) {
  return static_cast<float>(c10::Half(static_cast<uint16_t>(x.x) << 8, c10::Half::from_bits()));
}
inline float to_float(at::Float8_e4m3fn x) {
  const uint16_t b = x.x;
  const float mag = 256.f * static_cast<float>(c10::Half(static_cast<uint16_t>((b & 0x7F) << 7), c10::Half::from_bits()));
  return (b & 0x80) ? -mag : mag;
}

template <typename T>
inline void row_to_float(const T* __restrict src, float* __restrict dst, int64_t d) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    uint32_t* o = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) o[i] = static_cast<uint32_t>(s[i]) << 16;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]);
  }
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

// Online softmax for one query head over one block of scores: the running max after the block (stored in
// *m) and the factor that rescales what was accumulated before it (0 for the first block).
inline float advance_max(const float* sg, int64_t n, float* m) {
  float mx = *m;
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
  const float alpha = *m == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(*m - mx);
  *m = mx;
  return alpha;
}

#if defined(__AVX512F__)
#include <immintrin.h>

// e^x for 16 lanes: x = n ln2 + r with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial (relative error
// about 1e-7, a float32 ulp), times 2^n. Inputs below -87 (and -inf) give 0.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), p, n);
}

template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  } else if constexpr (std::is_same_v<T, at::Float8_e5m2>) {
    // 16 bytes -> 16 float16 (each byte as the high byte) -> 16 float32
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
  } else if constexpr (std::is_same_v<T, at::Float8_e4m3fn>) {
    // 16 bytes -> float16 bits -> float32, times 2^8. Sign-extending puts the sign in bits 8-15, so after
    // the shift by 7 bit 15 is the sign and bit 14 a copy of it, which the mask clears.
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// One (sequence, KV head, split) item with head dim 16 * NV held in registers.
template <typename T, int NV>
void attend_item(const float* qs, const T* k_cache, const T* v_cache, const int32_t* table, int64_t ctx, int64_t j0,
                 int64_t j1, int64_t G, int64_t BS, int64_t row_stride, int64_t h, float* acc, float* m, float* l,
                 float* s) {
  constexpr int64_t D = 16 * NV;
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t blk = table[j];
    const int64_t n = std::min(BS, ctx - j * BS);
    const T* kb = k_cache + blk * BS * row_stride + h * D;
    const T* vb = v_cache + blk * BS * row_stride + h * D;
    if (j + 2 < j1) {  // blocks sit anywhere in the pool: ask for the rows two blocks ahead while this one computes
      const int64_t nxt = table[j + 2] * BS * row_stride + h * D;
      constexpr int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
      for (int64_t t = 0; t < BS; ++t)
        for (int64_t c = 0; c < row_bytes; c += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(k_cache + nxt + t * row_stride) + c, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(v_cache + nxt + t * row_stride) + c, _MM_HINT_T0);
        }
    }
    // scores s[g * BS + t]
    for (int64_t t = 0; t < n; ++t) {
      __m512 k[NV];
      for (int v = 0; v < NV; ++v) k[v] = load16(kb + t * row_stride + 16 * v);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qs + g * D;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
        for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * v), k[v], a);
        s[g * BS + t] = _mm512_reduce_add_ps(a);
      }
    }
    // online softmax, 16 tokens at a time
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * BS;
      const float alpha = advance_max(sg, n, &m[g]);
      float sum = 0.f;
      const __m512 mxv = _mm512_set1_ps(m[g]);
      for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 mask = n - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - t)) - 1);
        const __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sg + t), mxv));
        _mm512_mask_storeu_ps(sg + t, mask, p);
        sum += _mm512_mask_reduce_add_ps(mask, p);
      }
      l[g] = l[g] * alpha + sum;
      if (alpha != 1.f) {
        const __m512 av = _mm512_set1_ps(alpha);
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + g * D + 16 * v, _mm512_mul_ps(av, _mm512_loadu_ps(acc + g * D + 16 * v)));
      }
    }
    for (int64_t g0 = 0; g0 < G; g0 += 2) {  // two query heads' accumulators in registers per V pass
      const int64_t gn = std::min<int64_t>(2, G - g0);
      __m512 a0[NV], a1[NV];
      for (int v = 0; v < NV; ++v) {
        a0[v] = _mm512_loadu_ps(acc + g0 * D + 16 * v);
        a1[v] = gn > 1 ? _mm512_loadu_ps(acc + (g0 + 1) * D + 16 * v) : _mm512_setzero_ps();
      }
      for (int64_t t = 0; t < n; ++t) {
        const __m512 p0 = _mm512_set1_ps(s[g0 * BS + t]);
        const __m512 p1 = _mm512_set1_ps(gn > 1 ? s[(g0 + 1) * BS + t] : 0.f);
        for (int v = 0; v < NV; ++v) {
          const __m512 vv = load16(vb + t * row_stride + 16 * v);
          a0[v] = _mm512_fmadd_ps(p0, vv, a0[v]);
          a1[v] = _mm512_fmadd_ps(p1, vv, a1[v]);
        }
      }
      for (int v = 0; v < NV; ++v) {
        _mm512_storeu_ps(acc + g0 * D + 16 * v, a0[v]);
        if (gn > 1) _mm512_storeu_ps(acc + (g0 + 1) * D + 16 * v, a1[v]);
      }
    }
  }
}
#endif

// Portable path: any head dim, compiler-vectorized loops.
template <typename T>
void attend_item_generic(const float* qs, const T* k_cache, const T* v_cache, const int32_t* table, int64_t ctx,
                         int64_t j0, int64_t j1, int64_t G, int64_t D, int64_t BS, int64_t row_stride, int64_t h,
                         float* acc, float* m, float* l, float* s, float* kf) {
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t blk = table[j];
    const int64_t n = std::min(BS, ctx - j * BS);
    const T* kb = k_cache + blk * BS * row_stride + h * D;
    const T* vb = v_cache + blk * BS * row_stride + h * D;
    for (int64_t t = 0; t < n; ++t) {
      row_to_float(kb + t * row_stride, kf, D);
      for (int64_t g = 0; g < G; ++g) s[g * BS + t] = dot(qs + g * D, kf, D);
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * BS;
      const float alpha = advance_max(sg, n, &m[g]);
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        sg[t] = std::exp(sg[t] - m[g]);
        sum += sg[t];
      }
      l[g] = l[g] * alpha + sum;
      float* a = acc + g * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) a[i] *= alpha;
    }
    for (int64_t t = 0; t < n; ++t) {
      row_to_float(vb + t * row_stride, kf, D);
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[g * BS + t];
        float* a = acc + g * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) a[i] += p * kf[i];
      }
    }
  }
}

template <typename T>
void decode_kernel(const float* q,          // [B, Hq, D]
                   const T* k_cache,        // [NB, BS, Hkv, D]
                   const T* v_cache,        // [NB, BS, Hkv, D]
                   const int32_t* tables,   // [B, MB]
                   const int32_t* ctx_lens, // [B]
                   float* out,              // [B, Hq, D]
                   float* part_out,         // [B, Hkv, S, G, D] partial outputs (S > 1 only)
                   float* part_lse,         // [B, Hkv, S, G]
                   int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t MB, int64_t splits,
                   int64_t blocks_per_split, float scale) {
  const int64_t G = Hq / Hkv;
  const int64_t row_stride = Hkv * D;  // between consecutive slots of one head
  const int64_t items = B * Hkv * splits;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> kf(D), s(BS * G), m(G), l(G), acc(G * D), qs(G * D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / (Hkv * splits);
      const int64_t h = (item / splits) % Hkv;
      const int64_t split = item % splits;
      const int64_t ctx = ctx_lens[b];
      const int64_t nblocks = (ctx + BS - 1) / BS;
      const int64_t j0 = split * blocks_per_split;
      const int64_t j1 = std::min(nblocks, j0 + blocks_per_split);
      for (int64_t g = 0; g < G; ++g) {  // the query rows of this KV head, pre-scaled
        const float* qr = q + (b * Hq + h * G + g) * D;
        for (int64_t i = 0; i < D; ++i) qs[g * D + i] = qr[i] * scale;
      }
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      const int32_t* table = tables + b * MB;
#if defined(__AVX512F__)
      if (D == 64)
        attend_item<T, 4>(qs.data(), k_cache, v_cache, table, ctx, j0, j1, G, BS, row_stride, h, acc.data(), m.data(), l.data(), s.data());
      else if (D == 128)
        attend_item<T, 8>(qs.data(), k_cache, v_cache, table, ctx, j0, j1, G, BS, row_stride, h, acc.data(), m.data(), l.data(), s.data());
      else
#endif
        attend_item_generic<T>(qs.data(), k_cache, v_cache, table, ctx, j0, j1, G, D, BS, row_stride, h, acc.data(),
                               m.data(), l.data(), s.data(), kf.data());
      for (int64_t g = 0; g < G; ++g) {
        const float* a = acc.data() + g * D;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        if (splits == 1) {
          float* o = out + (b * Hq + h * G + g) * D;
          for (int64_t i = 0; i < D; ++i) o[i] = a[i] * inv;
        } else {
          const int64_t p = ((b * Hkv + h) * splits + split) * G + g;
          float* o = part_out + p * D;
          for (int64_t i = 0; i < D; ++i) o[i] = a[i] * inv;
          part_lse[p] = l[g] > 0.f ? m[g] + std::log(l[g]) : -std::numeric_limits<float>::infinity();
        }
      }
    }
    if (splits > 1) {
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < B * Hkv; ++bh) {
        const int64_t b = bh / Hkv, h = bh % Hkv;
        for (int64_t g = 0; g < G; ++g) {
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, part_lse[(bh * splits + sp) * G + g]);
          float* o = out + (b * Hq + h * G + g) * D;
          std::fill(o, o + D, 0.f);
          float total = 0.f;
          for (int64_t sp = 0; sp < splits; ++sp) {
            const int64_t p = (bh * splits + sp) * G + g;
            if (part_lse[p] == -std::numeric_limits<float>::infinity()) continue;
            const float w = std::exp(part_lse[p] - mx);
            total += w;
            const float* po = part_out + p * D;
            for (int64_t i = 0; i < D; ++i) o[i] += w * po[i];
          }
          const float inv = total > 0.f ? 1.f / total : 0.f;
          for (int64_t i = 0; i < D; ++i) o[i] *= inv;
        }
      }
    }
  }
}

torch::Tensor paged_decode(torch::Tensor q,             // [B, Hq, D] float32
                           torch::Tensor k_cache,       // [NB, BS, Hkv, D]
                           torch::Tensor v_cache,       // [NB, BS, Hkv, D]
                           torch::Tensor block_tables,  // [B, MB] int32
                           torch::Tensor context_lens,  // [B] int32
                           double scale, int64_t splits) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32 [B, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous [NB, BS, Hkv, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(), "k/v cache mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2, "block_tables must be contiguous int32 [B, MB]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(), "context_lens must be contiguous int32 [B]");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2), MB = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "head geometry mismatch");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "batch mismatch");
  TORCH_CHECK(splits >= 1, "splits must be >= 1");
  auto out = torch::empty({B, Hq, D}, q.options());
  const int64_t blocks_per_split = std::max<int64_t>(1, (MB + splits - 1) / splits);
  splits = std::max<int64_t>(1, (MB + blocks_per_split - 1) / blocks_per_split);
  torch::Tensor part_out, part_lse;
  float *po = nullptr, *pl = nullptr;
  if (splits > 1) {
    part_out = torch::empty({B * Hkv * splits * (Hq / Hkv) * D}, q.options());
    part_lse = torch::empty({B * Hkv * splits * (Hq / Hkv)}, q.options());
    po = part_out.data_ptr<float>();
    pl = part_lse.data_ptr<float>();
  }
  const auto* tp = block_tables.data_ptr<int32_t>();
  const auto* cp = context_lens.data_ptr<int32_t>();
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      decode_kernel<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tp, cp,
                           out.data_ptr<float>(), po, pl, B, Hq, Hkv, D, BS, MB, splits, blocks_per_split, scale);
      break;
    case at::kBFloat16:
      decode_kernel<at::BFloat16>(q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                                  tp, cp, out.data_ptr<float>(), po, pl, B, Hq, Hkv, D, BS, MB, splits, blocks_per_split, scale);
      break;
    case at::kHalf:
      decode_kernel<at::Half>(q.data_ptr<float>(), k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), tp, cp,
                              out.data_ptr<float>(), po, pl, B, Hq, Hkv, D, BS, MB, splits, blocks_per_split, scale);
      break;
    case at::kFloat8_e5m2:
      decode_kernel<at::Float8_e5m2>(q.data_ptr<float>(), k_cache.data_ptr<at::Float8_e5m2>(),
                                     v_cache.data_ptr<at::Float8_e5m2>(), tp, cp, out.data_ptr<float>(), po, pl, B, Hq,
                                     Hkv, D, BS, MB, splits, blocks_per_split, scale);
      break;
    case at::kFloat8_e4m3fn:
      decode_kernel<at::Float8_e4m3fn>(q.data_ptr<float>(), k_cache.data_ptr<at::Float8_e4m3fn>(),
                                       v_cache.data_ptr<at::Float8_e4m3fn>(), tp, cp, out.data_ptr<float>(), po, pl, B,
                                       Hq, Hkv, D, BS, MB, splits, blocks_per_split, scale);
      break;
    default:
      TORCH_CHECK(false, "unsupported cache dtype ", k_cache.scalar_type());
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over a CPU KV pool, blocks read in place");
}
