"""Low-bit optimizer state (8-bit, 4-bit, fp8) from torchao, the same at every world size.

After ZeRO divides AdamW's state by N, each rank still keeps two fp32 moments: 8 bytes per
element of its chunk. torchao's ``AdamW8bit``, ``AdamW4bit`` and ``AdamWFp8`` keep them
block-wise quantized instead: codes (1 byte per element; half a byte for 4-bit) plus one
fp32 scale (the block's absmax) per block of ``B`` elements. zerofn runs torchao's own
pieces (its state tensor types ``OptimState8bit`` / ``OptimState4bit`` / ``OptimStateFp8``
and its update ``single_param_adam``) on each rank's chunk; it adds no quantization of its
own. What it adds is where the blocks are.

Why the numerics do not depend on N: a quantized param is placed ``"blocked(B)"``
(:mod:`zerofn.layout`): every rank's chunk is ``B * ceil(numel / (N * B))`` elements, whole
blocks, so block ``k`` of the flat param is elements ``[k * B, (k + 1) * B)`` at every world
size, on whichever rank holds it. A block's scale is the absmax of its own elements only,
and the update is element-wise given the scales, so every element sees the same codes,
scales and arithmetic at every N. The padding is whole blocks of zeros past the param's
end that no real block shares. (DeepSpeed hands bitsandbytes one flat partition per group,
so blocks straddle params and move with N; torchao under FSDP2 decides per *local* shard
whether to quantize, so a param gets 8-bit state replicated and fp32 state split.)

The rule, decided from the param's *global* size (so it is the same at every N, and it is
torchao's own rule, which torchao applies to the local tensor): a param is quantized, and
placed ``"blocked(B)"``, when ``numel >= 4096`` and ``numel % B == 0``; every other param
is placed ``"split"`` and keeps fp32 moments, as torchao keeps them. At N = 1 the result is
therefore torchao's, bit for bit, for any model.

torchao compiles its update (``torch.compile(single_param_adam, fullgraph=True,
dynamic=False)``, one graph per shard shape). ``compile=False`` (the default) runs the same
function eagerly; ``compile=True`` runs it compiled, as torchao does. Eager results are
bitwise equal to torchao's update run eagerly and the same at every N; see the README
("Low-bit optimizer state") for what holds compiled, and why.

Needs the optional extra: ``pip install 'zerofn[lowbit]'`` (torchao 0.18). No collectives
here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from zerofn import _optimizer, flat
from zerofn._tree import FrozenDict
from zerofn.layout import blocked

__all__ = [
    "KINDS",
    "MIN_QUANTIZED_NUMEL",
    "LowBitState",
    "adam4bit",
    "adam8bit",
    "adamfp8",
    "adamw4bit",
    "adamw8bit",
    "adamwfp8",
    "from_torchao",
    "is_torchao_optimizer",
    "quantizes",
    "state_nbytes",
]

TORCHAO_MISSING = (
    "zerofn's low-bit optimizers run torchao's (AdamW8bit, AdamW4bit, AdamWFp8): install the extra, "
    "pip install 'zerofn[lowbit]' (torchao==0.18.0), next to the torch you have"
)

# torchao's rule (torchao/optim/adam.py, after bitsandbytes): smaller tensors keep fp32 state.
MIN_QUANTIZED_NUMEL = 4096

# name -> (torchao class, default block size, decoupled weight decay)
KINDS: dict[str, tuple[str, int, bool]] = {
    "adamw8bit": ("AdamW8bit", 256, True),
    "adamw4bit": ("AdamW4bit", 128, True),
    "adamwfp8": ("AdamWFp8", 256, True),
    "adam8bit": ("Adam8bit", 256, False),
    "adam4bit": ("Adam4bit", 128, False),
    "adamfp8": ("AdamFp8", 256, False),
}
_KIND_OF_CLASS = {cls: kind for kind, (cls, _, _) in KINDS.items()}


def _torchao_optim() -> Any:
    """``torchao.optim``, or an ``ImportError`` naming the extra."""
    try:
        import torchao.optim as ao_optim
    except ImportError as e:
        raise ImportError(TORCHAO_MISSING) from e
    return ao_optim


def is_torchao_optimizer(cls: type) -> bool:
    """True for the torchao classes zerofn drives (``AdamW8bit``, ..., ``AdamFp8``)."""
    return cls.__module__.startswith("torchao.optim") and cls.__name__ in _KIND_OF_CLASS


def quantizes(numel: int, block_size: int) -> bool:
    """Whether a param of ``numel`` elements (its *global* size) gets quantized state.

    Examples:
      >>> quantizes(4096, 256), quantizes(4096 + 128, 256), quantizes(2048, 256)
      (True, False, False)
    """
    return numel >= MIN_QUANTIZED_NUMEL and numel % block_size == 0


class LowBitState(NamedTuple):
    """State of the low-bit optimizers.

    Attributes:
      step: name -> 0-d float32 CPU tensor, steps taken by that param (as torchao keeps it).
      exp_avg: name -> first moment over the shard: a torchao state tensor (codes + one
        fp32 scale per block of ``B``; appears as the shard's shape and dtype) for a
        ``"blocked(B)"`` param, a plain fp32 tensor shaped like the shard otherwise.
      exp_avg_sq: name -> second moment, the same way (unsigned codes).
      max_exp_avg_sq: name -> running max of ``exp_avg_sq``; empty unless ``amsgrad``.
    """

    step: FrozenDict[torch.Tensor]
    exp_avg: FrozenDict[torch.Tensor]
    exp_avg_sq: FrozenDict[torch.Tensor]
    max_exp_avg_sq: FrozenDict[torch.Tensor]


@dataclasses.dataclass(frozen=True)
class _Config:
    """What a low-bit optimizer fixes for all its params (torchao keeps these per optimizer)."""

    kind: str
    block_size: int
    bf16_stochastic_round: bool
    compile: bool


def _config(opt: _optimizer.Optimizer) -> _Config:
    return opt.static["lowbit"]


def _placement(config: _Config, name: str, shape: tuple[int, ...]) -> str:
    del name
    numel = 1
    for d in shape:
        numel *= d
    return blocked(config.block_size) if quantizes(numel, config.block_size) else "split"


def _zeros(opt: _optimizer.Optimizer, p: torch.Tensor, signed: bool, quantized: bool) -> torch.Tensor:
    """A zero moment for ``p``: torchao's state tensor when ``quantized``, else fp32 zeros."""
    if not quantized:
        return torch.zeros_like(p)
    cls = getattr(_torchao_optim(), KINDS[_config(opt).kind][0])
    return cls._subclass_zeros(p, signed, _config(opt).block_size)


def _init_with(
    opt: _optimizer.Optimizer, params: Mapping[str, torch.Tensor], quantized: Mapping[str, bool]
) -> LowBitState:
    amsgrad = {n for n in params if opt.hyperparams(n)["amsgrad"]}
    # Moments held as the params are (flat where every moment is a plain tensor); torchao's
    # state tensors, and so any mapping that holds one, stay per name.
    return LowBitState(
        step=FrozenDict({n: torch.tensor(0.0) for n in params}),
        exp_avg=flat.hold_like(params, {n: _zeros(opt, p, True, quantized[n]) for n, p in params.items()}),
        exp_avg_sq=flat.hold_like(params, {n: _zeros(opt, p, False, quantized[n]) for n, p in params.items()}),
        max_exp_avg_sq=flat.hold_like(
            params, {n: _zeros(opt, p, False, quantized[n]) for n, p in params.items() if n in amsgrad}
        ),
    )


def _init(opt: _optimizer.Optimizer, params: Mapping[str, torch.Tensor]) -> LowBitState:
    """State for full tensors (no layout): torchao's rule on each tensor's own size."""
    block = _config(opt).block_size
    return _init_with(opt, params, {n: quantizes(p.numel(), block) for n, p in params.items()})


def _init_placed(opt: _optimizer.Optimizer, params: Mapping[str, torch.Tensor], layout: Any) -> LowBitState:
    """State for shards of ``layout``: quantized exactly where the param is placed blocked(B)
    (or, for a whole param, where torchao's rule holds for its full size)."""
    block = _config(opt).block_size
    quantized = {}
    for n in params:
        spec = layout[n]
        if spec.block and spec.block != block:
            raise ValueError(
                f"zerofn.lowbit: param {n!r} is placed {spec.placement}, but the optimizer quantizes in blocks of "
                f"{block}: shard the params with this optimizer (zf.shard_params(params, opt))"
            )
        quantized[n] = bool(spec.block) or (spec.is_whole and quantizes(spec.numel, block))
    return _init_with(opt, params, quantized)


def _clone(t: torch.Tensor) -> torch.Tensor:
    """A copy of a plain tensor or of a torchao state tensor (its inner tensors cloned)."""
    if type(t) is torch.Tensor:
        return t.clone()
    inner, meta = t.__tensor_flatten__()
    return type(t).__tensor_unflatten__({k: getattr(t, k).clone() for k in inner}, meta, t.shape, t.stride())


def _own(t: torch.Tensor, donate: bool) -> torch.Tensor:
    return t if donate else _clone(t)


@functools.lru_cache(maxsize=2)
def _adam_fn(compiled: bool) -> Any:
    from torchao.optim.adam import single_param_adam

    if not compiled:
        return single_param_adam
    return torch.compile(single_param_adam, fullgraph=True, dynamic=False)


def _update(
    opt: _optimizer.Optimizer,
    grads: Mapping[str, torch.Tensor],
    state: LowBitState,
    params: Mapping[str, torch.Tensor],
    donate: bool,
) -> tuple[dict[str, torch.Tensor], LowBitState]:
    config = _config(opt)
    _, _, is_adamw = KINDS[config.kind]
    names = _optimizer._grads_in_order(opt, grads, params)
    new_params = dict(params)
    fields = {f: dict(getattr(state, f)) for f in LowBitState._fields}
    fn = _adam_fn(config.compile)
    # As torchao: the number of argument combinations is fixed per model, so recompiling
    # per shard shape is bounded; lifting the cache limit keeps every shape compiled.
    limit = torch._dynamo.utils.disable_cache_limit() if config.compile else contextlib.nullcontext()
    with torch.no_grad(), limit:
        for n in names:
            hp = opt.hyperparams(n)
            p = _own(params[n], donate)
            step = _own(state.step[n], donate)
            exp_avg = _own(state.exp_avg[n], donate)
            exp_avg_sq = _own(state.exp_avg_sq[n], donate)
            max_sq = _own(state.max_exp_avg_sq[n], donate) if hp["amsgrad"] else None
            step += 1
            fn(
                p,
                grads[n],
                step,
                exp_avg,
                exp_avg_sq,
                max_sq,
                torch.tensor(hp["lr"], dtype=torch.float32),  # torchao keeps lr as a float32 tensor
                hp["betas"][0],
                hp["betas"][1],
                hp["weight_decay"],
                hp["eps"],
                is_adamw,
                config.bf16_stochastic_round and p.dtype is torch.bfloat16,
            )
            new_params[n] = p
            fields["step"][n], fields["exp_avg"][n], fields["exp_avg_sq"][n] = step, exp_avg, exp_avg_sq
            if max_sq is not None:
                fields["max_exp_avg_sq"][n] = max_sq
    return new_params, LowBitState(**{f: flat.hold_like(getattr(state, f), v) for f, v in fields.items()})


def _factory(
    kind: str,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    block_size: int | None,
    bf16_stochastic_round: bool,
    compile: bool,
    param_groups: Sequence[Mapping[str, Any]] | None,
) -> _optimizer.Optimizer:
    ao_optim = _torchao_optim()
    class_name, default_block, _ = KINDS[kind]
    block = default_block if block_size is None else block_size
    if not isinstance(block, int) or block < 2 or block % 2:
        raise ValueError(f"zerofn.lowbit.{kind}: block_size must be an even int >= 2, got {block_size!r}")
    for i, g in enumerate(param_groups or ()):
        fixed = sorted({"block_size", "bf16_stochastic_round", "compile"} & set(g))
        if fixed:
            raise ValueError(
                f"zerofn.lowbit.{kind}: param_groups[{i}] sets {fixed}, which torchao fixes for the whole optimizer; "
                "pass them to the factory"
            )
    defaults = FrozenDict(dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad))
    _optimizer._check_hyperparams(kind, defaults)
    config = _Config(kind, block, bool(bf16_stochastic_round), bool(compile))
    return _optimizer.Optimizer(
        kind,
        defaults,
        _optimizer._make_groups(kind, param_groups),
        _init,
        _update,
        getattr(ao_optim, class_name),
        functools.partial(_placement, config),
        _init_placed=_init_placed,
        static=FrozenDict({"lowbit": config}),
    )


