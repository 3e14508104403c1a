"""logit_diff_metric: normalised, batched, and a valid TransformerLens metric."""

from __future__ import annotations

import pytest
import torch
from models import make_model, tokens

from safelens import PatchingError, TokenError, logit_diff_metric


def test_clean_is_one_corrupted_is_zero_per_run() -> None:
    model = make_model()
    clean_logits, corrupted_logits = model(tokens(2, 5, seed=1)), model(tokens(2, 5, seed=2))
    metric = logit_diff_metric(clean_logits, corrupted_logits, torch.tensor([3, 4]), 7)
    runs = torch.cat([clean_logits, corrupted_logits, clean_logits])
    torch.testing.assert_close(metric(runs), torch.tensor([1.0, 0.0, 1.0]))


def test_batched_equals_per_run_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    clean, corrupted, patched = (torch.randn(1, 4, 9, generator=generator) for _ in range(3))
    metric = logit_diff_metric(clean, corrupted, 2, 5)
    diff = lambda x: x[0, -1, 2] - x[0, -1, 5]  # noqa: E731
    expected = (diff(patched) - diff(corrupted)) / (diff(clean) - diff(corrupted))
    torch.testing.assert_close(metric(patched), expected.reshape(1))


def distinct_logits() -> tuple[torch.Tensor, torch.Tensor]:
    clean, corrupted = torch.zeros(2, 3, 5), torch.zeros(2, 3, 5)
    clean[:, -1, 1] = 2.0
    return clean, corrupted


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        (
            {"corrupted_logits": torch.zeros(1, 3, 5)},
            PatchingError,
            r"clean_logits \(2, 3, 5\) and corrupted_logits \(1, 3, 5\) must both be",
        ),
        (
            {"clean_logits": torch.zeros(2, 5)},
            PatchingError,
            r"clean_logits must be a non-empty floating tensor \[batch, pos, d_vocab\], got shape \(2, 5\)",
        ),
        (
            {"clean_logits": torch.zeros(2, 0, 5)},
            PatchingError,
            r"clean_logits must be a non-empty floating tensor .*got shape \(2, 0, 5\)",
        ),
        (
            {"corrupted_logits": torch.zeros(2, 3, 5, dtype=torch.long)},
            PatchingError,
            "corrupted_logits must be a non-empty floating tensor .*of torch.int64",
        ),
        (
            {"clean_logits": [[[0.0]]]},
            PatchingError,
            r"clean_logits must be a tensor \[batch, pos, d_vocab\], got list",
        ),
        (
            {"answer_token": torch.tensor([1, 2, 3])},
            PatchingError,
            r"answer_token must be an int or an integer tensor \[batch=2\], got torch.int64 of shape \(3,\)",
        ),
        (
            {"answer_token": torch.tensor([[1, 2]])},
            PatchingError,
            r"answer_token must be an int or an integer tensor \[batch=2\], got torch.int64 of shape \(1, 2\)",
        ),
        (
            {"answer_token": 5},
            TokenError,
            r"answer_token holds token id 5 at index \(0,\); ids must be in \[0, d_vocab=5\)",
        ),
        ({"wrong_token": -1}, TokenError, r"wrong_token holds token id -1 at index \(0,\)"),
        (
            {"answer_token": torch.tensor([1, 7])},
            TokenError,
            r"answer_token holds token id 7 at index \(1,\)",
        ),
        (
            {"answer_token": True},
            TokenError,
            "answer_token must hold integer token ids .*got dtype torch.bool",
        ),
        (
            {"wrong_token": 2.0},
            TokenError,
            "wrong_token must hold integer token ids .*got dtype torch.float32",
        ),
        (
            {"wrong_token": "a"},
            TokenError,
            r"wrong_token must be an int or an integer tensor \[batch=2\], got str",
        ),
        (
            {"wrong_token": 1},
            PatchingError,
            r"answer_token and wrong_token are the same token for every prompt \(\[1, 1\]\)",
        ),
        (
            {"corrupted_logits": distinct_logits()[0]},
            PatchingError,
            r"the clean and corrupted logit differences are 2 and 2; .*divides by their difference \(0\)",
        ),
        (
            {"clean_logits": torch.full((2, 3, 5), float("nan"))},
            PatchingError,
            "logit differences are nan and 0; .*NaN or infinite",
        ),
    ],
)
def test_bad_inputs(arguments: dict, error, match: str) -> None:
    clean, corrupted = distinct_logits()
    call = {
        "clean_logits": clean,
        "corrupted_logits": corrupted,
        "answer_token": 1,
        "wrong_token": 0,
    }
    with pytest.raises(error, match=match):
        logit_diff_metric(**{**call, **arguments})


@pytest.mark.parametrize(
    "logits",
    [torch.zeros(3, 3, 5), torch.zeros(2, 3, 4), torch.zeros(4, 5), torch.zeros(0, 3, 5), [0.0]],
)
def test_metric_refuses_logits_of_the_wrong_shape(logits) -> None:
    metric = logit_diff_metric(*distinct_logits(), 1, 0)
    with pytest.raises(
        PatchingError, match=r"are not \[runs \* batch, pos, d_vocab\] for batch=2, d_vocab=5"
    ):
        metric(logits)
