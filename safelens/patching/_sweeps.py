"""Activation patching sweeps: TransformerLens' `patching` results, many runs per pass.

Each function here takes the arguments of its namesake in `transformer_lens.patching`
(`model, corrupted_tokens, clean_cache, patching_metric`) and returns a tensor of the
same shape with the same numbers (up to float rounding), on the model's device (with
one exception, ungrouped grouped-query keys and values, below). Instead
of one full forward pass per patch, patched runs are stacked along the batch and run
from the corrupted run's frozen key/value cache: a patch at layer `l`, position `p` of a
causal model only runs positions `p:` and layers `l:` (see `safelens.patching._grid`).
Every input is checked before the first patched run (see `safelens.patching._inputs`).

Models: a `HookedTransformer` runs here. A TransformerBridge or a HuggingFace causal LM
goes to `safelens.patching._hf_sweeps` (keys and queries patched after the rotary
embedding, the same patch at one position; `resid_mid` refused in families that run
attention and MLP in parallel), and `generic_activation_patch` to
`safelens.patching._hf_generic`, so this module imports without `HookedTransformer`,
which TransformerLens 4 removed.

`patching_metric` is best *batched*: a function of logits `[runs * batch, pos, d_vocab]`
(rows `r * batch … (r + 1) * batch - 1` are patched run `r`) returning `[runs]`, as
[`logit_diff_metric`][safelens.logit_diff_metric] does. A TransformerLens-style metric,
logits of one run to a scalar, works too (it is detected at the first call on several
runs, when it returns a scalar for all of them) but is then called once per run.

Grouped-query models: key and value patches index the heads that `hook_k`/`hook_v`
hold: the key/value heads, `[…, n_kv_heads]`, as TransformerLens does; with
`ungroup_grouped_query_attention=True`, one per query head, `[…, n_heads]` (where
TransformerLens' own sweeps cover only the first `n_kv_heads` of them).

Models: causal models reuse the corrupted run's positions before each patch;
bidirectional ones run every position of every patched run (exact, slower). Prompts
are masked as TransformerLens masks them (a tokenizer's left padding). Several threads
may sweep one model at once (see `safelens.patching._grid`). Shortformer positional
embeddings are refused.

Caveat: positions before a patch are taken from the corrupted run, so a custom
`patch_setter` in [`generic_activation_patch`][safelens.generic_activation_patch] must
not change positions before its index's `pos` (TransformerLens' setters never do); one
that does is refused with a `PatchingError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, cast

import pandas as pd
import torch
from jaxtyping import Int

from ..backends._supported import SupportedModel
from ._hf_sites import TL_NAMES
from ._hf_sweeps import is_seam_model, seam_patch
from ._limits import DEFAULT_MAX_BYTES, _check_limits
from ._metric import Metric
from ._unchanged import known_setter_axes, marked, unchanged

if TYPE_CHECKING:
    from transformer_lens import ActivationCache, HookedTransformer

    from ._grid import Run
    from ._inputs import _Sweep

__all__ = [
    "generic_activation_patch",
    "get_act_patch_resid_pre",
    "get_act_patch_resid_mid",
    "get_act_patch_attn_out",
    "get_act_patch_mlp_out",
    "get_act_patch_attn_head_out_by_pos",
    "get_act_patch_attn_head_q_by_pos",
    "get_act_patch_attn_head_k_by_pos",
    "get_act_patch_attn_head_v_by_pos",
    "get_act_patch_attn_head_out_all_pos",
    "get_act_patch_attn_head_q_all_pos",
    "get_act_patch_attn_head_k_all_pos",
    "get_act_patch_attn_head_v_all_pos",
]

AxisName = Literal["layer", "pos", "head_index", "head", "src_pos", "dest_pos"]
PatchSetter = Callable[[torch.Tensor, Sequence[int], torch.Tensor], torch.Tensor]


def _row_index(
    sweep: _Sweep, runs: list[Run], rows: list[int], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Batch rows, clean-batch rows and per-run index columns on `device` (the patched tensor's)."""
    batch = torch.arange(sweep.batch, device=device)
    starts = torch.tensor(rows, device=device)
    row = (starts[:, None] + batch).reshape(-1)
    columns = torch.tensor([run.index for run in runs], device=device)
    return (row, batch.repeat(len(runs)), *columns.repeat_interleave(sweep.batch, dim=0).T)


def _by_pos_patcher(sweep: _Sweep, with_head: bool) -> Callable[..., None]:
    def patch(
        tensor: torch.Tensor, runs: list[Run], rows: list[int], batch: int, start: int
    ) -> None:
        row, clean_row, layer, pos, *head = _row_index(sweep, runs, rows, tensor.device)
        clean = sweep.clean[runs[0].layer]
        if with_head:
            tensor[row, pos - start, head[0]] = clean[clean_row, pos, head[0]]
        else:
            tensor[row, pos - start] = clean[clean_row, pos]

    return patch


