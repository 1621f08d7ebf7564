"""Closed-loop tuning (spec.tuning.mode closed-loop): refit each role's step cost from what its
engines measured, propose a threshold and budget, and try the proposal as a canary.

`status.tuning` holds it, written by the rollout controller (operator/rollout_controller.py),
read by the reconcile:
- `applied`: by role, the promoted `longPrefillTokenThreshold` and `maxNumBatchedTokens` with
  the reason (the fit and its arithmetic), which `tune` uses instead of the cost model's where
  the spec leaves them auto;
- `proposed`: by role, what a canary tries now (the reconcile renders the spec with it, and
  `stage` sees the pods' change as any other);
- `lastFit`: by role, the last fit (its numbers, the steps it saw, the SLO attainment) and
  what it proposed, or why nothing;
- `rejected`: by role, thresholds whose canary was rolled back; not proposed again.

The loop, per role whose steps carry decodes (unified, decode): a window of `windowSeconds`
over the role's stable pods (`step_fit.window` of two readings), `fit_steps`, then `propose`
against the role's current values. A proposal is written only when it changes a value and
was not rejected before, and only while no canary runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tidegate.operator.render import Rendered
from tidegate.operator.step_fit import StepTotals, fit_steps, propose, window
from tidegate.operator.tuning import MeasuredChunks, RoleTuning

TUNING_STATUS_KEY = "tuning"
THRESHOLD, BUDGET = "longPrefillTokenThreshold", "maxNumBatchedTokens"
# Roles whose steps carry decodes, which the ITL SLO is about.
TUNED_ROLES = ("unified", "decode")


def closed_loop(resource: Mapping[str, Any]) -> bool:
    """Whether the resource asks for closed-loop tuning (read from the raw spec)."""
    return ((resource.get("spec") or {}).get("tuning") or {}).get("mode") == "closed-loop"


def measured(entries: Mapping[str, Any] | None) -> dict[str, MeasuredChunks]:
    """status.tuning.applied or .proposed as `tune` takes them."""
    out = {}
    for role, entry in (entries or {}).items():
        try:
            out[role] = MeasuredChunks(
                int(entry[THRESHOLD]), int(entry[BUDGET]), str(entry.get("reason", ""))
            )
        except (KeyError, TypeError, ValueError):
            continue  # written by someone else: ignored
    return out


def tuning_inputs(
    resource: Mapping[str, Any],
) -> tuple[dict[str, MeasuredChunks], dict[str, MeasuredChunks]]:
    """(applied, proposed) of a closed-loop resource; empty otherwise."""
    if not closed_loop(resource):
        return {}, {}
    status = (resource.get("status") or {}).get(TUNING_STATUS_KEY) or {}
    return measured(status.get("applied")), measured(status.get("proposed"))


@dataclass
class RoleWindow:
    """One role's window: its pods' step counters at the window's start."""

    started: float
    before: dict[str, StepTotals] = field(default_factory=dict)


def look(
    windows: dict[str, RoleWindow],
    rendered: Rendered,
    role: str,
    readings: dict[str, StepTotals],
    now: float,
    rejected: list[int],
) -> tuple[dict[str, Any] | None, dict[str, Any]] | None:
    """One reading of a tuned role's pods: None while its window runs (the first reading
    begins it); at the window's end, `role_proposal` for it, and a new window begins."""
    current = windows.get(role)
    spec = rendered.spec
    if current is not None and now - current.started < spec.tuning.window_seconds:
        return None
    windows[role] = RoleWindow(now, readings)
    if current is None:
        return None
    return role_proposal(
        rendered.tuning.roles[role],
        window(current.before, readings),
        itl_slo_ms=spec.scheduling.slo.itl_ms,
        max_num_seqs=spec.scheduling.max_num_seqs,
        block_size=spec.scheduling.block_size,
        max_model_len=spec.model.max_model_len,
        rejected=rejected,
    )


def role_proposal(
    role: RoleTuning,
    totals: StepTotals,
    *,
    itl_slo_ms: float,
    max_num_seqs: int,
    block_size: int,
    max_model_len: int | None,
    rejected: list[int],
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(the proposal entry, or None; the lastFit entry) for one role's window."""
    fit = fit_steps(totals)
    current = role.long_prefill_token_threshold.value
    proposal = propose(
        fit,
        itl_slo_ms,
        current,
        int(role.max_num_batched_tokens.value),
        max_num_seqs,
        block_size,
        max_model_len=max_model_len,
    )
    last: dict[str, Any] = {"steps": int(totals.steps), "proposal": proposal.reason}
    if fit.ok:
        last["fit"] = {
            "baseMs": round(fit.base_s * 1e3, 4),
            "perDecodeMs": round(fit.per_decode_s * 1e3, 5),
            "perTokenUs": round(fit.per_token_s * 1e6, 4),
        }
    for kind, attainment in proposal.attainment.items():
        share = attainment.share_over
        if share is not None:
            last.setdefault("overSloShare", {})[kind] = round(share, 4)
    if not proposal.change or role.long_prefill_token_threshold.user_set:
        return None, last
    if int(proposal.threshold) in rejected:
        last["proposal"] = (
            f"{proposal.threshold} was tried as a canary and rolled back: not proposed again"
        )
        return None, last
    entry = {
        THRESHOLD: int(proposal.threshold),
        BUDGET: int(proposal.budget),
        "reason": proposal.reason,
    }
    return entry, last
