"""Patches that change nothing run no pass: they get the corrupted run's metric.

A prompt pair that differs from position `d` on shares every activation before `d`, so
a by-position patch there writes what the corrupted run already holds
(`safelens.patching._unchanged`). References: `transformer_lens.patching` on a
HookedTransformer and on a TransformerBridge, the torch-hooked loop of
`test_patching_hf` on a HuggingFace model, and the same sweep that runs every patch.
Runs in both CI environments (the HookedTransformer tests skip on TransformerLens 4).
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from bridge_models import bridge
from hf_models import ids, model
from test_patching_hf import ANSWER, TOL, WRONG, reference
from transformer_lens import patching

import safelens
from safelens import run_with_patching_cache
from safelens.patching import _hf_sweeps
from safelens.patching._unchanged import unchanged

LENGTH, SPLIT = 8, 5  # the prompts differ at position SPLIT alone


def metric(logits: torch.Tensor) -> torch.Tensor:
    """TransformerLens-style: one run's logits to a scalar."""
    return (logits[:, -1, ANSWER] - logits[:, -1, WRONG]).mean()


def pair(make_ids) -> tuple[torch.Tensor, torch.Tensor]:
    clean = make_ids(1, LENGTH, seed=4)
    corrupted = clean.clone()
    corrupted[:, SPLIT] = (clean[:, SPLIT] + 1) % 7 + 1
    return clean, corrupted


def test_unchanged_is_bitwise_and_needs_every_row():
    clean = torch.tensor([[[1.0, 0.0], [2.0, 3.0]], [[1.0, 0.0], [2.0, 4.0]]])  # [2, pos, d]
    assert unchanged(clean, clean.clone(), [1]).tolist() == [True, True]
    other = clean.clone()
    other[1, 1, 1] = 3.0  # the second row differs at position 1
    assert unchanged(clean, other, [1]).tolist() == [True, False]
    signed = clean.clone()
    signed[0, 0, 1] = -0.0  # equal as numbers, not as bits
    assert unchanged(clean, signed, [1]).tolist() == [False, True]
    nan = clean.clone()
    nan[:, 1, 0] = float("nan")
    assert unchanged(nan, nan.clone(), [1]).tolist() == [True, False]
    assert unchanged(clean, clean.double(), [1]).tolist() == [False, False]
    assert unchanged(clean.bfloat16(), clean.bfloat16(), [1, 2]).all()


# -- HookedTransformer --------------------------------------------------------------------


@pytest.fixture
def hooked_runs(monkeypatch):
    """The runs each HookedTransformer sweep sends through a forward pass, counted."""
    from safelens.patching import _grid

    counted = []
    forward = _grid._forward_chunk

    def spy(model, corrupted, pos, chunk, **shortcuts):
        counted.extend(run.cell for run in chunk)
        return forward(model, corrupted, pos, chunk, **shortcuts)

    monkeypatch.setattr(_grid, "_forward_chunk", spy)
    return counted


HOOKED = [
    ("get_act_patch_attn_head_k_by_pos", 2),  # [layer, pos, kv head]
    ("get_act_patch_attn_head_v_by_pos", 2),
    ("get_act_patch_attn_head_out_by_pos", 4),
    ("get_act_patch_resid_pre", 1),
    ("get_act_patch_mlp_out", 1),
]


@pytest.mark.hooked_transformer
@pytest.mark.parametrize("positional", ["rotary", "standard"])
def test_hooked_sweeps_skip_the_shared_positions_and_equal_transformer_lens(
    positional, hooked_runs
):
    from models import make_model, tokens

    model_ = make_model(positional, n_kv_heads=2)
    clean, corrupted = pair(lambda batch, length, seed: tokens(batch, length, seed))
    _, clean_cache = model_.run_with_cache(clean)
    for name, heads in HOOKED:
        hooked_runs.clear()
        got = getattr(safelens, name)(model_, corrupted, clean_cache, metric, progress=False)
        expected = getattr(patching, name)(model_, corrupted, clean_cache, metric)
        assert (got - expected).abs().max() <= TOL, name
        assert (got - got.flatten()[0]).abs().max() > 1e-6, name  # the patches matter
        # Every position before SPLIT is skipped, in every layer; in layer 1 every later
        # position differs (attention mixed SPLIT in), and runs.
        assert all(index[1] >= SPLIT for index in hooked_runs), name
        late = {index for index in hooked_runs if index[0] == 1}
        assert len(late) == (LENGTH - SPLIT) * heads, name