def _all_pos_patcher(sweep: _Sweep) -> Callable[..., None]:
    def patch(
        tensor: torch.Tensor, runs: list[Run], rows: list[int], batch: int, start: int
    ) -> None:
        row, clean_row, layer, head = _row_index(sweep, runs, rows, tensor.device)
        tensor[row, :, head] = sweep.clean[runs[0].layer][clean_row, start:, head]

    return patch


def _grid_runs(shape: tuple[int, ...], pos_axis: int | None) -> list[Run]:
    from ._grid import Run
    from ._index import grid

    return [
        Run(index[0], index[pos_axis] if pos_axis is not None else 0, slot, index)
        for slot, index in enumerate(grid(shape))
    ]


def _patch(
    activation_name: str,
    by_pos: bool,
    with_head: bool,
    model: HookedTransformer,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: ActivationCache,
    patching_metric: Metric,
    *,
    max_batch: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = True,
) -> torch.Tensor:
    from ._inputs import _Sweep

    _check_limits(max_batch, max_bytes, progress)
    hooked = cast("HookedTransformer", model)  # neither a bridge nor an HF model
    sweep = _Sweep(hooked, corrupted_tokens, clean_cache, activation_name)
    shape: tuple[int, ...] = (model.cfg.n_layers,)
    if by_pos:
        shape += (sweep.length,)
    if with_head:
        shape += (sweep.heads(),)
    # The patcher writes clean[:, pos, head] (every position without pos, the whole
    # position without head).
    runs, idle = _idle(
        sweep, _grid_runs(shape, 1 if by_pos else None), [1] * by_pos + [2] * with_head
    )
    patcher = _by_pos_patcher(sweep, with_head) if by_pos else _all_pos_patcher(sweep)
    return sweep.run(
        runs, shape, patcher, patching_metric, max_batch, max_bytes, progress, by_pos, idle
    )


def _idle(sweep: _Sweep, runs: list[Run], axes: list[int]) -> tuple[list[Run], list[Run]]:
    """`runs` split into those that change something and those that do not (`_unchanged`).

    A run's patch writes the clean activation at its index after the layer, on the
    activation's `axes` (every entry of the others).
    """
    same = [
        unchanged(sweep.clean[layer], sweep.corrupted.activations[sweep.hook_name(layer)], axes)
        for layer in range(sweep.model.cfg.n_layers)
    ]
    flags = marked(same, [run.index for run in runs])
    idle = [run for run, flag in zip(runs, flags, strict=True) if flag]
    return [run for run, flag in zip(runs, flags, strict=True) if not flag], idle


