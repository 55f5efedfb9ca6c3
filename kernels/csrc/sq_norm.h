// The squared L2 norm of a flat fp32/bf16/fp16 tensor in fp64, block by block:
// sq_norm.cpp's op sums a tensor alone; the Adam kernels sum their gradient
// beside their update (sq_sum_beside), so the norm costs no pass of its own.
//
// Numerics. A square of an fp32 (or narrower) value is exact in fp64 and never
// overflows, so the sum is finite exactly when every value is. The tensor is
// cut into blocks of kNormBlock elements; each block is summed by kNormLanes
// independent fp64 accumulators (element i into lane i % kNormLanes, which the
// compiler keeps in vector registers), the lanes are added in order, and the
// block sums are added in block order. No step depends on the thread count,
// on which thread ran a block or on which kernel took the norm: the same tensor
// always gives the same bits.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "chunks.h"

namespace infinity_kernels {

constexpr int64_t kNormBlock = 1 << 16;
constexpr int kNormLanes = 16;

template <class T>
double block_sq_sum(const T* x, int64_t n) {
  double lanes[kNormLanes] = {};
  int64_t i = 0;
  for (; i + kNormLanes <= n; i += kNormLanes) {
    for (int j = 0; j < kNormLanes; ++j) {
      const double v = static_cast<double>(static_cast<float>(x[i + j]));
      lanes[j] += v * v;
    }
  }
  for (int j = 0; i < n; ++i, ++j) {
    const double v = static_cast<double>(static_cast<float>(x[i]));
    lanes[j] += v * v;
  }
  double total = 0.0;
  for (int j = 0; j < kNormLanes; ++j) total += lanes[j];
  return total;
}

// The block sums added in block order.
inline double sum_in_order(const std::vector<double>& sums) {
  double total = 0.0;
  for (double s : sums) total += s;
  return total;
}

// A step over [0, n) whose every chunk is one norm block: span(begin, end) runs
// right after that block of `g` was summed, so it reads the gradients from the
// cache rather than from memory a second time. Returns the squared norm of `g`,
// the same bits as sq_norm.cpp's op. Each span begins on a norm block, a
// multiple of every kernel's chunk unit, and is no longer than the kernels'
// largest chunk (2^16 elements), so a kernel runs as it does alone.
template <class G, class Span>
double sq_sum_beside(const G* g, int64_t n, int64_t threads, const Span& span) {
  // One block a chunk; a tensor of a single block runs on the calling thread.
  constexpr ChunkShape kBlockEach{/*unit=*/1, /*min_chunk=*/1, /*max_chunk=*/1, /*grain=*/2};
  const int64_t blocks = (n + kNormBlock - 1) / kNormBlock;
  std::vector<double> sums(blocks, 0.0);
  run_in_chunks(blocks, threads, kBlockEach, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t begin = b * kNormBlock;
      const int64_t end = std::min(begin + kNormBlock, n);
      sums[b] = block_sq_sum(g + begin, end - begin);
      span(begin, end);
    }
  });
  return sum_in_order(sums);
}

// Where an op writes its gradient's squared norm: the optional one-element fp64
// CPU tensor it was given (0 until the op writes it), else nullptr (not asked).
inline double* sq_norm_out(const c10::optional<at::Tensor>& grad_sq_norm) {
  if (!grad_sq_norm.has_value()) return nullptr;
  const at::Tensor& t = *grad_sq_norm;
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kDouble && t.numel() == 1,
              "grad_sq_norm must be one float64 element on the CPU");
  double* out = t.data_ptr<double>();
  *out = 0.0;
  return out;
}

}  // namespace infinity_kernels
