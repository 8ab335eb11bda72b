// Decode-step kernels for CPUs with AVX2 but no bfloat16 or float16 arithmetic (one_token.py builds
// and loads them there). Without half-precision instructions ATen emulates half-precision products
// element by element, and oneDNN refuses them; an upcast copy streams twice the bytes. Both kernels
// widen the half-precision weights or cache to float32 in registers, sum in float32 and round once.
// A sequence's values do not depend on the other sequences of its batch, nor on how many slots the
// batch's cache has past its own.
//
// half_rows: the few rows of a decode step (one per sequence) times a weight, reading the weight once
// for up to 8 rows.
// half_decode_attention: one query head at a time against the cache slots of its KV head (the query
// heads sharing a KV head read its slots again, from the CPU's cache).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 8;  // float32 accumulators held in registers, one per input row

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

// y[m, n] = x[m, :] . w[n, :] for ROWS rows of x and the weight rows [n0, n1).
template <int ROWS, typename Half>
void multiply_rows(const float* x, const Half* w, float* y, int64_t k_size, int64_t n_size, int64_t n0, int64_t n1) {
  const int64_t vector_end = k_size - k_size % 8;
  for (int64_t n = n0; n < n1; ++n) {
    const Half* w_row = w + n * k_size;
    __m256 acc[ROWS];
    for (int m = 0; m < ROWS; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < vector_end; k += 8) {
      const __m256 w8 = widen8(w_row + k);
      for (int m = 0; m < ROWS; ++m) acc[m] = _mm256_fmadd_ps(w8, _mm256_loadu_ps(x + m * k_size + k), acc[m]);
    }
    for (int m = 0; m < ROWS; ++m) {
      float sum = horizontal_sum(acc[m]);
      for (int64_t k = vector_end; k < k_size; ++k) sum += static_cast<float>(w_row[k]) * x[m * k_size + k];
      y[m * n_size + n] = sum;
    }
  }
}

template <typename Half>
void multiply(const float* x, const Half* w, float* y, int64_t rows, int64_t k_size, int64_t n_size) {
  at::parallel_for(0, n_size, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
      const float* xm = x + m0 * k_size;
      float* ym = y + m0 * n_size;
      switch (std::min(kMaxRows, rows - m0)) {
        case 8: multiply_rows<8>(xm, w, ym, k_size, n_size, n0, n1); break;
        case 7: multiply_rows<7>(xm, w, ym, k_size, n_size, n0, n1); break;
        case 6: multiply_rows<6>(xm, w, ym, k_size, n_size, n0, n1); break;
        case 5: multiply_rows<5>(xm, w, ym, k_size, n_size, n0, n1); break;
        case 4: multiply_rows<4>(xm, w, ym, k_size, n_size, n0, n1); break;
        case 3: multiply_rows<3>(xm, w, ym, k_size, n_size, n0, n1); break;
        case 2: multiply_rows<2>(xm, w, ym, k_size, n_size, n0, n1); break;
        default: multiply_rows<1>(xm, w, ym, k_size, n_size, n0, n1);
      }
    }
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

// scores[s] = q . k[s] for the slots [0, slots) of one KV head, 4 slots at a time (4 independent sums).
template <typename Half>
void score_slots(const float* q, const Half* k, int64_t k_slot, int64_t slots, int64_t dim, float* scores) {
  int64_t s = 0;
  for (; s + 4 <= slots; s += 4) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 q8 = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(q8, widen8(k + (s + j) * k_slot + d), acc[j]);
    }
    for (int j = 0; j < 4; ++j) scores[s + j] = horizontal_sum(acc[j]);
  }
  for (; s < slots; ++s) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), widen8(k + s * k_slot + d), acc);
    scores[s] = horizontal_sum(acc);
  }
}

// out[d] = sum over slots of p[s] * v[s, d] for VECTORS * 8 dims from `first`, in registers.
template <int VECTORS, typename Half>
void weigh_values(const float* p, const Half* v, int64_t v_slot, int64_t slots, int64_t first, float* out) {
  __m256 acc[VECTORS];
  for (int i = 0; i < VECTORS; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t s = 0; s < slots; ++s) {
    if (p[s] == 0.0f) continue;  // a masked slot, whatever its stale values
    const __m256 p8 = _mm256_set1_ps(p[s]);
    const Half* row = v + s * v_slot + first;
    for (int i = 0; i < VECTORS; ++i) acc[i] = _mm256_fmadd_ps(p8, widen8(row + 8 * i), acc[i]);
  }
  for (int i = 0; i < VECTORS; ++i) _mm256_storeu_ps(out + first + 8 * i, acc[i]);
}

template <typename Half>
void weigh_all_values(const float* p, const Half* v, int64_t v_slot, int64_t slots, int64_t dim, float* out) {
  for (int64_t first = 0; first < dim; first += 64) {
    switch (std::min<int64_t>(8, (dim - first) / 8)) {
      case 8: weigh_values<8>(p, v, v_slot, slots, first, out); break;
      case 7: weigh_values<7>(p, v, v_slot, slots, first, out); break;
      case 6: weigh_values<6>(p, v, v_slot, slots, first, out); break;
      case 5: weigh_values<5>(p, v, v_slot, slots, first, out); break;
      case 4: weigh_values<4>(p, v, v_slot, slots, first, out); break;
      case 3: weigh_values<3>(p, v, v_slot, slots, first, out); break;
      case 2: weigh_values<2>(p, v, v_slot, slots, first, out); break;
      default: weigh_values<1>(p, v, v_slot, slots, first, out);
    }
  }
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
  at::parallel_for(0, keys.size(0) * heads * groups, 1, [&](int64_t begin, int64_t end) {
    const int64_t padded = (slots + 7) / 8 * 8;
    std::vector<float> scores(padded);
    for (int64_t unit = begin; unit < end; ++unit) {  // one query head: its KV head's slots
      const int64_t b = unit / (heads * groups), h = unit / groups % heads;
      const bool* visible = mask_data + b * m_batch + h * m_head;
      score_slots(q + unit * dim, k_data + b * k_batch + h * k_head, k_slot, slots, dim, scores.data());
      for (int64_t s = 0; s < padded; ++s)
        if (s >= slots || !visible[s * m_slot]) scores[s] = -std::numeric_limits<float>::infinity();
      const float sum = exponentiate(scores.data(), padded);
      float* out_unit = out + unit * dim;
      weigh_all_values(scores.data(), v_data + b * v_batch + h * v_head, v_slot, slots, dim, out_unit);
      for (int64_t d = 0; d < dim; ++d) out_unit[d] = sum > 0.0f ? out_unit[d] / sum : 0.0f;  // 0 if all masked
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
