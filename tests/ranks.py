"""Several-rank tests on processes that outlive one test.

A fresh `torch.multiprocessing.spawn` per test costs each rank a Python start and the imports of torch,
torch.distributed.tensor and the test module: about 6 s of CPU a process here, 9.4 s of wall time for 4 ranks on 2
cores, where most tests' own work takes 1-3 s. `spawn` hands the work to a pool of 4 processes started once
(spawned, so the same start as mp.spawn) and kept between tests. Each test still makes and destroys its own process
group.

What a fresh process gave a test, a reused one gives it again before every test: the parent's environment as it is
now, torch's thread count, torchclip's CPU capability and exact-norm default, no process group. (Not torch's default
seed: a fresh process draws its own, so no test may count on it.) A worker that changes other state of its process,
a module's attribute say, puts it back before it returns. A test that fails, hangs or kills a rank takes the pool
down with it (a rank stuck in a collective cannot be freed otherwise); the next test starts a new one.
"""

from __future__ import annotations

import atexit
import os
import queue
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torchclip

POOL_SIZE = 4  # the largest world any test asks for
TEST_TIMEOUT_S = 900.0  # a hung collective (gloo's own timeout is 30 minutes)
STRAGGLER_S = 20.0  # how long the other ranks get to finish or fail after one rank failed


def rendezvous(tmp_path):
    """A file-based rendezvous: no TCP port to race for between picking it and binding it."""
    return f"file://{tmp_path / 'rendezvous'}"


def spawn(worker, world, *args):
    """Runs worker(rank, world, *args) on ranks 0..world-1, each in its own process; raises if any rank fails."""
    if not 1 <= world <= POOL_SIZE:
        raise ValueError(f"spawn: world must be 1..{POOL_SIZE}, got {world}")
    global _pool
    if _pool is None or not _pool.alive():
        _pool = _RankPool()
    try:
        _pool.run(worker, world, args)
    except BaseException:
        _pool.close(kill=True)
        _pool = None
        raise


class RanksFailed(AssertionError):
    """A rank raised, exited or did not finish; the message holds each failed rank's traceback."""


def _serve(rank, inbox, outbox):
    """A pool process: runs each job it is sent, reports its traceback or None, and leaves at None."""
    threads = torch.get_num_threads()
    capability = torchclip.get_cpu_capability()
    exact = torchclip.get_exact_norm()
    while (job := inbox.get()) is not None:
        worker, world, args, environment = job
        os.environ.clear()
        os.environ.update(environment)
        error = None
        try:
            worker(rank, world, *args)
        except BaseException:  # noqa: BLE001 (pytest.fail and pytest.skip raise BaseExceptions: report them)
            error = traceback.format_exc()
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
            torch.set_num_threads(threads)
            torchclip.set_cpu_capability(capability)
            torchclip.set_exact_norm(exact)
        outbox.put((rank, error))
    # Without interpreter teardown, where gloo's threads sometimes abort the process ("terminate called without
    # an active exception") after the work is done.
    os._exit(0)


class _RankPool:
    def __init__(self):
        context = mp.get_context("spawn")
        self.outbox = context.Queue()
        self.inboxes = [context.Queue() for _ in range(POOL_SIZE)]
        self.processes = [
            context.Process(target=_serve, args=(rank, inbox, self.outbox), name=f"rank-{rank}")
            for rank, inbox in enumerate(self.inboxes)
        ]
        for process in self.processes:
            process.start()

    def alive(self):
        return all(process.is_alive() for process in self.processes)

    def run(self, worker, world, args):
        environment = dict(os.environ)
        for inbox in self.inboxes[:world]:
            inbox.put((worker, world, args, environment))
        errors, reported = {}, set()
        deadline = time.monotonic() + TEST_TIMEOUT_S
        while len(reported) < world:
            try:
                rank, error = self.outbox.get(timeout=0.5)
            except queue.Empty:
                dead = {rank: p.exitcode for rank, p in enumerate(self.processes[:world]) if not p.is_alive()}
                if dead:
                    errors.update({rank: f"the process exited with code {code}" for rank, code in dead.items()})
                    break
                if time.monotonic() > deadline:
                    break
                continue
            reported.add(rank)
            if error is not None:
                errors[rank] = error
                deadline = min(deadline, time.monotonic() + STRAGGLER_S)
        if errors or len(reported) < world:
            hung = sorted(set(range(world)) - reported - set(errors))
            parts = [f"-- rank {rank} failed:\n{text}" for rank, text in sorted(errors.items())]
            if hung:
                parts.append(f"-- ranks {hung} did not finish")
            raise RanksFailed(f"{worker.__name__} on {world} ranks:\n" + "\n".join(parts))

    def close(self, kill=False):
        if not kill:
            for inbox in self.inboxes:
                inbox.put(None)
            for process in self.processes:
                process.join(timeout=10)
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join()


_pool: _RankPool | None = None


@atexit.register
def _close_pool():
    if _pool is not None:
        _pool.close()
