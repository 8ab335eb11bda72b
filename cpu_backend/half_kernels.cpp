// Decode-step kernels for CPUs with AVX2 or AVX512 but no bfloat16 or float16 arithmetic (`make cpu-kernels`
// builds them; cpu_backend loads them where built). Without half-precision instructions ATen emulates half-precision
// products element by element, and oneDNN refuses them (AVX2) or emulates them too (AVX512); an upcast
// copy streams twice the bytes. Both kernels widen the half-precision weights or cache to float32 in
// registers, sum in float32 and round once.
// A sequence's values do not depend on the other sequences of its batch, nor on how many slots the
// batch's cache has past its own.
//
// half_rows: the few rows of a decode step (one per sequence) times a weight, reading the weight once
// for up to 8 rows.
// half_decode_attention: the query heads that share a KV head (up to 3 at a time) against its cache
// slots, each slot widened once for all of them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 8;  // float32 accumulators held in registers, one per input row
constexpr int64_t kRowsInL1Bytes = 24 * 1024;  // of the 32 KiB L1 data cache, for the rows of x

inline __m256 widen8(const at::BFloat16* p) {
  __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline __m256 widen8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Calls f(std::integral_constant<int, count>{}) for a runtime count in [1, N], so that loops over
// count unroll with their accumulators in registers.
template <int N, typename F>
inline void dispatch_up_to(int64_t count, F&& f) {
  if constexpr (N > 1) {
    if (count < N) return dispatch_up_to<N - 1>(count, f);
  }
  f(std::integral_constant<int, N>{});
}

// The lanes half_rows multiplies in: 16 where the CPU has AVX512 (twice the products per instruction,
// and 32 registers: 3 weight rows by 8 rows of x accumulate at once), else 8.
#ifdef __AVX512F__
using Lanes = __m512;
constexpr int64_t kLanes = 16;
inline Lanes widen_lanes(const at::BFloat16* p) {
  __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline Lanes widen_lanes(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Lanes load_lanes(const float* p) { return _mm512_loadu_ps(p); }
inline Lanes zero_lanes() { return _mm512_setzero_ps(); }
inline Lanes fmadd_lanes(Lanes a, Lanes b, Lanes c) { return _mm512_fmadd_ps(a, b, c); }
inline float sum_lanes(Lanes v) {
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return horizontal_sum(_mm256_add_ps(_mm512_castps512_ps256(v), high));
}
#else
using Lanes = __m256;
constexpr int64_t kLanes = 8;
template <typename Half>
inline Lanes widen_lanes(const Half* p) { return widen8(p); }
inline Lanes load_lanes(const float* p) { return _mm256_loadu_ps(p); }
inline Lanes zero_lanes() { return _mm256_setzero_ps(); }
inline Lanes fmadd_lanes(Lanes a, Lanes b, Lanes c) { return _mm256_fmadd_ps(a, b, c); }
inline float sum_lanes(Lanes v) { return horizontal_sum(v); }
#endif

// Left to itself the compiler folds the load of a row of x into each of the WEIGHTS products that use
// it; at 8 rows of x the tile is then bound by the loads (27 per 24 products), not by the products.
inline void keep_in_register(Lanes& v) { asm("" : "+v"(v)); }

constexpr int64_t kWeightsAhead = 6;  // weight rows between the tile and the rows it asks the memory for

// y[m, n] = x[m, :] . w[n, :] for the ROWS rows of x and the WEIGHTS weight rows from n, each sum in
// k order, kLanes lanes then the tail, whatever the tile. On the way it prefetches the weight rows
// kWeightsAhead after its own into L1: the hardware prefetcher alone leaves the memory bus idle
// between tiles.
template <int WEIGHTS, int ROWS, typename Half>
inline void multiply_tile(const float* x, const Half* w, float* y, int64_t k_size, int64_t n_size, int64_t n) {
  const int64_t vector_end = k_size - k_size % kLanes;
  const Half* ahead[WEIGHTS];
  for (int i = 0; i < WEIGHTS; ++i) ahead[i] = w + std::min(n + i + kWeightsAhead, n_size - 1) * k_size;
  Lanes acc[WEIGHTS][ROWS];
#pragma GCC unroll 8
  for (int i = 0; i < WEIGHTS; ++i)
#pragma GCC unroll 8
    for (int m = 0; m < ROWS; ++m) acc[i][m] = zero_lanes();
  for (int64_t k = 0; k < vector_end; k += kLanes) {
    Lanes w_lanes[WEIGHTS];
#pragma GCC unroll 8
    for (int i = 0; i < WEIGHTS; ++i) {
      w_lanes[i] = widen_lanes(w + (n + i) * k_size + k);
      _mm_prefetch(reinterpret_cast<const char*>(ahead[i] + k), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int m = 0; m < ROWS; ++m) {
      Lanes x_lanes = load_lanes(x + m * k_size + k);
      keep_in_register(x_lanes);
#pragma GCC unroll 8
      for (int i = 0; i < WEIGHTS; ++i) acc[i][m] = fmadd_lanes(w_lanes[i], x_lanes, acc[i][m]);
    }
  }
  for (int i = 0; i < WEIGHTS; ++i) {
    const Half* w_row = w + (n + i) * k_size;
    for (int m = 0; m < ROWS; ++m) {
      float sum = sum_lanes(acc[i][m]);
      for (int64_t k = vector_end; k < k_size; ++k) sum += static_cast<float>(w_row[k]) * x[m * k_size + k];
      y[m * n_size + n + i] = sum;
    }
  }
}

// AVX2: one weight row at a time against up to 8 rows of x while those rows fit the CPU's L1 cache;
// longer rows go 4 at a time against 3 weight rows, so that the rows of x are read from L1. AVX512: 3
// weight rows against up to 8 rows of x.
template <typename Half>
void multiply(const float* x, const Half* w, float* y, int64_t rows, int64_t k_size, int64_t n_size) {
  const bool wide_registers = kLanes == 16;
  const bool long_rows = rows > 4 && rows * k_size * static_cast<int64_t>(sizeof(float)) > kRowsInL1Bytes;
  const bool three_weights = wide_registers || long_rows;
  const int64_t tile_rows = long_rows && !wide_registers ? 4 : kMaxRows;
  at::parallel_for(0, n_size, 64, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; three_weights && n + 3 <= n1; n += 3)
      for (int64_t m0 = 0; m0 < rows; m0 += tile_rows)
        dispatch_up_to<kMaxRows>(std::min(tile_rows, rows - m0), [&](auto r) {
          multiply_tile<3, decltype(r)::value>(x + m0 * k_size, w, y + m0 * n_size, k_size, n_size, n);
        });
    for (; n < n1; ++n)
      for (int64_t m0 = 0; m0 < rows; m0 += tile_rows)
        dispatch_up_to<kMaxRows>(std::min(tile_rows, rows - m0), [&](auto r) {
          multiply_tile<1, decltype(r)::value>(x + m0 * k_size, w, y + m0 * n_size, k_size, n_size, n);
        });
  });
}

// x [rows, K] times weight [N, K] transposed, plus bias [N]: [rows, N], all in weight's dtype.
at::Tensor half_rows(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "half_rows: x [rows, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "half_rows: x and weight of one dtype");
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x32.options());
  if (w.scalar_type() == at::kBFloat16) {
    multiply(x32.data_ptr<float>(), w.data_ptr<at::BFloat16>(), y.data_ptr<float>(), x.size(0), w.size(1), w.size(0));
  } else {
    TORCH_CHECK(w.scalar_type() == at::kHalf, "half_rows: bfloat16 or float16 weights");
    multiply(x32.data_ptr<float>(), w.data_ptr<at::Half>(), y.data_ptr<float>(), x.size(0), w.size(1), w.size(0));
  }
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return y.to(x.scalar_type());
}


// exp of 8 floats x <= 0 (scores minus their maximum), Cephes' polynomial, within 2 ulp; below -87.3
// (2^-126) it gives about 1e-38 instead of less.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_setzero_ps()), _mm256_set1_ps(-87.3365447505531f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

// Asks for the cache lines of a slot's row of `dim` values, into L2.
template <typename Half>
inline void prefetch_row(const Half* row, int64_t dim) {
  constexpr int64_t kPerLine = 64 / sizeof(Half);
  for (int64_t d = 0; d < dim; d += kPerLine) _mm_prefetch(reinterpret_cast<const char*>(row + d), _MM_HINT_T1);
}

// scores[g, s] = q[g] . k[s] for the HEADS query heads g of one KV head and its slots [0, slots), each
// slot widened once for all of them; 4 slots at a time. Each slot's value row v[s] is prefetched on
// the way: weigh_values reads them next, and they would otherwise stall it one line at a time while
// the memory bus idles.
template <int HEADS, typename Half>
void score_slots(const float* q, const Half* k, int64_t k_slot, const Half* v, int64_t v_slot, int64_t slots,
                 int64_t dim, float* scores, int64_t scores_stride) {
  int64_t s = 0;
  for (; s + 4 <= slots; s += 4) {
    for (int j = 0; j < 4; ++j) prefetch_row(v + (s + j) * v_slot, dim);
    __m256 acc[HEADS][4];
#pragma GCC unroll 8
    for (int g = 0; g < HEADS; ++g)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      __m256 q8[HEADS];
#pragma GCC unroll 8
      for (int g = 0; g < HEADS; ++g) q8[g] = _mm256_loadu_ps(q + g * dim + d);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256 k8 = widen8(k + (s + j) * k_slot + d);
#pragma GCC unroll 8
        for (int g = 0; g < HEADS; ++g) acc[g][j] = _mm256_fmadd_ps(q8[g], k8, acc[g][j]);
      }
    }
    for (int g = 0; g < HEADS; ++g)
      for (int j = 0; j < 4; ++j) scores[g * scores_stride + s + j] = horizontal_sum(acc[g][j]);
  }
  for (; s < slots; ++s) {
    prefetch_row(v + s * v_slot, dim);
    __m256 acc[HEADS];
#pragma GCC unroll 8
    for (int g = 0; g < HEADS; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 k8 = widen8(k + s * k_slot + d);
#pragma GCC unroll 8
      for (int g = 0; g < HEADS; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * dim + d), k8, acc[g]);
    }
    for (int g = 0; g < HEADS; ++g) scores[g * scores_stride + s] = horizontal_sum(acc[g]);
  }
}