def generic_activation_patch(
    model: SupportedModel,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: ActivationCache,
    patching_metric: Metric,
    patch_setter: PatchSetter,
    activation_name: str,
    index_axis_names: Sequence[AxisName] | None = None,
    index_df: pd.DataFrame | None = None,
    return_index_df: bool = False,
    *,
    max_batch: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, pd.DataFrame]:
    """Patch with any setter over any index grid, as `transformer_lens.patching` does.

    Same arguments and result as TransformerLens' `generic_activation_patch`: the first
    index column is the layer; a `pos` column, when there is one, is the first position
    `patch_setter` changes (positions before it are reused from the corrupted run; a
    negative `pos` counts from the end). `patch_setter(corrupted_activation, index,
    clean_activation)` is called once per patch on that run's full-length activation
    `[batch, pos, …]`, and returns it patched (or `None` after editing it in place).
    With one of TransformerLens' own setters, a patch that writes what the corrupted run
    holds runs no pass; any other setter runs for
    every index.
    Patches of `rot_k`, `attn_scores` or `pattern`, whose tensors span every key
    position, always run every position. On a TransformerBridge the setter runs on the
    bridge's own hook points, every position of each run; on a plain HuggingFace model
    at the site of `activation_name` (the "Patching sites" page says where each is),
    both tensors in TransformerLens' layout.

    **Arguments:**

    - `model`, `corrupted_tokens`, `clean_cache`, `patching_metric`, `patch_setter`,
      `activation_name`, `index_axis_names`, `index_df`, `return_index_df`: as in
      TransformerLens.
    - `max_batch`: at most this many patched runs per forward pass.
    - `max_bytes`: a memory budget that bounds the runs per forward pass (default 1 GiB).
    - `progress`: show a progress bar.

    **Returns:** the metric per patch, `[*axis sizes]`, or `[len(index_df)]` when
    `index_df` is given (and `index_df` itself with `return_index_df=True`).

    **Raises:** [`TokenError`][safelens.TokenError] for corrupted tokens that are not
    token ids of this model; [`PatchingError`][safelens.PatchingError] for a model,
    clean cache, activation, index, setter result, metric result or limit that does not
    fit, naming it.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> from transformer_lens.patching import layer_pos_patch_setter
    >>> cfg = HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=8, d_head=4, n_heads=4, d_vocab=11, act_fn="gelu")
    >>> model = HookedTransformer(cfg)
    >>> _, clean_cache = model.run_with_cache(torch.tensor([[1, 2, 3]]))
    >>> metric = lambda logits: logits[:, -1, 0]
    >>> generic_activation_patch(model, torch.tensor([[1, 5, 3]]), clean_cache, metric,
    ...     layer_pos_patch_setter, "resid_pre", ("layer", "pos"), progress=False).shape
    torch.Size([2, 3])

    ```
    """
    if is_seam_model(model):
        from ._hf_generic import seam_generic

        swept, index_df = seam_generic(
            model,
            corrupted_tokens,
            clean_cache,
            patching_metric,
            patch_setter,
            activation_name,
            index_axis_names,
            index_df,
            max_batch,
            max_bytes,
            progress,
        )
        return (swept, index_df) if return_index_df else swept
    from ._grid import Run
    from ._index import check_index_choice
    from ._inputs import _check_patched, _index_grid, _Sweep

    _check_limits(max_batch, max_bytes, progress)
    check_index_choice(index_axis_names, index_df)
    hooked = cast("HookedTransformer", model)  # neither a bridge nor an HF model
    sweep = _Sweep(hooked, corrupted_tokens, clean_cache, activation_name)
    index_df, shape = _index_grid(sweep, index_axis_names, index_df)
    columns = list(index_df.columns)
    pos_column = columns.index("pos") if "pos" in columns else None
    runs = []
    for slot, row in enumerate(index_df.itertuples(index=False)):
        index = tuple(int(i) for i in row)
        pos = index[pos_column] % sweep.length if pos_column is not None else 0
        runs.append(Run(index[0], pos, slot, index))

    def patch(
        tensor: torch.Tensor, runs: list[Run], rows: list[int], batch: int, start: int
    ) -> None:
        layer = runs[0].layer
        before = sweep.corrupted.activations[sweep.hook_name(layer)]
        for run, row in zip(runs, rows, strict=True):
            own = tensor[row : row + batch]
            full = torch.cat([before[:, :start], own], dim=1)
            patched = patch_setter(full, list(run.index), sweep.clean[layer])
            _check_patched(full if patched is None else patched, full, before, start, run)
            own.copy_((full if patched is None else patched)[:, start:])

    idle: list[Run] = []
    writes = known_setter_axes(patch_setter)
    if writes is not None and all(len(run.index) == len(writes) + 1 for run in runs):
        runs, idle = _idle(sweep, runs, writes)
    result = sweep.run(
        runs, shape, patch, patching_metric, max_batch, max_bytes, progress, idle=idle
    )
    return (result, index_df) if return_index_df else result


_EXAMPLE = """
    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> cfg = HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=8, d_head=4, n_heads=4, d_vocab=11, act_fn="gelu")
    >>> model = HookedTransformer(cfg)
    >>> _, clean_cache = model.run_with_cache(torch.tensor([[1, 2, 3]]))
    >>> metric = lambda logits: logits[:, -1, 0] - logits[:, -1, 1]
    >>> {name}(model, torch.tensor([[1, 5, 3]]), clean_cache, metric, progress=False).shape
    {shape}

    ```
"""


