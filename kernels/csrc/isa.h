// The x86 code paths ("bodies") of the CPU kernels and the best one this CPU
// runs. Each kernel file compiles its vector bodies in `#pragma GCC target`
// regions, so one build serves every x86 CPU and the body is chosen at run
// time; the generic body is plain C++ that the compiler vectorizes for
// whatever -march=native allows (NEON, SVE, ...).

#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define INFINITY_X86 1
#include <immintrin.h>
#else
#define INFINITY_X86 0
#endif

namespace infinity_kernels {

// The codes of extension.ISA_CODES.
enum class Isa : int64_t { kAuto = 0, kGeneric = 1, kAvx2 = 2, kAvx512 = 3 };

inline Isa best_isa() {
#if INFINITY_X86
  static const Isa best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
      return Isa::kAvx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return Isa::kAvx2;
    return Isa::kGeneric;
  }();
  return best;
#else
  return Isa::kGeneric;
#endif
}

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kGeneric: return "generic";
    default: return "auto";
  }
}

// The body to run for an ISA code from Python: "auto" is the best one both this
// CPU and the kernel (whose best body is `kernel_best`) have.
inline Isa resolve_isa(int64_t code, Isa kernel_best, const char* kernel) {
  TORCH_CHECK(code >= 0 && code <= 3, "isa must be 0..3, got ", code);
  const Isa cpu_best = best_isa();
  if (code == 0) return std::min(cpu_best, kernel_best);
  const Isa isa = static_cast<Isa>(code);
  TORCH_CHECK(isa <= kernel_best, "the ", kernel, " kernel has no ", isa_name(isa), " body (best: ",
              isa_name(kernel_best), ")");
  TORCH_CHECK(isa <= cpu_best, "this CPU cannot run the ", isa_name(isa), " body (best: ",
              isa_name(cpu_best), ")");
  return isa;
}

}  // namespace infinity_kernels
