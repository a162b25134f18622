"""The Walsh-Hadamard transform over the last dimension (QuaRot-style rotations).

`hadamard_matrix(n)` is the orthonormal Sylvester matrix H_n / sqrt(n): symmetric and its own inverse
(H @ H = I), so rotating twice gives the input back and dot products survive a rotation of both sides.
Rotating a vector spreads an outlier channel over every channel, which is what makes 4-bit per-vector
quantization of keys and values hold up. `fwht` is the O(n log n) butterfly form of the same map.
"""

from __future__ import annotations

import functools

import torch


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@functools.lru_cache(maxsize=None)
def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal (n, n) Walsh-Hadamard matrix (Sylvester order); n must be a power of two."""
    if not is_power_of_two(n):
        raise ValueError(f"a Walsh-Hadamard transform needs a power-of-two size, got {n}")
    return _sylvester(n).to(dtype=dtype, device=device)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform over the last dimension; equals x @ hadamard_matrix(n)."""
    n = x.shape[-1]
    if not is_power_of_two(n):
        raise ValueError(f"a Walsh-Hadamard transform needs a power-of-two size, got {n}")
    lead = x.shape[:-1]
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)              # (rows, blocks, pair, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2)
        h *= 2
    return (y.reshape(*lead, n) / n ** 0.5).to(x.dtype)
