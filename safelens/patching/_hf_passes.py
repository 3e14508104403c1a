"""How a sweep on a HuggingFace model or TransformerBridge runs its patched runs: its passes.

`passes` cuts a sweep's runs into passes `(first layer, first position, runs)` by a
cost model; `Pass.logits` runs one pass: the runs stacked along the batch (`batch` rows
each, in layer order), positions `start:` on the corrupted run's frozen cache cropped to
`start`, each run entering at its layer, its patches written at the site's hook or seam,
with the shortcuts the sweep checked (`safelens.patching._hf_shortcuts`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..backends._backend import Backend
from ..backends._sites import Site
from ._engine import Run, patch_index, put
from ._grouping import groups, run_rows
from ._hf_shortcuts import Shortcuts
from ._hf_sites import site_edits

__all__ = ["Editor", "Pass", "Run", "passes"]

# Runs patched at positions `p0 … p0 + span - 1` share one pass that starts at `p0`.
_SPANS = (1, 2, 4, 8, 16)
# What one pass costs beyond its arithmetic, in multiply-adds: once, and per layer run (a
# CPU estimate; it only sets how runs are grouped into passes). For a plain model, fitted
# on 32-token grids of 4-layer Llama- and GPT-2-like models (a pass of many rows also
# copies the prefix cache per row and reads it in every layer); smaller values cut the
# runs into more passes and made those grids a tenth to a sixth slower.
_OVERHEAD = {"bridge": (1.5e8, 6e7), "hf": (1.5e8, 5e7)}

# How a generic sweep edits one layer's activation: `(layer, [(run's place in its pass,
# run)]) -> edit`; `None` for the sweeps' own patches.
Editor = Callable[[int, list[tuple[int, Run]]], Callable[[torch.Tensor], torch.Tensor]]


def passes(
    backend: Backend,
    site: Site,
    shortcuts: Shortcuts,
    runs: list[Run],
    length: int,
    batch: int,
    own_patches: bool = True,
) -> list[tuple[int, int, list[Run]]]:
    """The sweep's passes `(first layer, first position, runs)`, cheapest by a cost model.

    Runs start at the layer of their patch (when the shortcut holds) and at their
    position rounded down to a multiple of a span (`safelens.patching._grouping`). A
    pass holds the runs of one layer, or, staggered (`Shortcuts.stagger`), of every
    layer, each entering at its own (runs in layer order). The span minimises the estimated cost: `_OVERHEAD[family]`
    per pass and per layer it runs (in multiply-adds), plus the multiply-adds of every
    row, layer and position it runs.
    For a metric of the last position, every patch in the last layer runs the last
    position alone: a key or value patch changes only what that position reads (patched
    where the cache hands the last layer every position, `Site.full`), and a patch of an
    activation computed after the keys and values (`Skips.own_position`) changes only its own
    position, so one at an earlier position gives the corrupted run's logits. Not for
    a generic sweep's runs (`own_patches=False`), whose setter may write any position.
    """
    last = backend.n_layers - 1
    late = (
        own_patches
        and shortcuts.allowed.last_logits
        and (site.full is not None or shortcuts.allowed.own_position)
        and (shortcuts.skips or last == 0)
    )
    passes = [(last, length - 1, [run for run in runs if run.layer == last])] if late else []
    runs = [run for run in runs if not (late and run.layer == last)]
    config = backend.config  # type: ignore[attr-defined]
    d_model = backend.d_model
    d_mlp = getattr(config, "intermediate_size", None) or 4 * d_model
    per_position = d_model * (4 * d_model + 3 * d_mlp)
    once, per_layer = _OVERHEAD.get(backend.family, _OVERHEAD["hf"])
    n_layers = backend.n_layers

    def cost(start: int, chunk: list[Run]) -> float:
        entries = [shortcuts.first_layer(run.layer) for run in chunk]
        overhead = (once + per_layer * (n_layers - min(entries))) / per_position
        return overhead + sum(n_layers - entry for entry in entries) * batch * (length - start)

    by_layer: dict[int, list[Run]] = {}
    for run in runs:
        by_layer.setdefault(
            0 if shortcuts.stagger else shortcuts.first_layer(run.layer), []
        ).append(run)
    spans = _SPANS if shortcuts.partial else (length,)
    for group in by_layer.values():
        for start, chunk in groups(group, spans, cost):
            passes.append((shortcuts.first_layer(chunk[0].layer), start, chunk))
    return sorted(passes, key=lambda item: item[:2]) if shortcuts.stagger else passes


class Pass:
    """The patched passes of one sweep: its model, tokens, corrupted cache and clean values."""

    def __init__(
        self,
        backend: Backend,
        site: Site,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        corrupted: Any,
        clean: list[torch.Tensor],
        editor: Editor | None = None,
    ) -> None:
        self.backend, self.site, self.tokens, self.mask = backend, site, tokens, mask
        self.corrupted, self.clean, self.editor = corrupted, clean, editor

    def logits(
        self,
        shortcuts: Shortcuts,
        chunk: list[Run],
        first: int,
        start: int,
        runs: int,
        entries: list[int] | None = None,
        positions: list[int | None] | None = None,
    ) -> torch.Tensor:
        """Logits of `runs` patched runs (`chunk`; none: unpatched) from layer `first`, position `start`.

        Positions `start:`, `batch` rows per run; the last position alone when the metric
        reads only that. Each run enters at its layer in `entries` (by default, its
        patch's layer in a staggered pass, else `first`). `positions`: where each run's
        rows may differ from the corrupted run's from (by default, its patch's position
        for the sweep's own patches; every position for a generic sweep's).
        """
        backend, site, tokens = self.backend, self.site, self.tokens
        batch = tokens.shape[0]
        device = tokens.device
        if entries is None:
            entries = shortcuts.entries(first, runs, [run.layer for run in chunk] or None)
        if start:
            prefix = self.corrupted.cropped(start)
            if entries.count(first) < runs:
                counts = [
                    max(1, sum(entry <= layer for entry in entries))
                    for layer in range(backend.n_layers)
                ]
                prefix = prefix._repeated(counts, batch)
                prefix.freeze()
            else:
                prefix = run_rows(prefix, runs, batch)
        else:
            prefix = backend.empty_cache(batch * runs)
        edits: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}
        hooks: dict[int, str | None] = {}
        # `passes`' last-layer group: the last position of the last layer alone.
        late = first == backend.n_layers - 1 and start == tokens.shape[1] - 1
        full = late and site.full is not None
        for layer in sorted({run.layer for run in chunk}):
            # A run before `start` is an own-position patch in `passes`' last-layer group:
            # it changes nothing the metric reads, so it runs unpatched.
            at = [
                i
                for i, run in enumerate(chunk)
                if run.layer == layer and (full or run.pos is None or run.pos >= start)
            ]
            if not at:
                continue
            if self.editor is not None:
                hooks[layer] = site.hook(layer)
                edits[layer] = self.editor(layer, [(i, chunk[i]) for i in at])
                continue
            index = patch_index(at, [chunk[i] for i in at], batch, device)
            if full:
                hooks[layer] = site.full(layer)  # type: ignore[misc]
                edits[layer] = _edit(site, self.clean[layer], index, 0)
            else:
                hooks[layer] = site.hook(layer)
                edits[layer] = _edit(site, self.clean[layer], index, start)
        hooked = [(hooks[layer], edit) for layer, edit in edits.items() if hooks[layer] is not None]
        inputs = {layer: edit for layer, edit in edits.items() if hooks[layer] is None}
        fwd_hooks = [(name, _as_hook(edit)) for name, edit in hooked]
        last_patched = any(run.layer == backend.n_layers - 1 for run in chunk)
        if positions is None and chunk and self.editor is None:
            positions = [run.pos for run in chunk]
        taken = shortcuts.taken(first, start, entries, last_patched, positions)
        with taken, site_edits(backend, {site.activation: inputs}):
            with backend.pass_hooks(prefix, fwd_hooks):  # type: ignore[arg-type]
                # `forward`, not `forward_continuations`: reading the prefix once per layer
                # (`shared_prefix`) costs more than it saves on a pass of this many rows
                # and new positions (a quarter more on a 256-token key grid).
                logits = backend.forward(
                    tokens[:, start:].repeat(runs, 1), self.mask.repeat(runs, 1), prefix
                )
        return logits[:, -1:] if shortcuts.last_only else logits


def _edit(
    site: Site, clean: torch.Tensor, index: tuple[torch.Tensor, ...], start: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda tensor: put(site, tensor, clean, index, start)


def _as_hook(edit: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def hook(tensor: torch.Tensor, hook: Any = None) -> torch.Tensor:
        return edit(tensor)

    return hook
