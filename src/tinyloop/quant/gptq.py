"""GPTQ's math (Frantar et al., 2022) on one weight matrix, with no model in sight.

Given W (N out, K in) and the Hessian H = X X^T / n of its inputs (K, K), quantize W column by column;
after each column, the remaining columns absorb its rounding error in the least-squares sense
(`column_update`), so the layer's output error ||(W - Q) X|| stays small. Blocks of columns are updated
lazily (`block_update`). Options: dampening (a fraction of H's mean diagonal added to it), act-order
(columns by decreasing H diagonal) with static groups (each group's scale and zero computed up front in
the original column order, so the stored layout needs no column permutation).

`tinyloop.tools.gptq` gathers the Hessians from a model; this module only does the arithmetic.
"""

from __future__ import annotations

import torch

from .packing import minmax_params, quantize_with, resolve_group_size


def inverse_hessian_factor(H: torch.Tensor, percdamp: float = 0.01) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp I)^-1 (U^T U = H^-1): row i of U drives the update after column i."""
    H = H.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    damp = percdamp * torch.mean(torch.diag(H))
    H.diagonal().add_(damp)
    L = torch.linalg.cholesky(H)
    del H  # (K, K) doubles each: at most two alive (0.25 GiB each for an MLP's down projection at dim 5632)
    Hinv = torch.cholesky_inverse(L)
    del L
    return torch.linalg.cholesky(Hinv, upper=True)


def column_update(w_rest: torch.Tensor, err: torch.Tensor, u_row: torch.Tensor) -> torch.Tensor:
    """The optimal brain surgeon step: columns still to quantize absorb one column's scaled error.

    w_rest (N, R): the remaining columns; err (N,): (w - dequantized) / U[i, i]; u_row (R,): U[i, i+1:].
    Returns w_rest - err u_row^T, the least-squares best remaining columns given the quantized column.
    """
    return w_rest - err[:, None] * u_row[None, :]


def block_update(w_after: torch.Tensor, errs: torch.Tensor, u_block_rows: torch.Tensor) -> torch.Tensor:
    """The lazy batch form: columns after a block absorb all of its errors at once.

    w_after (N, R); errs (N, B) the block's scaled errors; u_block_rows (B, R) = U[block, after].
    """
    return w_after - errs @ u_block_rows


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, bits: int, group_size: int | None, *,
                  blocksize: int = 128, percdamp: float = 0.01, act_order: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W (N, K), H (K, K) -> (q uint8 (N, K), scales float16 (N, K/G), zeros uint8 (N, K/G)), the layout of
    `packing.quantize_rtn`. Without act-order a group's scale/zero come from its already-updated weights (as
    in the paper); with act-order they are static (from the original weights, before any update)."""
    N, K = W.shape
    G = resolve_group_size(bits, group_size, K)
    W = W.detach().double().clone()
    H = H.to(W)
    dead = torch.diag(H) == 0
    W[:, dead] = 0
    n_groups = K // G
    scales = torch.zeros(N, n_groups, dtype=torch.float64, device=W.device)
    zeros = torch.zeros_like(scales)
    have = torch.zeros(n_groups, dtype=torch.bool)
    if act_order:
        s, z = minmax_params(W.reshape(N, n_groups, G), bits)  # static groups
        scales, zeros = s[..., 0].double(), z[..., 0].double()
        have[:] = True
        perm = torch.argsort(torch.diag(H), descending=True)
    else:
        perm = torch.arange(K, device=W.device)
    if act_order:  # (without it the order is the natural one: no permuted copies of W and H)
        W, H = W[:, perm], H[perm][:, perm]
    U = inverse_hessian_factor(H, percdamp)
    del H
    Q = torch.zeros_like(W)
    for b0 in range(0, K, blocksize):
        b1 = min(b0 + blocksize, K)
        W1 = W[:, b0:b1].clone()
        E1 = torch.zeros_like(W1)
        for i in range(b1 - b0):
            col = int(perm[b0 + i])
            g = col // G
            if not have[g]:  # first column of a group (natural order): params from the updated weights
                # this group's columns, as updated (only those: not a copy of every column still to come)
                here = W1[:, i:i + G]
                upcoming = here if here.shape[1] == G else torch.cat([here, W[:, b1:b1 + G - here.shape[1]]], dim=1)
                s, z = minmax_params(upcoming, bits)
                scales[:, g], zeros[:, g] = s[:, 0].double(), z[:, 0].double()
                have[g] = True
            s, z = scales[:, g], zeros[:, g]
            w = W1[:, i]
            q = quantize_with(w, s, z, bits).double()
            Q[:, b0 + i] = q
            err = (w - (q - z) * s) / U[b0 + i, b0 + i]
            W1[:, i + 1:] = column_update(W1[:, i + 1:], err, U[b0 + i, b0 + i + 1:b1])
            E1[:, i] = err
        W[:, b1:] = block_update(W[:, b1:], E1, U[b0:b1, b1:])
    if act_order:
        Q = Q[:, torch.argsort(perm)]
    return Q.to(torch.uint8), scales.half(), zeros.to(torch.uint8)
