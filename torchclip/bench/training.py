"""torchclip-bench --training MODEL: what clipping adds to a whole training step (forward, backward, clip, step).

Four candidates train copies of one model on the same batch, interleaved (balanced orders, medians):
  no clip      the fused AdamW step alone;
  torch clip   torch.nn.utils.clip_grad_norm_, then the step;
  folded       torchclip.optim's grad_clip=ClipGradByGlobalNorm, folded into the step's kernel;
  in backward  the same with norm_in_backward=True (the norm measured while backward runs).
Each call is timed whole and from the end of backward (the part the clip can stretch after backward);
get_total_norm of the gradients (one read) is timed in the same rounds, the unit of the "after backward"
columns. Every call clips (max_norm is tiny) and the learning rate is small, so the copies stay alike.
With ranks > 1 each rank runs the candidates on a DistributedDataParallel copy (gloo, one thread each) and
rank 0 reports. The models come from transformers (a GPT-2-style decoder, ResNet-50), which --training needs.
On CUDA (one process) the models and batches are GPT-2 small's and ImageNet's sizes, and the times are
CUDA events' (the GPU's timeline).
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from dataclasses import dataclass

import torch

import torchclip
from torchclip.bench.timing import balanced_orders, format_columns

CANDIDATES = ("no clip", "torch clip", "folded", "in backward")
MAX_NORM = 1e-3  # below any gradient norm here: every call clips
LEARNING_RATE = 1e-7


def gpt2_small(cuda=False):
    """On the CPU a GPT-2-style decoder of 27M parameters (6 layers, width 512, a 16,384-token vocabulary)
    and a batch of 2 x 128 tokens: ~0.4 s a step on 2 cores. On CUDA GPT-2 small (124M) on 8 x 512 tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if cuda:
        config, batch = GPT2Config(n_positions=512, bos_token_id=0, eos_token_id=0), (8, 512)
    else:
        config = GPT2Config(
            n_layer=6, n_embd=512, n_head=8, n_positions=128, vocab_size=16384, bos_token_id=0, eos_token_id=0
        )
        batch = (2, 128)
    config.loss_type = "ForCausalLM"  # (named, so transformers does not warn for every copy)
    tokens = torch.randint(0, config.vocab_size, batch, generator=torch.Generator().manual_seed(0))
    return GPT2LMHeadModel(config), {"input_ids": tokens, "labels": tokens}


def resnet50(cuda=False):
    """ResNet-50 (25.6M parameters) and a batch of 4 images of 96 x 96 (on CUDA, 32 of 224 x 224)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        depths=[3, 4, 6, 3], layer_type="bottleneck", hidden_sizes=[256, 512, 1024, 2048], num_labels=1000
    )
    generator = torch.Generator().manual_seed(0)
    count, side = (32, 224) if cuda else (4, 96)
    images = torch.randn(count, 3, side, side, generator=generator)
    return ResNetForImageClassification(config), {
        "pixel_values": images,
        "labels": torch.randint(0, 1000, (count,), generator=generator),
    }


MODELS = {"gpt2-small": gpt2_small, "resnet50": resnet50}


@dataclass
class TrainingRow:
    model: str
    ranks: int
    threads: int
    parameters: int
    step_ms: dict  # candidate -> median ms of a whole step
    after_backward_ms: dict  # candidate -> median ms from the end of backward to the end of the step
    total_norm_ms: float
    spread: float  # the largest IQR / median of the whole steps
    measured_after_backward: int = 0  # gradients "in backward" had to measure at its last step (0: none)


class _Clock:
    """Times from a start mark: the host's clock on the CPU, CUDA events on the GPU (the GPU's timeline, whose
    work the host only queues), synchronised at the end of each call."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        if not self.cuda:
            return 1e3 * (end - start)
        end.synchronize()
        return start.elapsed_time(end)


class _Trainer:
    """One candidate: its own copy of the model and optimizer."""

    def __init__(self, name, model, ddp, clock):
        self.name, self.clock = name, clock
        self.model = copy.deepcopy(model)
        self.module = torch.nn.parallel.DistributedDataParallel(self.model) if ddp else self.model
        clip = torchclip.ClipGradByGlobalNorm(MAX_NORM)
        in_backward = name == "in backward"
        self.optimizer = torchclip.optim.AdamW(
            self.model.parameters(), lr=LEARNING_RATE, fused=True, grad_clip=clip, norm_in_backward=in_backward
        )
        attachment = self.optimizer.grad_clip_attachment
        attachment.enabled = name == "folded" or in_backward
        if ddp and in_backward:
            attachment.backward_norms.reduced_by(self.module)
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def step(self, batch) -> tuple[float, float]:
        start = self.clock.mark()
        self.optimizer.zero_grad(set_to_none=True)
        self.module(**batch).loss.backward()
        backward_done = self.clock.mark()
        if self.name == "torch clip":
            torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM)
        self.optimizer.step()
        end = self.clock.mark()
        return self.clock.ms(start, end), self.clock.ms(backward_done, end)


