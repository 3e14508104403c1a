"""Where a sweep patches on a TransformerBridge or a HuggingFace model, and the clean cache.

The sites themselves are the backends' (`Backend.patch_site`: a HuggingFace model's
in `safelens.backends.hf._sites`, a bridge's in `safelens.backends.bridge._sites`).
Here: how a sweep reaches them.

`site_edits` puts a pass's edits at the seams of a HuggingFace model
(`safelens.patching._engine.put` writes the clean values); `run_with_patching_cache`
makes a HuggingFace model's clean cache. A site's clean tensor is checked against the
prompt by `safelens.patching._clean_cache.clean_activation`, on every family.

On a bridge the clean cache is `bridge.run_with_cache(clean_tokens)`'s
`ActivationCache`; on a HuggingFace model it is the dict
[`run_with_patching_cache`][safelens.run_with_patching_cache] returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from ..backends._backend import Backend, NamesFilter
from ..backends._families import backend_of
from ..backends._sites import TL_NAMES
from ..backends.hf._seams import Edit, seam_edits
from ..backends.hf._sites import decoder_layers
from ..core._errors import PatchingError
from ._clean_cache import sweep_tokens

__all__ = ["run_with_patching_cache", "site_edits"]


@contextmanager
def site_edits(backend: Backend, edits: Mapping[str, Mapping[int, Edit]]) -> Iterator[None]:
    """Within the block, `edits[activation][layer]` sees (and may edit) that seam's tensor.

    For a HuggingFace model's seams (`safelens.backends.hf._seams.SEAMS`), in the hook layout of its `Site` (`Backend.patch_site`)
    ([`seam_edits`][safelens.backends.hf._seams.seam_edits]).
    """
    if not any(edits.values()):
        yield
        return
    _, layers = decoder_layers(backend.model, backend.n_layers)
    with seam_edits(layers, backend.config, edits):  # type: ignore[attr-defined]
        yield


def run_with_patching_cache(
    model: Any, tokens: torch.Tensor, *, names_filter: NamesFilter | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run a HuggingFace causal LM once; return its logits and the clean cache of the sweeps.

    `run_with_cache`'s counterpart for plain HuggingFace models, whose modules carry no
    TransformerLens hook points: the dict holds, per layer `l`, every activation the
    patching sweeps patch on such a model (the module notes' table), under
    TransformerLens' names: `blocks.{l}.hook_resid_pre`, `hook_resid_mid`,
    `hook_resid_post`, `hook_attn_out` and `hook_mlp_out` `[batch, pos, d_model]`;
    `blocks.{l}.attn.hook_q` and `hook_z` `[batch, pos, n_heads, d_head]` (queries after
    the rotary embedding); `blocks.{l}.attn.hook_pattern` and `hook_attn_scores`
    `[batch, n_heads, dest_pos, src_pos]`; and the cache's
    `model.layers.{l}.kv_cache.hook_k_new` / `hook_v_new` `[batch, n_kv_heads, pos,
    d_head]` (keys after the rotary embedding). A family without a site (no `mlp`
    module, as OPT; no residual stream between attention and MLP, as GPT-J) has no
    entries for it; the sweeps of that site say why. Positions and padding as the
    sweeps use them: the attention mask from the model's tokenizer (`model.tokenizer`,
    left padding) when it has one, else every position.

    Caveat: patterns and scores are `[batch, n_heads, pos, pos]` per layer, and while
    either is kept every layer's attention is computed eagerly (the logits then differ
    from the model's own attention by float rounding); `names_filter` keeps only what a
    sweep needs.

    **Arguments:**

    - `model`: a HuggingFace causal LM (on a TransformerBridge, use its own
      `run_with_cache`).
    - `tokens`: `[batch, pos]` token ids of the clean prompts.
    - `names_filter`: which names to keep, as in `run_with_cache`: a name, a list of
      names, or a function `fn(name) -> bool`; `None` keeps every one.

    **Returns:** `(logits, cache)`: logits `[batch, pos, d_vocab]`, and the dict above.

    **Raises:** [`TokenError`][safelens.TokenError] for tokens that are not token ids
    of this model; [`PatchingError`][safelens.PatchingError] for a TransformerBridge.

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=10))
    >>> logits, clean_cache = run_with_patching_cache(model, torch.tensor([[1, 2, 3]]))
    >>> clean_cache["model.layers.1.kv_cache.hook_k_new"].shape
    torch.Size([1, 2, 3, 4])
    >>> clean_cache["blocks.0.attn.hook_pattern"].shape
    torch.Size([1, 4, 3, 3])

    ```
    """
    backend = backend_of(model, "run_with_patching_cache")
    if backend.family != "hf":
        raise PatchingError(
            "run_with_patching_cache takes a plain HuggingFace causal LM, got a "
            f"{type(model).__name__}; on a TransformerBridge the clean cache is "
            "bridge.run_with_cache(clean_tokens)[1]"
        )
    tokens = sweep_tokens(backend, tokens, "tokens")
    wanted = _names_filter(names_filter)
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str, transposed: bool) -> Callable[..., None]:
        def hook(tensor: torch.Tensor, hook: Any = None) -> None:
            captured[name] = (tensor.transpose(1, 2) if transposed else tensor).detach().clone()

        return hook

    pairs: list[tuple[NamesFilter, Callable[..., None]]] = []
    seams: dict[str, dict[int, Edit]] = {}
    for activation in TL_NAMES:
        try:
            site = backend.patch_site(activation)
            hooks = [site.hook(layer) for layer in range(backend.n_layers)]
        except PatchingError:  # a family without the site: its sweep says so when asked
            if activation in ("k", "v"):
                raise
            continue
        for layer, hook in enumerate(hooks):
            name = site.clean(layer)
            if not wanted(name):
                continue
            if hook is None:
                seams.setdefault(activation, {})[layer] = keep(name, site.transposed)
            else:
                pairs.append((hook, keep(name, site.transposed)))
    cache = backend.empty_cache(tokens.shape[0])
    with torch.no_grad(), site_edits(backend, seams), backend.pass_hooks(cache, pairs):
        logits = backend.forward(tokens, backend.default_mask(tokens), cache)
    return logits, captured


def _names_filter(names: NamesFilter | None) -> Callable[[str], bool]:
    """`names_filter` as a predicate, or a `PatchingError` for one of another kind."""
    if names is None:
        return lambda name: True
    if callable(names):
        return names
    listed = {names} if isinstance(names, str) else set(names)
    if not all(isinstance(name, str) for name in listed):
        raise PatchingError(
            f"names_filter must be a name, a list of names or a function fn(name) -> bool, "
            f"got {names!r}"
        )
    return listed.__contains__
