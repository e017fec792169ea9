// C++ test of the torchclip ops through the dispatcher, against ATen, for one kernel module.
// Usage: torchclip_cpp_test <kernel module path> <expected capability>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <initializer_list>
#include <iostream>
#include <utility>
#include <vector>

#include "cpu/kernel_loader.h"
#include "cpu/multi_tensor.h"

namespace {

int failures = 0;

// ctest's SKIP_RETURN_CODE (CMakeLists.txt): an instruction set the CPU lacks is reported as skipped.
constexpr int kSkipped = 77;

void expect(bool ok, const std::string& what) {
  std::cout << (ok ? "PASS " : "FAIL ") << what << "\n";
  failures += ok ? 0 : 1;
}

// Small enough that every norm here is representable in float16 (its largest finite value is 65504).
constexpr double kScale = 0.01;

std::vector<at::Tensor> sample(at::ScalarType dtype) {
  at::manual_seed(0);
  std::vector<at::Tensor> tensors;
  for (int64_t n : {1, 7, 16, 100, 4097, 200003}) {
    tensors.push_back((at::randn({n}) * kScale).to(dtype));
  }
  tensors.push_back((at::randn({33, 17}) * kScale).t().to(dtype));  // dense, permuted strides
  tensors.push_back((at::randn({40}) * kScale).to(dtype).slice(0, 0, 40, 3));  // gaps: ATen's path
  return tensors;
}

double reference_total_norm(const std::vector<at::Tensor>& tensors, double ord) {
  std::vector<at::Tensor> norms;
  for (const auto& t : tensors) {
    norms.push_back(at::linalg_vector_norm(t.to(at::kDouble), ord));
  }
  return at::linalg_vector_norm(at::stack(norms), ord).item<double>();
}

}  // namespace

