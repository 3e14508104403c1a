"""The pattern sweeps and the `*_every` bundles on a TransformerBridge and on HuggingFace models.

References: on a bridge, `transformer_lens.patching` itself on the same bridge (its
bundles, its pattern sweeps, and `generic_activation_patch` over an `index_df` where the
full grid is slow); on a plain HuggingFace model, one torch-hooked uncached forward per
patch, without safelens. The models here (Llama: rotary, grouped-query; GPT-2: one fused
qkv projection) have weights drawn with std 0.2, not `hf_models`' 0.02, so their
attention patterns differ between prompts and each patch type moves the metric by far
more than the tolerance. Pattern sweeps refuse an OPT bridge, whose attention is
HuggingFace's own. Runs on TransformerLens 3.9 and 4.x.
"""

from __future__ import annotations

import functools
import tempfile

import pandas as pd
import pytest
import torch
import transformers
from hf_models import CONFIGS, ids, tokenizer
from transformer_lens import patching
from transformer_lens.model_bridge import TransformerBridge

import safelens
from safelens import PatchingError, run_with_patching_cache

TOL = 1e-4
ANSWER, WRONG = 3, 5
PATTERNS = (
    "get_act_patch_attn_head_pattern_all_pos",
    "get_act_patch_attn_head_pattern_by_pos",
    "get_act_patch_attn_head_pattern_dest_src_pos",
)
BUNDLES = (
    "get_act_patch_block_every",
    "get_act_patch_attn_head_all_pos_every",
    "get_act_patch_attn_head_by_pos_every",
)


@functools.cache
def sharp_model(name: str) -> torch.nn.Module:
    """A two-layer HuggingFace causal LM of family `name` whose weights have std 0.2; cached."""
    return _sharp(name)


@functools.cache
def sharp_bridge(name: str) -> TransformerBridge:
    """A bridge over `sharp_model(name)`'s twin (booting edits the model it wraps); cached."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer().save_pretrained(folder)
        booted = TransformerBridge.boot_transformers(folder, hf_model=_sharp(name), device="cpu")
    booted.eval()
    return booted


def _sharp(name: str) -> torch.nn.Module:
    config = CONFIGS[name](2) if name in CONFIGS else _opt_config(2)
    config.initializer_range = 0.2
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _opt_config(layers: int) -> transformers.OPTConfig:
    """OPT, whose TransformerLens adapter runs HuggingFace's own attention (an AttentionBridge)."""
    return transformers.OPTConfig(
        vocab_size=50,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=64,
        bos_token_id=0,
        pad_token_id=None,
        eos_token_id=None,
    )


def metric(logits: torch.Tensor) -> torch.Tensor:
    """TransformerLens-style: one run's logits to a scalar."""
    return (logits[:, -1, ANSWER] - logits[:, -1, WRONG]).mean()


def batched(logits: torch.Tensor) -> torch.Tensor:
    """Batched: logits of runs of 2 rows each to one value per run."""
    return (logits[:, -1, ANSWER] - logits[:, -1, WRONG]).reshape(-1, 2).mean(-1)


def last_position(logits: torch.Tensor) -> torch.Tensor:
    """`batched`, saying that it reads only the last position (the sweeps' shortcut)."""
    return batched(logits)


last_position.last_position_only = True  # type: ignore[attr-defined]


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """(clean, corrupted) prompts, 2 rows of 6 tokens, differing at positions 2 and 4."""
    clean = ids(2, 6, seed=3)
    corrupted = clean.clone()
    corrupted[:, 2] = 9
    corrupted[:, 4] = 11
    return clean, corrupted


def hook_state(lm: TransformerBridge) -> dict[str, tuple[int, ...]]:
    """The ids of the forward hooks on each of a bridge's hook points."""
    return {name: tuple(point._forward_hooks) for name, point in lm.hook_dict.items()}


def forward_counter(lm: torch.nn.Module) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    passes: list[int] = []
    return passes, lm.register_forward_hook(lambda *args: passes.append(1))


# -- pattern sweeps on a bridge ----------------------------------------------------------


def test_the_bridge_attention_uses_what_hook_pattern_returns():
    """The premise of pattern patching on the bridge: a patched pattern changes the logits."""
    for name in ("llama", "gpt2"):
        lm = sharp_bridge(name)
        _, corrupted = prompts()
        plain = lm(corrupted)
        for layer in range(2):
            hook = (f"blocks.{layer}.attn.hook_pattern", lambda pattern, hook: pattern * 0)
            assert (lm.run_with_hooks(corrupted, fwd_hooks=[hook]) - plain).abs().max() > 0.1


