"""Models split over devices: each layer's tensors on its layer's device, numbers unchanged.

On the CPU: a HuggingFace model dispatched with accelerate (`device_map`, its hooks
installed) runs every experiment and sweep with the numbers of the same weights
undispatched; safelens reads each layer's device from the model (accelerate's execution
device, else the layer's weights), checked with a layer moved to `meta` so nothing
runs. With CUDA: the same model with its first layers on `cuda:0` and the rest on the
CPU, and a HookedTransformer with `n_devices=2` where there are two GPUs.
"""

from __future__ import annotations

import copy

import accelerate
import pytest
import torch
from split_models import N_LAYERS, cache_devices, experiments, split_llama, unsplit

import safelens
from safelens.backends._families import backend_of
from safelens.backends.hf._sites import layer_device
from safelens.patching._clean_cache import clean_activation

NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device to split layers between it and the CPU",
)


def _assert_same(split: dict[str, torch.Tensor], whole: dict[str, torch.Tensor], atol: float):
    assert split.keys() == whole.keys()
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=atol, rtol=atol, msg=name)


def test_a_model_dispatched_with_accelerate_gives_the_numbers_of_the_undispatched_one():
    model = split_llama(["cpu"] * N_LAYERS)
    assert all(hasattr(layer, "_hf_hook") for layer in model.model.layers)
    _assert_same(experiments(model), experiments(unsplit()), atol=0.0)


def test_each_layer_s_device_is_read_from_the_model_without_running_it():
    model = copy.deepcopy(unsplit())
    model.model.layers[1].to("meta")  # its weights there, and no accelerate hook
    # Accelerate runs layer 3 on its hook's execution device, wherever its weights are.
    hook = accelerate.hooks.AlignDevicesHook(execution_device=torch.device("meta"))
    accelerate.hooks.add_hook_to_module(model.model.layers[3], hook)
    backend = backend_of(model, "test")
    devices = [layer_device(backend, layer).type for layer in range(N_LAYERS)]
    assert devices == ["cpu", "meta", "cpu", "meta"]
    _, clean_cache = safelens.run_with_patching_cache(unsplit(), torch.tensor([[1, 2, 3]]))
    site = backend.patch_site("k", clean_cache)
    placed = [clean_activation(backend, site, clean_cache, layer, 1, 3) for layer in range(4)]
    assert [tensor.device.type for tensor in placed] == devices


@NEEDS_CUDA
def test_a_model_split_between_cuda_and_the_cpu_gives_the_numbers_of_one_device():
    devices = ["cuda:0"] * (N_LAYERS // 2) + ["cpu"] * (N_LAYERS - N_LAYERS // 2)
    model = split_llama(devices)
    assert cache_devices(model) == [torch.device(device) for device in devices]
    _assert_same(experiments(model), experiments(unsplit()), atol=1e-4)


@pytest.mark.hooked_transformer
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices for n_devices=2")
def test_a_hooked_transformer_on_two_gpus_keeps_each_layer_s_cache_on_its_gpu():
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = dict(n_layers=4, d_model=32, n_ctx=32, d_head=8, n_heads=4, d_vocab=50, act_fn="gelu")
    split = HookedTransformer(HookedTransformerConfig(**cfg, n_devices=2, device="cuda", seed=0))
    whole = HookedTransformer(HookedTransformerConfig(**cfg, device="cpu", seed=0))
    whole.load_state_dict({name: p.cpu() for name, p in split.state_dict().items()})
    tokens = torch.randint(0, 50, (1, 8), generator=torch.Generator().manual_seed(0))
    prefix = safelens.prefill(split, tokens)
    assert [entry.keys.device.index for entry in prefix.cache] == [0, 0, 1, 1]
    scores = safelens.score_continuations(split, prefix, [[1, 2], [3]]).sums
    expected = safelens.score_continuations(whole, safelens.prefill(whole, tokens), [[1, 2], [3]])
    torch.testing.assert_close(scores.cpu(), expected.sums, atol=1e-4, rtol=1e-4)