_DOC = r"""{title}, torchao's ``{cls}`` on zerofn's shards, the same at every world size.

    .. math::
        {math}

    with the moments ``m``, ``v`` kept {how} in blocks of ``B`` elements (one fp32 absmax
    scale per block) for every param with ``numel >= 4096`` and ``numel % B == 0``, which
    is placed ``"blocked(B)"``; fp32 for the others (torchao's rule, on the global size).

    Args:
      lr, betas, eps, weight_decay, amsgrad: as ``torchao.optim.{cls}``.
      block_size: ``B`` (default {block}, torchao's); even.
      bf16_stochastic_round: as torchao (only for bf16 params updated without fp32 masters;
        it draws random numbers per element, so it is not the same at every N).
      compile: run torchao's update compiled as torchao does (``torch.compile(fullgraph=True,
        dynamic=False)``, one graph per shard shape); default eager.
      param_groups: per-name hyperparameter overrides (see :mod:`zerofn.optim`).

    Examples:
      >>> import torch, zerofn as zf
      >>> opt = zf.optim.{kind}(lr=1e-3)
      >>> opt.placement("w", (64, 128)), opt.placement("b", (128,))
      ('blocked({block})', 'split')

    References:
      Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2022; Li et al.,
      "Memory Efficient Optimizers with 4-bit States", 2023.
    """