# cells of `generic_activation_patch` for the dest-src sweep: (layer, head, dest, src),
# below, on and above the diagonal
DEST_SRC = [(0, 1, 3, 2), (1, 3, 5, 0), (1, 0, 4, 4), (0, 2, 2, 5), (1, 2, 5, 5)]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_bridge_pattern_sweeps_equal_transformer_lens_patching(name):
    lm = sharp_bridge(name)
    clean, corrupted = prompts()
    _, clean_cache = lm.run_with_cache(clean)
    unpatched = float(metric(lm(corrupted)))
    for sweep in PATTERNS[:2]:
        got = getattr(safelens, sweep)(lm, corrupted, clean_cache, batched, progress=False)
        expected = getattr(patching, sweep)(lm, corrupted, clean_cache, metric)
        assert got.shape == expected.shape == (2, 4, *((6,) if "by_pos" in sweep else ()))
        assert (got - expected).abs().max() <= TOL, sweep
        assert (got - unpatched).abs().max() > 0.1, sweep  # the patches matter
        last = getattr(safelens, sweep)(lm, corrupted, clean_cache, last_position, progress=False)
        assert (last - expected).abs().max() <= TOL, sweep
    got = safelens.get_act_patch_attn_head_pattern_dest_src_pos(
        lm, corrupted, clean_cache, batched, progress=False
    )
    index_df = pd.DataFrame(DEST_SRC, columns=["layer", "head_index", "dest_pos", "src_pos"])
    expected = patching.generic_activation_patch(
        lm,
        corrupted,
        clean_cache,
        metric,
        patching.layer_head_dest_src_pos_pattern_patch_setter,
        "pattern",
        index_df=index_df,
    )
    assert got.shape == (2, 4, 6, 6)
    assert (got[tuple(torch.tensor(DEST_SRC).T)] - expected).abs().max() <= TOL
    assert (got - unpatched).abs().max() > 0.1
    above = torch.ones(6, 6, dtype=torch.bool).triu(1)
    assert (got[:, :, above] - unpatched).abs().max() <= TOL  # zero in both runs


def test_pattern_sweeps_refuse_a_bridge_whose_attention_ignores_hook_pattern():
    lm = sharp_bridge("opt")
    clean, corrupted = prompts()
    _, clean_cache = lm.run_with_cache(clean)
    hooks = hook_state(lm)  # TransformerLens 4's OPT adapter has hooks of its own
    unused = (
        r"patches blocks.0.attn.hook_pattern, which this bridge's attention \(AttentionBridge\) "
        "does not use: zeroing the hook's tensor left the logits as they were"
    )
    for sweep in (*PATTERNS, *BUNDLES[1:]):
        with pytest.raises(PatchingError, match=rf"{sweep} {unused}"):
            getattr(safelens, sweep)(lm, corrupted, clean_cache, batched, progress=False)
    # So does the generic sweep of patterns, where every patch would give the corrupted
    # run's metric as silently.
    with pytest.raises(PatchingError, match=rf"generic_activation_patch {unused}"):
        safelens.generic_activation_patch(
            lm,
            corrupted,
            clean_cache,
            batched,
            patching.layer_head_pattern_patch_setter,
            "pattern",
            ["layer", "head_index"],
            progress=False,
        )
    assert hook_state(lm) == hooks


def test_bridge_pattern_sweep_takes_a_transformer_lens_metric_and_max_batch():
    lm = sharp_bridge("llama")
    clean, corrupted = prompts()
    _, clean_cache = lm.run_with_cache(clean)
    sweep = safelens.get_act_patch_attn_head_pattern_by_pos
    fast = sweep(lm, corrupted, clean_cache, batched, progress=False)
    slow = sweep(lm, corrupted, clean_cache, metric, max_batch=5, progress=False)
    assert (fast - slow).abs().max() <= TOL


def test_bridge_pattern_sweeps_batch_patches_and_leave_no_hooks():
    lm = sharp_bridge("gpt2")
    clean, corrupted = prompts()
    _, clean_cache = lm.run_with_cache(clean)
    hooks = hook_state(lm)
    passes, handle = forward_counter(lm)
    try:
        safelens.get_act_patch_attn_head_pattern_dest_src_pos(
            lm, corrupted, clean_cache, batched, progress=False
        )
    finally:
        handle.remove()
    assert 2 * 4 * 6 * 6 > 20 * len(passes)  # 288 patches, many per pass
    assert hook_state(lm) == hooks