// out[g, d] = sum over visible slots of p[g, s] * v[s, d], for the HEADS query heads g and VECTORS * 8
// dims from `first`, in registers; each slot widened once for all heads.
template <int HEADS, int VECTORS, typename Half>
void weigh_values(const float* p, int64_t p_stride, const bool* visible, int64_t m_slot, const Half* v,
                  int64_t v_slot, int64_t slots, int64_t dim, int64_t first, float* out) {
  __m256 acc[HEADS][VECTORS];
#pragma GCC unroll 8
  for (int g = 0; g < HEADS; ++g)
#pragma GCC unroll 4
    for (int i = 0; i < VECTORS; ++i) acc[g][i] = _mm256_setzero_ps();
  for (int64_t s = 0; s < slots; ++s) {
    if (!visible[s * m_slot]) continue;  // whatever its stale values
    __m256 p8[HEADS];
#pragma GCC unroll 8
    for (int g = 0; g < HEADS; ++g) p8[g] = _mm256_set1_ps(p[g * p_stride + s]);
    const Half* row = v + s * v_slot + first;
#pragma GCC unroll 4
    for (int i = 0; i < VECTORS; ++i) {
      const __m256 v8 = widen8(row + 8 * i);
#pragma GCC unroll 8
      for (int g = 0; g < HEADS; ++g) acc[g][i] = _mm256_fmadd_ps(p8[g], v8, acc[g][i]);
    }
  }
  for (int g = 0; g < HEADS; ++g)
    for (int i = 0; i < VECTORS; ++i) _mm256_storeu_ps(out + g * dim + first + 8 * i, acc[g][i]);
}