@pytest.mark.hooked_transformer
def test_a_hooked_sweep_of_one_prompt_against_itself_runs_nothing(hooked_runs):
    from models import make_model, tokens

    model_ = make_model("rotary")
    prompt = tokens(2, LENGTH, seed=6)
    _, clean_cache = model_.run_with_cache(prompt)
    got = safelens.get_act_patch_attn_head_v_all_pos(model_, prompt, clean_cache, metric)
    expected = patching.get_act_patch_attn_head_v_all_pos(model_, prompt, clean_cache, metric)
    assert not hooked_runs
    assert (got - expected).abs().max() <= TOL
    assert torch.equal(got, torch.full_like(got, float(got.flatten()[0])))


# -- TransformerBridge and HuggingFace models ---------------------------------------------


@pytest.fixture
def seam_runs(monkeypatch):
    """The runs each bridge or HuggingFace sweep plans passes for, counted."""
    counted = []
    plan = _hf_sweeps.passes

    def spy(backend, site, shortcuts, runs, *rest):
        counted.extend(runs)
        return plan(backend, site, shortcuts, runs, *rest)

    monkeypatch.setattr(_hf_sweeps, "passes", spy)
    return counted


BRIDGE = [
    ("get_act_patch_attn_head_k_by_pos", "k", patching.layer_pos_head_vector_patch_setter),
    ("get_act_patch_attn_head_v_by_pos", "v", patching.layer_pos_head_vector_patch_setter),
    ("get_act_patch_attn_head_q_by_pos", "q", patching.layer_pos_head_vector_patch_setter),
    ("get_act_patch_resid_pre", "resid_pre", patching.layer_pos_patch_setter),
]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_bridge_sweeps_skip_the_shared_positions_and_equal_transformer_lens(name, seam_runs):
    lm = bridge(name)
    clean, corrupted = pair(ids)
    _, clean_cache = lm.run_with_cache(clean)
    for sweep, activation, setter in BRIDGE:
        seam_runs.clear()
        got = getattr(safelens, sweep)(lm, corrupted, clean_cache, metric, progress=False)
        indices = torch.stack(torch.unravel_index(torch.arange(got.numel()), got.shape), 1)
        columns = ["layer", "pos", "head_index"][: got.dim()]
        expected = patching.generic_activation_patch(
            lm,
            corrupted,
            clean_cache,
            metric,
            setter,
            activation,
            index_df=pd.DataFrame(indices[::3].tolist(), columns=columns),
        )
        assert (got.flatten()[::3] - expected).abs().max() <= TOL, sweep
        assert (got - got.flatten()[0]).abs().max() > 1e-6, sweep
        assert all(run[2] >= SPLIT for run in seam_runs), sweep
        assert {run[2] for run in seam_runs if run[1] == 1} == set(range(SPLIT, LENGTH)), sweep


def test_bridge_pattern_sweep_skips_rows_before_the_split(seam_runs):
    lm = bridge("llama")
    clean, corrupted = pair(ids)
    _, clean_cache = lm.run_with_cache(clean)
    got = safelens.get_act_patch_attn_head_pattern_by_pos(
        lm, corrupted, clean_cache, metric, progress=False
    )
    expected = patching.get_act_patch_attn_head_pattern_by_pos(lm, corrupted, clean_cache, metric)
    assert (got - expected).abs().max() <= TOL
    assert seam_runs and min(run[2] for run in seam_runs) == SPLIT


