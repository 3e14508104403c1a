"""nnsight over a frozen safelens prefix, each result checked against `DynamicCache`.

(Named `nnsight_prefix.py`, not `nnsight.py`: a script of that name would import itself
instead of the nnsight package.) Wraps a small random-weight `LlamaForCausalLM` and a
word-level tokenizer, both built offline, in nnsight's `TransformersModel`, runs a prompt
once into a frozen `HFKeyValueCache`, then:

1. runs many traces over it, each with an attention mask over cached + new positions,
2. runs three invokes in one trace over `prefix.expand(3)`,
3. zeroes prompt values at a safelens cache hook point while nnsight halves an MLP's
   output, in one forward, and
4. generates from `prefix.fork()` with an nnsight intervention at every step.

Each is compared, bitwise, with the same work on transformers' `DynamicCache`; the prefix
is checked to be bitwise unchanged at the end. docs/howto/nnsight.md explains each step.
"""

import copy

import torch
import transformers
from nnsight import TransformersModel
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from safelens import HFKeyValueCache, hf_cache_argument

torch.set_grad_enabled(False)
torch.manual_seed(0)
config = LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=100, bos_token_id=0, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
hf_model = LlamaForCausalLM(config).eval()
tokenizer = transformers.PreTrainedTokenizerFast(
    tokenizer_object=Tokenizer(WordLevel({f"t{i}": i for i in range(100)}, unk_token="t1")),
    bos_token="t0",
    unk_token="t1",
)
model = TransformersModel(hf_model, tokenizer=tokenizer, task="text-generation")
arg = hf_cache_argument(hf_model)  # "past_key_values", or "cache" from transformers 5.24
prompt = torch.randint(1, 100, (1, 10))
continuations = torch.randint(1, 100, (3, 4))

prefix = HFKeyValueCache()
hf_model(prompt, **{arg: prefix})
prefix.freeze()
dynamic = DynamicCache()  # the same prefix, transformers' way
hf_model(prompt, **{arg: dynamic})
before = [t.clone() for layer in prefix.layers for t in (layer.keys, layer.values)]
mask = torch.ones(1, 10 + 4, dtype=torch.long)  # cached + new positions, for every trace


def trace(tokens, cache):
    with model.trace(tokens, attention_mask=mask, **{arg: cache}):
        logits = model.output.logits.save()
    return logits


# 1. Many traces over one frozen prefix; DynamicCache needs a fresh copy for each.
for continuation in continuations:
    ours = trace(continuation[None], prefix)
    assert torch.equal(ours, trace(continuation[None], copy.deepcopy(dynamic)))
print(f"3 traces over the frozen prefix = DynamicCache; prefix length {prefix.get_seq_length()}")


# 2. Several invokes in one trace: one cache row per invoke row, one mask per invoke.
def invokes(cache):
    with model.trace(**{arg: cache}) as tracer:
        for continuation in continuations:
            with tracer.invoke(continuation[None], attention_mask=mask):
                pass
        with tracer.invoke():
            logits = model.output.logits.save()
    return logits


repeated = copy.deepcopy(dynamic)
repeated.batch_repeat_interleave(3)
batched = invokes(prefix.expand(3))
assert torch.equal(batched, invokes(repeated))
print(f"3 invokes over prefix.expand(3) = DynamicCache: logits {tuple(batched.shape)}")


# 3. A safelens cache hook and an nnsight intervention in one forward.
def zero_values(values, hook):  # the values layer 0 reads, cached + new
    values[:, 1, 3:7] = 0
    return values


def halve_mlp(tokens, cache):
    with model.trace(tokens, attention_mask=mask, **{arg: cache}):
        model.model.layers[1].mlp.output[:] = model.model.layers[1].mlp.output * 0.5
        logits = model.output.logits.save()
    return logits


branch = prefix.fork()
with branch.hooks([("model.layers.0.kv_cache.hook_v_full", zero_values)]):
    edited = halve_mlp(continuations[:1], branch)
edited_dynamic = copy.deepcopy(dynamic)
edited_dynamic.layers[0].values[:, 1, 3:7] = 0
assert torch.equal(edited, halve_mlp(continuations[:1], edited_dynamic))
change = (edited - trace(continuations[:1], prefix)).abs().max().item()
print(f"cache hook + nnsight edit = DynamicCache edited by hand; logits moved by {change:.3f}")

# 4. Generation from a fork, with nnsight zeroing an MLP at every step.
tokens = torch.cat([prompt, continuations[:1]], dim=1)
generated = []
for cache in (prefix.fork(), copy.deepcopy(dynamic)):
    with model.generate(tokens, max_new_tokens=6, do_sample=False, **{arg: cache}) as tracer:
        for _ in tracer.iter[0:6]:
            model.model.layers[1].mlp.output[:] = 0
        generated.append(tracer.result.save())
assert torch.equal(generated[0], generated[1])
print(f"generated from a fork = DynamicCache: {generated[0][0, 14:].tolist()}")

after = [t for layer in prefix.layers for t in (layer.keys, layer.values)]
unchanged = all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
print(f"prefix bitwise unchanged: {unchanged}")
assert unchanged
