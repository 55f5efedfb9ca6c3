// Fused mixed-precision Adam/AdamW step over fp32 master, moments and
// fp32/bf16/fp16 gradients, writing an optional low-precision parameter copy
// in the same pass. Built on first use by infinity/kernels/extension.py.
//
// Numerics. Every element goes through the same sequence of IEEE-754 fp32
// operations, each rounded once (no FMA: the build passes -ffp-contract=off),
// in the order of torch's fused Adam (aten/src/ATen/native/cpu/FusedAdamKernel.cpp):
//
//   p  = p * decay                      (AdamW, weight_decay != 0)
//   g  = g + p * l2                     (Adam,  weight_decay != 0)
//   m  = base + coeff * (g - m)         (m.lerp_(g, 1 - beta1); base, coeff as in torch)
//   v  = v * beta2 + ((1 - beta2) * g) * g
//   d  = sqrt(v) / sqrt(bias_correction2) + eps
//   p  = p + (-step_size * m) / d
//   out = round_to_nearest_even(p)      (bf16, fp16 or fp32)
//
// so the vector body, the scalar tails and the pure-torch reference
// (reference.py) agree bit for bit. The scalar constants arrive as doubles
// computed by Python and are rounded to fp32 here, as torch rounds them.
//
// Code paths. AVX-512 and AVX2 bodies are compiled in `#pragma GCC target`
// regions and picked at run time by cpuid; the generic body is plain C++ that
// the compiler vectorizes for whatever -march=native allows (NEON, SVE, ...).
// Tails and alignment peels use the generic body.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "chunks.h"
#include "isa.h"
#include "sq_norm.h"

namespace infinity_kernels {
namespace {

using BF16 = c10::BFloat16;
using F16 = c10::Half;

// The parameter copy is optional; `NoOut` stands for "none given".
struct NoOut {};

enum class Decay { kNone, kDecoupled, kL2 };

// The step's constants, as doubles; see the header comment.
struct Hyper {
  double decay;                  // 1 - lr * weight_decay            (AdamW)
  double l2;                     // weight_decay                      (Adam)
  double lerp_weight;            // 1 - beta1
  double beta2;
  double beta2_complement;       // 1 - beta2
  double bias_correction2_sqrt;  // sqrt(1 - beta2**step), or 1
  double neg_step_size;          // -lr / (1 - beta1**step), or -lr
  double eps;
};

// Copy bytes above which the parameter copy is written with non-temporal
// stores: it is write-only, so this saves the read-for-ownership of each of
// its lines, and it is consumed later (written to a tier), not from cache.
constexpr int64_t kStreamMinBytes = 4 << 20;
// Chunks (chunks.h) are multiples of 64 elements (a 64-byte line of every
// dtype, a multiple of every vector width); fewer than 2^15 elements run on
// the calling thread alone.
constexpr ChunkShape kChunks{/*unit=*/64, /*min_chunk=*/1 << 12, /*max_chunk=*/1 << 16, /*grain=*/1 << 15};

// ---------------------------------------------------------------------------
// Generic body: one element at a time, written so that compilers vectorize it.

inline uint16_t bf16_bits_rne(float x) {
  // Round to nearest even, as c10::BFloat16 and torch's vectorized cast do;
  // NaN becomes 0xFFFF as in torch's vectorized cast (Vectorized<BFloat16>).
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if (x != x) return 0xFFFF;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct Generic {
  using F = float;
  static constexpr int64_t kWidth = 1;

  static F set1(double x) { return static_cast<float>(x); }
  static F load(const float* p) { return *p; }
  static F load(const BF16* p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof(h));
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float x;
    std::memcpy(&x, &u, sizeof(x));
    return x;
  }
  static F load(const F16* p) {
#if INFINITY_X86 && defined(__F16C__)
    uint16_t h;
    std::memcpy(&h, p, sizeof(h));
    return _cvtsh_ss(h);
#else
    return static_cast<float>(*p);
#endif
  }
  static void store(float* p, F x) { *p = x; }
  static void store(BF16* p, F x) {
    uint16_t h = bf16_bits_rne(x);
    std::memcpy(p, &h, sizeof(h));
  }
  static void store(F16* p, F x) {
#if INFINITY_X86 && defined(__F16C__)
    // The same instruction as the vector bodies, so NaN payloads agree too.
    uint16_t h = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    std::memcpy(p, &h, sizeof(h));
#else
    *p = F16(x);
#endif
  }
  template <class T>
  static void stream(T* p, F x) { store(p, x); }
  static void stream(NoOut*, F) {}
  static void store(NoOut*, F) {}

  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  static void fence() {}
};

// ---------------------------------------------------------------------------
// The step, written once for every body S.

template <class S>
struct Consts {
  typename S::F decay, l2, coeff, beta2, beta2_complement, bc2_sqrt, neg_step, eps;
  bool base_is_avg;  // torch's lerp: m + w*(g-m) when |w| < 0.5, else g + (w-1)*(g-m)

