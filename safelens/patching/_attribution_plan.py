"""What one attribution reads: `Plan`, the activations' sites and the QK fix's.

`attribution_patch` (and its dataset and Ray forms) names the grids to estimate, of
`ACTIVATIONS`; `plan` checks that choice and the model, and asks the model family's
adapter where it reads each activation (`Backend.read_site`, `safelens.backends._sites`;
the table in `safelens.patching._attribution_pass`): the keys, queries, values, head
outputs, patterns and node sites, and, with the QK fix on keys or queries, the queries,
keys, scores and pattern the fix recomputes attention from (`Backend.qk_sites`). A
`Plan` then says which clean activations the estimates read and which tensors (and
gradients) the corrupted pass keeps.

Caveat: the QK fix and pattern grids read `hook_pattern`, so a model whose attention
does not use what that hook returns is refused for them, as is the QK fix on a
`HookedTransformer` that transforms queries and keys further (attention sinks, log-n
scaling, QK norms or clipping outside the rotary path).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..backends._backend import Backend
from ..backends._families import backend_of
from ..backends._sites import Site
from ..core._arguments import flag
from ..core._errors import PatchingError
from ._attribution_pass import Read
from ._hf_sweeps import _check_no_dropout
from ._pattern_hook import check_pattern_hook

__all__ = ["ACTIVATIONS", "FIXED", "HEAD_SITES", "Activation", "Plan", "check_activations", "plan"]

Activation = Literal["k", "v", "q", "z", "pattern", "resid_pre", "resid_mid", "attn_out", "mlp_out"]
ACTIVATIONS: tuple[Activation, ...] = (
    "k",
    "v",
    "q",
    "z",
    "pattern",
    "resid_pre",
    "resid_mid",
    "attn_out",
    "mlp_out",
)
HEAD_SITES: tuple[Activation, ...] = ("k", "v", "q", "z")
FIXED = frozenset({"k", "q"})  # what the QK fix recomputes


@dataclass(frozen=True)
class Plan:
    """What one attribution reads: the site of each activation, the QK fix's sites."""

    backend: Backend
    activations: tuple[Activation, ...]
    sites: dict[str, Site]
    qk: dict[str, Site] | None

    def clean_names(self) -> list[str]:
        """The clean cache's names the estimates read."""
        sites = [*self.sites.values(), *((self.qk["qk_q"], self.qk["qk_k"]) if self.qk else ())]
        layers = range(self.backend.n_layers)
        return sorted({site.clean(layer) for site in sites for layer in layers})

    def reads(self) -> list[Read]:
        """Every tensor the corrupted pass keeps, gradients for the sites and the pattern."""
        layers = range(self.backend.n_layers)
        reads = {
            (name, layer): Read((name, layer), site.hook(layer), True, site.activation)
            for name, site in self.sites.items()
            for layer in layers
        }
        for role, site in (self.qk or {}).items():
            for layer in layers:
                grad = role == "pattern" or (role, layer) in reads
                reads[(role, layer)] = Read((role, layer), site.hook(layer), grad, site.activation)
        return list(reads.values())


def check_activations(activations: Any) -> tuple[Activation, ...]:
    """`activations` as a tuple of known names, or a `PatchingError` listing them."""
    if isinstance(activations, str) or not isinstance(activations, Sequence):
        raise PatchingError(
            f"activations must be a sequence of {list(ACTIVATIONS)}, got {activations!r}"
        )
    unknown = [name for name in activations if name not in ACTIVATIONS]
    if unknown or not activations:
        raise PatchingError(
            f"activations must be a non-empty sequence of {list(ACTIVATIONS)}, got "
            f"{list(activations)!r}"
        )
    return tuple(dict.fromkeys(activations))


def plan(
    model: Any,
    activations: Any,
    qk_fix: Any,
    clean_cache: Any,
    tokens: torch.Tensor,
    what: str = "attribution_patch",
) -> Plan:
    """Check the model and the choice of grids; where each is read (or why it cannot be)."""
    backend = backend_of(model, what)
    flag(qk_fix, "qk_fix", error=PatchingError, shown=repr)
    chosen = check_activations(activations)
    fixed = qk_fix and bool(FIXED & set(chosen))
    if backend.family == "hooked":
        _check_hooked_attention(model.cfg, fixed)
    elif fixed:
        _check_no_sinks(backend.model)
    sites: dict[str, Site] = {name: backend.read_site(name) for name in chosen}
    qk = _qk_sites(backend, chosen, what) if fixed else None
    _check_no_dropout(backend.model)
    if fixed or "pattern" in chosen:
        # The fix and pattern gradients read `hook_pattern`: attention must use its output.
        check_pattern_hook(model, tokens, f"{what}'s {'QK fix' if fixed else 'pattern grid'}")
    return Plan(backend, chosen, sites, qk)


def _qk_sites(backend: Any, chosen: Sequence[str], what: str) -> Any:
    """The QK fix's sites, or a `PatchingError` saying the fix (not the grid) is what fails."""
    try:
        return backend.qk_sites()
    except PatchingError as error:
        fixed = ", ".join(sorted(FIXED & set(chosen)))
        raise PatchingError(
            f"{what}'s QK fix for {fixed} recomputes attention from the queries, keys and "
            f"pattern, which this model does not expose ({error}); pass qk_fix=False for "
            f"plain gradient estimates of {fixed}"
        ) from error


def _check_no_sinks(model: torch.nn.Module) -> None:
    """Refuse the QK fix on a model whose attention softmax takes a learned sink per head.

    GPT-OSS and Granite-SWA (`sinks`, handed to attention as `s_aux`): a sink's logit
    joins every query's softmax, which the fix's exact softmax does not know.
    """
    for name, module in model.named_modules():
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            raise PatchingError(
                "the QK fix recomputes attention from the keys and queries, which this "
                f"model's attention also normalises with a learned sink per head "
                f"({type(module).__name__}.sinks at {name!r}); pass qk_fix=False for plain "
                "gradient estimates of k and q"
            )


def _check_hooked_attention(cfg: Any, qk_fix: bool) -> None:
    """Refuse the QK fix on a HookedTransformer whose attention transforms q and k further."""
    special = [
        name
        for name, on in (
            ("use_attention_sinks", cfg.use_attention_sinks),
            ("use_logn_attn", cfg.use_logn_attn),
            ("use_qk_norm", cfg.use_qk_norm and cfg.positional_embedding_type != "rotary"),
            ("clip_qkv", cfg.clip_qkv is not None and cfg.positional_embedding_type != "rotary"),
        )
        if on
    ]
    if qk_fix and special:
        raise PatchingError(
            f"the QK fix recomputes attention from the keys and queries, which this model "
            f"transforms further ({', '.join('cfg.' + s for s in special)}); pass "
            "qk_fix=False for plain gradient estimates of k and q"
        )
