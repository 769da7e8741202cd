"""The benchmark's models and synthetic data.

Three models, all fp32, all deterministic from a seed (every system and every rank builds
bitwise the same initial weights):

``transformer``
    A small decoder-only transformer (GPT-2 style, pre-LayerNorm, causal
    ``scaled_dot_product_attention``, untied LM head), about 10.5M parameters at the
    default size. Synthetic token batches, next-token cross-entropy.
``mlp-small``
    An MLP whose every ``width x width`` weight is assembled by ``torch.cat`` from
    ``width / block_rows`` row blocks, each its own ``nn.Parameter`` of
    ``block_rows * width`` elements: >= 1000 parameters of a few thousand elements each.
``mlp-large``
    The same MLP with one parameter per weight matrix: the same total size Ψ and the same
    arithmetic (one matmul per layer), in a handful of large parameters.

``mlp-small`` and ``mlp-large`` compute the same function with the same FLOPs; only the
number of parameter tensors differs, so the ratio of their step times isolates the
per-parameter cost of a training system (hooks, per-tensor kernels, bucket copies) from the
cost of the model's own arithmetic. (A literal 1000-layer MLP would change the model's own
forward/backward cost as well, and every system, DDP included, would be slower on it.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "ModelConfig", "build_model", "make_batches", "model_config"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What to build; ``quick`` shrinks everything for smoke tests.

    Attributes:
      name: ``"transformer"``, ``"mlp-small"`` or ``"mlp-large"``.
      vocab, d_model, n_layer, n_head, d_ff, seq_len: transformer sizes.
      width, layers, block_rows: MLP sizes (``block_rows`` rows per small param).
      batch: samples (sequences for the transformer) per rank per step.
    """

    name: str
    vocab: int = 8192
    d_model: int = 256
    n_layer: int = 8
    n_head: int = 4
    d_ff: int = 1024
    seq_len: int = 32
    width: int = 1024
    layers: int = 4
    block_rows: int = 4
    batch: int = 4


MODELS = ("transformer", "mlp-small", "mlp-large")

_QUICK = {
    "transformer": dict(vocab=256, d_model=32, n_layer=2, n_head=2, d_ff=64, seq_len=8, batch=2),
    "mlp-small": dict(width=64, layers=2, block_rows=4, batch=4),
    "mlp-large": dict(width=64, layers=2, block_rows=4, batch=4),
}
_DEFAULT_BATCH = {"transformer": 4, "mlp-small": 32, "mlp-large": 32}


def model_config(name: str, *, quick: bool = False, batch: int | None = None) -> ModelConfig:
    """The default (or ``quick``) config of model ``name``; ``batch`` overrides per-rank batch."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    kw: dict = {"batch": _DEFAULT_BATCH[name]}
    if quick:
        kw.update(_QUICK[name])
    if batch is not None:
        kw["batch"] = batch
    return ModelConfig(name, **kw)


# ----------------------------------------------------------------------------- transformer


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, d_ff: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, d_ff)
        self.fc2 = nn.Linear(d_ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    """Decoder-only transformer; ``blocks`` is the list FSDP2 shards one by one."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_head, cfg.d_ff) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


# ----------------------------------------------------------------------------- MLPs


class BlockLinear(nn.Module):
    """A ``width x width`` linear layer whose weight is ``width / rows`` separate row-block params."""

    def __init__(self, width: int, rows: int) -> None:
        super().__init__()
        if width % rows:
            raise ValueError(f"mlp width {width} must be a multiple of block_rows {rows}")
        full = nn.Linear(width, width)  # same init as the large variant, then cut
        self.parts = nn.ParameterList(nn.Parameter(w.clone()) for w in full.weight.detach().split(rows, dim=0))
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, torch.cat(list(self.parts), dim=0), self.bias)


class MLP(nn.Module):
    """``layers`` linear layers of ``width``, GELU between; ``blocks`` is what FSDP2 shards."""

    def __init__(self, cfg: ModelConfig, small: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            BlockLinear(cfg.width, cfg.block_rows) if small else nn.Linear(cfg.width, cfg.width)
            for _ in range(cfg.layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.blocks):
            x = layer(x)
            if i + 1 < len(self.blocks):
                x = F.gelu(x)
        return x


def build_model(cfg: ModelConfig, seed: int, device: torch.device) -> nn.Module:
    """The model, with the same initial weights for every (system, rank) given ``seed``."""
    torch.manual_seed(seed)
    if cfg.name == "transformer":
        model: nn.Module = Transformer(cfg)
    else:
        model = MLP(cfg, small=cfg.name == "mlp-small")
    return model.to(device)


def loss_fn(cfg: ModelConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss(output, target)``: cross-entropy over the vocabulary / the MLP's width."""

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    return loss


def make_batches(
    cfg: ModelConfig, seed: int, rank: int, count: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` synthetic ``(input, target)`` batches for ``rank`` (different on each rank).

    Step ``i`` of every system uses batch ``i % count``, so all systems see the same data.
    """
    g = torch.Generator().manual_seed(seed * 100_003 + 7919 * (rank + 1))
    out = []
    for _ in range(count):
        if cfg.name == "transformer":
            tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len + 1), generator=g)
            x, y = tokens[:, :-1], tokens[:, 1:]
        else:
            x = torch.randn(cfg.batch, cfg.width, generator=g)
            y = torch.randint(0, cfg.width, (cfg.batch,), generator=g)
        out.append((x.contiguous().to(device), y.contiguous().to(device)))
    return out


def param_count(model: nn.Module) -> tuple[int, int]:
    """(elements Ψ, number of parameter tensors)."""
    ps = list(model.parameters())
    return sum(p.numel() for p in ps), len(ps)


def transformer_params(cfg: ModelConfig) -> int:
    """Ψ of the transformer from its sizes (documentation aid, checked in the smoke test)."""
    d, f = cfg.d_model, cfg.d_ff
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    return cfg.vocab * d + cfg.seq_len * d + cfg.n_layer * block + 2 * d + d * cfg.vocab
