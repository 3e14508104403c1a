"""Hostile input: every public entry point refuses bad arguments cleanly and changes nothing.

Each test drives public calls with arguments drawn from a catalogue of valid values and
of bad ones (wrong dtype, out of range, wrong shape, wrong type, NaN, …). For every
call the outcome must be exactly one of:

- every argument was valid: the call succeeds with its documented result;
- some argument was bad: it raises a `SafelensError` (or a `TypeError`/`ValueError`/
  `IndexError`) whose message names one of the arguments, and afterwards every cache,
  the model's weights and hooks, and the clean activation cache are bitwise as before.

`CATALOGUES` below lists the bad inputs, by kind of argument.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import safelens
from safelens import Ablation, KeyValueCache, SafelensError
from tests.models import D_VOCAB, make_model, tokens

ALLOWED = (SafelensError, TypeError, ValueError, IndexError)
PREFIX = 6
hostile = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@dataclass(frozen=True)
class Arg:
    """One argument value and whether the docs make it valid."""

    label: str
    value: Any
    valid: bool


def _valid(label: str, value: Any) -> Arg:
    return Arg(label, value, True)


def _bad(label: str, value: Any) -> Arg:
    return Arg(label, value, False)


TOKENS = [
    _valid("ids", tokens(1, 3, seed=7)),
    _valid("one id", tokens(1, 1, seed=8)),
    _bad("negative id", torch.tensor([[1, -1, 2]])),
    _bad("id == d_vocab", torch.tensor([[1, D_VOCAB]])),
    _bad("huge id", torch.tensor([[2**40]])),
    _bad("bool", torch.tensor([[True, False]])),
    _bad("float", torch.tensor([[1.0, 2.0]])),
    _bad("nan", torch.tensor([[math.nan]])),
    _bad("empty", torch.zeros(1, 0, dtype=torch.long)),
    _bad("3-D", torch.zeros(1, 2, 2, dtype=torch.long)),
    _bad("past n_ctx", torch.zeros(1, 300, dtype=torch.long)),
    _bad("text without tokenizer", "hello"),
    _bad("None", None),
    _bad("floats in a list", [[1.5, 2.0]]),
]
CONTINUATIONS = [
    _valid("ragged list", [[1, 2, 3], [4]]),
    _valid("tensor", tokens(2, 2, seed=9)),
    _bad("negative id", [[1, -1]]),
    _bad("id == d_vocab", [[D_VOCAB]]),
    _bad("bool tensor", torch.tensor([[True, False]])),
    _bad("float tensor", torch.tensor([[1.0]])),
    _bad("empty list", []),
    _bad("empty row", [[1], []]),
    _bad("past n_ctx", [list(range(10)) * 26]),
    _bad("a string", "abc"),
    _bad("3-D tensor", torch.zeros(1, 1, 1, dtype=torch.long)),
]
COUNTS = [
    _valid("1", 1),
    _valid("3", 3),
    _bad("0", 0),
    _bad("-1", -1),
    _bad("1.5", 1.5),
    _bad("True", True),
    _bad("'3'", "3"),
    _bad("nan", math.nan),
]
OPTIONAL_COUNTS = [_valid("None", None)] + COUNTS
TEMPERATURES = [
    _valid("1.0", 1.0),
    _valid("0.5", 0.5),
    _valid("0 (greedy)", 0.0),
    _bad("-1", -1.0),
    _bad("nan", math.nan),
    _bad("inf", math.inf),
    _bad("'1'", "1"),
]
TOP_P = [
    _valid("None", None),
    _valid("0.9", 0.9),
    _valid("1", 1.0),
    _bad("0", 0.0),
    _bad("1.5", 1.5),
    _bad("nan", math.nan),
    _bad("-0.1", -0.1),
]
LAYERS = [
    _valid("0", 0),
    _valid("[1]", [1]),
    _valid("[0, 1]", [0, 1]),
    _bad("[]", []),
    _bad("[1.5]", [1.5]),
    _bad("'0'", "0"),
    _bad("7 (out of range)", 7),
    _bad("True", True),
]
HEADS = [
    _valid("None", None),
    _valid("[0, 2]", [0, 2]),
    _bad("[9]", [9]),
    _bad("[0.5]", [0.5]),
    _bad("[]", []),
    _bad("'all'", "all"),
]
POSITIONS = [
    _valid("None", None),
    _valid("[1, 3]", [1, 3]),
    _valid("5", 5),
    _bad("[100]", [100]),
    _bad("[2.0]", [2.0]),
    _bad("[]", []),
    _bad("[True]", [True]),
]
KINDS = [_valid("zero", "zero"), _bad("median", "median"), _bad("None", None)]
TARGETS = [_valid("keys", "keys"), _valid("both", "both"), _bad("k", "k"), _bad("3", 3)]
MAX_BYTES = [
    _valid("2**30", 2**30),
    _valid("2**16", 2**16),
    _bad("0", 0),
    _bad("-1", -1),
    _bad("1.5", 1.5),
    _bad("True", True),
    _bad("'big'", "big"),
]
ROWS = [
    _valid("0", 0),
    _valid("[0]", [0]),
    _valid("slice", slice(0, 1)),
    _bad("[1.7]", [1.7]),
    _bad("[5]", [5]),
    _bad("True", True),
    _bad("'0'", "0"),
    _bad("[]", []),
]
CATALOGUES = {
    "tokens": TOKENS,
    "continuations": CONTINUATIONS,
    "counts": COUNTS,
    "temperatures": TEMPERATURES,
    "top_p": TOP_P,
    "layers": LAYERS,
    "heads": HEADS,
    "positions": POSITIONS,
    "kinds": KINDS,
    "targets": TARGETS,
    "max_bytes": MAX_BYTES,
    "rows": ROWS,
}


def pick(values: list[Arg]) -> st.SearchStrategy[Arg]:
    return st.sampled_from(values)


# -- the world every call may touch ---------------------------------------------------


class World:
    """The model, a frozen prefix, an unfrozen cache and a clean activation cache."""

    def __init__(self) -> None:
        self.model = make_model()
        self.prompt = tokens(1, PREFIX)
        self.prefix = safelens.prefill(self.model, self.prompt)
        self.cache = KeyValueCache.init_cache(self.model.cfg)
        self.model(
            self.prompt, past_kv_cache=self.cache, attention_mask=torch.ones_like(self.prompt)
        )
        self.clean_tokens = tokens(1, PREFIX, seed=3)
        _, self.clean = self.model.run_with_cache(self.clean_tokens)
        self.weights = [p.detach().clone() for p in self.model.parameters()]

    def state(self) -> list[Any]:
        tensors: list[Any] = []
        for cache in (self.prefix.cache, self.cache):
            for entry in cache:
                tensors += [entry.keys.clone(), entry.values.clone()]
            tensors += [cache.previous_attention_mask.clone(), bool(cache.frozen)]
        tensors += [self.prefix.last_logits.clone()]
        tensors += [t.clone() for t in self.clean.values()]
        return tensors

    def hooks(self) -> list[Any]:
        model = self.model
        points = [
            (name, len(p.fwd_hooks), len(p.bwd_hooks), len(p._forward_hooks))
            for name, p in model.hook_dict.items()
        ]
        modules = [
            (name, len(m._forward_hooks), len(m._forward_pre_hooks), "forward" in m.__dict__)
            for name, m in model.named_modules()
        ]
        cache_points = [
            len(p.fwd_hooks)
            for c in (self.prefix.cache, self.cache)
            for p in c.hook_points().values()
        ]
        return points + modules + cache_points

    def unchanged(self, state: list[Any], hooks: list[Any]) -> None:
        now = self.state()
        assert len(now) == len(state)
        for a, b in zip(now, state, strict=True):
            if isinstance(a, torch.Tensor):
                assert a.shape == b.shape and torch.equal(a, b), "a cache changed"
            else:
                assert a == b, "a frozen flag changed"
        assert self.hooks() == hooks, "hooks were left behind"
        for now_weight, weight in zip(self.model.parameters(), self.weights, strict=True):
            assert torch.equal(now_weight, weight), "the model's weights changed"


@pytest.fixture(scope="module")
def world() -> World:
    return World()


def attempt(world: World, call: Callable[[], Any], args: dict[str, Arg]) -> Any:
    """Run `call`; check it fails iff an argument is bad, cleanly and changing nothing."""
    state, hooks = world.state(), world.hooks()
    bad = [name for name, arg in args.items() if not arg.valid]
    try:
        result = call()
    except ALLOWED as error:
        message = str(error)
        assert bad, f"valid arguments {args} were refused: {type(error).__name__}: {message}"
        named = [name for name in args if name in message]
        assert named, f"{type(error).__name__}({message!r}) names none of {list(args)}"
        world.unchanged(state, hooks)
        return None
    assert not bad, f"bad {bad} accepted: {[args[name].label for name in bad]}"
    assert world.hooks() == hooks
    return result


# -- the entry points -------------------------------------------------------------------


@hostile
@given(tokens_arg=pick(TOKENS))
def test_prefill(world: World, tokens_arg: Arg) -> None:
    args = {"tokens_or_text": tokens_arg}
    prefix = attempt(world, lambda: safelens.prefill(world.model, tokens_arg.value), args)
    if prefix is not None:
        assert prefix.cache.frozen and prefix.cache.sequence_length == tokens_arg.value.shape[-1]


@hostile
@given(continuations=pick(CONTINUATIONS), batch_size=pick(OPTIONAL_COUNTS))
def test_score_continuations(world: World, continuations: Arg, batch_size: Arg) -> None:
    args = {"continuations": continuations, "batch_size": batch_size}
    scores = attempt(
        world,
        lambda: safelens.score_continuations(
            world.model, world.prefix, continuations.value, batch_size=batch_size.value
        ),
        args,
    )
    if scores is not None:
        assert scores.sums.shape == (len(continuations.value),)
        assert torch.isfinite(scores.sums).all()


@hostile
@given(
    max_new_tokens=pick(COUNTS),
    n_samples=pick(COUNTS),
    temperature=pick(TEMPERATURES),
    top_p=pick(TOP_P),
    top_k=pick(OPTIONAL_COUNTS),
)
def test_generate(
    world: World, max_new_tokens: Arg, n_samples: Arg, temperature: Arg, top_p: Arg, top_k: Arg
) -> None:
    args = {
        "max_new_tokens": max_new_tokens,
        "n_samples": n_samples,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
    }
    out = attempt(
        world,
        lambda: safelens.generate(
            world.model,
            world.prefix,
            max_new_tokens.value,
            n_samples=n_samples.value,
            do_sample=True,
            temperature=temperature.value,
            top_p=top_p.value,
            top_k=top_k.value,
            seed=0,
        ),
        args,
    )
    if out is not None:
        assert out.tokens.shape == (n_samples.value, max_new_tokens.value)
        assert ((out.tokens >= 0) & (out.tokens < D_VOCAB)).all()


@hostile
@given(input_arg=pick(TOKENS), stop_at_layer=pick([_valid("None", None), _bad("1", 1)]))
def test_run_with_hooks(world: World, input_arg: Arg, stop_at_layer: Arg) -> None:
    args = {"input": input_arg, "stop_at_layer": stop_at_layer}
    attempt(
        world,
        lambda: safelens.run_with_hooks(
            world.model,
            input_arg.value,
            cache=world.cache.clone(),
            stop_at_layer=stop_at_layer.value,
        ),
        args,
    )


@hostile
@given(
    kind=pick(KINDS),
    layers=pick(LAYERS),
    heads=pick(HEADS),
    positions=pick(POSITIONS),
    target=pick(TARGETS),
    write=st.booleans(),
)
def test_ablations(
    world: World, kind: Arg, layers: Arg, heads: Arg, positions: Arg, target: Arg, write: bool
) -> None:
    args = {
        "kind": kind,
        "layers": layers,
        "heads": heads,
        "positions": positions,
        "target": target,
    }

    def call() -> Any:
        ablation = Ablation(
            kind.value,
            layers.value,
            heads=heads.value,
            positions=positions.value,
            target=target.value,
        )
        if write:
            return safelens.ablate_write(world.model, world.prefix, ablation)
        return safelens.ablate_read(world.prefix, ablation)

    edited = attempt(world, call, args)
    if edited is not None:
        assert edited.cache.frozen and edited.cache.sequence_length == PREFIX


@hostile
@given(corrupted=pick(TOKENS), max_bytes=pick(MAX_BYTES), max_batch=pick(OPTIONAL_COUNTS))
def test_patching_sweep(world: World, corrupted: Arg, max_bytes: Arg, max_batch: Arg) -> None:
    # Only prompts of the clean prompt's length fit its activation cache.
    fits = isinstance(corrupted.value, torch.Tensor) and corrupted.value.shape[-1] == PREFIX
    corrupted = Arg(corrupted.label, corrupted.value, corrupted.valid and fits)
    args = {"corrupted_tokens": corrupted, "max_bytes": max_bytes, "max_batch": max_batch}

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, 0]

    result = attempt(
        world,
        lambda: safelens.get_act_patch_resid_pre(
            world.model,
            corrupted.value,
            world.clean,
            metric,
            max_bytes=max_bytes.value,
            max_batch=max_batch.value,
            progress=False,
        ),
        args,
    )
    if result is not None:
        assert result.shape == (world.model.cfg.n_layers, PREFIX)


@pytest.mark.parametrize(
    "metric, label",
    [
        (lambda logits: None, "returns None"),
        (lambda logits: "high", "returns a string"),
        (lambda logits: logits[:, -1, :2], "returns the wrong shape"),
    ],
)
def test_patching_metric_that_returns_nonsense(world: World, metric, label: str) -> None:
    args = {"patching_metric": _bad(label, metric)}
    attempt(
        world,
        lambda: safelens.get_act_patch_attn_head_v_by_pos(
            world.model, tokens(1, PREFIX, seed=5), world.clean, metric, progress=False
        ),
        args,
    )


@hostile
@given(
    rows=pick(ROWS),
    n=pick(COUNTS),
    length=pick(
        [_valid("3", 3), _valid("-1", -1), _bad("9", 9), _bad("2.0", 2.0), _bad("True", True)]
    ),
)
def test_branching(world: World, rows: Arg, n: Arg, length: Arg) -> None:
    cache = world.prefix.cache
    attempt(world, lambda: cache.select(rows.value), {"rows": rows})
    expanded = attempt(world, lambda: cache.expand(n.value), {"n": n})
    if expanded is not None:
        assert expanded.batch_size == n.value
    cropped = attempt(world, lambda: cache.crop(length.value), {"length": length})
    if cropped is not None:
        assert cropped.sequence_length == (
            length.value if length.value >= 0 else PREFIX + length.value
        )


@hostile
@given(
    batch=st.integers(0, 3),
    pos=st.integers(0, 3),
    heads=st.integers(1, 5),
    d_head=st.integers(15, 17),
    dim=st.sampled_from([1, -3, 0, 2, 3, -1]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.int64, torch.bool]),
)
def test_append(
    world: World, batch: int, pos: int, heads: int, d_head: int, dim: int, dtype
) -> None:
    n_kv = world.model.cfg.n_heads
    valid = (batch, heads, d_head) == (1, n_kv, 16) and dim in (1, -3) and dtype.is_floating_point
    new = Arg(
        f"[{batch}, {pos}, {heads}, {d_head}] {dtype}",
        torch.ones(batch, pos, heads, d_head, dtype=dtype),
        valid,
    )
    args = {"keys": new, "dim": _valid(str(dim), dim)}
    with world.prefix.cache.frozen():
        full = attempt(
            world, lambda: world.prefix.cache.append(0, new.value, new.value, dim=dim), args
        )
    if full is not None:
        assert full[0].shape == (1, PREFIX + pos, n_kv, 16)


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=0, max_size=512), cut=st.integers(0, 4096))
def test_load_of_hostile_bytes(data: bytes, cut: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "cache.safetensors"
        good = KeyValueCache.init_cache(make_model().cfg)
        good.save(path)
        blob = path.read_bytes()
        path.write_bytes(blob[: cut % (len(blob) + 1)] + data)
        try:
            loaded = KeyValueCache.load(path)
        except safelens.CacheFileError as error:
            assert str(error)
        else:
            assert len(loaded) == len(good) and loaded.sequence_length == 0


def _raises(tensor: torch.Tensor, hook: Any) -> None:
    raise RuntimeError("a hook that raises")


def _wrong_shape(tensor: torch.Tensor, hook: Any) -> torch.Tensor:
    return tensor[:, :1]


def _wrong_dtype(tensor: torch.Tensor, hook: Any) -> torch.Tensor:
    return tensor.double()


def _not_a_tensor(tensor: torch.Tensor, hook: Any) -> Any:
    return "keys"


def _edits_in_place(tensor: torch.Tensor, hook: Any) -> None:
    tensor.mul_(0.5)


HOOKS = [
    _valid("edits in place", _edits_in_place),
    _valid("returns None", lambda tensor, hook: None),
    _bad("raises", _raises),
    _bad("wrong shape", _wrong_shape),
    _bad("wrong dtype", _wrong_dtype),
    _bad("not a tensor", _not_a_tensor),
]
CACHE_POINTS = ["hook_k_new", "hook_v_new", "hook_k_full", "hook_v_full"]


@hostile
@given(
    fn=pick(HOOKS),
    point=st.sampled_from(CACHE_POINTS + ["attn.hook_z", "hook_resid_pre"]),
    layer=st.integers(0, 1),
    frozen=st.booleans(),
)
def test_hooks_that_misbehave(world: World, fn: Arg, point: str, layer: int, frozen: bool) -> None:
    site = f"kv_cache.{point}" if point in CACHE_POINTS else point
    name = f"blocks.{layer}.{site}"
    cache = world.cache.clone()
    before = [t.clone() for e in cache for t in (e.keys, e.values)]
    if frozen:
        cache.freeze()
    if point not in CACHE_POINTS and fn.label != "raises" and not fn.valid:
        # What a model hook point does with a misfit result is TransformerLens' business.
        return
    args = {"fwd_hooks": fn, name: fn}

    def call() -> Any:
        try:
            return safelens.run_with_hooks(
                world.model, tokens(1, 2, seed=11), cache=cache, fwd_hooks=[(name, fn.value)]
            )
        except RuntimeError as error:
            if "a hook that raises" not in str(error):
                raise
            raise safelens.HookError(f"fwd_hooks: {name} raised") from error

    attempt(world, call, args)
    after = [t.clone() for e in cache for t in (e.keys, e.values)]
    stored = [t[:, :PREFIX] for t in after]
    if frozen or not fn.valid:
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    elif point not in ("hook_k_new", "hook_v_new"):
        # Read-time and model hooks never change the stored prefix positions.
        assert all(torch.equal(a, b) for a, b in zip(stored, before, strict=True))
