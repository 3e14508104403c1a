"""The induction task of the main demonstration: model, training, prompts and head scores.

A 2-layer attention-only `HookedTransformer` learns to continue a random segment that
repeats (`BOS s_1 … s_L s_1 … s_L`). Segment lengths vary in training, so no fixed
positional offset solves the task: the model has to build the textbook two-head
circuit. A *previous-token head* in layer 0 writes "the token before me was `s_i`"
into the residual stream at position `i + 1`; an *induction head* in layer 1, at the
second occurrence of `s_i`, forms its query from `s_i` and finds position `i + 1`
through the key computed there from that layer-0 output (K-composition), then copies the
token it holds, `s_{i+1}`.

`train_induction_model(seed)` trains the demonstration's model and builds its prompts,
deterministically; the weights are kept per seed for the rest of the process, so a
second call (a test, a notebook) gets a fresh copy of the same model at no cost.
`head_scores` gives the standard previous-token and induction scores of every head.

`hf=True` trains the same circuit in a HuggingFace `LlamaForCausalLM` built from a
`LlamaConfig` (same sizes, rotary on the whole head, no biases, eager attention so the
attention weights can be read). Llama has no attention-only or norm-free setting, so
each decoder layer's MLP is replaced by a zero module and its RMSNorms (and the final
one) by identities: with them in place the model learns the task by another route,
without a clean previous-token head. What still differs from the `HookedTransformer`:
the initialisation, and that HF caches keys after rotary.

Caveat: training is seeded and runs on one thread, so it repeats bit for bit on one
machine, but the number of steps (and so the weights) can differ across CPUs or torch
builds whose float reductions differ; the demonstration asserts on what it measures, not
on fixed numbers.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import transformers
from jaxtyping import Float, Int
from tqdm import tqdm

warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")

if TYPE_CHECKING:  # imported where it is built: `hf=True` runs on TransformerLens 4 too
    from transformer_lens import HookedTransformer

VOCAB = 48
"""Random tokens are `1 … VOCAB`; token 0 is BOS."""
BOS = 0
MAX_SEGMENT = 12
"""Training segments have 4 to `MAX_SEGMENT` tokens."""
SEGMENT = 10
"""The length of every segment the demonstration evaluates on."""
KNOWN = 3
"""How many tokens of the second copy a continuation prefix already holds."""


@dataclass(frozen=True)
class InductionData:
    """The demonstration's prompts, every segment `SEGMENT` distinct random tokens.

    **Fields:**

    - `diagnostic`: `[n, 1 + 2 * SEGMENT]` BOS, a segment, the segment again: the
      sequences the head scores are measured on.
    - `clean`: `[n, 2 * SEGMENT]` BOS, a segment, the segment but its last token; the
      next token (`answers`) is the segment's last, at position `SEGMENT` (the
      *source*), found through the token before it, at `SEGMENT - 1`.
    - `corrupted`: `clean` with the first copy's token at `SEGMENT - 1` replaced by a
      token outside the segment, so the final token has no earlier occurrence: what
      changes is *where* induction can look, not what the source holds.
    - `answers`: `[n]` the clean prompts' next tokens.
    - `prefixes`: `[m, 1 + SEGMENT + KNOWN]` BOS, a segment, its first `KNOWN` tokens.
    - `continuations`: `[m, SEGMENT - KNOWN]` the rest of each segment's repeat.
    - `references`: `[r, 1 + SEGMENT + KNOWN]` prefixes of other segments, whose mean
      keys/values replace ablated ones.
    """

    diagnostic: Int[torch.Tensor, "n pos"]
    clean: Int[torch.Tensor, "n pos"]
    corrupted: Int[torch.Tensor, "n pos"]
    answers: Int[torch.Tensor, " n"]
    prefixes: Int[torch.Tensor, "m pos"]
    continuations: Int[torch.Tensor, "m new_tokens"]
    references: Int[torch.Tensor, "r pos"]


class Trained(NamedTuple):
    """What `train_induction_model` returns."""

    model: HookedTransformer | transformers.LlamaForCausalLM
    data: InductionData
    steps: int
    accuracy: float


class _Zero(torch.nn.Module):
    """Stands in for a Llama MLP: adds nothing to the residual stream."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