  explicit Consts(const Hyper& h) {
    const float w = static_cast<float>(h.lerp_weight);
    base_is_avg = std::fabs(w) < 0.5f;
    decay = S::set1(h.decay);
    l2 = S::set1(h.l2);
    coeff = S::set1(base_is_avg ? w : w - 1.0f);
    beta2 = S::set1(h.beta2);
    beta2_complement = S::set1(h.beta2_complement);
    bc2_sqrt = S::set1(h.bias_correction2_sqrt);
    neg_step = S::set1(h.neg_step_size);
    eps = S::set1(h.eps);
  }
};

template <class S, Decay D, bool kStream, class G, class O>
inline void adam_at(const Consts<S>& c, float* p, const G* g, float* m, float* v, O* out) {
  auto grad = S::load(g);
  auto param = S::load(p);
  if constexpr (D == Decay::kDecoupled) param = S::mul(param, c.decay);
  if constexpr (D == Decay::kL2) grad = S::add(grad, S::mul(param, c.l2));
  auto avg = S::load(m);
  auto base = c.base_is_avg ? avg : grad;
  avg = S::add(base, S::mul(c.coeff, S::sub(grad, avg)));
  auto sq = S::load(v);
  sq = S::add(S::mul(sq, c.beta2), S::mul(S::mul(c.beta2_complement, grad), grad));
  auto denom = S::add(S::div(S::sqrt(sq), c.bc2_sqrt), c.eps);
  param = S::add(param, S::div(S::mul(c.neg_step, avg), denom));
  S::store(p, param);
  S::store(m, avg);
  S::store(v, sq);
  if constexpr (kStream) {
    S::stream(out, param);
  } else {
    S::store(out, param);
  }
}

// The bandwidth floor for benchmarks: the same loads and stores as adam_at,
// with one multiply and three adds instead of the step's arithmetic: each of
// p, m, v gets 0 * g added (the 0 comes in at run time), so values stay put.
template <class S, Decay, bool kStream, class G, class O>
inline void touch_at(const Consts<S>& c, float* p, const G* g, float* m, float* v, O* out) {
  const auto zero_grad = S::mul(S::load(g), c.neg_step);
  const auto param = S::add(S::load(p), zero_grad);
  S::store(p, param);
  S::store(m, S::add(S::load(m), zero_grad));
  S::store(v, S::add(S::load(v), zero_grad));
  if constexpr (kStream) {
    S::stream(out, param);
  } else {
    S::store(out, param);
  }
}

enum class Op { kAdam, kTouch };

template <Op K, class S, Decay D, bool kStream, class G, class O>
inline void op_at(const Consts<S>& c, float* p, const G* g, float* m, float* v, O* out) {
  if constexpr (K == Op::kAdam) {
    adam_at<S, D, kStream>(c, p, g, m, v, out);
  } else {
    touch_at<S, D, kStream>(c, p, g, m, v, out);
  }
}

template <class O>
inline O* advance(O* out, int64_t i) {
  if constexpr (std::is_same_v<O, NoOut>) {
    return out;
  } else {
    return out + i;
  }
}

// Elements [begin, end) with body S; the generic body for what S cannot take.
template <Op K, class S, Decay D, class G, class O>
void run_span(const Hyper& h, float* p, const G* g, float* m, float* v, O* out,
              int64_t begin, int64_t end, bool stream) {
  const Consts<Generic> c1(h);
  int64_t i = begin;
  auto scalar_until = [&](int64_t stop) {
    for (; i < stop; ++i) {
      op_at<K, Generic, D, false>(c1, p + i, g + i, m + i, v + i, advance(out, i));
    }
  };
  if constexpr (S::kWidth == 1) {
    scalar_until(end);
  } else {
    const Consts<S> c(h);
    constexpr int64_t W = S::kWidth;
    if constexpr (std::is_same_v<O, NoOut>) {
      stream = false;
    } else {
      if (stream) {
        // Peel until the copy's stores are aligned to a whole vector.
        constexpr uintptr_t kAlign = W * sizeof(O);
        const auto addr = reinterpret_cast<uintptr_t>(out + i);
        if (addr % sizeof(O) != 0) {
          stream = false;
        } else {
          const int64_t peel = static_cast<int64_t>(((kAlign - addr % kAlign) % kAlign) / sizeof(O));
          scalar_until(std::min(end, i + peel));
        }
      }
    }
    const int64_t vec_end = i + (end - i) / W * W;
    if (stream) {
      for (; i < vec_end; i += W) {
        op_at<K, S, D, true>(c, p + i, g + i, m + i, v + i, advance(out, i));
      }
      S::fence();
    } else {
      for (; i < vec_end; i += W) {
        op_at<K, S, D, false>(c, p + i, g + i, m + i, v + i, advance(out, i));
      }
    }
    scalar_until(end);
  }
}

// ---------------------------------------------------------------------------
// x86 bodies. Each lives in its own target region, so one build serves every
// x86 CPU and the best body is chosen at run time.

#if INFINITY_X86

#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx2,f16c"))), apply_to = function)
#endif

struct Avx2 {
  using F = __m256;
  static constexpr int64_t kWidth = 8;

