"""A HuggingFace model split over devices with accelerate, and every experiment run on it.

`split_llama(devices)` dispatches a 4-layer Llama-like model (grouped-query attention)
with `accelerate.dispatch_model`: embeddings and each decoder layer on the device
`devices` gives it, the final norm and unembedding on the last layer's device, with
accelerate's hooks installed even where every device is the CPU. `experiments(model)`
runs each experiment and sweep of the HF backend on fixed inputs and returns its numbers
by name, so a split model can be compared with the same weights on one device, and
`cache_devices(model)` says where a prefilled cache keeps each layer.
"""

from __future__ import annotations

import copy
import functools

import accelerate
import torch
import transformers
from hf_models import CONFIGS, ids

import safelens

N_LAYERS = 4
ANSWER, WRONG = 3, 5


@functools.cache
def unsplit() -> torch.nn.Module:
    """The 4-layer model on the CPU, float32: what a split copy must equal."""
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"](N_LAYERS)).eval()


def split_llama(devices: list[str]) -> torch.nn.Module:
    """A copy of `unsplit()` with decoder layer `i` on `devices[i]`, dispatched by accelerate."""
    device_map = {f"model.layers.{i}": device for i, device in enumerate(devices)}
    device_map |= {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0]}
    device_map |= {"model.norm": devices[-1], "lm_head": devices[-1]}
    return accelerate.dispatch_model(
        copy.deepcopy(unsplit()), device_map=device_map, force_hooks=True
    )


def _metric(logits: torch.Tensor) -> torch.Tensor:
    return (logits[:, -1, ANSWER] - logits[:, -1, WRONG]).mean()


def cache_devices(model: torch.nn.Module) -> list[torch.device]:
    """The device of each layer's keys in a prefilled cache of `model`."""
    prefix = safelens.prefill(model, ids(1, 8))
    return [layer.keys.device for layer in prefix.cache.layers]


def experiments(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every experiment's numbers on `model`, on the CPU, by name (fixed inputs)."""
    prompt, continuations = ids(1, 8), [[3, 4, 5], [6, 7]]
    clean, corrupted = ids(1, 6, seed=3), ids(1, 6, seed=4)
    prefix = safelens.prefill(model, prompt)
    reference = safelens.prefill(model, ids(3, 8, seed=5))
    mean = safelens.Ablation("mean", layers=[1, 3], reference=reference)
    zero = safelens.Ablation("zero", layers=[2], heads=[1])
    names = lambda name: name.endswith("hook_k_full")  # noqa: E731
    logits, capture = safelens.run_with_cache_capture(
        model, prompt, cache=safelens.HFKeyValueCache(), names=names
    )
    captured = [capture[name].to(logits.device) for name in sorted(capture)]
    hooked = safelens.run_with_hooks(
        model,
        prompt,
        cache=safelens.HFKeyValueCache(),
        fwd_hooks=[("model.layers.2.kv_cache.hook_v_full", lambda v, hook: v * 0.5)],
    )
    _, clean_cache = safelens.run_with_patching_cache(model, clean)
    numbers = {
        "prefill logits": prefix.last_logits,
        "score_continuations": safelens.score_continuations(model, prefix, continuations).sums,
        "generate (greedy)": safelens.generate(model, prefix, max_new_tokens=4).log_probs,
        "ablate_write (mean)": safelens.score_continuations(
            model, safelens.ablate_write(model, prefix, mean), continuations
        ).sums,
        "ablate_read (zero)": safelens.score_continuations(
            model, safelens.ablate_read(prefix, zero), continuations
        ).sums,
        "run_with_cache_capture": torch.cat([logits.flatten(), *map(torch.flatten, captured)]),
        "run_with_hooks": hooked,
    }
    for sweep in ("attn_head_k_by_pos", "attn_head_v_by_pos", "resid_pre", "attn_out"):
        patch = getattr(safelens, f"get_act_patch_{sweep}")
        numbers[sweep] = patch(model, corrupted, clean_cache, _metric, progress=False)
    return {name: value.detach().cpu() for name, value in numbers.items()}