def build_hf_model(seed: int) -> transformers.LlamaForCausalLM:
    """The untrained demonstration model as an attention-only HuggingFace Llama."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB + 1,
        hidden_size=64,
        intermediate_size=1,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        max_position_embeddings=2 * MAX_SEGMENT + 1,
        initializer_range=0.1,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=BOS,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    for layer in model.model.layers:
        layer.mlp = _Zero()
        layer.input_layernorm = torch.nn.Identity()
        layer.post_attention_layernorm = torch.nn.Identity()
    model.model.norm = torch.nn.Identity()
    return model


def build_model(seed: int) -> HookedTransformer:
    """The untrained demonstration model: 2 attention-only layers of 4 heads."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=2,
        d_model=64,
        n_ctx=2 * MAX_SEGMENT + 1,
        d_head=16,
        n_heads=4,
        d_vocab=VOCAB + 1,
        attn_only=True,
        act_fn="gelu",
        normalization_type=None,
        positional_embedding_type="rotary",
        rotary_dim=16,
        seed=seed,
        device="cpu",
    )
    return HookedTransformer(cfg)


def segments(n: int, length: int, generator: torch.Generator) -> Int[torch.Tensor, "n length"]:
    """`n` segments of `length` distinct random tokens."""
    return torch.stack([torch.randperm(VOCAB, generator=generator)[:length] + 1 for _ in range(n)])


def repeated(segment: Int[torch.Tensor, "n length"]) -> Int[torch.Tensor, "n pos"]:
    """`[n, 1 + 2 * length]`: BOS, each segment, the segment again."""
    bos = torch.full((len(segment), 1), BOS)
    return torch.cat([bos, segment, segment], dim=1)


def is_huggingface(model: torch.nn.Module) -> bool:
    """Whether `model` is the HuggingFace demonstration model (else the `HookedTransformer`)."""
    return isinstance(model, transformers.PreTrainedModel)


def logits_of(model: torch.nn.Module, tokens: Int[torch.Tensor, "n pos"]) -> torch.Tensor:
    """`[n, pos, d_vocab]` logits of a `HookedTransformer` or a HuggingFace causal LM."""
    out = model(tokens)
    return out.logits if is_huggingface(model) else out


def attention_patterns(
    model: torch.nn.Module, tokens: Int[torch.Tensor, "n pos"]
) -> Float[torch.Tensor, "layer n head q k"]:
    """Every head's attention pattern: TransformerLens' `hook_pattern`, HF's eager weights."""
    with torch.no_grad():
        if is_huggingface(model):
            return torch.stack(model(tokens, output_attentions=True).attentions)
        names = [f"blocks.{layer}.attn.hook_pattern" for layer in range(model.cfg.n_layers)]
        _, cache = model.run_with_cache(tokens, names_filter=names)
        return torch.stack([cache[name] for name in names])


def repeat_accuracy(model: torch.nn.Module, tokens: Int[torch.Tensor, "n pos"]) -> float:
    """How often the model predicts the second copy's tokens after its first."""
    length = tokens.shape[1] // 2
    with torch.no_grad():
        predicted = logits_of(model, tokens)[:, length + 1 : -1].argmax(-1)
    return (predicted == tokens[:, length + 2 :]).float().mean().item()


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one CPU thread inside the block (restored after).

    The model is tiny: one thread is fastest, above all on a busy machine where extra
    threads wait on each other, and training repeats bit for bit whatever the machine's
    default thread count.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _train(
    model: torch.nn.Module, seed: int, min_steps: int = 0, max_steps: int = 2000
) -> tuple[int, float]:
    """Train on repeats of random length until held-out accuracy reaches 0.99.

    Not before `min_steps`: the HuggingFace model trains all its steps, since at 0.99 its
    previous-token role is often still shared by several layer-0 heads.
    """
    generator = torch.Generator().manual_seed(seed)
    held_out = repeated(segments(256, SEGMENT, torch.Generator().manual_seed(seed + 1)))
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    accuracy = 0.0
    bar = tqdm(range(1, max_steps + 1), desc="training", unit="step", leave=False, disable=None)
    for step in bar:
        length = int(torch.randint(4, MAX_SEGMENT + 1, (1,), generator=generator))
        tokens = repeated(torch.randint(1, VOCAB + 1, (32, length), generator=generator))
        log_probs = logits_of(model, tokens)[:, length + 1 : -1].log_softmax(-1)
        loss = -log_probs.gather(-1, tokens[:, length + 2 :, None]).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if step % 50 == 0:
            accuracy = repeat_accuracy(model, held_out)
            bar.set_postfix(loss=f"{loss.item():.3f}", accuracy=f"{accuracy:.2f}")
            if accuracy >= 0.99 and step >= min_steps:
                break
    bar.close()
    return step, accuracy


