// How the CPU kernels spread a tensor over threads, and how many threads.
//
// Work is split into chunks that threads claim one at a time, so a thread that
// the OS descheduled (a busy host, the engine's I/O threads) delays the step by
// one chunk, not by half the tensor. Results depend on neither the team's size
// nor which thread ran a chunk: each element is computed alone.
//
// The team's size is the caller's: `threads` > 0 asks for exactly that many
// (the engine sizes its team from the machine and binds it to cores of its own,
// infinity/runtime/host_cores.py, so it does not take the core that feeds the
// GPU); 0 takes torch's count (torch.set_num_threads). The team is an OpenMP
// region of its own, not at::parallel_for, whose team is capped by torch's
// count. Threads that OpenMP starts for a calling thread inherit that thread's
// CPU affinity, which is how a bound caller's team stays on its cores.

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace infinity_kernels {

struct ChunkShape {
  int64_t unit;           // a chunk is a multiple of this many elements (vector widths, blocks)
  int64_t min_chunk;
  int64_t max_chunk;
  int64_t grain;          // fewer elements than this run on the calling thread alone
  int64_t per_thread = 8; // chunks a thread claims on average
};

inline int64_t team_size(int64_t threads) {
  TORCH_CHECK(threads >= 0, "threads must be 0 (torch's count) or positive, got ", threads);
  return threads > 0 ? threads : static_cast<int64_t>(at::get_num_threads());
}

// Calls span(begin, end) over [0, n) in chunks, on `threads` threads (0: torch's count).
template <class Span>
void run_in_chunks(int64_t n, int64_t threads, const ChunkShape& shape, const Span& span) {
  const int64_t team = team_size(threads);
  if (n < shape.grain || team <= 1 || at::in_parallel_region() || omp_in_parallel()) {
    span(0, n);
    return;
  }
  int64_t chunk = (n + team * shape.per_thread - 1) / (team * shape.per_thread);
  chunk = std::clamp((chunk + shape.unit - 1) / shape.unit * shape.unit, shape.min_chunk, shape.max_chunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  // One task per thread; each claims chunks until none are left.
#pragma omp parallel num_threads(static_cast<int>(std::min(team, chunks)))
  {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      span(c * chunk, std::min((c + 1) * chunk, n));
    }
  }
}

}  // namespace infinity_kernels