def _sweep_function(
    name: str, activation: str, what: str, by_pos: bool, with_head: bool, example: str
) -> Callable[..., torch.Tensor]:
    def patch(
        model: SupportedModel,
        corrupted_tokens: Int[torch.Tensor, "batch pos"],
        clean_cache: ActivationCache,
        patching_metric: Metric,
        *,
        max_batch: int | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        progress: bool = True,
    ) -> torch.Tensor:
        if is_seam_model(model):
            return seam_patch(
                activation,
                by_pos,
                with_head,
                model,
                corrupted_tokens,
                clean_cache,
                patching_metric,
                max_batch,
                max_bytes,
                progress,
            )
        return _patch(
            activation,
            by_pos,
            with_head,
            cast("HookedTransformer", model),  # neither a bridge nor an HF model
            corrupted_tokens,
            clean_cache,
            patching_metric,
            max_batch=max_batch,
            max_bytes=max_bytes,
            progress=progress,
        )

    axes = "layer" + (", pos" if by_pos else "") + (", head" if with_head else "")
    heads = (
        " (`n_kv_heads` on grouped-query models)" if activation in ("k", "v") and with_head else ""
    )
    patch.__name__ = patch.__qualname__ = name
    patch.__doc__ = f"""Patch {what}: TransformerLens' `patching.{name}`, batched on the cache.

    Patches `blocks.{{layer}}.{TL_NAMES[activation]}` from `clean_cache`
    into the corrupted run at each [{axes}]{heads}. On a TransformerBridge or a
    HuggingFace model, the "Patching sites" page says where it patches (keys and
    queries after the rotary embedding: the same patch at one position) and what each
    family holds there.

    **Arguments:**

    - `model`: a [`SupportedModel`][safelens.SupportedModel]: a `HookedTransformer`, a
      `TransformerBridge` or a HuggingFace causal LM.
    - `corrupted_tokens`: `[batch, pos]` tokens of the corrupted run.
    - `clean_cache`: the clean run's `ActivationCache` (`model.run_with_cache`; on a
      HuggingFace model, [`run_with_patching_cache`][safelens.run_with_patching_cache]'s
      dict).
    - `patching_metric`: logits `[runs * batch, pos, d_vocab]` to `[runs]` (fast), or
      TransformerLens-style logits of one run to a scalar.
    - `max_batch`: at most this many patched runs per forward pass.
    - `max_bytes`: a memory budget that bounds the runs per forward pass (default 1 GiB).
    - `progress`: show a progress bar.

    **Returns:** the metric per patch, float32 `[{axes}]` on the model's device.

    **Raises:** [`TokenError`][safelens.TokenError] for corrupted tokens that are not
    token ids of this model; [`PatchingError`][safelens.PatchingError] for a model,
    clean cache, activation, metric result or limit that does not fit, naming it.
    {_EXAMPLE.format(name=name, shape=example)}"""
    return patch


get_act_patch_resid_pre = _sweep_function(
    "get_act_patch_resid_pre",
    "resid_pre",
    "the residual stream before each block",
    True,
    False,
    "torch.Size([2, 3])",
)
get_act_patch_resid_mid = _sweep_function(
    "get_act_patch_resid_mid",
    "resid_mid",
    "the residual stream between each block's attention and MLP",
    True,
    False,
    "torch.Size([2, 3])",
)
get_act_patch_attn_out = _sweep_function(
    "get_act_patch_attn_out",
    "attn_out",
    "each attention layer's output",
    True,
    False,
    "torch.Size([2, 3])",
)
get_act_patch_mlp_out = _sweep_function(
    "get_act_patch_mlp_out",
    "mlp_out",
    "each MLP layer's output",
    True,
    False,
    "torch.Size([2, 3])",
)
get_act_patch_attn_head_out_by_pos = _sweep_function(
    "get_act_patch_attn_head_out_by_pos",
    "z",
    "each head's output `z` by position",
    True,
    True,
    "torch.Size([2, 3, 4])",
)
get_act_patch_attn_head_q_by_pos = _sweep_function(
    "get_act_patch_attn_head_q_by_pos",
    "q",
    "each head's queries by position",
    True,
    True,
    "torch.Size([2, 3, 4])",
)
get_act_patch_attn_head_k_by_pos = _sweep_function(
    "get_act_patch_attn_head_k_by_pos",
    "k",
    "each head's keys by position",
    True,
    True,
    "torch.Size([2, 3, 4])",
)
get_act_patch_attn_head_v_by_pos = _sweep_function(
    "get_act_patch_attn_head_v_by_pos",
    "v",
    "each head's values by position",
    True,
    True,
    "torch.Size([2, 3, 4])",
)
get_act_patch_attn_head_out_all_pos = _sweep_function(
    "get_act_patch_attn_head_out_all_pos",
    "z",
    "each head's output `z` at all positions",
    False,
    True,
    "torch.Size([2, 4])",
)
get_act_patch_attn_head_q_all_pos = _sweep_function(
    "get_act_patch_attn_head_q_all_pos",
    "q",
    "each head's queries at all positions",
    False,
    True,
    "torch.Size([2, 4])",
)
get_act_patch_attn_head_k_all_pos = _sweep_function(
    "get_act_patch_attn_head_k_all_pos",
    "k",
    "each head's keys at all positions",
    False,
    True,
    "torch.Size([2, 4])",
)
get_act_patch_attn_head_v_all_pos = _sweep_function(
    "get_act_patch_attn_head_v_all_pos",
    "v",
    "each head's values at all positions",
    False,
    True,
    "torch.Size([2, 4])",
)
