"""Preference losses on sequence log-probabilities: DPO, IPO, SimPO and ORPO, with the metrics TRL logs.

Every loss reads the policy's log-probability of each answer (the sum over its scored tokens, ``sequence_logps``)
and, for DPO and IPO, the reference model's; the conventions are TRL 1.16's, so the numbers equal its trainers':

- DPO (Rafailov et al. 2023, arXiv 2305.18290, eq. 7): -log sigmoid(beta (log-ratio chosen - log-ratio rejected)),
  a log-ratio being log pi(y|x) - log pi_ref(y|x); with label smoothing eps the conservative form
  -(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d) (Mitchell 2023, "cDPO"; TRL's CPO sigmoid loss).
- IPO (Azar et al. 2023, arXiv 2310.12036, eq. 17): (d / tokens - 1 / (2 beta))^2, each log-ratio divided by its
  answer's scored tokens (TRL's DPOTrainer loss_type="ipo": "confirmed with the IPO authors").
- SimPO (Meng et al. 2024, arXiv 2405.14734, eq. 6): no reference; -log sigmoid(beta (mean log-prob chosen - mean
  log-prob rejected) - gamma), the means per scored token (TRL's CPOTrainer loss_type="simpo", cpo_alpha=0).
- ORPO (Hong et al. 2024, arXiv 2403.07691, eqs. 4-7): no reference; the chosen answers' token-mean NLL minus
  lambda * mean log sigmoid(log odds(chosen) - log odds(rejected)), odds from the per-token mean log-probs
  (TRL's ORPOTrainer, lambda its ``beta``).

Rewards (as TRL names the metrics): beta x log-ratio for DPO / IPO, beta x the (mean) log-prob for SimPO / ORPO;
``rewards/accuracies`` the share of pairs whose chosen reward is the larger, ``rewards/margins`` the mean gap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainscale.errors import TrainscaleError

IGNORE = -100  # runtime/model.IGNORE: a target not scored
LOSSES = ("dpo", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")


@dataclass(frozen=True)
class PreferenceSettings:
    """Which loss, and its constants (TRL's defaults: beta 0.1; SimPO's gamma 0.5, TRL CPOConfig's simpo_gamma;
    ORPO's lambda is beta)."""

    loss: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5  # SimPO's target margin (TRL's simpo_gamma)

    def check(self) -> PreferenceSettings:
        if self.loss not in LOSSES:
            raise TrainscaleError(f"the preference loss must be one of {', '.join(LOSSES)}, not {self.loss!r}")
        if not self.beta > 0:
            raise TrainscaleError(f"beta must be positive, not {self.beta:g}")
        if not 0 <= self.label_smoothing < 0.5:
            raise TrainscaleError(f"label smoothing must be in [0, 0.5), not {self.label_smoothing:g}")
        if self.label_smoothing and self.loss not in ("dpo", "simpo"):
            raise TrainscaleError(f"label smoothing applies to the dpo and simpo losses, not {self.loss}")
        return self

    @property
    def needs_reference(self) -> bool:
        return self.loss not in REFERENCE_FREE


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [b, s, V] (position t predicts targets[:, t]) and targets [b, s] (IGNORE where not scored) ->
    (sum of the scored tokens' log-probabilities [b], number of scored tokens [b]); computed in fp32."""
    mask = targets != IGNORE
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1), mask.sum(-1)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable both near 0 and far below (Maechler 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def preference_loss(s: PreferenceSettings, chosen: torch.Tensor, rejected: torch.Tensor, n_chosen: torch.Tensor,
                    n_rejected: torch.Tensor, ref_chosen: torch.Tensor | None = None,
                    ref_rejected: torch.Tensor | None = None,
                    nll: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The batch's loss (the mean over its pairs) and per-pair metrics tensors from sequence log-probs [b] (sums
    over the scored tokens), their token counts [b], the reference's sums [b] (DPO, IPO) and, for ORPO, the chosen
    answers' token-mean NLL (a scalar). -> (loss, {"rewards/chosen", "rewards/rejected", "logps/chosen",
    "logps/rejected"} per pair, detached)."""
    if s.needs_reference:
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(f"the {s.loss} loss needs the reference model's log-probs")
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        rewards = s.beta * chosen_ratio.detach(), s.beta * rejected_ratio.detach()
        if s.loss == "dpo":
            d = s.beta * (chosen_ratio - rejected_ratio)
            losses = -(1 - s.label_smoothing) * F.logsigmoid(d) - s.label_smoothing * F.logsigmoid(-d)
        else:  # ipo
            d = chosen_ratio / n_chosen.clamp_min(1) - rejected_ratio / n_rejected.clamp_min(1)
            losses = (d - 1 / (2 * s.beta)) ** 2
        loss = losses.mean()
    else:
        mean_c, mean_r = chosen / n_chosen.clamp_min(1), rejected / n_rejected.clamp_min(1)
        rewards = s.beta * mean_c.detach(), s.beta * mean_r.detach()
        if s.loss == "simpo":
            d = s.beta * (mean_c - mean_r - s.gamma / s.beta)
            loss = (-(1 - s.label_smoothing) * F.logsigmoid(d) - s.label_smoothing * F.logsigmoid(-d)).mean()
        else:  # orpo
            if nll is None:
                raise ValueError("the orpo loss needs the chosen answers' NLL")
            log_odds = (mean_c - mean_r) - (_log1mexp(mean_c) - _log1mexp(mean_r))
            loss = nll - s.beta * F.logsigmoid(log_odds).mean()
    return loss, {"rewards/chosen": rewards[0], "rewards/rejected": rewards[1],
                  "logps/chosen": chosen.detach(), "logps/rejected": rejected.detach()}


def summarize(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-pair metrics (``preference_loss``'s, pairs concatenated) -> TRL's logged means: rewards/chosen,
    rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected."""
    c, r = metrics["rewards/chosen"], metrics["rewards/rejected"]
    out = {"rewards/chosen": c.mean(), "rewards/rejected": r.mean(), "rewards/accuracies": (c > r).float().mean(),
           "rewards/margins": (c - r).mean(), "logps/chosen": metrics["logps/chosen"].mean(),
           "logps/rejected": metrics["logps/rejected"].mean()}
    return {k: float(v) for k, v in out.items()}
