"""The registry of objectives: a name (``--loss``) -> what the config needs to know of it, and where its builder is.

An :class:`ObjectiveSpec` declares an objective's config facts: the ``--tis-level`` values it takes (the first is
``auto``'s), whether it needs the reference policy beyond a KL term, whether its score passes run in FP8 by
default, and the ``LossConfig`` fields only it reads (any other objective refuses them). ``config/`` reads the
specs to validate a run; :func:`megatron_pacs.algo.objectives.build_objective` builds the objective through
:meth:`ObjectiveSpec.build`, whose module is imported only then.

This module lives in ``config/`` and imports nothing but the standard library: ``config/`` stays free of torch
(``--help`` and the dry run stay instant), and ``algo/`` (whose package imports torch) already imports ``config/``,
so a spec module there would make the config pull torch and import back up.

A new objective: its class and a builder ``(LossConfig, BatchConfig) -> Objective`` (``algo/objectives.py`` or
its own module), and an :meth:`ObjectiveRegistry.register` call here with its spec.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

# A spec reads a LossConfig and hands the builder a BatchConfig; both are named in the annotations as Any: loss.py
# imports this module (its validation reads the registry), so importing them here would close a circle.
LossConfig = BatchConfig = Any

__all__ = ["OBJECTIVES", "ObjectiveRegistry", "ObjectiveSpec"]


def _no_reference(cfg: LossConfig) -> bool:
    del cfg
    return False


@dataclass(frozen=True, kw_only=True)
class ObjectiveSpec:
    """What the config knows of one objective."""

    title: str
    """Its name in messages (``PACS``)."""
    builder: str
    """``"module:function"`` of its builder, ``(LossConfig, BatchConfig) -> Objective``."""
    tis_levels: tuple[str, ...]
    """The ``--tis-level`` values it takes; the first is what ``auto`` resolves to."""
    tis_levels_why: str
    """Why it refuses the other levels (a refusal reads ``<level>: <why>; use <its levels>``)."""
    own_flags: Mapping[str, str] = field(default_factory=dict)
    """``LossConfig`` fields only it reads -> the problem another objective reports when one is set; ``{loss}`` is
    the ``--loss`` in use, ``{title}`` its title."""
    needs_reference: Callable[[LossConfig], bool] = _no_reference
    """Whether it needs the reference policy's log-probs given the loss config (a KL term needs them anyway)."""
    loss_agg_mode: str | None = None
    """What ``--loss-agg-mode auto`` resolves to for a token-level objective (None: it aggregates by itself)."""
    fp8_scores: bool = False
    """With ``--fp8-score-precision auto``: whether its score passes run in FP8, because its scores or ratios take a
    term from the FP8 training pass anyway (direct mode, ``--keep-groups-in-microbatch``, does for any objective)."""

    def build(self, loss: LossConfig, batch: BatchConfig) -> Any:
        """Import its builder and return the objective it builds for ``loss`` and ``batch``."""
        module, _, name = self.builder.partition(":")
        return getattr(importlib.import_module(module), name)(loss, batch)


