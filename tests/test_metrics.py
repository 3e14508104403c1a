"""logit_diff_metric: normalised, batched, and a valid TransformerLens metric."""

from __future__ import annotations

import pytest
import torch
from models import make_model, tokens

from safelens import PatchingError, logit_diff_metric


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


def test_bad_inputs() -> None:
    logits = torch.zeros(2, 3, 5)
    with pytest.raises(PatchingError, match="must both be"):
        logit_diff_metric(logits, torch.zeros(1, 3, 5), 1, 2)
    with pytest.raises(PatchingError, match=r"answer_token must be an int or an integer tensor"):
        logit_diff_metric(logits, logits, torch.tensor([1, 2, 3]), 2)
    with pytest.raises(PatchingError, match=r"not \[runs \* batch"):
        logit_diff_metric(logits, logits, 1, 2)(torch.zeros(3, 3, 5))
