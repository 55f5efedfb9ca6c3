// The squared L2 norm of a flat fp32/bf16/fp16 tensor, summed in fp64, in one
// pass with the GIL released. Built with the Adam kernels (extension.py).
//
// Why here: the overlapped optimizer step takes every sub-group's squared
// gradient norm on its worker thread while backward runs on the main thread.
// In torch ops that was ~150 calls per 19M elements, each taking the GIL from
// backward's hooks: 14-29 ms per sub-group on two cores, against 3 ms here.
//
// Numerics: sq_norm.h (the Adam kernels take the same sums beside their update).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "chunks.h"
#include "sq_norm.h"

namespace infinity_kernels {
namespace {

// Blocks are handed to threads a few at a time (chunks.h); fewer than 8 are summed on the calling thread.
constexpr ChunkShape kBlockChunks{/*unit=*/1, /*min_chunk=*/1, /*max_chunk=*/64, /*grain=*/8};

template <class T>
double sq_sum(const T* x, int64_t n, int64_t threads) {
  const int64_t blocks = (n + kNormBlock - 1) / kNormBlock;
  std::vector<double> sums(blocks, 0.0);
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t start = b * kNormBlock;
      sums[b] = block_sq_sum(x + start, std::min(kNormBlock, n - start));
    }
  };
  run_in_chunks(blocks, threads, kBlockChunks, run);
  return sum_in_order(sums);
}

double sq_norm_fp64(const at::Tensor& values, int64_t threads) {
  TORCH_CHECK(values.device().is_cpu(), "values must be on the CPU");
  TORCH_CHECK(values.is_contiguous(), "values must be contiguous");
  const int64_t n = values.numel();
  if (n == 0) return 0.0;
  switch (values.scalar_type()) {
    case at::kFloat: return sq_sum(values.data_ptr<float>(), n, threads);
    case at::kBFloat16: return sq_sum(values.data_ptr<c10::BFloat16>(), n, threads);
    case at::kHalf: return sq_sum(values.data_ptr<c10::Half>(), n, threads);
    default: TORCH_CHECK(false, "values must be float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infinity_kernels, m) {
  m.def("sq_norm_fp64(Tensor values, int threads=0) -> float", &sq_norm_fp64);
}

}  // namespace infinity_kernels
