// The one exported symbol of a per-ISA kernel library. Built once per instruction set with
// TORCHCLIP_CPU_CAPABILITY set to that set's name (see setup.py / CMakeLists.txt); everything else
// in the library has hidden visibility.
#include "item_pool.h"
#include "kernels.h"

#ifndef TORCHCLIP_CPU_CAPABILITY
#error "TORCHCLIP_CPU_CAPABILITY must name the instruction set this library is compiled for"
#endif

extern "C" __attribute__((visibility("default"))) const torchclip::cpu::KernelTable* torchclip_cpu_kernel_table() {
  static const torchclip::cpu::KernelTable table = {
      torchclip::cpu::kKernelAbiVersion,
      TORCHCLIP_CPU_CAPABILITY,
      &torchclip::cpu::tensor_norms,
      &torchclip::cpu::exact_norms,
      &torchclip::cpu::scale,
      &torchclip::cpu::clamp,
      &torchclip::cpu::unitwise_clip,
      &torchclip::cpu::adam_step,
      &torchclip::cpu::sgd_step,
      &torchclip::cpu::adagrad_step,
      &torchclip::cpu::per_sample_accumulate,
      &torchclip::cpu::ItemPool::use,
  };
  return &table;
}