_ADAMW_MATH = (
    r"\theta \leftarrow \theta(1 - \eta\lambda),\ m \leftarrow \beta_1 m + (1-\beta_1) g,\ "
    r"v \leftarrow \beta_2 v + (1-\beta_2) g^2,\ "
    r"\theta \leftarrow \theta - \eta\,\frac{{m / (1-\beta_1^t)}}{{\sqrt{{v}} / \sqrt{{1-\beta_2^t}} + \epsilon}}"
)
_ADAM_MATH = _ADAMW_MATH.replace(r"\theta \leftarrow \theta(1 - \eta\lambda),\ ", r"g \leftarrow g + \lambda\theta,\ ")


def _make(kind: str, weight_decay_default: float) -> Any:
    class_name, block, is_adamw = KINDS[kind]

    def factory(
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = weight_decay_default,
        amsgrad: bool = False,
        *,
        block_size: int | None = None,
        bf16_stochastic_round: bool = False,
        compile: bool = False,
        param_groups: Sequence[Mapping[str, Any]] | None = None,
    ) -> _optimizer.Optimizer:
        return _factory(
            kind, lr, betas, eps, weight_decay, amsgrad, block_size, bf16_stochastic_round, compile, param_groups
        )

    how = {"8bit": "as 8-bit dynamic-map codes", "4bit": "as 4-bit codes", "fp8": "as float8_e4m3fn codes"}
    factory.__name__ = factory.__qualname__ = kind
    factory.__doc__ = _DOC.format(
        title=("AdamW" if is_adamw else "Adam") + " with " + kind.removeprefix("adamw").removeprefix("adam") + " state",
        cls=class_name,
        math=_ADAMW_MATH if is_adamw else _ADAM_MATH,
        how=how[kind.removeprefix("adamw").removeprefix("adam")],
        block=block,
        kind=kind,
    )
    return factory


