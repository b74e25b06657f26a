"""The InferenceModelRewrites of an InferencePool: list and watch ``llm-d.ai/v1alpha2`` InferenceModelRewrite objects
in the pool's namespace (``kube_objectives.PoolObjectWatch``: the same follower as the InferenceObjectives) and
publish ``{name: ModelRewrite}`` of those whose ``spec.poolRef`` is the pool. The request path applies their rules
(``picker.request.model_rewrite``); docs/llm-d-compat.md, "InferenceModelRewrite".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from picker.shared.discovery.config import InferencePoolRef
from picker.shared.discovery.kube_access import SERVICE_ACCOUNT_DIR
from picker.shared.discovery.kube_objectives import PoolObjectWatch
from picker.shared.discovery.kube_objects import ModelRewrite, parse_model_rewrite
from picker.shared.discovery.model import Count

MAX_MODEL_REWRITES = 1000  # rewrites of the pool kept; one past it is ignored, counted "over_limit" and logged

PublishRewrites = Callable[[dict[str, ModelRewrite]], None]


class KubernetesModelRewriteWatch(PoolObjectWatch[ModelRewrite]):
    """Follows the InferenceModelRewrites of the InferencePool ``ref`` names and publishes ``{name: ModelRewrite}``
    (a malformed object is skipped whole, counted and logged). Bound: at most ``max_rewrites`` objects, each at most
    ``kube_objects.MAX_REWRITE_RULES`` rules of ``MAX_RULE_ITEMS`` matches and targets. Counters are prefixed
    ``rewrites_``."""

    count_prefix = "rewrites_"
    plural = "inferencemodelrewrites"
    noun = "rewrites"
    crd_kind = "InferenceModelRewrite"
    without_crd = "model rewrites come from the config's model_rewrites only"

    def __init__(
        self,
        ref: InferencePoolRef,
        publish: PublishRewrites,
        count: Count | None = None,
        *,
        service_account_dir: str = SERVICE_ACCOUNT_DIR,
        max_rewrites: int = MAX_MODEL_REWRITES,
    ) -> None:
        super().__init__(ref, publish, count, service_account_dir=service_account_dir, max_objects=max_rewrites)

    def parse_object(self, obj: Mapping[str, Any]) -> tuple[str, ModelRewrite | None]:
        return parse_model_rewrite(obj, self._ref.name)


__all__ = ["MAX_MODEL_REWRITES", "KubernetesModelRewriteWatch", "PublishRewrites"]
