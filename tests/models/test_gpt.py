"""The GPT: paper shapes, causal masking, whole-head width slicing, exits and depth prefixes."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from hfl.models import build_model
from hfl.models.base import ScalableModel
from hfl.models.exits import add_exits
from hfl.models.gpt import GPT, CausalSelfAttention
from hfl.submodel import extract, full_spec, shape_model, truncate, width_spec

VOCAB, CONTEXT = 11, 16


def small(width: float = 1.0, depth: int = 3) -> GPT:
    """Embedding 12, 3 heads of 4 dimensions, MLP 48."""
    torch.manual_seed(0)
    return GPT(VOCAB, width, dim=12, depth=depth, heads=3, context=CONTEXT)


def tokens(length: int = CONTEXT, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("depth", [3, 6, 9, 12])
def test_the_papers_shapes_and_their_parameter_counts(depth: int) -> None:
    vocab, d, context = 81, 96, 256
    model = GPT(vocab, depth=depth)
    per_block = 2 * 2 * d + 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)  # 2 LNs, q k v proj, MLP
    expected = vocab * d + context * d + depth * per_block + 2 * d + (d * vocab + vocab)

    logits = model(torch.randint(0, vocab, (2, context)))

    assert len(model.body) == depth and all(b.attn.heads == 3 and b.attn.head_dim == 32 for b in model.body)
    assert sum(p.numel() for p in model.parameters()) == expected
    assert logits.shape == (2, vocab, context)


def test_build_model_reads_num_classes_as_the_vocabulary() -> None:
    model = build_model("gpt", 7, 81)

    assert model.stem.tokens.num_embeddings == 81 and model.head.fc.out_features == 81
    assert len(model.body) == 12 and model.context == 256


def test_model_depth_builds_the_family_and_only_the_gpt_takes_one() -> None:
    from hfl.config import ModelConfig
    from hfl.errors import ConfigError

    assert len(build_model("gpt", 1, 81, depth=3).body) == 3
    assert ModelConfig(name="gpt", depth=6).depth == 6
    with pytest.raises(ConfigError, match=r"depth=2 .*0 for cnn: only gpt take a depth"):
        ModelConfig(name="cnn", depth=2)


def test_the_default_objective_is_the_next_token_loss() -> None:
    """Logits (batch, vocab, sequence): cross-entropy against (batch, sequence) targets averages
    the loss of every position."""
    model = small()
    x, y = tokens(), tokens(seed=2)

    logits = model(x)
    per_position = torch.stack([F.cross_entropy(logits[:, :, t], y[:, t]) for t in range(CONTEXT)])

    assert torch.allclose(F.cross_entropy(logits, y), per_position.mean(), atol=1e-6)


def test_a_future_token_does_not_change_earlier_logits() -> None:
    model = small().eval()
    x = tokens()
    changed = x.clone()
    changed[:, 9] = (x[:, 9] + 1) % VOCAB

    before, after = model(x), model(changed)

    assert torch.allclose(before[..., :9], after[..., :9], atol=1e-6)
    assert not torch.allclose(before[..., 9:], after[..., 9:])


def test_sequences_longer_than_the_context_are_refused() -> None:
    with pytest.raises(ValueError, match="longer than the context"):
        small()(tokens(CONTEXT + 1))


@pytest.mark.parametrize(("width", "heads"), [(1.0, 3), (0.5, 2), (0.25, 1), (0.1667, 1)])
def test_width_keeps_whole_heads_of_unchanged_dimension(width: float, heads: int) -> None:
    full, narrow = small(), small(width)
    spec = width_spec(full, width)

    assert all(b.attn.heads == heads and b.attn.head_dim == 4 for b in narrow.body)
    assert narrow.body[0].attn.q.out_features == 4 * heads
    if width < 1:
        assert torch.equal(spec.indices["body.0.attn.q.weight"][0], torch.arange(4 * heads))


def test_a_rolled_window_keeps_whole_heads() -> None:
    """FedRolex's offset counts heads: a window of two heads starting at head 2 wraps to head 0."""
    spec = width_spec(small(), 0.5, {"body.0.attn": 2})

    assert spec.indices["body.0.attn.q.weight"][0].tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
    assert spec.indices["body.0.attn.proj.weight"][1].tolist() == [8, 9, 10, 11, 0, 1, 2, 3]


