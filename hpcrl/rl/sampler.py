"""The data position: a reshuffled permutation per epoch, resumable from (epoch, cursor)."""

from __future__ import annotations

import torch


class EpochSampler:
    def __init__(self, n: int, seed: int, epoch: int = 0, cursor: int = 0):
        self.n, self.seed, self.epoch, self.cursor = n, seed, epoch, cursor
        self._perm = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list:
        # its own generator: the order depends on (seed, epoch) only, never on the global RNG
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def next(self, k: int) -> list:
        out = []
        while len(out) < k:
            if self.cursor >= self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
            take = min(k - len(out), self.n - self.cursor)
            out += self._perm[self.cursor:self.cursor + take]
            self.cursor += take
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}
