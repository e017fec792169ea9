// Loads one per-ISA CPU kernel library and hands its KernelTable to the CPU ops.
#pragma once

#include <string>

#include "kernel_table.h"

namespace torchclip {

// Whether this CPU has every instruction set the kernel library for `capability` ("DEFAULT", "AVX2",
// "AVX512") is compiled with (the ISA flags in setup.py and CMakeLists.txt); false for an unknown name.
bool cpu_runs(const std::string& capability);

// dlopen()s `path` (RTLD_LOCAL: nothing it holds can interpose on other libraries), checks its ABI
// version and that this CPU runs its instruction set (an error, not SIGILL), and makes it the table
// every CPU op uses from now on. Returns the library's capability name. Safe to call again to switch instruction sets
// (the tests do, to run every compiled path).
std::string load_cpu_kernels(const std::string& path);

// The capability name of the loaded library, or "" when none is loaded.
std::string loaded_cpu_capability();

// In a child made by fork(), the first call sets torch's intra-op threads to 1, as torch's DataLoader does in
// its workers: OpenMP's thread pool does not survive fork, and a child whose parent ran a parallel region
// hangs in its next one (torch's own large ops too). Every CPU op and the parameter walk call it first.
void one_thread_after_fork();

// The active table (after one_thread_after_fork); raises a clear error when no library was loaded.
const cpu::KernelTable& cpu_kernels();

}  // namespace torchclip
