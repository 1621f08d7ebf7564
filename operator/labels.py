"""The labels on every object the operator makes: the app.kubernetes.io/* keys and their values.

Selectors (of Deployments, Services, PodDisruptionBudgets, the KV NetworkPolicy) match
`selector_labels`, which never change over a resource's life; the operator finds a
resource's children by `owned_labels`, and the chart's monitors find engines by MANAGED_BY.
"""

from __future__ import annotations

NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"  # the LLMDeployment's name
COMPONENT_LABEL = "app.kubernetes.io/component"  # the role: unified, prefill, decode, router
PART_OF_LABEL = "app.kubernetes.io/part-of"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"

APP_NAME = "tidegate"
MANAGED_BY = "tidegate-operator"


def selector_labels(name: str, component: str) -> dict[str, str]:
    """Labels that pick one role's pods; never changes over a resource's life."""
    return {NAME_LABEL: APP_NAME, INSTANCE_LABEL: name, COMPONENT_LABEL: component}


def child_labels(name: str, component: str) -> dict[str, str]:
    """Labels on every object the operator owns."""
    return {
        **selector_labels(name, component),
        PART_OF_LABEL: APP_NAME,
        MANAGED_BY_LABEL: MANAGED_BY,
    }


def owned_labels(name: str) -> dict[str, str]:
    """Labels that find every object the operator made for the resource `name`."""
    return {INSTANCE_LABEL: name, MANAGED_BY_LABEL: MANAGED_BY}


# On the pods of a canary Deployment (beside the role's selector labels): its own selector
# adds it, so the stable and canary pods of a role are told apart while the role's Services,
# PodDisruptionBudget and router still see both.
TRACK_LABEL = "tidegate.dev/track"
CANARY_TRACK = "canary"
