"""Adaptive depth: when a token may leave the recurrence, and what its skipped loops leave behind.

A request with `loops: "auto"` gives each generated token its own depth, between `min_loops` and
`max_loops`. After every loop from `min_loops` on, the token's exit criterion is checked on its own
states, so whether it exits never depends on the other rows of the batch:

    latent   relative change of the core state between successive loops, ||h_r - h_{r-1}|| / ||h_r||,
             below the threshold (no head needed)
    kl       KL(p_r || p_{r-1}) between the next-token distributions after successive loops, below the
             threshold: each check runs the read-out (coda, final norm, the full LM head) on the row's state,
             exact but costly (a coda pass and a head per loop; docs/adaptive.md measures it)
    gate     a learned exit gate (a checkpoint's, kept by `tinyloop convert`): lambda_r = sigmoid(gate(h_r)) after
             every loop, and the token exits once the cumulative exit probability
             1 - prod_{i<=r} (1 - lambda_i) reaches the threshold (the gate's checkpoint's rule; a default 1.0 never exits early)

A row that exits leaves the step's remaining loops (it costs nothing there) and goes to the read-out
with its last state. Later tokens that run deeper attend, at loop r, to slots an exited token never
wrote. The fallback the early-exit literature uses (CALM, Schuster et al. 2022; a recurrent-depth reference's
"latest" KV lookup) fills them with the token's last computed loop's keys and values: `PagedStep
.fill_skipped` copies them into the deeper core slots as the token exits, so attention reads ordinary
slots afterwards.

Prompt tokens always run `max_loops`: their keys are then exact at every depth a later token may reach.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CRITERIA = ("latent", "kl", "gate")
DEFAULT_THRESHOLDS = {"latent": 0.3, "kl": 0.1, "gate": 0.9}  # latent: benchmarks/adaptive.py, docs/adaptive.md


@dataclass(frozen=True)
class ExitRule:
    criterion: str
    threshold: float
    min_loops: int
    max_loops: int

    def __post_init__(self):
        if self.criterion not in CRITERIA:
            raise ValueError(f"exit criterion must be one of {CRITERIA}, got {self.criterion!r}")
        if not 1 <= self.min_loops <= self.max_loops:
            raise ValueError(f"need 1 <= min_loops ({self.min_loops}) <= max_loops ({self.max_loops})")

    def needs_distribution_after(self, loop: int) -> bool:
        """kl: whether the read-out runs after loop index `loop` (the check after loop r compares r - 1)."""
        return self.criterion == "kl" and self.min_loops - 1 <= loop + 1 < self.max_loops

    def may_exit_after(self, loop: int) -> bool:
        """Whether the check runs after loop index `loop` (0-based): `min_loops` loops done, not the last."""
        return self.min_loops <= loop + 1 < self.max_loops


def latent_change(h_prev: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """(n, dim) states before and after a loop -> (n,) relative change ||h - h_prev|| / ||h|| (float64)."""
    h64, p64 = h.double(), h_prev.double()
    return (h64 - p64).norm(dim=-1) / h64.norm(dim=-1).clamp_min(1e-30)


def gate_survival(survival: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
    """Probability of not having exited yet, after one more loop whose gate gave `gate_logit` (float64)."""
    return survival * (1.0 - torch.sigmoid(gate_logit.double()))


def kl_divergence(logp: torch.Tensor, logp_prev: torch.Tensor) -> torch.Tensor:
    """(n, V) log-probabilities after this loop and the one before -> (n,) KL(p || p_prev) (float64)."""
    logp, logp_prev = logp.double(), logp_prev.double()
    return (logp.exp() * (logp - logp_prev)).sum(-1)


def should_exit(rule: ExitRule, h_prev: torch.Tensor, h: torch.Tensor,
                survival: torch.Tensor | None = None, kl: torch.Tensor | None = None) -> torch.Tensor:
    """(n,) bool: the rows whose criterion says stop after this loop (`survival`: the gate rule's, updated;
    `kl`: the kl rule's divergences, inf where there is no previous distribution yet)."""
    if rule.criterion == "gate":
        return 1.0 - survival >= rule.threshold
    if rule.criterion == "kl":
        return kl < rule.threshold
    return latent_change(h_prev, h) < rule.threshold