def test_hf_sweeps_skip_the_shared_positions_and_equal_a_loop_of_hooked_forwards(seam_runs):
    lm = model("llama")
    clean, corrupted = pair(ids)
    mask = torch.ones_like(clean)
    _, clean_cache = run_with_patching_cache(lm, clean)
    for sweep, activation in [
        ("get_act_patch_attn_head_k_by_pos", "k"),
        ("get_act_patch_resid_pre", "resid_pre"),
        ("get_act_patch_mlp_out", "mlp_out"),
    ]:
        seam_runs.clear()
        got = getattr(safelens, sweep)(lm, corrupted, clean_cache, metric, progress=False)
        indices = [(layer, pos, 1)[: got.dim()] for layer in range(2) for pos in (0, 4, 5, 7)]
        expected = reference(lm, activation, indices, clean, corrupted, mask)
        assert (got[tuple(torch.tensor(indices).T)] - expected).abs().max() <= TOL, sweep
        assert all(run[2] >= SPLIT for run in seam_runs), sweep
        assert {run[2] for run in seam_runs if run[1] == 1} == set(range(SPLIT, LENGTH)), sweep


@pytest.mark.parametrize(
    "kind", [pytest.param("hooked", marks=pytest.mark.hooked_transformer), "bridge"]
)
def test_a_generic_sweep_runs_every_setter_even_where_clean_is_corrupted(kind, request):
    """A user's setter may write anything: nothing is skipped."""
    if kind == "hooked":
        from models import make_model, tokens

        lm, prompt, counted = make_model("standard"), tokens(1, LENGTH, seed=6), "hooked_runs"
    else:
        lm, prompt, counted = bridge("llama"), ids(1, LENGTH, seed=6), "seam_runs"
    runs = request.getfixturevalue(counted)
    _, clean_cache = lm.run_with_cache(prompt)

    def zero(activation, index, clean):
        activation[:, index[1]] = 0.0
        return activation

    got = safelens.generic_activation_patch(
        lm, prompt, clean_cache, metric, zero, "resid_pre", ["layer", "pos"], progress=False
    )
    expected = patching.generic_activation_patch(
        lm, prompt, clean_cache, metric, zero, "resid_pre", ["layer", "pos"]
    )
    assert len(runs) == got.numel()
    assert (got - expected).abs().max() <= TOL


@pytest.mark.hooked_transformer
def test_hooked_pattern_sweep_skips_rows_before_the_split(hooked_runs):
    from models import make_model, tokens

    model_ = make_model("rotary", n_kv_heads=2)
    clean, corrupted = pair(lambda batch, length, seed: tokens(batch, length, seed))
    _, clean_cache = model_.run_with_cache(clean)
    got = safelens.get_act_patch_attn_head_pattern_by_pos(
        model_, corrupted, clean_cache, metric, progress=False
    )
    expected = patching.get_act_patch_attn_head_pattern_by_pos(
        model_, corrupted, clean_cache, metric
    )
    assert (got - expected).abs().max() <= TOL
    assert (got - got.flatten()[0]).abs().max() > 1e-6
    # Cells [layer, dest_pos, head] (the result moves the head second): rows before
    # SPLIT are the corrupted run's in both runs.
    assert hooked_runs and min(cell[1] for cell in hooked_runs) == SPLIT


@pytest.mark.parametrize(
    "kind", [pytest.param("hooked", marks=pytest.mark.hooked_transformer), "bridge"]
)
def test_a_skipped_patch_keeps_no_graph_with_gradients_on(kind):
    """The corrupted run's metric enters the grid as a value, as the patched runs' do."""
    if kind == "hooked":
        from models import make_model, tokens

        lm, make = make_model("rotary", n_kv_heads=2), tokens
    else:
        lm, make = bridge("llama"), ids
    clean, corrupted = pair(lambda batch, length, seed: make(batch, length, seed))
    with torch.enable_grad():
        _, clean_cache = lm.run_with_cache(clean)
        got = safelens.get_act_patch_resid_pre(lm, corrupted, clean_cache, metric, progress=False)
    assert not got.requires_grad and got.grad_fn is None