adamw8bit = _make("adamw8bit", 1e-2)
adamw4bit = _make("adamw4bit", 1e-2)
adamwfp8 = _make("adamwfp8", 1e-2)
adam8bit = _make("adam8bit", 0.0)
adam4bit = _make("adam4bit", 0.0)
adamfp8 = _make("adamfp8", 0.0)


def from_torchao(torch_opt: torch.optim.Optimizer, group_names: Sequence[Sequence[str]]) -> _optimizer.Optimizer:
    """The functional twin of a constructed torchao low-bit optimizer, its groups keyed by name.

    Args:
      torch_opt: e.g. ``torchao.optim.AdamW8bit(model.parameters(), lr=1e-3)``.
      group_names: for each of its param groups, the names of its params.

    Returns:
      The matching factory's optimizer with torchao's ``block_size`` and
      ``bf16_stochastic_round`` and one zerofn param group per torchao group.
    """
    kind = _KIND_OF_CLASS[type(torch_opt).__name__]
    groups = []
    for names, g in zip(group_names, torch_opt.param_groups, strict=True):
        hp = {k: g[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad")}
        if isinstance(hp["lr"], torch.Tensor):
            hp["lr"] = float(hp["lr"])  # torchao keeps lr as a 0-d float32 tensor; the float is exact
        groups.append({"params": list(names), **hp})
    return _factory(
        kind,
        1e-3,
        (0.9, 0.999),
        1e-8,
        0.0,
        False,
        torch_opt.block_size,
        torch_opt.bf16_stochastic_round,
        False,
        groups,
    )


def state_nbytes(t: torch.Tensor) -> int:
    """Bytes a state tensor really holds: a torchao state tensor's codes and scales (its
    shared ``qmap`` lookup table counted once per tensor), a plain tensor's elements."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return t.numel() * t.element_size()
    inner, _ = t.__tensor_flatten__()
    return sum(getattr(t, k).numel() * getattr(t, k).element_size() for k in inner)


# --------------------------------------------------------------------------- checkpoints

_STATE_CLASSES = ("OptimState8bit", "OptimState4bit", "OptimStateFp8")


def is_quantized(t: Any) -> bool:
    """True for a torchao low-bit state tensor (codes + block scales)."""
    return type(t).__name__ in _STATE_CLASSES and type(t).__module__.startswith("torchao.optim")


def kind_of(t: torch.Tensor) -> str:
    """A quantized state tensor's kind as text, ``"<class>:<signed>"``, for checkpoint metadata."""
    return f"{type(t).__name__}:{int(getattr(t, 'signed', True))}"


def codes_per_element(t: torch.Tensor) -> float:
    """Code bytes per element: 1 (8-bit, fp8) or 0.5 (4-bit, two codes per byte)."""
    return 0.5 if type(t).__name__ == "OptimState4bit" else 1.0


def parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of a quantized state tensor: flat codes, one fp32 scale per block."""
    return t.codes.reshape(-1), t.scale


def rebuild(like: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A state tensor of ``like``'s class, sign and dtype, appearing as ``shape``, over ``codes`` and ``scale``."""
    name = type(like).__name__
    if name == "OptimState4bit":
        return type(like)(codes.reshape(-1), scale, like.qmap.clone(), like.signed, tuple(shape), like.dtype)
    if name == "OptimState8bit":
        return type(like)(codes.reshape(shape), scale, like.qmap.clone(), like.signed, like.dtype)
    return type(like)(codes.reshape(shape), scale, like.dtype)


def state_zeros(kind: str, numel: int, block: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero state tensor of ``kind`` (:func:`kind_of`) over ``numel`` elements in blocks of ``block``."""
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8

    name, _, signed = kind.partition(":")
    if name == "OptimStateFp8":
        return OptimStateFp8.zeros((numel,), block, device, dtype=dtype)
    cls = {"OptimState8bit": OptimState8bit, "OptimState4bit": OptimState4bit}[name]
    return cls.zeros((numel,), bool(int(signed)), block, device, dtype=dtype)


def to_global(like: torch.Tensor, pieces: Sequence[tuple[torch.Tensor, torch.Tensor]], spec: Any) -> torch.Tensor:
    """The param-shaped state tensor from every rank's ``(codes, scale)`` of a blocked(B) param.

    The ranks' chunks are whole blocks in order, so the global codes and scales are the
    concatenations, cut at the param's last block (the padding is whole blocks past it).
    """
    per = codes_per_element(like)
    codes = torch.cat([c for c, _ in pieces])[: int(spec.numel * per)]
    scale = torch.cat([s for _, s in pieces])[: spec.numel // spec.block]
    return rebuild(like, codes.clone(), scale.clone(), spec.shape)


def to_shard(full: torch.Tensor, spec: Any, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Rank ``rank``'s ``(shard_numel,)`` state tensor cut from a param-shaped one (whole blocks;
    padding blocks zero: codes 0 and scale 0 dequantize to 0, as a fresh state)."""
    per = codes_per_element(full)
    codes, scale = parts(full)
    first = rank * spec.shard_numel // spec.block
    blocks = max(0, min(spec.shard_numel // spec.block, spec.numel // spec.block - first))
    new_codes = torch.zeros(int(spec.shard_numel * per), dtype=codes.dtype, device=device or codes.device)
    new_scale = torch.zeros(spec.shard_numel // spec.block, dtype=scale.dtype, device=device or scale.device)
    width = int(spec.block * per)
    new_codes[: blocks * width].copy_(codes[first * width : (first + blocks) * width])
    new_scale[:blocks].copy_(scale[first : first + blocks])
    moved = rebuild(full, new_codes, new_scale, (spec.shard_numel,))
    return moved if device is None else moved.to(device=device)