# -- the *_every bundles on a bridge ------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("bundle", BUNDLES)
def test_bridge_bundles_equal_transformer_lens_bundles(name, bundle):
    """Row by row, with the k and v rows of grouped-query Llama zero-padded as TransformerLens pads them."""
    lm = sharp_bridge(name)
    clean, corrupted = prompts()
    _, clean_cache = lm.run_with_cache(clean)
    unpatched = float(metric(lm(corrupted)))
    got = getattr(safelens, bundle)(lm, corrupted, clean_cache, batched, progress=False)
    expected = getattr(patching, bundle)(lm, corrupted, clean_cache, metric)
    last = getattr(safelens, bundle)(lm, corrupted, clean_cache, last_position, progress=False)
    assert (last - expected).abs().max() <= TOL  # with the last-position shortcuts
    assert got.shape == expected.shape
    assert got.shape[:2] == ((3, 2) if bundle == BUNDLES[0] else (5, 2))
    for row in range(got.shape[0]):
        assert (got[row] - expected[row]).abs().max() <= TOL, row
        assert (got[row] - unpatched).abs().max() > 0.05, row  # each row's patches matter
    if bundle != BUNDLES[0] and name == "llama":  # n_kv_heads = 2 of n_heads = 4
        assert torch.equal(got[2:4, ..., 2:], torch.zeros_like(got[2:4, ..., 2:]))


def test_bridge_bundle_rows_equal_the_single_sweeps():
    """The GQA bundle's rows, against safelens' own single sweeps (padding apart)."""
    lm = sharp_bridge("llama")
    clean, corrupted = prompts()
    _, clean_cache = lm.run_with_cache(clean)
    got = safelens.get_act_patch_attn_head_by_pos_every(
        lm, corrupted, clean_cache, batched, progress=False
    )
    rows = ("out", "q", "k", "v")
    for row, activation in enumerate(rows):
        single = getattr(safelens, f"get_act_patch_attn_head_{activation}_by_pos")(
            lm, corrupted, clean_cache, batched, progress=False
        )
        assert torch.equal(got[row, ..., : single.shape[-1]], single), activation
    pattern = safelens.get_act_patch_attn_head_pattern_by_pos(
        lm, corrupted, clean_cache, batched, progress=False
    )
    assert torch.equal(got[4], pattern.transpose(1, 2))


def test_bridge_bundle_checks_the_clean_cache_before_any_sweep():
    lm = sharp_bridge("gpt2")
    clean, corrupted = prompts()
    _, clean_cache = lm.run_with_cache(clean)
    without_mlp = {name: value for name, value in clean_cache.items() if "mlp" not in name}
    _, short = lm.run_with_cache(clean[:, :5])
    passes, handle = forward_counter(lm)
    try:
        with pytest.raises(
            PatchingError,
            match=r"get_act_patch_block_every stacks sweeps of resid_pre, attn_out, mlp_out, "
            r"and cannot sweep 'mlp_out' here: clean_cache has no activation "
            r"'blocks.0.hook_mlp_out'",
        ):
            safelens.get_act_patch_block_every(lm, corrupted, without_mlp, batched, progress=False)
        with pytest.raises(
            PatchingError,
            match=r"cannot sweep 'z' here: clean_cache\['blocks.0.attn.hook_z'\] has shape "
            r"\(2, 5, 4, 8\); expected \[batch=2 or 1, 6, 4, 8\]",
        ):
            safelens.get_act_patch_attn_head_all_pos_every(
                lm, corrupted, short, batched, progress=False
            )
    finally:
        handle.remove()
    assert passes == []


def test_bridge_pattern_sweep_names_a_clean_pattern_of_another_length():
    lm = sharp_bridge("llama")
    clean, corrupted = prompts()
    _, short = lm.run_with_cache(clean[:, :5])
    with pytest.raises(
        PatchingError,
        match=r"clean_cache\['blocks.0.attn.hook_pattern'\] has shape \(2, 4, 5, 5\); "
        r"expected \[batch=2 or 1, 4, 6, 6\]",
    ):
        safelens.get_act_patch_attn_head_pattern_all_pos(
            lm, corrupted, short, batched, progress=False
        )


# -- plain HuggingFace models -------------------------------------------------------------


def _layer_sites(lm: torch.nn.Module, layer: int) -> list[tuple[torch.nn.Module, bool]]:
    """(module, pre-hook?) of resid_pre, attn_out and mlp_out at `layer`."""
    block = (lm.transformer.h if hasattr(lm, "transformer") else lm.model.layers)[layer]
    attention = block.attn if hasattr(block, "attn") else block.self_attn
    return [(block, True), (attention, False), (block.mlp, False)]