// Unnormalized softmax over `scores` [slots, a multiple of 8] in place; masked slots hold -inf and
// get exactly 0. Returns the sum. Slot s is always in lane s % 8, so more masked slots after the last
// visible one (a longer sequence in the batch) add exact zeros and change no bit.
inline float exponentiate(float* scores, int64_t slots) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  __m256 high8 = _mm256_set1_ps(minus_inf);
  for (int64_t s = 0; s < slots; s += 8) high8 = _mm256_max_ps(high8, _mm256_loadu_ps(scores + s));
  float high = minus_inf;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, high8);
  for (float lane : lanes) high = std::max(high, lane);
  __m256 sum8 = _mm256_setzero_ps();
  for (int64_t s = 0; s < slots; s += 8) {
    const __m256 score = _mm256_loadu_ps(scores + s);
    const __m256 masked = _mm256_cmp_ps(score, _mm256_set1_ps(minus_inf), _CMP_EQ_OQ);
    const __m256 p = _mm256_andnot_ps(masked, exp8(_mm256_sub_ps(score, _mm256_set1_ps(high))));
    _mm256_storeu_ps(scores + s, p);
    sum8 = _mm256_add_ps(sum8, p);
  }
  return horizontal_sum(sum8);
}

constexpr int64_t kHeadsAtOnce = 3;  // query heads per pass over a KV head's slots: 12 of 16 registers accumulate

