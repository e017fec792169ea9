"""Builds torchclip's native parts with torch.utils.cpp_extension (ninja).

Extensions:
  torchclip._C             op schemas (csrc/ops.cpp), CPU op implementations, Python helpers
  torchclip._cpu_<isa>     the CPU kernels (csrc/cpu/*_kernel.cpp), once per instruction set; the
                           package loads the best one the CPU supports at import (nothing is tuned to the build machine)
  torchclip._cuda          the CUDA kernels and their op registrations (csrc/cuda/), when CUDA is built: a
                           module of its own so that the CPU build never needs CUDA; imported after _C

Build switches (environment variables):
  TORCHCLIP_CPU_ISAS   comma list of kernel libraries to build, from DEFAULT,AVX2,AVX512
                       (default: all three on x86-64, DEFAULT elsewhere)
  TORCHCLIP_CUDA       1 to build the CUDA kernels (an error if torch has no CUDA or nvcc is missing), 0 not
                       to, auto (the default): when torch has CUDA and nvcc is found (CUDA_HOME, else torch's
                       search: nvcc on PATH, /usr/local/cuda)
  TORCH_CUDA_ARCH_LIST the GPU architectures to compile for, e.g. "9.0" or "8.0;9.0+PTX" (torch's default: the
                       GPUs of this machine, or every architecture torch supports when it has none)
  DEBUG                1 for -O0 -g builds (default 0)
  TORCHCLIP_SANITIZE   1 to build every native part with AddressSanitizer and UndefinedBehaviorSanitizer
                       (csrc/build.json's flags; UB stops the process); Python then needs the runtimes
                       preloaded: ./dev sanitize does it all (default 0)
  MAX_JOBS             parallel compile jobs (ninja; default: all cores)

Install with `pip install --no-build-isolation -e .`: torch is a run-time dependency, and build
isolation would install a second (CUDA) torch to build against.
"""

import json
import os
import platform
import re
import shutil
import subprocess

SUPPORTED_TORCH = ((2, 11), (2, 15))  # pyproject.toml's torch>=2.11,<2.16


def refuse(reason: str, fix: str):
    """Stops the build with one paragraph that says why and what to run, instead of a traceback."""
    raise SystemExit(f"\ntorchclip cannot be built here: {reason}\n\n{fix}\n")


try:
    import torch
except ModuleNotFoundError:
    refuse(
        "torch is not importable in the build environment. torchclip compiles against the torch installed "
        "beside it, and pip builds in an isolated environment (which holds no torch) unless told not to.",
        "Install torch (2.11 to 2.15) first, then, in that same environment:\n    pip install --no-build-isolation .",
    )
_torch_release = tuple(int(n) for n in re.findall(r"\d+", torch.__version__)[:2])
if not SUPPORTED_TORCH[0] <= _torch_release <= SUPPORTED_TORCH[1]:
    refuse(
        f"the installed torch is {torch.__version__}; torchclip supports torch 2.11 to 2.15, and building "
        "against another would make pip replace your torch to satisfy torchclip's requirement.",
        "Install a supported torch (e.g. pip install torch==2.15.0) into this environment, then run\n"
        "    pip install --no-build-isolation .",
    )
_compiler = (os.environ.get("CXX") or "c++").split()[0]  # (CXX may be "ccache g++")
if os.name != "nt" and not shutil.which(_compiler):
    refuse(
        f"no C++ compiler was found ({_compiler} is not on PATH, or CXX names none); the kernels are C++17.",
        "Install one (Debian/Ubuntu: apt install g++; Fedora: dnf install gcc-c++; macOS: xcode-select "
        "--install), or point CXX at it, then run the install again.",
    )

from setuptools import find_packages, setup
from torch.utils import cpp_extension
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("DEBUG", "0") == "1"
SANITIZE = os.environ.get("TORCHCLIP_SANITIZE", "0") == "1"

# The sources and ISA flags, shared with CMakeLists.txt. AVX2 and AVX-512 match what torch itself requires for
# its AVX2/AVX512 capabilities (FMA; VL/BW/DQ), plus F16C for the fp16 conversions; GCC's generic tuning
# prefers 256-bit vectors, and the AVX-512 vector types want full zmm registers.
with open(os.path.join(ROOT, "csrc", "build.json")) as build_file:
    BUILD = json.load(build_file)
ISA_FLAGS = BUILD["cpu_isa_flags"]


def cpu_isas():
    default = "DEFAULT,AVX2,AVX512" if platform.machine() in ("x86_64", "AMD64") else "DEFAULT"
    names = [n.strip().upper() for n in os.environ.get("TORCHCLIP_CPU_ISAS", default).split(",") if n.strip()]
    unknown = sorted(set(names) - set(ISA_FLAGS))
    if unknown:
        raise SystemExit(f"TORCHCLIP_CPU_ISAS: unknown instruction set(s) {unknown}; choose from {sorted(ISA_FLAGS)}")
    if "DEFAULT" not in names:
        names.insert(0, "DEFAULT")  # the fallback every CPU can run
    return names