# -- generic_activation_patch with TransformerLens' setters -------------------------------

# (activation, the setter, its index columns, the named sweep of the same cells)
GENERIC = [
    (
        "k",
        "layer_pos_head_vector_patch_setter",
        ["layer", "pos", "head_index"],
        "get_act_patch_attn_head_k_by_pos",
    ),
    ("resid_pre", "layer_pos_patch_setter", ["layer", "pos"], "get_act_patch_resid_pre"),
    (
        "pattern",
        "layer_head_pos_pattern_patch_setter",
        ["layer", "head_index", "dest_pos"],
        "get_act_patch_attn_head_pattern_by_pos",
    ),
]


def _cells(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every third cell of `shape`, shuffled; and the same with every other last index
    negative (counted from the end, as TransformerLens' setters index)."""
    cells = torch.cartesian_prod(*(torch.arange(n) for n in shape)).reshape(-1, len(shape))[::3]
    cells = cells[torch.randperm(len(cells), generator=torch.Generator().manual_seed(0))]
    negative = cells.clone()
    negative[::2, -1] -= shape[-1]
    return cells, negative


@pytest.mark.parametrize(
    "kind", [pytest.param("hooked", marks=pytest.mark.hooked_transformer), "bridge", "hf"]
)
def test_a_generic_sweep_with_a_transformer_lens_setter_runs_as_the_named_sweep(
    kind, monkeypatch, seam_runs
):
    """Its index rows are the named sweep's cells: the same numbers, and the patches
    before the prompts differ are skipped (no pass runs them, every run's position
    is where it patches). A setter of TransformerLens' whose index columns do not name
    the axes it writes runs as given, and still equals TransformerLens' own."""
    if kind == "hooked":
        from models import make_model, tokens

        from safelens.patching import _grid

        lm, make = make_model("rotary", n_kv_heads=2), tokens
        forwarded: list = []
        forward = _grid._forward_chunk

        def spy(model_, corrupted, pos, chunk, **shortcuts):
            forwarded.extend(chunk)
            return forward(model_, corrupted, pos, chunk, **shortcuts)

        monkeypatch.setattr(_grid, "_forward_chunk", spy)
    else:
        lm = bridge("llama") if kind == "bridge" else model("llama")
        make, forwarded = ids, seam_runs
    clean, corrupted = pair(lambda batch, length, seed: make(batch, length, seed))
    if kind == "hf":
        _, clean_cache = run_with_patching_cache(lm, clean)
    else:
        _, clean_cache = lm.run_with_cache(clean)
    for activation, setter, columns, sweep in GENERIC:
        named = getattr(safelens, sweep)(lm, corrupted, clean_cache, metric, progress=False)
        cells, negative = _cells(tuple(named.shape))
        forwarded.clear()
        got = safelens.generic_activation_patch(
            lm,
            corrupted,
            clean_cache,
            metric,
            getattr(patching, setter),
            activation,
            index_df=pd.DataFrame(negative.tolist(), columns=columns),
            progress=False,
        )
        assert got.shape == (len(cells),), activation
        assert (got - named[tuple(cells.T)]).abs().max() <= 1e-6, activation
        assert (got - got[0]).abs().max() > 1e-6, activation  # the patches matter
        assert forwarded and all(run.pos is not None for run in forwarded), activation
        assert all(run.pos >= SPLIT for run in forwarded), activation
        # The cells hold patches before the split, and no pass runs them.
        pos_axis = columns.index("dest_pos" if "dest_pos" in columns else "pos")
        assert any(cell[pos_axis] < SPLIT for cell in cells.tolist()), activation
    if kind == "hf":
        return
    as_given = [patching.layer_pos_patch_setter, "resid_pre", ("layer", "head_index")]
    got = safelens.generic_activation_patch(
        lm, corrupted, clean_cache, metric, *as_given, progress=False
    )
    expected = patching.generic_activation_patch(lm, corrupted, clean_cache, metric, *as_given)
    assert (got - expected).abs().max() <= TOL
