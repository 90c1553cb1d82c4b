"""Data-parallel DP-SGD on torch.distributed (``torchrun``), and the single-process default.

How a logical step is split over P processes (see docs/distributed.md):

* rank r Poisson-samples its shard {i : i mod P = r} with the run's q, from its own stream;
* each rank clips and sums its examples' gradients (any engine, in physical chunks);
* **rank 0 alone** adds N(0, (sigma C)^2) to its local sum, then one all-reduce (SUM) gives every
  rank the same noisy sum: the noise is added exactly once, with std sigma C in total;
* every rank divides by the global expected batch size B and takes the same optimizer step.

Only rank 0 writes files. Collectives here are no-ops when ``world_size == 1``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from dpscale.rng import derive_seed

# The rank that draws the DP noise (documented; tests check the total std is sigma * C).
NOISE_RANK = 0


@dataclass(frozen=True)
class Distributed:
    """This process's place in the job.

    Attributes:
        rank: global rank (0 writes every file).
        world_size: number of processes P.
        local_rank: rank on this node (selects the GPU).
        backend: "gloo", "nccl", or None for a single process.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def adds_noise(self) -> bool:
        return self.rank == NOISE_RANK

    def all_reduce_sum_(self, tensors: list[torch.Tensor]) -> None:
        """Sum each tensor over ranks, in place (one flat collective for all of them)."""
        if not self.enabled or not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any (e.g. a stop request seen by one rank)."""
        if not self.enabled:
            return flag
        value = torch.tensor([1.0 if flag else 0.0])
        if self.backend == "nccl":
            value = value.cuda()
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item() > 0)

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """[obj of rank 0, obj of rank 1, ...] on every rank."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_module_(self, module: nn.Module) -> None:
        """Copy rank 0's parameters and buffers to every rank."""
        if not self.enabled:
            return
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (e.g. filling a cache), then the others."""
        if self.enabled and not self.is_main:
            dist.barrier()
        yield
        if self.enabled and self.is_main:
            dist.barrier()


def init_distributed(device: str) -> Distributed:
    """Join the torchrun job described by the environment (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_*),
    or return the single-process default when WORLD_SIZE is unset or 1.

    Backend: nccl for CUDA devices, gloo otherwise.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Distributed()
    backend = "nccl" if device.startswith("cuda") else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)  # object collectives use the current device
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return Distributed(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        backend=dist.get_backend(),
    )


def rank_stream_seed(base: int, rank: int, world_size: int, start_step: int) -> int:
    """Seed of rank ``rank``'s sampling/augmentation stream in a job of ``world_size`` processes
    that starts (or restarts with a different P) at ``start_step``.

    A single process starting at step 0 keeps ``base`` itself, so single-process runs draw exactly
    what they drew before distributed training existed. Every other (P, rank, start) gets an
    independent stream, so a resume with a different P never replays randomness already used.

    Returns:
        a 128-bit seed (DPRandom streams need that many bits; fewer could be enumerated).
    """
    if world_size == 1 and start_step == 0:
        return int(base)
    # A spawn key, not more entropy words: [base, P, r, s] could equal another base's words.
    return derive_seed(base, (world_size, rank, start_step))


def launch_command(
    processes: int, dpscale_args: list[str], threads: int = 1
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that run ``dpscale ARGS`` on this machine with ``processes`` processes:
    torchrun --standalone for several, plain ``python -m dpscale`` for one (benchmarks, tests).

    The environment sets ``threads`` OpenMP threads per process and drops any WORLD_SIZE inherited
    from an enclosing job.
    """
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("WORLD_SIZE", None)
    if processes == 1:
        return [sys.executable, "-m", "dpscale", *dpscale_args], env
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
    ]
    return [*launcher, "-m", "dpscale", *dpscale_args], env
