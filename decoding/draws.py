"""Per-user random numbers: a user's draws depend on the run's seed, the user's id and where in the user's own decode
they are used, never on the batch the user is decoded in (its neighbours, its row, a halved slice, a resume).

A counter-based generator (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) on SplitMix64
(Steele et al., OOPSLA 2014): row u of a call tagged t holds its user's seed (`user_seeds`: a stable hash of the run's
seed and the user id), and its element i is SplitMix64 at state key(u, t) + (i + 1) * golden, key(u, t) =
SplitMix64(seed_u + t). The tag names the call inside the decoder (its round, step, site) and the element index the
candidate inside the user's row (a beam and child, a draw and proposal), so a few int64 tensor ops give every user
of a batch its own numbers at once, without a Python loop over users.

`uniform(shape, generator, device, index)` is what the decoders call: a `UserDraws` gives per-user numbers, a
`torch.Generator` (or None) torch's, as before.
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch

GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a wrapping int64
_M1, _M2 = -4658895280553007687, -7723592293110705685  # 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (wrapping arithmetic; the shifts are logical)."""
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _M1
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _M2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def mix_int(x: int) -> int:
    """The same finaliser on a Python int -> a signed 64-bit int."""
    x &= (1 << 64) - 1
    x = ((x ^ (x >> 30)) * (_M1 & ((1 << 64) - 1))) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * (_M2 & ((1 << 64) - 1))) & ((1 << 64) - 1)
    x ^= x >> 31
    return x - (1 << 64) if x >= 1 << 63 else x


def unit(x: torch.Tensor) -> torch.Tensor:
    """int64 bits -> float64 uniforms in (0, 1), from the top 52 bits: (n + 0.5) / 2^52 is exact in float64, so the
    largest is 1 - 2^-53, never 1 (a log or a Gumbel of it stays finite)."""
    return (((x >> 12) & ((1 << 52) - 1)).double() + 0.5) / 2.0**52


def user_seeds(seed: int, users: Iterable, device: torch.device | str = "cpu") -> torch.Tensor:
    """The run's seed and user ids (ints or strings) -> one 64-bit seed per user [U] int64: BLAKE2b of the seed and
    the id's canonical bytes (type-tagged: an int and its numpy twin agree, 5 and "5" differ), the same on every
    machine and Python version."""
    out = [
        int.from_bytes(
            hashlib.blake2b(f"{seed}".encode() + b"\x00" + canonical(u), digest_size=8).digest(), "little", signed=True
        )
        for u in users
    ]
    return torch.tensor(out, dtype=torch.int64, device=device)


def canonical(user) -> bytes:
    if isinstance(user, str):
        return b"s" + user.encode("utf-8")
    if isinstance(user, bytes):
        return b"b" + user
    return b"i" + str(operator.index(user)).encode()  # int, numpy integers; anything else is refused


@dataclass(frozen=True)
class UserDraws:
    """One seed per row of the decoder's batch [B] and the tag of the call that draws with it."""

    seeds: torch.Tensor  # [B] int64
    tag: int = 0

    def select(self, rows: torch.Tensor) -> UserDraws:
        """The rows `rows` [A] (the users still decoding, in their new order)."""
        return UserDraws(self.seeds[rows], self.tag)

    def at(self, *tag: int) -> UserDraws:
        """The same users, for the call named by `tag` (ints) inside the current one."""
        t = self.tag
        for x in tag:
            t = mix_int(t * 31 + mix_int(x + 1))
        return UserDraws(self.seeds, t)

    def keys(self) -> torch.Tensor:
        """Each row's key for this tag [B] int64."""
        return mix(self.seeds + self.tag)

    def uniform(self, shape: tuple[int, ...], index: torch.Tensor | None = None) -> torch.Tensor:
        """Uniforms in (0, 1) [B, ...] float64; element [u, i...] keyed by (row u's seed, the tag, index[u, i...]:
        the element's place in its user's row, by default its flat offset in the row)."""
        if shape[0] != self.seeds.shape[0]:
            raise ValueError(f"per-user draws for {shape[0]} rows, but {self.seeds.shape[0]} users' seeds")
        if index is None:
            index = torch.arange(math.prod(shape[1:]), device=self.seeds.device).view(1, *shape[1:])
        key = self.keys().view(-1, *([1] * (len(shape) - 1)))
        return unit(mix(key + (index + 1) * GOLDEN)).expand(shape)


Generator = torch.Generator | UserDraws | None


def uniform(shape: tuple[int, ...], generator: Generator, device, index: torch.Tensor | None = None) -> torch.Tensor:
    """Uniforms [shape] float64: per user from a UserDraws (`index`: see UserDraws.uniform), else torch.rand."""
    if isinstance(generator, UserDraws):
        return generator.uniform(tuple(shape), index)
    return torch.rand(tuple(shape), generator=generator, device=device, dtype=torch.float64)


def gumbel(shape: tuple[int, ...], generator: Generator, device, index: torch.Tensor | None = None) -> torch.Tensor:
    """Standard Gumbel noise [shape] float64 (see `uniform`)."""
    u = uniform(shape, generator, device, index).clamp(1e-300, 1.0)
    return -torch.log(-torch.log(u))


def stream(generator: Generator, *tag: int) -> Generator:
    """The numbers of one call site: a UserDraws tagged `tag`; a torch.Generator goes on with its own sequence."""
    return generator.at(*tag) if isinstance(generator, UserDraws) else generator


def select(generator: Generator, rows: torch.Tensor) -> Generator:
    """A UserDraws's rows `rows` (the decoder dropped or reordered users); a torch.Generator as it is."""
    return generator.select(rows) if isinstance(generator, UserDraws) else generator