// ThreadsLosing (multi_tensor.h): a call torch's threads made more than twice as slow as the calling thread alone
// would have been sends the next 2, 4, 8 ... 256 (at most) calls to the item pool; 32 calls they win in a row reset
// that, fewer do not. A call whose calling thread ran none of at least two items a thread sends the next 256 at once.
// Three more pool calls whose helper ran items on the caller's core than calls whose helper ran items on another core
// send the pool's next 8, 16 ... 256 turns alone, and each crowded call after them the next; as many shared calls
// more reset that.
void test_threads_losing() {
  using torchclip::cpu::ThreadsLosing;
  using Way = ThreadsLosing::Way;
  const auto turns = [] {  // the ways of the calls before torch's threads' next: {alone, on the pool}
    std::pair<int, int> taken{0, 0};
    for (Way way = ThreadsLosing::way_now(); way != Way::TorchThreads; way = ThreadsLosing::way_now()) {
      ++(way == Way::Alone ? taken.first : taken.second);
    }
    return taken;
  };
  const auto pool_calls = [&] {
    const auto [alone, pool] = turns();
    return alone == 0 ? pool : -1;
  };
  const auto win = [](int calls) {
    for (int i = 0; i < calls; ++i) {
      ThreadsLosing::record(0.6, 0.5, 1, 2, 2);  // 0.6 s against the caller's 1.0 alone
    }
  };
  expect(pool_calls() == 0, "threads: no pool calls before any was lost");
  ThreadsLosing::record(1.0, 0.5, 1, 2, 2);  // 1.0 s against the caller's 1.0 alone: not lost by 2x
  expect(pool_calls() == 0, "threads: a call lost by less than 2x keeps the threads");
  const int expected[] = {2, 4, 8, 16, 32, 64, 128, 256, 256};
  for (int lost : expected) {
    ThreadsLosing::record(5.0, 0.5, 1, 2, 2);  // 5.0 s against 1.0
    expect(pool_calls() == lost, "threads: a lost call sends the next " + std::to_string(lost) + " calls to the pool");
  }
  win(31);
  ThreadsLosing::record(5.0, 0.5, 1, 2, 2);
  expect(pool_calls() == 256, "threads: 31 won calls in a row keep the backoff");
  win(32);
  ThreadsLosing::record(5.0, 0.5, 1, 2, 2);
  expect(pool_calls() == 2, "threads: 32 won calls in a row reset the backoff");
  win(31);
  ThreadsLosing::record(5.0, 0.5, 1, 2, 2);
  expect(pool_calls() == 4, "threads: a lost call within 32 of the last sends the next 4 calls to the pool");
  ThreadsLosing::record(0.1, 0.0, 0, 2, 2);  // the caller took none of one item a thread: no rate to compare with
  ThreadsLosing::record(5.0, 0.5, 1, 2, 2);
  expect(pool_calls() == 8, "threads: a call without the caller's items is no win (the backoff goes on)");
  ThreadsLosing::record(5.0, 0.0, 0, 2, 2);
  expect(pool_calls() == 0, "threads: a call without the caller's one item is no loss");
  ThreadsLosing::record(0.1, 0.0, 0, 4, 2);  // none of two items a thread: the caller was held off its core
  expect(pool_calls() == 256, "threads: a call without the caller's items sends the next 256 calls to the pool");
  win(32);
  ThreadsLosing::record(5.0, 0.5, 1, 2, 2);
  expect(pool_calls() == 2, "threads: after 32 won calls a lost call sends the next 2 again");

  const auto after_pool_calls = [&](std::initializer_list<std::pair<bool, bool>> calls) {
    ThreadsLosing::record(0.1, 0.0, 0, 4, 2);  // 256 turns off torch's threads
    for (const auto [crowded, shared] : calls) {
      ThreadsLosing::record_pool(crowded, shared);
    }
    return turns();
  };
  constexpr std::pair<bool, bool> kCrowded{true, false}, kShared{false, true}, kCallerAlone{false, false};
  expect(after_pool_calls({kCrowded, kCrowded}) == std::pair{0, 256},
      "threads: two crowded pool calls send no turn alone");
  expect(after_pool_calls({kCrowded}) == std::pair{8, 248},
      "threads: a third crowded pool call sends the pool's next 8 turns alone");
  for (int alone : {16, 32, 64, 128, 256, 256}) {
    expect(after_pool_calls({kCrowded}) == std::pair{alone, 256 - alone},
        "threads: each crowded pool call after those sends the next " + std::to_string(alone) + " turns alone");
  }
  expect(after_pool_calls({kCallerAlone, kShared, kCrowded}) == std::pair{0, 256},
      "threads: a shared pool call takes one crowded call back (a call its caller ran alone, none)");
  expect(after_pool_calls({kCrowded}) == std::pair{256, 0}, "threads: ... and keeps the backoff while any is left");
  expect(after_pool_calls({kShared, kShared, kCrowded, kCrowded}) == std::pair{0, 256},
      "threads: two shared pool calls take the two crowded ones left back");
  expect(after_pool_calls({kCrowded}) == std::pair{8, 248},
      "threads: ... and reset the backoff: three crowded calls from there send 8 turns alone again");
}

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " <kernel module> <capability>\n";
    return 2;
  }
  if (!torchclip::cpu_runs(argv[2])) {
    std::cout << "SKIP this CPU cannot run " << argv[2] << " code\n";
    return kSkipped;
  }
  const std::string capability = torchclip::load_cpu_kernels(argv[1]);
  expect(capability == argv[2], "loaded capability " + capability);
  test_threads_losing();

  auto norm_op = c10::Dispatcher::singleton()
                     .findSchemaOrThrow("torchclip::multi_tensor_norm", "")
                     .typed<std::tuple<at::Tensor, at::Tensor>(at::TensorList, double, bool, std::optional<bool>,
                         std::optional<at::ScalarType>)>();
  auto clip_op = c10::Dispatcher::singleton()
                     .findSchemaOrThrow("torchclip::clip_grad_norm_", "")
                     .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(at::TensorList, double, double, bool, double,
                         bool, c10::string_view, std::optional<bool>)>();
  auto clamp_op = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("torchclip::multi_tensor_clamp_", "")
                      .typed<void(at::TensorList, double, double)>();

  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    const std::string name = std::string(c10::toString(dtype));
    const double tolerance = (dtype == at::kHalf || dtype == at::kBFloat16) ? 1e-2 : 1e-6;
    for (double ord : {1.0, 2.0, static_cast<double>(INFINITY), 3.0}) {
      auto tensors = sample(dtype);
      const double got =
          std::get<0>(norm_op.call(tensors, ord, false, std::nullopt, std::nullopt)).to(at::kDouble).item<double>();
      const double want = reference_total_norm(tensors, ord);
      expect(std::abs(got - want) <= tolerance * std::abs(want),
          name + " norm ord=" + std::to_string(ord) + ": " + std::to_string(got) + " vs " + std::to_string(want));
    }
    {
      auto tensors = sample(dtype);
      std::vector<at::Tensor> expected;
      const double total = reference_total_norm(tensors, 2.0);
      for (const auto& t : tensors) {
        expected.push_back(t.to(at::kDouble) * std::min(1.0 / (total + 1e-6), 1.0));
      }
      const double coefficient = std::min(1.0 / (total + 1e-6), 1.0);
      const auto [clipped_total, norms, kept_coefficient] =
          clip_op.call(tensors, 1.0, 2.0, false, 1e-6, false, "propagate", std::nullopt);
      bool close = true;
      for (size_t i = 0; i < tensors.size(); ++i) {
        close &= at::allclose(tensors[i].to(at::kDouble), expected[i], tolerance, 1e-7);
      }
      expect(close, name + " clip_grad_norm_ scales every tensor by max_norm / total_norm");
      expect(norms.scalar_type() == at::kDouble && norms.numel() == static_cast<int64_t>(tensors.size()),
          name + " clip_grad_norm_ returns one float64 norm per tensor");
      expect(std::abs(kept_coefficient.item<double>() - coefficient) <= 1e-6 * coefficient,
          name + " clip_grad_norm_ returns the coefficient it scaled by");
    }
    {
      auto tensors = sample(dtype);
      std::vector<at::Tensor> expected;
      for (const auto& t : tensors) {
        expected.push_back(t.clamp(-0.5, 0.5));
      }
      clamp_op.call(tensors, -0.5, 0.5);
      bool equal = true;
      for (size_t i = 0; i < tensors.size(); ++i) {
        equal &= at::equal(tensors[i], expected[i]);
      }
      expect(equal, name + " multi_tensor_clamp_ equals at::clamp");
    }
    {
      // Exact norms: ones squared sum to an integer, whose correctly rounded root IEEE sqrt gives.
      const std::vector<at::Tensor> ones = {at::ones({1000}, dtype), at::ones({3001}, dtype)};
      const at::Tensor exact = std::get<0>(norm_op.call(ones, 2.0, false, true, at::kDouble));
      expect(exact.item<double>() == std::sqrt(4001.0), name + " exact norm of 4,001 ones is sqrt(4001) rounded once");
    }
  }
  std::cout << (failures == 0 ? "all passed" : std::to_string(failures) + " failed") << "\n";
  return failures == 0 ? 0 : 1;
}