def nvcc_release(nvcc: str):
    """The toolkit's release ("13.0") from `nvcc --version`, or None where it does not say."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else None


def cuda_decision():
    """(build the CUDA kernels?, why), from TORCHCLIP_CUDA, torch's CUDA version and nvcc."""
    mode = os.environ.get("TORCHCLIP_CUDA", "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"TORCHCLIP_CUDA must be auto, 0 or 1, got {mode!r}")
    if mode == "0":
        return False, "TORCHCLIP_CUDA=0"
    missing = []
    if not torch.version.cuda:
        missing.append(f"torch {torch.__version__} is not a CUDA build")
    home = cpp_extension.CUDA_HOME
    nvcc = os.path.join(home, "bin", "nvcc") if home else None
    if not nvcc or not os.path.exists(nvcc):
        missing.append("nvcc not found (set CUDA_HOME)")
    elif not os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
        # torch takes CUDA_HOME from `which nvcc`, which a wrapper script in /usr/local/bin misleads.
        missing.append(f"no CUDA headers under {home}/include (set CUDA_HOME to the toolkit's directory)")
    if missing:
        if mode == "1":
            raise SystemExit("TORCHCLIP_CUDA=1, but " + "; ".join(missing))
        return False, "TORCHCLIP_CUDA=auto: " + "; ".join(missing)
    toolkit = nvcc_release(nvcc)
    if toolkit and toolkit.split(".")[0] != torch.version.cuda.split(".")[0]:
        # torch's own check would stop the build later with a traceback; a minor difference only warns
        refuse(
            f"the CUDA toolkit at {home} is CUDA {toolkit}, but torch {torch.__version__} was built with CUDA "
            f"{torch.version.cuda}, and kernels compiled by one major release cannot link against the other.",
            f"Point CUDA_HOME at a CUDA {torch.version.cuda.split('.')[0]}.x toolkit (or install one: "
            "https://developer.nvidia.com/cuda-toolkit-archive), or build without the CUDA kernels:\n"
            "    TORCHCLIP_CUDA=0 pip install --no-build-isolation .",
        )
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "torch's default")
    return True, f"TORCHCLIP_CUDA={mode}: torch {torch.__version__} (CUDA {torch.version.cuda}), {nvcc}, arch {arch}"


def cxx_standard():
    def release(version):
        return tuple(int(part) for part in version.split("+")[0].split(".")[:2])

    standard = 20 if release(torch.__version__) >= release(BUILD["cxx20_from_torch"]) else BUILD["cxx_standard"]
    return f"-std=c++{standard}"


def optimisation():
    return ["-O0", "-g"] if DEBUG else ["-O3"]


def host_optimisation():
    """optimisation() for the host compiler. -g0: Python's own CFLAGS, which setuptools puts first, carry -g, which
    nearly doubled the compile time of the files that include torch's headers, for debug information a release
    build does not ship (the sanitizers' -g1 comes after it and wins)."""
    return optimisation() if DEBUG else optimisation() + ["-g0"]


def sanitizers():
    """(compile flags, link flags) of TORCHCLIP_SANITIZE=1, for the C++ sources (nvcc takes none of them)."""
    if not SANITIZE:
        return [], []
    return BUILD["sanitize_compile_flags"], BUILD["sanitize_link_flags"]


def extensions():
    isas = cpu_isas()
    with_cuda, why = cuda_decision()
    print(f"torchclip: CUDA kernels {'on' if with_cuda else 'off'} ({why})")
    sanitize_compile, sanitize_link = sanitizers()
    common = host_optimisation() + [cxx_standard(), "-Wall", "-Wno-unknown-pragmas"] + sanitize_compile
    exts = [
        CppExtension(
            "torchclip._C",
            BUILD["op_library"] + BUILD["python_bindings"],
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=[("TORCHCLIP_CPU_CAPABILITIES", '"' + ",".join(isas) + '"')]
            + ([("TORCHCLIP_WITH_CUDA", "1")] if with_cuda else []),  # _C.cuda_built()
            # -fopenmp: the parameter walk (walk/param_walk.cpp) runs on torch's intra-op threads.
            extra_compile_args=common + ["-fopenmp"],
            extra_link_args=["-ldl", "-fopenmp"] + sanitize_link,
        )
    ]
    for isa in isas:
        exts.append(
            CppExtension(
                f"torchclip._cpu_{isa.lower()}",
                BUILD["cpu_kernels"],
                include_dirs=[os.path.join(ROOT, "csrc")],
                define_macros=[("TORCHCLIP_CPU_CAPABILITY", f'"{isa}"')],
                # OpenMP: at::parallel_for is a header template that only runs in parallel when the
                # including file is compiled with -fopenmp; at run time it shares torch's libgomp.
                extra_compile_args=common + ISA_FLAGS[isa] + ["-fvisibility=hidden", "-fopenmp"],
                extra_link_args=["-fopenmp"] + sanitize_link,
            )
        )
    if with_cuda:
        from torch.utils.cpp_extension import CUDAExtension

        exts.append(
            CUDAExtension(
                "torchclip._cuda",
                BUILD["cuda_kernels"],
                include_dirs=[os.path.join(ROOT, "csrc")],
                define_macros=[("TORCHCLIP_PYTHON_MODULE", "1")],  # PyInit__cuda (CMake builds a plain library)
                extra_compile_args={
                    "cxx": common,
                    # -lineinfo: profilers map time to source lines, at no cost to the code.
                    "nvcc": optimisation() + [cxx_standard(), "-lineinfo", "-Xcompiler=-Wall"],
                },
                extra_link_args=sanitize_link,  # (ops_cuda.cpp's host code; compute-sanitizer checks the kernels)
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
