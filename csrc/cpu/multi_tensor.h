// The multi-tensor walk shared by every CPU kernel: many tensors, cut into fixed chunks, spread over
// torch's intra-op threads by element count (not by tensor count), so 10,000 tiny tensors and one
// huge tensor both keep every core busy.
//
// Determinism: chunk boundaries depend only on the tensor sizes, never on the thread count, and each
// chunk's partial result lands in its own slot; reductions then combine the slots in chunk order. The
// same inputs give bit-identical norms whatever torch.set_num_threads() says.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernel_table.h"

namespace torchclip::cpu {

struct Chunk {
  int64_t tensor;  // index into the span list
  int64_t begin;   // element offsets within that tensor
  int64_t end;
};

// Below this many elements a second thread costs more to wake than it saves (measured on the 2,000 x
// 64x64 workload: the crossover is near 20k fp32 elements).
constexpr int64_t kMinElementsPerThread = 32768;
// Chunks are at least this long (a multiple of every vector width), so a chunk's fixed cost (a partial
// slot, a loop entry) is amortised over >= 256 KiB of fp32 data.
constexpr int64_t kMinChunkElements = 1 << 16;
// ...and there are at most about this many chunks of a big tensor, so the partial slots stay
// O(number of tensors), not O(elements).
constexpr int64_t kMaxBigChunks = 1 << 14;

struct ChunkPlan {
  std::vector<Chunk> chunks;
  std::vector<int64_t> first_element;  // chunks[i] starts at this offset of the concatenated data
  int64_t total_elements = 0;
};

inline ChunkPlan plan_chunks(const TensorSpan* spans, int64_t count) {
  ChunkPlan plan;
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) {
    total += spans[i].numel;
  }
  int64_t chunk = std::max(kMinChunkElements, (total + kMaxBigChunks - 1) / kMaxBigChunks);
  chunk = (chunk + 63) / 64 * 64;
  plan.chunks.reserve(count + total / chunk + 1);
  plan.first_element.reserve(count + total / chunk + 1);
  int64_t offset = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = spans[i].numel;
    for (int64_t b = 0; b < n; b += chunk) {
      plan.chunks.push_back({i, b, std::min(n, b + chunk)});
      plan.first_element.push_back(offset + b);
    }
    offset += n;
  }
  plan.total_elements = total;
  return plan;
}

// Calls visit(chunk_index) exactly once per chunk, from torch's intra-op thread pool. Each thread gets
// a contiguous run of chunks holding about total/threads elements.
template <typename Visit>
inline void parallel_for_chunks(const ChunkPlan& plan, const Visit& visit) {
  const int64_t num_chunks = static_cast<int64_t>(plan.chunks.size());
  const int64_t threads = std::min<int64_t>(
      at::get_num_threads(), std::max<int64_t>(1, plan.total_elements / kMinElementsPerThread));
  if (threads <= 1 || num_chunks <= 1 || at::in_parallel_region()) {
    for (int64_t c = 0; c < num_chunks; ++c) {
      visit(c);
    }
    return;
  }
  auto first_chunk_of = [&](int64_t t) -> int64_t {
    // The first chunk that starts at or after thread t's share of the elements.
    const int64_t start = plan.total_elements / threads * t + std::min(t, plan.total_elements % threads);
    return std::lower_bound(plan.first_element.begin(), plan.first_element.end(), start) -
        plan.first_element.begin();
  };
  at::parallel_for(0, threads, 1, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t last = t + 1 == threads ? num_chunks : first_chunk_of(t + 1);
      for (int64_t c = first_chunk_of(t); c < last; ++c) {
        visit(c);
      }
    }
  });
}

// Typed dispatch over the four storage types; `f` is called with a null pointer of the element type.
template <typename F>
inline void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Float16:
      return f(static_cast<c10::Half*>(nullptr));
    case DType::BFloat16:
      return f(static_cast<c10::BFloat16*>(nullptr));
    case DType::Float32:
      return f(static_cast<float*>(nullptr));
    case DType::Float64:
      return f(static_cast<double*>(nullptr));
  }
}

}  // namespace torchclip::cpu
