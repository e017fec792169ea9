// Loads one per-ISA CPU kernel library and hands its KernelTable to the CPU ops.
#pragma once

#include <string>

#include "kernel_table.h"

namespace torchclip {

// dlopen()s `path` (RTLD_LOCAL: nothing it holds can interpose on other libraries), checks its ABI
// version, and makes it the table every CPU op uses from now on. Returns the library's capability
// name. Safe to call again to switch instruction sets (the tests do, to run every compiled path).
std::string load_cpu_kernels(const std::string& path);

// The capability name of the loaded library, or "" when none is loaded.
std::string loaded_cpu_capability();

// The active table; raises a clear error when no library was loaded.
const cpu::KernelTable& cpu_kernels();

}  // namespace torchclip