template <typename Half>
void attend(const float* q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask, float* out,
            int64_t groups) {
  const int64_t heads = keys.size(1), slots = keys.size(2), dim = keys.size(3);
  const int64_t k_batch = keys.stride(0), k_head = keys.stride(1), k_slot = keys.stride(2);
  const int64_t v_batch = values.stride(0), v_head = values.stride(1), v_slot = values.stride(2);
  const int64_t m_batch = mask.stride(0), m_head = mask.stride(1), m_slot = mask.stride(2);
  const Half* k_data = keys.data_ptr<Half>();
  const Half* v_data = values.data_ptr<Half>();
  const bool* mask_data = mask.data_ptr<bool>();
  const int64_t passes = (groups + kHeadsAtOnce - 1) / kHeadsAtOnce;
  at::parallel_for(0, keys.size(0) * heads * passes, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kHeadsAtOnce * ((slots + 7) / 8 * 8));
    for (int64_t unit = begin; unit < end; ++unit) {  // up to kHeadsAtOnce query heads of one KV head
      const int64_t b = unit / (heads * passes), h = unit / passes % heads;
      const int64_t first_head = (b * heads + h) * groups + unit % passes * kHeadsAtOnce;
      const int64_t n_heads = std::min(kHeadsAtOnce, (b * heads + h + 1) * groups - first_head);
      const bool* visible = mask_data + b * m_batch + h * m_head;
      int64_t used = slots;  // the slots after the last visible one (a cache not yet full) are not read
      while (used > 0 && !visible[(used - 1) * m_slot]) --used;
      const int64_t padded = (used + 7) / 8 * 8;
      const Half* k_unit = k_data + b * k_batch + h * k_head;
      const Half* v_unit = v_data + b * v_batch + h * v_head;
      const float* q_unit = q + first_head * dim;
      float* out_unit = out + first_head * dim;
      dispatch_up_to<kHeadsAtOnce>(n_heads, [&](auto n) {
        constexpr int kHeads = decltype(n)::value;
        score_slots<kHeads>(q_unit, k_unit, k_slot, v_unit, v_slot, used, dim, scores.data(), padded);
        float sums[kHeads];
        for (int g = 0; g < kHeads; ++g) {
          float* row = scores.data() + g * padded;
          for (int64_t s = 0; s < padded; ++s)
            if (s >= used || !visible[s * m_slot]) row[s] = -std::numeric_limits<float>::infinity();
          sums[g] = exponentiate(row, padded);
        }
        for (int64_t first = 0; first < dim; first += 32)
          dispatch_up_to<4>(std::min<int64_t>(4, (dim - first) / 8), [&](auto v) {
            weigh_values<kHeads, decltype(v)::value>(scores.data(), padded, visible, m_slot, v_unit, v_slot, used,
                                                     dim, first, out_unit);
          });
        for (int g = 0; g < kHeads; ++g)
          for (int64_t d = 0; d < dim; ++d)
            out_unit[g * dim + d] = sums[g] > 0.0f ? out_unit[g * dim + d] / sums[g] : 0.0f;  // 0 if all masked
      });
    }
  });
}

// Softmax attention of q [B, H, G, D] (the G query heads of each KV head, one token) over keys and
// values [B, H, S, D] at the slots where mask [B, H or 1, S] is true, scaled by 1/sqrt(D).
at::Tensor half_decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                 const at::Tensor& mask) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && keys.sizes() == values.sizes(), "half_decode_attention: 4-d inputs");
  TORCH_CHECK(q.size(0) == keys.size(0) && q.size(1) == keys.size(1) && q.size(3) == keys.size(3),
              "half_decode_attention: q [B, H, G, D] against keys [B, H, S, D]");
  TORCH_CHECK(keys.size(3) % 8 == 0, "half_decode_attention: head dim a multiple of 8");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(),
              "half_decode_attention: q, keys and values of one dtype");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "half_decode_attention: contiguous head dims");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 3, "half_decode_attention: a bool mask [B, H, S]");
  const at::Tensor slot_mask = mask.expand({keys.size(0), keys.size(1), keys.size(2)});
  const at::Tensor q32 = (q.to(at::kFloat) * (1.0 / std::sqrt(static_cast<double>(q.size(3))))).contiguous();
  at::Tensor out = at::empty(q.sizes(), q32.options());
  if (keys.scalar_type() == at::kBFloat16) {
    attend<at::BFloat16>(q32.data_ptr<float>(), keys, values, slot_mask, out.data_ptr<float>(), q.size(2));
  } else {
    TORCH_CHECK(keys.scalar_type() == at::kHalf, "half_decode_attention: bfloat16 or float16");
    attend<at::Half>(q32.data_ptr<float>(), keys, values, slot_mask, out.data_ptr<float>(), q.size(2));
  }
  return out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvwb, m) {
  m.def("half_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("half_decode_attention(Tensor q, Tensor keys, Tensor values, Tensor mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvwb, CPU, m) {
  m.impl("half_rows", &half_rows);
  m.impl("half_decode_attention", &half_decode_attention);
}
