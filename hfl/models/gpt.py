"""A small decoder-only transformer language model (GPT).

Radford et al. 2019, "Language Models are Unsupervised Multitask Learners" (GPT-2's pre-norm
blocks); the tiny shapes of Pfeiffer et al. 2024, "Efficient Federated Finetuning of Tiny
Transformers with Resource-Constrained Devices" (CAFF): embedding 96, 3 heads, context 256 and
l = 3, 6, 9 or 12 blocks. `stem` adds a learned position embedding to the token embedding, `body`
holds pre-norm blocks (x + causal attn(LN(x)), then x + mlp(LN(x)), a 4x GELU MLP), `head` is a
final LayerNorm and a linear layer over the vocabulary.

Inputs are token ids, a LongTensor (batch, sequence) of at most `context` positions. The logits
are (batch, vocab, sequence): the class dimension second, as `F.cross_entropy` expects, so hfl's
default objective `F.cross_entropy(model(x), y)` with next-token targets y (batch, sequence) is the
language-modelling loss, averaged over every position. The vocabulary is the model's `num_classes`:
`build_model("gpt", in_channels, num_classes)` embeds and predicts `num_classes` token ids
(`hfl.data.text` gives the sizes: 81 for LEAF's Shakespeare characters, 256 for bytes) and ignores
`in_channels` (token ids have no channels). Between blocks the tokens travel channels first,
(batch, dim, sequence), the layout of the other models' features, so exit points, block-wise
training and anything else reading channels from dim 1 treat the GPT like the others; a block
views them as (batch, sequence, dim) without copying.

The output head is untied from the token embedding (GPT-2 ties them): a tied head would be one
tensor in two places, which width slicing, freezing and aggregation would each have to know about;
untied, the head is an ordinary classifier (`classifier_keys`) and the embedding an ordinary
stem, so CAFF can freeze the embeddings while training the head.

Width scales the embedding dimension (channel group `embed`: both embeddings, every LayerNorm,
every projection into or out of the residual stream, the head's input), each block's attention
(`body.{i}.attn`: the outputs of the q, k and v projections and the input of the output projection)
and its MLP (`body.{i}.mlp`, the hidden units). Attention channels are laid out head by head
(channel c is dimension c % head_dim of head c // head_dim) and the group's unit is one head, so a
width slice keeps ceil(width * heads) whole heads of unchanged dimension, the first ones (HeteroFL,
FjORD) or a rolling window of them (FedRolex), and the scores keep their 1/sqrt(head_dim) scale.
Every block keeps the token shape, so depth scaling may skip or cut any of them, and an exit after
block i is a LayerNorm + linear like the head.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfl.errors import ConfigError
from hfl.models.base import ResidualBlock, ScalableModel
from hfl.models.vit import BATCH_NORMS, MLP
from hfl.registry import MODELS

INIT_STD = 0.02
"""GPT-2's initialisation: normal weights with this standard deviation, zero biases."""


class TokenEmbedding(nn.Module):
    """Token embedding plus learned position embedding; (batch, sequence) ids -> (batch, dim, sequence)."""

    def __init__(self, model: ScalableModel, vocab_size: int, dim: int, context: int, group: str) -> None:
        super().__init__()
        # An embedding table is (rows, dim): its columns (dim 1, what `couple` calls the input) are the channels.
        self.tokens = model.couple(nn.Embedding(vocab_size, dim), group, None)
        self.positions = model.couple(nn.Embedding(context, dim), group, None)

    def forward(self, ids: Tensor) -> Tensor:
        length, context = ids.shape[1], self.positions.num_embeddings
        if length > context:
            raise ValueError(f"a sequence of {length} tokens is longer than the context ({context})")
        h = self.tokens(ids) + self.positions(torch.arange(length, device=ids.device))
        return h.transpose(1, 2)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v projections whose channels run head by
    head (`inner` = heads * head_dim), so the first n * head_dim channels are the first n heads."""

    def __init__(self, model: ScalableModel, dim: int, inner: int, head_dim: int, groups: tuple[str, str]) -> None:
        super().__init__()
        gembed, gattn = groups
        self.heads, self.head_dim = inner // head_dim, head_dim
        self.q = model.couple(nn.Linear(dim, inner), gembed, gattn)
        self.k = model.couple(nn.Linear(dim, inner), gembed, gattn)
        self.v = model.couple(nn.Linear(dim, inner), gembed, gattn)
        self.proj = model.couple(nn.Linear(inner, dim), gattn, gembed)

    def _split(self, t: Tensor) -> Tensor:
        """(batch, tokens, heads * head_dim) -> (batch, heads, tokens, head_dim)."""
        b, n, _ = t.shape
        return t.view(b, n, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class DecoderBlock(ResidualBlock):
    """Pre-norm decoder block on (batch, dim, sequence) tokens: x + s_attn * attn(LN(x)), then
    x + s_mlp * mlp(LN(x)) (step sizes s only once a method adds them, as for NeFL)."""

    step_names = ("attn_step", "mlp_step")

    def __init__(self, model: ScalableModel, dim: int, inner: int, head_dim: int, hidden: int, groups: tuple[str, str, str]) -> None:
        super().__init__()
        gembed, gattn, gmlp = groups
        self.norm1 = model.couple(nn.LayerNorm(dim), None, gembed)
        self.attn = CausalSelfAttention(model, dim, inner, head_dim, (gembed, gattn))
        self.norm2 = model.couple(nn.LayerNorm(dim), None, gembed)
        self.mlp = MLP(model, dim, hidden, (gembed, gmlp))

    def forward(self, x: Tensor) -> Tensor:
        t = x.transpose(1, 2)
        t = t + self.scaled(self.attn(self.norm1(t)), self.attn_step)
        t = t + self.scaled(self.mlp(self.norm2(t)), self.mlp_step)
        return t.transpose(1, 2)


class TokenHead(nn.Module):
    """LayerNorm and a linear layer at every position: (batch, dim, sequence) -> (batch, classes,
    sequence) logits. The model's head, and every early exit."""

    def __init__(self, model: ScalableModel, group: str, dim: int, num_classes: int) -> None:
        super().__init__()
        self.norm = model.couple(nn.LayerNorm(dim), None, group)
        self.fc = model.couple(nn.Linear(dim, num_classes), group, None)

    def forward(self, h: Tensor) -> Tensor:
        return self.fc(self.norm(h.transpose(1, 2))).transpose(1, 2)


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation of linear layers and embeddings (LayerNorms keep ones and zeros)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=INIT_STD)
    if isinstance(module, nn.Linear):
        nn.init.zeros_(module.bias)