def make_data(seed: int) -> InductionData:
    """The demonstration's prompts, from `seed` (independent of training's)."""
    generator = torch.Generator().manual_seed(seed + 2)
    diagnostic = repeated(segments(64, SEGMENT, generator))
    patched = segments(16, SEGMENT, generator)
    clean = repeated(patched)[:, :-1]
    corrupted = clean.clone()
    for row, segment in enumerate(patched):
        outside = torch.ones(VOCAB + 1, dtype=torch.bool)
        outside[BOS] = False
        outside[segment] = False
        choices = outside.nonzero()[:, 0]
        pick = torch.randint(len(choices), (1,), generator=generator)
        corrupted[row, SEGMENT - 1] = choices[pick]
    continued = repeated(segments(8, SEGMENT, generator))
    references = repeated(segments(16, SEGMENT, generator))
    return InductionData(
        diagnostic=diagnostic,
        clean=clean,
        corrupted=corrupted,
        answers=patched[:, -1],
        prefixes=continued[:, : 1 + SEGMENT + KNOWN],
        continuations=continued[:, 1 + SEGMENT + KNOWN :],
        references=references[:, : 1 + SEGMENT + KNOWN],
    )


_TRAINED: dict[tuple[int, bool], tuple[dict[str, torch.Tensor], int, float]] = {}


def train_induction_model(seed: int = 0, hf: bool = False) -> Trained:
    """Train the demonstration's model (or reuse this process's training) and its prompts.

    **Arguments:**

    - `seed`: seeds the weights, the training batches and the prompts.
    - `hf`: train the attention-only HuggingFace Llama (`build_hf_model`) instead.

    **Returns:** a `Trained`: a fresh model in eval mode (yours to edit), the
    `InductionData`, the training steps taken and the held-out repeat accuracy.
    """
    build = build_hf_model if hf else build_model
    if (seed, hf) not in _TRAINED:
        model = build(seed)
        with one_thread(), torch.enable_grad():
            steps, accuracy = _train(model, seed, min_steps=2000 if hf else 0)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        _TRAINED[seed, hf] = (weights, steps, accuracy)
    weights, steps, accuracy = _TRAINED[seed, hf]
    model = build(seed)
    model.load_state_dict(weights)
    model.eval()
    return Trained(model, make_data(seed), steps, accuracy)


def head_scores(
    model: torch.nn.Module, tokens: Int[torch.Tensor, "n pos"]
) -> tuple[Float[torch.Tensor, "layer head"], Float[torch.Tensor, "layer head"]]:
    """Previous-token and induction scores of every head, from its attention pattern.

    On repeated sequences `BOS s_1 … s_L s_1 … s_L`: the previous-token score is the mean
    attention from each position to the one before it; the induction score is the mean
    attention from each token of the second copy to the token after its first
    occurrence (offset `L - 1` back). Both are 1 for a perfect head.
    """
    length = tokens.shape[1] // 2
    patterns = attention_patterns(model, tokens)
    previous = patterns.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(1, -1))
    induction = patterns.diagonal(offset=1 - length, dim1=-2, dim2=-1)[..., 2:]
    return previous, induction.mean(dim=(1, -1))


class AnswerLogProb:
    """A batched patching metric: the answers' mean log-probability, clean 1, corrupted 0.

    Called with logits `[runs * n, pos, d_vocab]` (rows `r * n … (r + 1) * n - 1` are
    run `r`), it returns `[runs]`: the mean over prompts of `log p(answer)` at the last
    position, mapped linearly so the clean run gives 1 and the corrupted run 0.
    """

    last_position_only = True

    def __init__(
        self,
        clean_logits: Float[torch.Tensor, "n pos d_vocab"],
        corrupted_logits: Float[torch.Tensor, "n pos d_vocab"],
        answers: Int[torch.Tensor, " n"],
    ) -> None:
        self.answers = answers
        self.clean = self.log_prob(clean_logits)
        self.corrupted = self.log_prob(corrupted_logits)

    def log_prob(self, logits: Float[torch.Tensor, "rows pos d_vocab"]) -> torch.Tensor:
        """`[runs]` the mean log-probability of the answers at the last position."""
        last = logits[:, -1].log_softmax(-1).reshape(-1, len(self.answers), logits.shape[-1])
        return last[:, torch.arange(len(self.answers)), self.answers].mean(dim=1)

    def __call__(self, logits: Float[torch.Tensor, "rows pos d_vocab"]) -> torch.Tensor:
        return (self.log_prob(logits) - self.corrupted) / (self.clean - self.corrupted)
