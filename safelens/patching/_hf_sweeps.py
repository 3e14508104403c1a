"""Patching sweeps on a TransformerBridge or a HuggingFace causal LM, many runs per pass.

The runner of a TransformerBridge and of a plain HuggingFace causal LM
(`safelens.patching._runners`): how the runs of every sweep (from the one front-end,
`safelens.patching._front`) run on these families (`SeamSweep`). Where each sweep
patches is the adapter's (`Backend.patch_site`); its clean tensors are checked by
`safelens.patching._clean_cache`. The corrupted prompt runs
once into a frozen [`HFKeyValueCache`][safelens.HFKeyValueCache]. A patch at layer `l`,
position `p` (an attention pattern's destination position: the row it patches spans
every source position, the keys of positions before `p` included, and changes the head's
output at `p` alone) changes nothing before `l` or before `p` in a causal model, so the patched
runs are grouped by `p` rounded down to a multiple of a span (chosen by a cost model,
`safelens.patching._hf_passes`), and by layer where a pass cannot take runs of several; each group's runs
are stacked along the batch, `batch` rows per run, in layer order, and run only
positions `p:` through the model, on forks of the corrupted cache cropped to `p` and
broadcast to every row (`cropped(p).expand(rows)`), each run entering at its layer `l`
with the corrupted run's residual stream (the earliest starts the pass, the others join
it there), and, for a metric that reads only the last position, unembedding that
position alone (`safelens.patching._hf_shortcuts`, which checks that both shortcuts
hold on the model, once per model and prompt shape: `safelens.patching._hf_checked`).
The logits of positions `< p` are the corrupted run's. While a hook of the user's is
attached anywhere in the model, every pass runs every position (a hook
may index positions); it still starts at the layer of its patch. Otherwise a bridge's
patched passes run on its plain HuggingFace model where that gives the bridge's numbers
(`_on_plain_model`).

Positions and padding, as the reference does: on a bridge, every position is attended
with positions `0…pos-1`, as `bridge(tokens)` does for a tensor of tokens; on a
HuggingFace model, the mask comes from `model.tokenizer` (left padding, a BOS that
shares the pad id attended) when it has a pad token, and positions from the mask, as
`generate` gives them.

Caveat: the memory budget bounds the rows of one pass. Hooks on a bridge's own hook
points act on every thread's passes while a sweep runs (TransformerLens' bookkeeping);
everything else a sweep attaches acts on its own thread only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..backends._backend import Backend
from ..backends._families import backend_of
from ..backends._sites import Site
from ..core._errors import PatchingError
from ..core._thread_hooks import hooked_anywhere
from ._clean_cache import named_inputs
from ._engine import Planned, Run, Schedule, run_passes
from ._grouping import with_positions_before
from ._hf_checked import fingerprint, remembered
from ._hf_generic import generic_inputs
from ._hf_passes import Editor, Pass, passes
from ._hf_shortcuts import Shortcuts, captured, tolerance
from ._limits import Limits, rows_within
from ._metric import Metric
from ._setters import Setter
from ._unchanged import seeing

__all__ = ["Editor", "Run", "SeamPasses", "SeamSweep", "seam_sweep"]

# Sites a bridge's plain HuggingFace model may run for it (`_on_plain_model`).
_ON_PLAIN_MODEL = frozenset({"resid_pre", "attn_out", "mlp_out", "k", "v"})


def _rows_limit(backend: Backend, new: int, length: int, max_bytes: int) -> int:
    """Rows one pass of `new` positions may hold within `max_bytes` (`rows_within`)."""
    config = backend.config  # type: ignore[attr-defined]
    d_mlp = getattr(config, "intermediate_size", None) or 4 * backend.d_model
    n_heads = getattr(config, "num_attention_heads", None) or backend.d_model // backend.d_head
    return rows_within(
        max_bytes,
        d_vocab=backend.d_vocab,
        d_model=backend.d_model,
        d_mlp=d_mlp,
        n_heads=n_heads,
        new=new,
        length=length,
        dtype=backend.dtype,
    )


@dataclass
class SeamSweep:
    """A sweep's checked inputs on a bridge or HuggingFace model, and how its runs run.

    The front-end's `Prepared` (`safelens.patching._front`) on these families: the site,
    the tokens, each layer's clean tensor at the site, and the heads of a head index;
    `run` scores the runs on `SeamPasses` (the engine's `run_passes`). With an `editor`
    (`generic_activation_patch`'s setter, `safelens.patching._hf_generic`) each run
    runs every position, since its setter may write any.
    """

    backend: Backend
    site: Site
    tokens: torch.Tensor
    clean: list[torch.Tensor]
    heads: int
    editor: Editor | None = None

    @property
    def n_layers(self) -> int:
        return self.backend.n_layers

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])

    def run(
        self, runs: list[Run], shape: tuple[int, ...], metric: Metric, limits: Limits
    ) -> torch.Tensor:
        if self.editor is not None:
            runs = [run._replace(pos=None) for run in runs]
        passes = SeamPasses.of(self.backend, self.site, self.tokens, self.clean, self.editor)
        out = torch.zeros(shape, device=self.backend.device)
        return run_passes(passes, self.clean, runs, out, metric, limits)


def seam_sweep(
    model: Any,
    corrupted_tokens: torch.Tensor,
    clean_cache: Any,
    activation: str,
    setter: Setter | None,
) -> SeamSweep:
    """The runner's `prepare` on a bridge or HuggingFace model: a named sweep's checked
    inputs, or with `setter` a generic one's (`safelens.patching._hf_generic`)."""
    if setter is not None:
        return SeamSweep(*generic_inputs(model, corrupted_tokens, clean_cache, setter, activation))
    backend = backend_of(model, "patching")
    site, tokens, clean = named_inputs(backend, corrupted_tokens, clean_cache, activation)
    return SeamSweep(backend, site, tokens, clean, site.heads)


@dataclass
class SeamPasses:
    """A sweep's passes on a bridge or HuggingFace model (`safelens.patching._engine.Passes`).

    `of` runs the corrupted prompt (module notes); `site` and `seen` are the model's
    own (a bridge's, where its passes run on its plain model), what the idle check
    reads; `schedule` plans the passes, which run on `pass_`.
    """

    corrupted: _Corrupted
    reference: _Corrupted
    pass_: Pass
    partial: bool
    generic: bool
    model_key: tuple[Any, ...]

    @property
    def batch(self) -> int:
        return int(self.pass_.tokens.shape[0])

    @property
    def site(self) -> Site:
        return self.reference.site

    @property
    def seen(self) -> dict[int, torch.Tensor]:
        return self.reference.seen

    @classmethod
    def of(
        cls,
        backend: Backend,
        site: Site,
        tokens: torch.Tensor,
        clean: list[torch.Tensor],
        editor: Editor | None,
    ) -> SeamPasses:
        """The corrupted run of `tokens`, once, into a frozen cache."""
        _check_no_dropout(backend.model)
        if backend.family == "bridge":
            mask = torch.ones_like(tokens, dtype=torch.long)
        else:
            mask = backend.default_mask(tokens).to(tokens.device)
        partial = not hooked_anywhere(backend.model)  # read before the sweep attaches its own
        with torch.no_grad():
            # The model's own corrupted run: patches that write what it holds are its runs.
            reference = _corrupted_run(backend, site, tokens, mask, editor is not None)
            corrupted = reference
            if partial and editor is None and backend.family == "bridge":
                corrupted = _on_plain_model(reference, tokens, mask)
        backend, site = corrupted.backend, corrupted.site
        pass_ = Pass(backend, site, tokens, mask, corrupted.cache, clean, editor)
        model_key = (fingerprint(backend.model, tokens, mask), site.activation)
        return cls(corrupted, reference, pass_, partial, editor is not None, model_key)

    def schedule(self, runs: list[Run], metric: Metric, max_bytes: int) -> Schedule:
        """The runs in passes by the cost model (`safelens.patching._hf_passes`), on the
        shortcuts that hold on this model (checked once per model and prompt shape)."""
        corrupted, pass_ = self.corrupted, self.pass_
        backend, site = corrupted.backend, corrupted.site
        batch, length = pass_.tokens.shape
        corrupted_logits = corrupted.logits

        def check(shortcuts: Shortcuts, entries: list[int], start: int) -> bool:
            key = (self.model_key, shortcuts.key(), tuple(entries), start)
            return remembered(backend.model, key, lambda: checked(shortcuts, entries, start))

        def checked(shortcuts: Shortcuts, entries: list[int], start: int) -> bool:
            # Each unpatched run as if patched part-way: the MLPs map its later positions
            # alone (`_hf_lean`), which must give the corrupted run's logits too.
            new = length - start
            at: list[int | None] = [
                start + (i + 1) * new // (len(entries) + 1) for i in range(len(entries))
            ]
            with torch.no_grad():
                logits = pass_.logits(shortcuts, [], entries[0], start, len(entries), entries, at)
            expected = corrupted_logits[:, -1:] if shortcuts.last_only else corrupted_logits
            expected = expected[:, -logits.shape[1] :].repeat(len(entries), 1, 1)
            return logits.shape == expected.shape and _close(
                logits, expected, shortcuts.tolerance()
            )

        shortcuts = Shortcuts.of(
            backend,
            site.activation,
            metric,
            corrupted.inputs,
            corrupted.forms,
            check,
            self.partial,
            corrupted.outputs,
        )
        planned: list[Planned] = []
        for first, start, group in passes(
            backend, site, shortcuts, runs, length, batch, not self.generic
        ):

            def run(chunk: list[Run], first: int = first, start: int = start) -> torch.Tensor:
                # A chunk of a staggered pass enters at its earliest run's layer.
                entry = max(first, shortcuts.first_layer(chunk[0].layer))
                entry = entry if shortcuts.stagger else first
                logits = pass_.logits(shortcuts, chunk, entry, start, len(chunk))
                if logits.shape[1] < length and not shortcuts.last_only:
                    logits = with_positions_before(logits, corrupted_logits, start)
                return logits

            planned.append((start, group, run))
        reference = self.reference.logits
        idle_logits = reference[:, -1:] if shortcuts.last_only else reference

        def rows(start: int) -> int:
            return _rows_limit(backend, length - start, length, max_bytes)

        return Schedule(planned, idle_logits, rows, torch.no_grad())


@dataclass
class _Corrupted:
    """The corrupted run on `backend`: its frozen cache and logits, `seen` (the site's
    values as its patch hook sees them, per layer) and what the shortcut check reads."""

    backend: Backend
    site: Site
    cache: Any
    logits: torch.Tensor
    seen: dict[int, torch.Tensor]
    inputs: Any
    forms: Any
    outputs: Any


def _corrupted_run(
    backend: Backend, site: Site, tokens: torch.Tensor, mask: torch.Tensor, generic: bool
) -> _Corrupted:
    cache = backend.empty_cache(tokens.shape[0])
    seen: dict[int, torch.Tensor] = {}
    with captured(backend) as (inputs, forms, outputs), seeing(backend, site, cache, seen, generic):
        logits = backend.forward(tokens, mask, cache)
    cache.freeze()
    return _Corrupted(backend, site, cache, logits, seen, inputs, forms, outputs)


def _on_plain_model(run: _Corrupted, tokens: torch.Tensor, mask: torch.Tensor) -> _Corrupted:
    """`run` redone on the bridge's plain HuggingFace model, when that gives the bridge's numbers.

    The plain model (`safelens.backends.bridge._plain`) holds the bridge's parameters and
    runs HuggingFace's own code without the bridge's components; its passes cost less.
    It is used only where HuggingFace has the site, and only when its corrupted run
    gives the bridge's logits and, at every layer, the bridge's values at the site, to
    float rounding (where the bridge's components compute otherwise, as Gemma-2's read
    `attn_out` after a norm outside the module, it does not); else, and where the plain
    model cannot run the pass at all, `run` is returned as it is.
    """
    if run.site.activation not in _ON_PLAIN_MODEL:
        return run
    try:
        backend = run.backend.plain()  # type: ignore[attr-defined]
        if backend is None:
            return run
        site = backend.patch_site(run.site.activation)
        twin = _corrupted_run(backend, site, tokens, mask, False)
    except Exception:  # noqa: BLE001 - no hook of the user's is attached: the model's own
        return run
    bound = tolerance(backend.dtype)
    same = (
        twin.logits.shape == run.logits.shape
        and _close(twin.logits, run.logits, bound)
        and twin.seen.keys() == run.seen.keys()
        and all(
            twin.seen[layer].shape == seen.shape and _close(twin.seen[layer], seen, bound)
            for layer, seen in run.seen.items()
        )
    )
    return twin if same else run


def _close(got: torch.Tensor, expected: torch.Tensor, tolerance: float) -> bool:
    """Whether `got` equals `expected` within `tolerance` relative to `expected`'s largest value."""
    bound = tolerance * (1 + float(expected.abs().max()))
    return float((got - expected).abs().max()) <= bound


def _check_no_dropout(model: torch.nn.Module) -> None:
    """A `PatchingError` naming a dropout that would act in the sweep's passes (train mode)."""
    for name, module in model.named_modules():
        if not module.training:
            continue
        rate = module.p if isinstance(module, torch.nn.modules.dropout._DropoutNd) else 0.0
        rate = rate or getattr(module, "attention_dropout", 0.0)  # HF attention's own
        if isinstance(rate, float) and rate > 0:
            raise PatchingError(
                f"model is in training mode with dropout {rate} at {name or 'the model'!r}: "
                "every patched run would drop other units, and the corrupted run it reuses "
                "yet others, so the numbers would be noise; call model.eval() first"
            )