class GPT(ScalableModel):
    """Token + position embedding, `depth` pre-norm decoder blocks, LayerNorm + linear head over the
    `vocab_size` token ids (untied from the embedding; see the module docstring).

    Takes (batch, sequence) token ids, sequence at most `context`, and returns (batch, vocab_size,
    sequence) next-token logits. `norm` is accepted for the common builder signature: the GPT
    normalises with LayerNorm, so 'bn' and 'static_bn' build the same model ('none' is refused)."""

    input_kind = "tokens"

    def __init__(
        self,
        vocab_size: int,
        width: float = 1.0,
        norm: str = "bn",
        dim: int = 96,
        depth: int = 12,
        heads: int = 3,
        context: int = 256,
        mlp_ratio: float = 4.0,
    ) -> None:
        super().__init__(width, vocab_size, norm, head_norm=False)
        if norm not in BATCH_NORMS:
            # The layer norms are part of the architecture: 'none' removes batch norm, which the GPT has none of.
            raise ConfigError("model.norm", norm, f"one of {', '.join(BATCH_NORMS)} for the GPT (they build the same model)")
        if heads < 1 or dim % heads:
            raise ValueError(f"dim ({dim}) must be a positive multiple of heads ({heads})")
        if min(vocab_size, depth, context) < 1 or mlp_ratio <= 0:
            raise ValueError(
                f"vocab_size, depth and context must be >= 1 and mlp_ratio > 0, got {vocab_size}, {depth}, {context} and {mlp_ratio}"
            )
        self.vocab_size, self.context, self.heads = vocab_size, context, heads
        head_dim = dim // heads
        embed = self.channels("embed", dim)
        self.stem = TokenEmbedding(self, vocab_size, embed, context, "embed")
        blocks = []
        for i in range(depth):
            gattn, gmlp = f"body.{i}.attn", f"body.{i}.mlp"
            inner = self.channels(gattn, dim, unit=head_dim)
            hidden = self.channels(gmlp, round(dim * mlp_ratio))
            blocks.append(DecoderBlock(self, embed, inner, head_dim, hidden, ("embed", gattn, gmlp)))
            self.declare_block("embed", "embed", droppable=True)
        self.body = nn.ModuleList(blocks)
        self.head = TokenHead(self, "embed", embed, vocab_size)
        self.apply(init_weights)
        for block in blocks:
            # GPT-2 scales the projections back into the residual stream by 1/sqrt(2 * depth), so
            # the stream's variance does not grow with the number of residual branches.
            for layer in (block.attn.proj, block.mlp.fc2):
                nn.init.normal_(layer.weight, std=INIT_STD / (2 * depth) ** 0.5)

    def exit_classifier(self, name: str, group: str, target_bases: Sequence[int]) -> nn.Module:
        """A LayerNorm + linear head at every position, like the model's. Every block keeps the
        stream's width, so there is nothing to down-sample to: a 'bottleneck' exit is the same."""
        if target_bases:
            raise NotImplementedError(f"{name}: a GPT exit cannot down-sample to other channel groups")
        exit_head = TokenHead(self, group, self.group_channels(group), self.num_classes)
        exit_head.apply(init_weights)
        return exit_head

    def example_batch(
        self, batch: int, channels: int = 3, extent: int = 32, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """`batch` random sequences of `extent` token ids and a target token per position
        (`channels` is ignored, as by the builder)."""
        ids = torch.randint(0, self.vocab_size, (batch, extent + 1), generator=generator)
        return ids[:, :-1], ids[:, 1:]


@MODELS.register("gpt")
def gpt(in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn", depth: int = 12) -> GPT:
    """CAFF's tiny language model (embedding 96, 3 heads, context 256) with `depth` blocks, at its
    deepest by default (the family is l = 3, 6, 9, 12; `model.depth`), over a vocabulary of
    `num_classes` token ids; `in_channels` is ignored."""
    return GPT(num_classes, width, norm, depth=depth)


@MODELS.register("gpt_l3")
def gpt_l3(in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> GPT:
    """CAFF's tiny language model with 3 blocks (`hfl pretrain`'s `l3` members)."""
    return GPT(num_classes, width, norm, depth=3)


@MODELS.register("gpt_l6")
def gpt_l6(in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> GPT:
    """CAFF's tiny language model with 6 blocks."""
    return GPT(num_classes, width, norm, depth=6)


@MODELS.register("gpt_l9")
def gpt_l9(in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> GPT:
    """CAFF's tiny language model with 9 blocks."""
    return GPT(num_classes, width, norm, depth=9)