  static F set1(double x) { return _mm256_set1_ps(static_cast<float>(x)); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const BF16* p) {
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  static F load(const F16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static __m128i to_bf16(F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    r = _mm256_srli_epi32(r, 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), _mm256_castps_si256(nan));
    // Pack the eight 32-bit lanes to 16 bits (packus works per 128-bit half).
    const __m256i packed = _mm256_packus_epi32(r, r);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
  }
  static __m128i to_f16(F x) {
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static void store(BF16* p, F x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }
  static void store(F16* p, F x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_f16(x)); }
  static void store(NoOut*, F) {}
  static void stream(float* p, F x) { _mm256_stream_ps(p, x); }
  static void stream(BF16* p, F x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }
  static void stream(F16* p, F x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_f16(x)); }
  static void stream(NoOut*, F) {}

  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static void fence() { _mm_sfence(); }
};

template <Op K, Decay D, class G, class O>
__attribute__((noinline)) void span_avx2(const Hyper& h, float* p, const G* g, float* m, float* v,
                                         O* out, int64_t begin, int64_t end, bool stream) {
  run_span<K, Avx2, D>(h, p, g, m, v, out, begin, end, stream);
}

#ifdef __clang__
#pragma clang attribute pop
#endif
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c"))), apply_to = function)
#endif

struct Avx512 {
  using F = __m512;
  static constexpr int64_t kWidth = 16;

  static F set1(double x) { return _mm512_set1_ps(static_cast<float>(x)); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const BF16* p) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  }
  static F load(const F16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m256i to_bf16(F x) {
    // Not vcvtneps2bf16: it flushes denormals, torch's cast does not.
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0xFFFF));
    return _mm512_cvtepi32_epi16(r);
  }
  static __m256i to_f16(F x) {
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static void store(BF16* p, F x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }
  static void store(F16* p, F x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_f16(x)); }
  static void store(NoOut*, F) {}
  static void stream(float* p, F x) { _mm512_stream_ps(p, x); }
  static void stream(BF16* p, F x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }
  static void stream(F16* p, F x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_f16(x)); }
  static void stream(NoOut*, F) {}

  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static void fence() { _mm_sfence(); }
};

template <Op K, Decay D, class G, class O>
__attribute__((noinline)) void span_avx512(const Hyper& h, float* p, const G* g, float* m, float* v,
                                           O* out, int64_t begin, int64_t end, bool stream) {
  run_span<K, Avx512, D>(h, p, g, m, v, out, begin, end, stream);
}

#ifdef __clang__
#pragma clang attribute pop
#endif
#pragma GCC pop_options

#endif  // INFINITY_X86

// ---------------------------------------------------------------------------
// Dispatch: body, then decay mode and dtypes, then threads.

template <Op K, Decay D, class G, class O>
void run_parallel(Isa isa, const Hyper& h, float* p, const G* g, float* m, float* v, O* out,
                  int64_t n, int64_t threads, double* grad_sq_norm) {
  bool stream = false;
  if constexpr (!std::is_same_v<O, NoOut>) {
    stream = n * static_cast<int64_t>(sizeof(O)) >= kStreamMinBytes;
  }
  auto span = [&](int64_t begin, int64_t end) {
    switch (isa) {
#if INFINITY_X86
      case Isa::kAvx512: span_avx512<K, D>(h, p, g, m, v, out, begin, end, stream); return;
      case Isa::kAvx2: span_avx2<K, D>(h, p, g, m, v, out, begin, end, stream); return;
#endif
      default: run_span<K, Generic, D>(h, p, g, m, v, out, begin, end, stream); return;
    }
  };
  if (grad_sq_norm != nullptr) {
    // each norm block summed just before the update reads it: one pass over the gradients, not two
    *grad_sq_norm = sq_sum_beside(g, n, threads, span);
    return;
  }
  run_in_chunks(n, threads, kChunks, span);
}