def _hooked(module: torch.nn.Module, pre: bool, edit) -> torch.utils.hooks.RemovableHandle:
    """A torch hook that hands `edit` the module's input (pre) or first output, to edit in place.

    `edit` returns None: the module's arguments and output stay the objects they were.
    """
    if pre:
        return module.register_forward_pre_hook(lambda m, args: edit(args[0]))
    return module.register_forward_hook(
        lambda m, args, output: edit(output[0] if isinstance(output, tuple) else output)
    )


def block_every_by_hooked_forwards(lm, clean, corrupted) -> torch.Tensor:
    """`[3, layer, pos]`: one uncached forward per patch, clean values captured by the same hooks."""
    n_layers, length = lm.config.num_hidden_layers, clean.shape[1]
    captured: dict[tuple[int, int], torch.Tensor] = {}

    def capture(t: torch.Tensor, key: tuple[int, int]) -> None:
        captured[key] = t.clone()

    handles = [
        _hooked(module, pre, functools.partial(capture, key=(kind, layer)))
        for layer in range(n_layers)
        for kind, (module, pre) in enumerate(_layer_sites(lm, layer))
    ]
    try:
        lm(clean)
    finally:
        for handle in handles:
            handle.remove()
    result = torch.zeros(3, n_layers, length)
    for kind in range(3):
        for layer in range(n_layers):
            module, pre = _layer_sites(lm, layer)[kind]
            for pos in range(length):

                def patch(t, key=(kind, layer), pos=pos):
                    t[:, pos] = captured[key][:, pos]

                handle = _hooked(module, pre, patch)
                try:
                    result[kind, layer, pos] = metric(lm(corrupted).logits)
                finally:
                    handle.remove()
    return result


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hf_block_every_equals_a_loop_of_hooked_forwards(name):
    lm = sharp_model(name)
    clean, corrupted = prompts()
    _, clean_cache = run_with_patching_cache(lm, clean)
    got = safelens.get_act_patch_block_every(lm, corrupted, clean_cache, batched, progress=False)
    expected = block_every_by_hooked_forwards(lm, clean, corrupted)
    assert got.shape == (3, 2, 6)
    assert (got - expected).abs().max() <= TOL
    last = safelens.get_act_patch_block_every(
        lm, corrupted, clean_cache, last_position, progress=False
    )
    assert (last - expected).abs().max() <= TOL
    for row in got:
        assert (row - row.flatten()[0]).abs().max() > 0.05  # each row's patches matter
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in lm.modules())


def test_hf_bundles_check_the_clean_cache_before_any_pass():
    lm = sharp_model("llama")
    clean, corrupted = prompts()
    _, clean_cache = run_with_patching_cache(lm, clean)
    passes, handle = forward_counter(lm)
    try:
        for bundle in BUNDLES[1:]:
            missing = {k: v for k, v in clean_cache.items() if "hook_pattern" not in k}
            with pytest.raises(
                PatchingError,
                match=rf"{bundle} stacks sweeps of z, q, k, v, pattern, and cannot sweep "
                "'pattern' here: clean_cache has no activation 'blocks.0.attn.hook_pattern'",
            ):
                getattr(safelens, bundle)(lm, corrupted, missing, batched, progress=False)
        missing = {k: v for k, v in clean_cache.items() if "mlp" not in k}
        with pytest.raises(PatchingError, match="clean_cache has no activation 'blocks.0.hook_mlp"):
            safelens.get_act_patch_block_every(lm, corrupted, missing, batched, progress=False)
    finally:
        handle.remove()
    assert passes == []


def test_the_pattern_probe_acts_on_its_own_threads_pass_only():
    """The probe zeroes one copy's pattern per layer; another thread's pass through the
    bridge meanwhile (started from inside the probe's own pass) must be plain."""
    import threading

    from hf_models import logits

    lm = sharp_bridge("llama")
    clean, corrupted = prompts()
    _, clean_cache = lm.run_with_cache(clean)
    probe = ids(3, 6, seed=7)
    plain = logits(lm, probe)
    me, seen = threading.get_ident(), []

    def other() -> None:
        seen.append(logits(lm, probe))

    def start_other(module, args, output) -> None:
        if threading.get_ident() == me and not seen:
            worker = threading.Thread(target=other)
            worker.start()
            worker.join()

    handle = lm.original_model.lm_head.register_forward_hook(start_other)
    try:
        safelens.get_act_patch_attn_head_pattern_all_pos(
            lm, corrupted, clean_cache, batched, progress=False
        )
    finally:
        handle.remove()
    assert len(seen) == 1 and torch.equal(seen[0], plain)
