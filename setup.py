"""Builds torchclip's native parts with torch.utils.cpp_extension (ninja).

Extensions:
  torchclip._C             op schemas (csrc/ops.cpp), CPU op implementations, Python helpers
  torchclip._cpu_<isa>     the CPU kernels (csrc/cpu/*_kernel.cpp), once per instruction set; the
                           package loads the best one the CPU supports at import (nothing is tuned to the build machine)

Build switches (environment variables):
  TORCHCLIP_CPU_ISAS   comma list of kernel libraries to build, from DEFAULT,AVX2,AVX512
                       (default: all three on x86-64, DEFAULT elsewhere)
  TORCHCLIP_CUDA       1 to build the CUDA kernels, 0 not to, unset: when torch has CUDA and nvcc exists
  DEBUG                1 for -O0 -g builds (default 0)
  MAX_JOBS             parallel compile jobs (ninja; default: all cores)

Install with `pip install --no-build-isolation -e .`: torch is a run-time dependency, and build
isolation would install a second (CUDA) torch to build against.
"""

import os
import platform

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("DEBUG", "0") == "1"

# Flags per kernel library. AVX2 and AVX-512 match what torch itself requires for its AVX2/AVX512
# capabilities (FMA; VL/BW/DQ), plus F16C for the fp16 conversions.
ISA_FLAGS = {
    "DEFAULT": [],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    # GCC's generic tuning prefers 256-bit vectors; our 64-byte vector types want full zmm registers.
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
               "-mprefer-vector-width=512"],
}
KERNEL_SOURCES = [
    "csrc/cpu/norm_kernel.cpp",
    "csrc/cpu/scale_kernel.cpp",
    "csrc/cpu/clamp_kernel.cpp",
    "csrc/cpu/kernel_library.cpp",
]


def cpu_isas():
    default = "DEFAULT,AVX2,AVX512" if platform.machine() in ("x86_64", "AMD64") else "DEFAULT"
    names = [n.strip().upper() for n in os.environ.get("TORCHCLIP_CPU_ISAS", default).split(",") if n.strip()]
    unknown = sorted(set(names) - set(ISA_FLAGS))
    if unknown:
        raise SystemExit(f"TORCHCLIP_CPU_ISAS: unknown instruction set(s) {unknown}; choose from {sorted(ISA_FLAGS)}")
    if "DEFAULT" not in names:
        names.insert(0, "DEFAULT")  # the fallback every CPU can run
    return names


def optimisation():
    return ["-O0", "-g"] if DEBUG else ["-O3"]


def extensions():
    isas = cpu_isas()
    common = optimisation() + ["-std=c++17", "-Wall", "-Wno-unknown-pragmas"]
    exts = [
        CppExtension(
            "torchclip._C",
            ["csrc/ops.cpp", "csrc/ops_autograd.cpp", "csrc/cpu/ops_cpu.cpp", "csrc/cpu/kernel_loader.cpp", "csrc/python_module.cpp"],
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=[("TORCHCLIP_CPU_CAPABILITIES", '"' + ",".join(isas) + '"')],
            extra_compile_args=common,
            extra_link_args=["-ldl"],
        )
    ]
    for isa in isas:
        exts.append(
            CppExtension(
                f"torchclip._cpu_{isa.lower()}",
                KERNEL_SOURCES,
                include_dirs=[os.path.join(ROOT, "csrc")],
                define_macros=[("TORCHCLIP_CPU_CAPABILITY", f'"{isa}"')],
                # OpenMP: at::parallel_for is a header template that only runs in parallel when the
                # including file is compiled with -fopenmp; at run time it shares torch's libgomp.
                extra_compile_args=common + ISA_FLAGS[isa] + ["-fvisibility=hidden", "-fopenmp"],
                extra_link_args=["-fopenmp"],
            )
        )
    return exts


class BuildPerExtension(BuildExtension):
    """Gives every extension its own object directory: the kernel libraries compile the same sources
    with different flags, and a shared directory would let one ISA's objects stand in for another's."""

    def build_extension(self, ext):
        base = self.build_temp
        self.build_temp = os.path.join(base, ext.name)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base


setup(
    packages=find_packages(include=["torchclip", "torchclip.*"]),
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildPerExtension.with_options(use_ninja=True)},
)
