#!/usr/bin/env bash
# One lease of a GPU machine (issue 19): build in place against the machine's torch, run the CUDA tests
# and the rest of the suite, time the CUDA rows, break down the host cost. Logs go to $OUT (or bench/out).
#
#   bench/on_gpu.sh [build] [test] [suite] [bench] [host] [results] [training] [step] [step-bits] [step-profile]
#                   [exact-memory] [exact-cost] [exact-profile]
#   (default: build test bench host)
#
# The machine's default compiler wrapper (/opt/gcc/bin/g++) once built a _cuda module that crashed while
# formatting any error message holding an integer; the system GCC does not.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/out}
mkdir -p "$out"
python=${PYTHON:-python3}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build test bench host)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
for step in "${steps[@]}"; do
  case $step in
    build)
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
      "$python" -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' | tee -a "$out/gpu.txt"
      CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared" TORCHCLIP_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 \
        MAX_JOBS=16 "$python" setup.py --quiet build_ext --inplace >"$out/build.log" 2>&1 \
        || { tail -50 "$out/build.log"; exit 1; }
      ;;
    test)
      # Every test's CUDA case (the `device` fixture's, and the CUDA-only tests), 4 workers of 4 threads
      OMP_NUM_THREADS=4 "$python" -m pytest -q -n 4 -m cuda -p no:cacheprovider --timeout 300 tests \
        2>&1 | tee "$out/test_cuda.log" | tail -25
      ;;
    suite)
      # The CPU cases with a GPU present (--timeout: on 2026-11-24 this step stopped at 80% for minutes)
      OMP_NUM_THREADS=2 "$python" -m pytest -q -n 8 -m "not cuda" -p no:cacheprovider --timeout 120 tests \
        --ignore tests/test_wheel.py 2>&1 | tee "$out/test_suite.log" | tail -25
      ;;
    bench)
      "$python" -m torchclip.bench --device cuda --workload gpt2_124m --workload resnet50 --workload 10000x100 \
        --dtype float32 --dtype bfloat16 --rounds 9 --json "$out/bench.json" 2>&1 | tee "$out/bench.txt" | tail -45
      ;;
    results)
      "$python" -m torchclip.bench --device cuda --workload gpt2_124m --workload resnet50 --workload 10000x100 \
        --dtype float32 --dtype bfloat16 --rounds 9 --exact --json "$out/results-cuda.json" --markdown "$out/RESULTS-cuda.md" \
        2>&1 | tee "$out/results.txt" | tail -60
      ;;
    training)
      # Whole training steps (issue 33): no clip, torch's clip, the folded clip, the norm in backward
      "$python" -m torchclip.bench --device cuda --training gpt2-small --training resnet50 --rounds 21 \
        --json "$out/training-cuda.json" --markdown "$out/RESULTS-training-cuda.md" 2>&1 | tee "$out/training.txt" | tail -20
      ;;
    step)
      # What clipping adds to torch's fused CUDA optimizer steps (torchclip-bench --step)
      "$python" -m torchclip.bench --device cuda --step adamw-fused --step adam-fused --step sgd-fused --rounds 11 \
        --json "$out/step-cuda.json" 2>&1 | tee "$out/step.txt" | tail -30
      ;;
    step-bits)
      # Where the read-only CUDA steps' bits part from torch's fused CUDA steps, option by option
      "$python" bench/cuda_step_bits.py 2>&1 | tee "$out/step_bits.txt" | tail -80
      ;;
    exact-memory)
      # What the exact kernels' stack frames reserve on the device: free memory before and after the first exact
      # launch, after a plain norm has loaded the module and the caching allocator has its first blocks
      "$python" -c 'import torch, torchclip; g = [torch.randn(1 << 20, device="cuda")]
free = lambda: torch.cuda.mem_get_info()[0] / 2**20
torchclip.get_total_norm(g); torch.cuda.synchronize(); before = free()
torchclip.get_total_norm(g, exact=True); torch.cuda.synchronize()
print(f"exact norm: free device memory {before:.0f} MiB -> {free():.0f} MiB")' 2>&1 | tee "$out/exact_memory.txt"
      ;;
    exact-cost)
      # Exact norms against today's on the device: host and kernel ms of get_total_norm with and without exact=True
      "$python" bench/cuda_host_cost.py --workload gpt2_124m --workload resnet50 --workload 10000x100 --dtype float32 \
        --dtype bfloat16 --case "get_total_norm (drop-in)" --case "get_total_norm (drop-in, exact)" 2>&1 \
        | grep -v Warn | tee -a "$out/exact_cost.txt"
      ;;
    exact-profile)
      # Nsight Compute on one exact launch over GPT-2's gradients (float32, or PROFILE_DTYPE): throughput,
      # occupancy, where warps stall
      timeout 120 ncu --kernel-name regex:exact_norm_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section Occupancy --section WarpStateStats --section LaunchStats --section ComputeWorkloadAnalysis \
        "$python" -c 'import torch, torchclip
from torchclip.bench import workloads
from torchclip.bench.timing import Grads
g = Grads(workloads.resolve("gpt2_124m")[1], getattr(torch, "'"${PROFILE_DTYPE:-float32}"'"), device="cuda")
for _ in range(4): torchclip.get_total_norm(g.grads, exact=True)
torch.cuda.synchronize()' 2>&1 | tee "$out/exact_profile.txt" | tail -80
      ;;
    step-profile)
      # Nsight Compute on one read-only AdamW step (adam_kernel's launches, 48 tensors each) and one of torch's fused
      # AdamW (FusedAdamMathFunctor's), GPT-2's float32 parameters: throughput, occupancy, memory
      timeout 150 ncu --kernel-name-base mangled --kernel-name regex:"adam_kernel|FusedAdamMathFunctor" \
        --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis "$python" -c 'import torch, torchclip
from torchclip.bench import workloads
shapes = workloads.resolve("gpt2_124m")[1]
for optimizer_class, clip in ((torchclip.optim.AdamW, torchclip.ClipGradByGlobalNorm(1e9)), (torch.optim.AdamW, None)):
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    options = {"grad_clip": clip} if clip is not None else {}
    optimizer = optimizer_class(params, lr=1e-3, fused=True, **options)
    optimizer.step()
torch.cuda.synchronize()' 2>&1 | tee "$out/step_profile.txt" | tail -80
      ;;
    host)
      "$python" bench/cuda_host_cost.py --workload 10000x100 --workload gpt2_124m --workload resnet50 ${HOST_ARGS:-} 2>&1 | tee "$out/host_cost.txt"
      ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