def _causal_head(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One head's causal attention, written out (no scaled_dot_product_attention)."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    future = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), diagonal=1)
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v


def test_a_narrow_attention_is_the_full_attention_restricted_to_its_first_heads() -> None:
    owner = ScalableModel(1.0, VOCAB, "bn", head_norm=False)
    torch.manual_seed(0)
    full, narrow = CausalSelfAttention(owner, 12, 12, 4, ("e", "a")), CausalSelfAttention(owner, 12, 8, 4, ("e", "a2"))
    with torch.no_grad():
        for name in ("q", "k", "v"):
            getattr(narrow, name).weight.copy_(getattr(full, name).weight[:8])
            getattr(narrow, name).bias.copy_(getattr(full, name).bias[:8])
        narrow.proj.weight.copy_(full.proj.weight[:, :8])
        narrow.proj.bias.copy_(full.proj.bias)
    x = torch.randn(2, 5, 12)

    expected = full.proj.bias.expand(2, 5, 12).clone()
    for h in range(2):  # heads 0 and 1 of the full attention, through their columns of the projection
        rows = slice(4 * h, 4 * h + 4)
        q, k, v = (F.linear(x, getattr(full, n).weight[rows], getattr(full, n).bias[rows]) for n in ("q", "k", "v"))
        expected = expected + _causal_head(x, q, k, v) @ full.proj.weight[:, rows].T

    assert narrow.heads == 2
    assert torch.allclose(narrow(x), expected, atol=1e-5)


def test_a_half_width_slice_is_a_narrow_gpt_holding_the_sliced_weights() -> None:
    """extract(width_spec) gives a width-1/2 GPT exactly the first channels of every group (the
    first two heads), and it computes what a narrow GPT given those weights by hand computes."""
    full = small()
    sub_state = extract(full.state_dict(), width_spec(full, 0.5))
    extracted, by_hand = small(0.5), small(0.5)
    extracted.load_state_dict(sub_state, strict=True)
    with torch.no_grad():
        for key, tensor in by_hand.state_dict().items():
            tensor.copy_(full.state_dict()[key][tuple(slice(0, n) for n in tensor.shape)])
    x = tokens()

    assert by_hand.stem.tokens.embedding_dim == 6 and by_hand.body[0].mlp.fc1.out_features == 24
    assert all(torch.equal(sub_state[k], v) for k, v in by_hand.state_dict().items())
    assert torch.equal(extracted(x), by_hand(x))
    assert extracted(x).shape == (2, VOCAB, CONTEXT)


def test_the_head_is_an_untied_classifier_and_the_embeddings_are_the_stem() -> None:
    model = small()
    spec = width_spec(model, 0.5)

    assert model.classifier_keys() == ["head.fc.weight", "head.fc.bias"]
    assert model.head.fc.weight.data_ptr() != model.stem.tokens.weight.data_ptr()
    # Width slices the embedding channels, never the vocabulary.
    assert set(spec.indices["head.fc.weight"]) == {1} and "head.fc.bias" not in spec.indices
    assert set(spec.indices["stem.tokens.weight"]) == {1} and set(spec.indices["stem.positions.weight"]) == {1}


@pytest.mark.parametrize("kind", ["linear", "bottleneck"])
def test_a_truncated_slice_computes_the_global_models_exit(kind: str) -> None:
    model = small()
    add_exits(model, range(len(model.body) - 1), kind)
    model.eval()
    x = tokens()
    outputs = model.forward_exits(x)
    spec = truncate(full_spec(), model, 2)
    client = small()
    add_exits(client, range(len(client.body) - 1), kind)
    sub = shape_model(client, spec).eval()

    sub.load_state_dict(extract(model.state_dict(), spec), strict=True)

    assert [tuple(o.shape) for o in outputs] == [(2, VOCAB, CONTEXT)] * 3
    assert torch.allclose(sub(x), outputs[1], atol=1e-6)


def test_step_sizes_at_one_compute_the_plain_model() -> None:
    plain = small().eval()
    stepped = copy.deepcopy(plain)
    stepped.add_step_sizes(1.0)

    assert torch.equal(stepped(tokens()), plain(tokens()))
    assert stepped.step_size_keys()[:2] == ["body.0.attn_step", "body.0.mlp_step"]


@pytest.mark.parametrize("norm", ["layer", "none"])
def test_norm_must_be_a_batch_norm_kind(norm: str) -> None:
    with pytest.raises(ValueError, match="model.norm=.*one of bn, static_bn"):
        GPT(VOCAB, norm=norm, dim=12, depth=1)
