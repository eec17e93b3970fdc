"""Several ranks under torchrun: process group, shares of a batch, agreement, gradient reduction.

Without torchrun's environment (WORLD_SIZE unset or 1) every method is the identity of one
process and no process group is made, so the single-process trainer runs exactly as before.

Why the random streams are keyed: a rank's sampling draws come from generators seeded by
(seed, step, position of the prompt in the global batch), never from a per-rank RNG, so which
rank holds a prompt does not change its completions; the data order is the EpochSampler's
(seed, epoch) permutation, which every rank walks in step.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import time

import torch

# the stop reasons in the order a collective MAX picks the strongest
REASONS = (None, "deadline", "SIGUSR1", "SIGTERM")


def stream_seed(*key) -> int:
    """A 63-bit seed from a key such as (seed, step, prompt position): the same on every rank."""
    digest = hashlib.blake2b("/".join(str(k) for k in key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2 ** 63 - 1)


def generator(device, *key) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(stream_seed(*key))


class Dist:
    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0, timeout_s: float = 300.0,
                 device_name: str = "auto"):
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.enabled = world > 1
        self.comm_s = 0.0  # wall time inside collectives (includes waiting for slower ranks)
        if not self.enabled:
            return
        import torch.distributed as dist

        use_cuda = device_name != "cpu" and torch.cuda.is_available()
        if device_name == "auto" and not use_cuda:
            from .policy import cpu_only_or_fail

            cpu_only_or_fail()  # gloo on the CPU only where no GPU was given
        if use_cuda:
            torch.cuda.set_device(local_rank)
        # the timeout bounds every collective: a peer that is alive but stuck fails this rank
        # after timeout_s; a peer that died closes its sockets and gloo fails at once
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self._dist = dist

    @classmethod
    def from_env(cls, cfg: dict, env=None) -> "Dist":
        env = os.environ if env is None else env
        world = int(env.get("WORLD_SIZE") or 1)
        return cls(int(env.get("RANK") or 0), world, int(env.get("LOCAL_RANK") or 0),
                   cfg.get("dist_timeout_s", 300.0), cfg.get("device", "auto"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, device: torch.device) -> torch.device:
        """This rank's device: its own GPU (LOCAL_RANK) under torchrun."""
        if self.enabled and device.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return device

    def share(self, n: int, rank: int | None = None) -> range:
        """This rank's contiguous share of n items (sizes differ by at most one)."""
        r = self.rank if rank is None else rank
        base, extra = divmod(n, self.world)
        start = r * base + min(r, extra)
        return range(start, start + base + (1 if r < extra else 0))

    # ---------------------------------------------------------------- collectives

    def _tensor(self, values, dtype=torch.float64) -> torch.Tensor:
        # gloo on CPU; nccl needs the tensor on this rank's GPU
        dev = torch.device("cuda", self.local_rank) if self._dist.get_backend() == "nccl" else torch.device("cpu")
        return torch.tensor(values, dtype=dtype, device=dev)

    def max(self, values: list) -> list:
        if not self.enabled:
            return list(values)
        t = self._tensor(values)
        t0 = time.monotonic()
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX)
        self.comm_s += time.monotonic() - t0
        return t.tolist()

    def sum(self, values: list) -> list:
        if not self.enabled:
            return list(values)
        t = self._tensor(values)
        t0 = time.monotonic()
        self._dist.all_reduce(t)
        self.comm_s += time.monotonic() - t0
        return t.tolist()

    def agree_stop(self, reason: str | None) -> str | None:
        """The strongest stop reason any rank has (None: nobody wants to stop)."""
        if not self.enabled:
            return reason
        return REASONS[int(self.max([REASONS.index(reason)])[0])]

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order (small Python objects: scores, metrics)."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world
        t0 = time.monotonic()
        self._dist.all_gather_object(out, obj)
        self.comm_s += time.monotonic() - t0
        return out

    def barrier(self) -> None:
        if self.enabled:
            self.max([0])  # a collective under the group's timeout (barrier() ignores it on gloo)

    def all_reduce_grads(self, params, bucket_bytes: int = 32 << 20) -> None:
        """Sum the gradients over ranks (the loss is already normalised globally).

        A rank with no rows in a mini-batch has no gradient: it contributes zeros. One flat
        buffer per bucket: one collective per ~32 MB instead of one per parameter.
        """
        if not self.enabled:
            return
        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket, size = [], 0
        for p in params:
            bucket.append(p)
            size += p.grad.numel() * p.grad.element_size()
            if size >= bucket_bytes:
                self._reduce_bucket(bucket)
                bucket, size = [], 0
        if bucket:
            self._reduce_bucket(bucket)

    def _reduce_bucket(self, bucket) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        t0 = time.monotonic()
        self._dist.all_reduce(flat)
        self.comm_s += time.monotonic() - t0
        offset = 0
        for p in bucket:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    def close(self) -> None:
        if self.enabled and self._dist.is_initialized():
            self._dist.destroy_process_group()