class ObjectiveRegistry:
    """``--loss`` names -> :class:`ObjectiveSpec`, in registration order (the first is listed first)."""

    def __init__(self) -> None:
        self._specs: dict[str, ObjectiveSpec] = {}

    def register(self, name: str, spec: ObjectiveSpec) -> None:
        """Add ``spec`` under ``name``; a second registration of a name is an error."""
        if name in self._specs:
            raise KeyError(f"loss {name!r} is already registered")
        self._specs[name] = spec

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a plugin's or a test's own objective)."""
        del self._specs[name]

    def get(self, name: str) -> ObjectiveSpec:
        """The spec of ``name``, or a ``ValueError`` listing the valid names."""
        try:
            return self._specs[name]
        except KeyError:
            raise ValueError(f"loss={name!r} is not a valid option; choose one of {self.names()}") from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._specs)

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._specs))


def _ref_anchored(cfg: LossConfig) -> bool:
    return cfg.pacs_score_reference == "ref"


_PACS_ONLY = "only applies to --loss pacs; it has no meaning for --loss {loss}: drop it"

OBJECTIVES = ObjectiveRegistry()
"""The objectives ``--loss`` offers."""

OBJECTIVES.register(
    "pacs",
    ObjectiveSpec(
        title="PACS",
        builder="megatron_pacs.algo.objectives:build_pacs",
        tis_levels=("geometric", "sequence"),
        tis_levels_why="a PACS score and loss are per response",
        own_flags={
            "pacs_beta": _PACS_ONLY,
            "pacs_score": _PACS_ONLY,
            "pacs_advantage": _PACS_ONLY,
            "pacs_weights": _PACS_ONLY,
            "pacs_score_reference": "anchors the PACS score; it has no meaning for --loss {loss}",
        },
        needs_reference=_ref_anchored,
        fp8_scores=False,  # the two-phase gradient takes every score from bf16 passes
    ),
)
_TOKEN_LEVEL = "is a setting of the token-level objectives (grpo, gspo, cispo, ppo); {title} has none: drop it"
_GROUP_LEVEL = "shapes the group advantages of grpo, gspo and cispo; {title} has none: drop it"
_TOKEN_FLAGS = {
    name: _TOKEN_LEVEL
    for name in (
        "clip_ratio",
        "clip_ratio_low",
        "clip_ratio_high",
        "loss_agg_mode",
        "advantage_estimator",
        "norm_adv_by_std",
        "overlong_buffer_len",
        "overlong_penalty_factor",
        "mask_truncated",
        "entropy_coef",
    )
}
_GROUP_FLAGS = ("advantage_estimator", "norm_adv_by_std", "overlong_buffer_len", "overlong_penalty_factor")
_TOKEN_FLAGS.update({name: _GROUP_LEVEL for name in _GROUP_FLAGS})
_TOKEN_FLAGS["advantage_estimator"] = (
    "picks the group advantage of grpo, gspo and cispo; --loss {loss} has its own (PACS: --pacs-advantage; PPO: "
    "GAE over its critic, --gae-gamma and --gae-lambda): drop it"
)
OBJECTIVES.register(
    "grpo",
    ObjectiveSpec(
        title="GRPO",
        builder="megatron_pacs.algo.token_objectives:build_grpo",
        tis_levels=("token",),
        tis_levels_why="GRPO weights its tokens by token-level ratios",
        own_flags={
            **_TOKEN_FLAGS,
            "clip_ratio_c": "is the dual clip of grpo and ppo; {title} has none: drop it",
        },
        loss_agg_mode="seq-mean-token-sum-norm",  # the released GRPO baseline's (Dr. GRPO's constant T_max)
        fp8_scores=True,  # the ratio's current term is the FP8 training pass
    ),
)
OBJECTIVES.register(
    "gspo",
    ObjectiveSpec(
        title="GSPO",
        builder="megatron_pacs.algo.token_objectives:build_gspo",
        tis_levels=("geometric", "sequence", "token"),
        tis_levels_why="GSPO's ratio is the response's geometric mean",
        own_flags=_TOKEN_FLAGS,
        loss_agg_mode="seq-mean-token-mean",  # the GSPO paper's (and verl's) per-response mean
        fp8_scores=True,  # the ratio's current term is the FP8 training pass
    ),
)
OBJECTIVES.register(
    "cispo",
    ObjectiveSpec(
        title="CISPO",
        builder="megatron_pacs.algo.token_objectives:build_cispo",
        tis_levels=("token",),
        tis_levels_why="CISPO weights its tokens by token-level ratios",
        own_flags=_TOKEN_FLAGS,
        loss_agg_mode="token-mean",  # MiniMax-M1's token-level normalisation
        fp8_scores=True,  # the importance weight's current term is the FP8 training pass
    ),
)
OBJECTIVES.register(
    "ppo",
    ObjectiveSpec(
        title="PPO",
        builder="megatron_pacs.algo.ppo:build_ppo",
        tis_levels=("token",),
        tis_levels_why="PPO weights its tokens by token-level ratios",
        # GRPO's surrogate and its token-level settings on the critic's advantages (no group advantage to shape)
        own_flags={
            **{name: problem for name, problem in _TOKEN_FLAGS.items() if name not in _GROUP_FLAGS},
            "clip_ratio_c": "is the dual clip of grpo and ppo; {title} has none: drop it",
        },
        loss_agg_mode="seq-mean-token-sum-norm",
        fp8_scores=True,  # the ratio's current term is the FP8 training pass, as GRPO's
    ),
)