def _run(name, rounds, warmup, ddp, device) -> TrainingRow:
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    model, batch = MODELS[name](cuda)
    model, batch = model.to(device), {k: v.to(device) for k, v in batch.items()}
    clock = _Clock(device)
    trainers = [_Trainer(candidate, model, ddp, clock) for candidate in CANDIDATES]

    def total_norm():
        grads = [p.grad for p in trainers[0].params if p.grad is not None]
        start = clock.mark()
        torchclip.get_total_norm(grads)
        return clock.ms(start, clock.mark()), 0.0

    calls = [lambda t=t: t.step(batch) for t in trainers] + [total_norm]
    for _ in range(warmup):
        for call in calls:
            call()
    samples = [[] for _ in calls]
    orders = balanced_orders(len(trainers))
    for r in range(rounds):
        for i in orders[r % len(orders)]:
            samples[i].append(calls[i]())
            if i == 0:
                samples[-1].append(total_norm())  # the norm of the gradients backward just made
    medians = [tuple(statistics.median(s[k] for s in column) for k in (0, 1)) for column in samples]
    spreads = []
    for column in samples[:-1]:
        whole = sorted(s[0] for s in column)
        spreads.append((whole[(3 * len(whole)) // 4] - whole[len(whole) // 4]) / statistics.median(whole))
    return TrainingRow(
        name,
        torch.distributed.get_world_size() if ddp else 1,
        torch.get_num_threads(),
        sum(p.numel() for p in trainers[0].params),
        {c: medians[i][0] for i, c in enumerate(CANDIDATES)},
        {c: medians[i][1] for i, c in enumerate(CANDIDATES)},
        medians[-1][0],
        max(spreads),
        trainers[CANDIDATES.index("in backward")].optimizer.grad_clip_attachment.backward_norms.taken_after_backward,
    )


def _rank_main(rank, ranks, names, rounds, warmup, port, results):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(max(1, (os.cpu_count() or ranks) // ranks))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=ranks)
    rows = [_run(name, rounds, warmup, ddp=True, device=torch.device("cpu")) for name in names]
    torch.distributed.barrier()
    if rank == 0:
        results.put(rows)  # (a SimpleQueue writes at once: nothing left to flush)
    # Leave without interpreter teardown, where gloo's threads, with DDP's reducers alive, now and then
    # abort the process after the work is done (tests/test_distributed.py's _run_and_exit).
    os._exit(0)


def run(names, rounds, warmup, ranks=1, device="cpu") -> list[TrainingRow]:
    """The rows of `names` (MODELS' keys); ranks > 1 (DDP over gloo) on the CPU only."""
    if ranks == 1:
        return [_run(name, rounds, warmup, ddp=False, device=torch.device(device)) for name in names]
    if torch.device(device).type != "cpu":
        raise ValueError(f"ranks={ranks} on {device}: DDP rows run on the CPU only")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(_rank_main, (ranks, names, rounds, warmup, port, results), nprocs=ranks, start_method="spawn")
    return results.get()


def format_table(rows) -> str:
    header = ["model", "ranks", "thr", "no clip ms"]
    for candidate in CANDIDATES[1:]:
        header += [f"{candidate} ms", f"{candidate} added"]
    header += ["norm ms"] + [f"{c} after bwd (reads)" for c in CANDIDATES[1:]] + ["spread"]
    lines = []
    for r in rows:
        base, base_after = r.step_ms["no clip"], r.after_backward_ms["no clip"]
        line = [r.model, str(r.ranks), str(r.threads), f"{base:.1f}"]
        for candidate in CANDIDATES[1:]:
            line += [f"{r.step_ms[candidate]:.1f}", f"{100 * (r.step_ms[candidate] / base - 1):+.1f}%"]
        line.append(f"{r.total_norm_ms:.2f}")
        line += [f"{(r.after_backward_ms[c] - base_after) / r.total_norm_ms:.2f}" for c in CANDIDATES[1:]]
        line.append(f"{100 * r.spread:.0f}%")
        lines.append(line)
    return format_columns(header, lines, left=3)