template <Op K, Decay D, class G>
void with_out(Isa isa, const Hyper& h, float* p, const G* g, float* m, float* v,
              const c10::optional<at::Tensor>& out, int64_t n, int64_t threads, double* sq) {
  if (!out.has_value()) {
    NoOut none;
    return run_parallel<K, D>(isa, h, p, g, m, v, &none, n, threads, sq);
  }
  switch (out->scalar_type()) {
    case at::kFloat: return run_parallel<K, D>(isa, h, p, g, m, v, out->data_ptr<float>(), n, threads, sq);
    case at::kBFloat16: return run_parallel<K, D>(isa, h, p, g, m, v, out->data_ptr<BF16>(), n, threads, sq);
    case at::kHalf: return run_parallel<K, D>(isa, h, p, g, m, v, out->data_ptr<F16>(), n, threads, sq);
    default: TORCH_CHECK(false, "param_out must be float32, bfloat16 or float16");
  }
}

template <Op K, Decay D>
void with_grad(Isa isa, const Hyper& h, const at::Tensor& param, const at::Tensor& grad,
               const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
               const c10::optional<at::Tensor>& out, int64_t threads, double* sq) {
  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const int64_t n = param.numel();
  switch (grad.scalar_type()) {
    case at::kFloat: return with_out<K, D>(isa, h, p, grad.data_ptr<float>(), m, v, out, n, threads, sq);
    case at::kBFloat16: return with_out<K, D>(isa, h, p, grad.data_ptr<BF16>(), m, v, out, n, threads, sq);
    case at::kHalf: return with_out<K, D>(isa, h, p, grad.data_ptr<F16>(), m, v, out, n, threads, sq);
    default: TORCH_CHECK(false, "grad must be float32, bfloat16 or float16");
  }
}

void check(const at::Tensor& t, const char* name, int64_t n, bool fp32) {
  // Python validates first with ValueError; these guard direct op calls.
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements, param has ", n);
  TORCH_CHECK(!fp32 || t.scalar_type() == at::kFloat, name, " must be float32");
}

template <Op K>
void run_op(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
            const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& param_out,
            const Hyper& h, bool decoupled, int64_t isa_code, int64_t threads,
            const c10::optional<at::Tensor>& grad_sq_norm) {
  const int64_t n = param.numel();
  check(param, "param", n, true);
  check(grad, "grad", n, false);
  check(exp_avg, "exp_avg", n, true);
  check(exp_avg_sq, "exp_avg_sq", n, true);
  if (param_out.has_value()) check(*param_out, "param_out", n, false);
  double* sq = sq_norm_out(grad_sq_norm);
  if (n == 0) return;
  const Isa isa = resolve_isa(isa_code, Isa::kAvx512, "fused Adam");
  if constexpr (K == Op::kTouch) {
    with_grad<K, Decay::kNone>(isa, h, param, grad, exp_avg, exp_avg_sq, param_out, threads, sq);
  } else if (h.l2 != 0.0 && !decoupled) {
    with_grad<K, Decay::kL2>(isa, h, param, grad, exp_avg, exp_avg_sq, param_out, threads, sq);
  } else if (h.decay != 1.0 && decoupled) {
    with_grad<K, Decay::kDecoupled>(isa, h, param, grad, exp_avg, exp_avg_sq, param_out, threads, sq);
  } else {
    with_grad<K, Decay::kNone>(isa, h, param, grad, exp_avg, exp_avg_sq, param_out, threads, sq);
  }
}

void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& param_out,
               bool decoupled, double decay, double l2, double lerp_weight, double beta2,
               double beta2_complement, double bias_correction2_sqrt, double neg_step_size,
               double eps, int64_t isa, int64_t threads, const c10::optional<at::Tensor>& grad_sq_norm) {
  const Hyper h{decay, l2, lerp_weight, beta2, beta2_complement, bias_correction2_sqrt,
                neg_step_size, eps};
  run_op<Op::kAdam>(param, grad, exp_avg, exp_avg_sq, param_out, h, decoupled, isa, threads, grad_sq_norm);
}

void touch(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
           const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& param_out,
           int64_t isa, int64_t threads) {
  const Hyper h{1.0, 0.0, 0.1, 0.0, 0.0, 1.0, /*neg_step_size: the zero factor*/ 0.0, 0.0};
  run_op<Op::kTouch>(param, grad, exp_avg, exp_avg_sq, param_out, h, false, isa, threads, c10::nullopt);
}

std::string best_isa_name() { return isa_name(best_isa()); }

}  // namespace

TORCH_LIBRARY(infinity_kernels, m) {
  m.def(
      "adam_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? param_out, bool decoupled, float decay, float l2, float lerp_weight, "
      "float beta2, float beta2_complement, float bias_correction2_sqrt, float neg_step_size, "
      "float eps, int isa, int threads=0, Tensor(e!)? grad_sq_norm=None) -> ()",
      &adam_step);
  m.def(
      "touch(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? param_out, int isa, int threads=0) -> ()",
      &touch);
  m.def("best_isa() -> str", &best_isa_name);
}

}  // namespace infinity_kernels
