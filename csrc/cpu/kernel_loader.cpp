#include "kernel_loader.h"

#include "item_pool.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <pthread.h>

#include <atomic>
#include <string>
#include <unordered_map>
#include <vector>

namespace torchclip {
namespace {
// Libraries are never unloaded: a switch leaves the old one mapped, so a kernel still running on
// another thread keeps valid code under it.
std::atomic<const cpu::KernelTable*> active_table{nullptr};

// Set in a child made by fork(), by the one thing an atfork handler may safely do: store a flag.
std::atomic<bool> forked_child{false};
void note_forked_child() {
  forked_child.store(true, std::memory_order_relaxed);
}
const int atfork_registered = pthread_atfork(nullptr, nullptr, note_forked_child);
}  // namespace

void one_thread_after_fork() {
  if (C10_UNLIKELY(forked_child.load(std::memory_order_relaxed)) && forked_child.exchange(false)) {
    at::set_num_threads(1);
  }
}

bool cpu_runs(const std::string& capability) {
  // cpuinfo's names for what each library's flags enable. torch's own AVX512 test asks for avx512_f
  // alone, but our AVX512 library is built with BW/VL/DQ too (absent on Knights Landing).
  static const std::unordered_map<std::string, std::vector<std::string>> needs = {
      {"DEFAULT", {}},
      {"AVX2", {"avx2", "fma3", "f16c"}},
      {"AVX512", {"avx512_f", "avx512_bw", "avx512_vl", "avx512_dq", "avx2", "fma3", "f16c"}},
  };
  const auto wanted = needs.find(capability);
  if (wanted == needs.end()) {
    return false;
  }
  const auto features = at::cpu::get_cpu_capabilities();
  for (const std::string& feature : wanted->second) {
    const auto found = features.find(feature);
    if (found == features.end() || !found->second.isBool() || !found->second.toBool()) {
      return false;
    }
  }
  return true;
}

std::string load_cpu_kernels(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(handle != nullptr, "torchclip: cannot load the CPU kernel library '", path, "': ", dlerror(),
      ". Rebuild torchclip against the installed torch: pip install --no-build-isolation -e .");
  using TableFn = const cpu::KernelTable* (*)();
  auto table_fn = reinterpret_cast<TableFn>(dlsym(handle, "torchclip_cpu_kernel_table"));
  TORCH_CHECK(table_fn != nullptr, "torchclip: '", path,
      "' is not a torchclip CPU kernel library (no "
      "torchclip_cpu_kernel_table symbol)");
  const cpu::KernelTable* table = table_fn();
  TORCH_CHECK(table->abi_version == cpu::kKernelAbiVersion, "torchclip: the CPU kernel library '", path,
      "' has kernel ABI version ", table->abi_version, " but this build expects ", cpu::kKernelAbiVersion,
      ". Rebuild torchclip: pip install --no-build-isolation -e .");
  TORCH_CHECK(cpu_runs(table->capability), "torchclip: this CPU cannot run the ", table->capability,
      " kernel library '", path, "'; load one for an instruction set it has");
  table->share_item_pool(&cpu::ItemPool::of_this_library);
  active_table.store(table);
  return table->capability;
}

std::string loaded_cpu_capability() {
  const cpu::KernelTable* table = active_table.load();
  return table == nullptr ? std::string() : std::string(table->capability);
}

const cpu::KernelTable& cpu_kernels() {
  one_thread_after_fork();
  const cpu::KernelTable* table = active_table.load();
  TORCH_CHECK(table != nullptr,
      "torchclip: no CPU kernel library is loaded. `import torchclip` loads the "
      "one for this CPU; C++ users call torchclip::load_cpu_kernels(path) first.");
  return *table;
}

}  // namespace torchclip
