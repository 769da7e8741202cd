"""Validation that runs before any collective, and the rank-agreement check.

A mismatch discovered *inside* a collective hangs every rank (or, worse, silently sums
the wrong elements), so every stage function validates its inputs locally first and then
confirms, with one tiny all-gather, that all ranks are about to issue the same sequence
of collectives. Errors name the rank, the parameter and the shapes, and say what to do.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from zerofn import _comm as comm
from zerofn import _traced
from zerofn.layout import ShardLayout, layout_by_fingerprint, live_layout

__all__ = ["RankMismatchError", "check_ranks_agree", "validate_grads", "validate_params"]


class RankMismatchError(RuntimeError):
    """Ranks of one group disagree on something every rank must share.

    Raised on every rank of the group at once, before any bucket is exchanged.
    """


def _rank_tag(group: comm.Group) -> str:
    return f"rank {comm.group_rank(group)}"


def validate_params(params: Mapping[str, torch.Tensor], where: str) -> None:
    """Local checks on a ``name -> tensor`` param mapping (no communication)."""
    if not isinstance(params, Mapping):
        raise TypeError(
            f"{where}: params must be a mapping name -> tensor (e.g. dict(model.named_parameters())), "
            f"got {type(params).__name__}"
        )
    if len(params) == 0:
        raise ValueError(f"{where}: params is empty; give at least one parameter to shard")
    seen: dict[int, str] = {}
    devices: dict[torch.device, str] = {}
    for name, p in params.items():
        if not isinstance(name, str):
            raise TypeError(f"{where}: parameter names must be str, got {name!r}")
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{where}: param {name!r} is a {type(p).__name__}, not a torch.Tensor")
        if not p.is_floating_point():
            raise TypeError(
                f"{where}: param {name!r} has dtype {p.dtype}; only floating-point params can be "
                "optimized. Leave integer buffers out of the mapping (use named_parameters(), not state_dict())."
            )
        key = id(p)
        if key in seen:
            raise ValueError(
                f"{where}: params {seen[key]!r} and {name!r} are the same tensor (tied weights); "
                "list it once, as model.named_parameters() does"
            )
        seen[key] = name
        devices.setdefault(p.device, name)
    if len(devices) > 1:
        listing = ", ".join(f"{n!r} on {d}" for d, n in devices.items())
        raise ValueError(f"{where}: params live on different devices ({listing}); move the model to one device first")


def validate_grads(
    grads: Mapping[str, torch.Tensor | None],
    layout: ShardLayout,
    group: comm.Group,
    where: str,
    *,
    accum_dtype_for: Callable[[torch.dtype], torch.dtype] | None = None,
) -> list[str]:
    """Check full gradients against the layout; return the names that have a gradient.

    A gradient must have its param's shape, and its dtype or, with ``accum_dtype_for``,
    the accumulation dtype for the param's dtype (e.g. float32 for a bfloat16 param).
    """
    if not isinstance(grads, Mapping):
        raise TypeError(f"{where}: grads must be a mapping name -> tensor, got {type(grads).__name__}")
    if torch.compiler.is_compiling():  # the lookups per name run at trace time, natively
        # operator.index: a dimension made symbolic by automatic dynamic shapes (a second
        # model through the same code) is specialized, so the metadata is a constant.
        meta = tuple((n, tuple(map(operator.index, g.shape)), g.dtype) for n, g in grads.items() if g is not None)
        dtypes = _layout_dtypes(layout.fingerprint)
        accum = tuple((d, accum_dtype_for(d) if accum_dtype_for is not None else d) for d in dtypes)
        present, failure = _traced_grads_verdict(layout.fingerprint, f"{where} on {_rank_tag(group)}", meta, accum)
        if failure is not None:
            raise _traced.rebuild_failure(failure)
        return list(present)

    def shape_dtype(name: str) -> tuple[Any, torch.dtype] | None:
        g = grads.get(name)
        return None if g is None else (g.shape, g.dtype)

    return _grads_verdict(grads, shape_dtype, layout, lambda: f"{where} on {_rank_tag(group)}", accum_dtype_for)


@_traced.constant_result
def _layout_dtypes(fingerprint: str) -> tuple[torch.dtype, ...]:
    """The working dtypes of a layout's params, in order of first appearance."""
    layout = live_layout(fingerprint)
    return tuple(dict.fromkeys(spec.dtype for spec in layout.params))


@_traced.constant_result
def _traced_grads_verdict(
    fingerprint: str,
    where: str,
    meta: tuple[tuple[str, tuple[int, ...], torch.dtype], ...],
    accum: tuple[tuple[torch.dtype, torch.dtype], ...],
) -> tuple[tuple[str, ...], tuple[str, str] | None]:
    """:func:`validate_grads` on the gradients' static metadata: ``(present, failure)``."""
    layout = live_layout(fingerprint)
    shapes = {n: (shape, dtype) for n, shape, dtype in meta}
    accum_of = dict(accum)
    try:
        return tuple(_grads_verdict(shapes, shapes.get, layout, lambda: where, accum_of.__getitem__)), None
    except (KeyError, ValueError) as e:
        return (), _traced.failure_desc(e)


def _grads_verdict(
    names: Iterable[str],
    shape_dtype: Callable[[str], tuple[Any, torch.dtype] | None],
    layout: ShardLayout,
    where: Callable[[], str],
    accum_dtype_for: Callable[[torch.dtype], torch.dtype] | None,
) -> list[str]:
    """:func:`validate_grads`' checks on each gradient's ``(shape, dtype)`` (``None``: no gradient);
    ``where()`` names the caller and rank in a message (only made for one)."""
    unknown = [n for n in names if n not in layout]
    if unknown:
        raise KeyError(
            f"{where()}: gradients for params the layout does not know: {unknown}; "
            f"known params start with {list(layout.names[:5])}"
        )
    present = []
    accum_of: dict[torch.dtype, torch.dtype] = {}  # per dtype, not per param (a model has few)
    for spec in layout.params:
        got = shape_dtype(spec.name)
        if got is None:
            continue
        shape, dtype = got
        accum = accum_of.get(spec.dtype)
        if accum is None:
            accum = accum_of[spec.dtype] = accum_dtype_for(spec.dtype) if accum_dtype_for is not None else spec.dtype
        if shape != spec.shape or dtype not in (spec.dtype, accum):
            also = f" (or, accumulated, dtype {accum})" if accum != spec.dtype else ""
            raise ValueError(
                f"{where()}: gradient of {spec.name!r} has shape {tuple(shape)} "
                f"dtype {dtype}, but the param has shape {spec.shape} dtype {spec.dtype}{also}"
            )
        present.append(spec.name)
    return present


def validate_out(out: Mapping[str, torch.Tensor], layout: ShardLayout, where: str) -> None:
    """Destination tensors for gathered params must match the layout exactly."""
    if torch.compiler.is_compiling():  # the lookups per name run at trace time, natively
        meta = tuple((n, tuple(map(operator.index, t.shape)), t.dtype, t.is_contiguous()) for n, t in out.items())
        failure = _traced_out_verdict(layout.fingerprint, where, meta)
        if failure is not None:
            raise _traced.rebuild_failure(failure)
        return
    _out_verdict(lambda name: _out_meta(out.get(name)), layout, where)


def _out_meta(t: torch.Tensor | None) -> tuple[Any, torch.dtype, bool] | None:
    return None if t is None else (t.shape, t.dtype, t.is_contiguous())


@_traced.constant_result
def _traced_out_verdict(
    fingerprint: str, where: str, meta: tuple[tuple[str, tuple[int, ...], torch.dtype, bool], ...]
) -> tuple[str, str] | None:
    """:func:`validate_out` on the destinations' static metadata: the failure, or ``None``."""
    layout = live_layout(fingerprint)
    table = {n: rest for n, *rest in meta}
    try:
        _out_verdict(table.get, layout, where)
    except (KeyError, ValueError) as e:
        return _traced.failure_desc(e)
    return None


def _out_verdict(
    meta_of: Callable[[str], tuple[Any, torch.dtype, bool] | None], layout: ShardLayout, where: str
) -> None:
    """:func:`validate_out`'s checks on each destination's ``(shape, dtype, contiguous)`` (``None``: missing)."""
    for spec in layout.params:
        got = meta_of(spec.name)
        if got is None:
            raise KeyError(f"{where}: out has no tensor for param {spec.name!r}")
        shape, dtype, contiguous = got
        if shape != spec.shape or dtype != spec.dtype or not contiguous:
            raise ValueError(
                f"{where}: out[{spec.name!r}] has shape {tuple(shape)} dtype {dtype} "
                f"contiguous={contiguous}, but the param is a contiguous {spec.shape} {spec.dtype}"
            )


def validate_world(layout: ShardLayout, group: comm.Group, where: str) -> None:
    n = comm.group_size(group)
    if n != layout.world_size:
        raise ValueError(
            f"{where} on {_rank_tag(group)}: the layout was made for {layout.world_size} ranks but the group "
            f"has {n}; reshard the state (zerofn.checkpoint) or pass the group it was made with"
        )


_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 4, torch.float64: 8}


def dtype_code(dtype: torch.dtype | None) -> int:
    """A small int naming a floating dtype, for comparing settings over a collective.

    0 is ``None``; float16, bfloat16, float32, float64 are 1, 2, 4, 8; others 16.
    """
    return 0 if dtype is None else _DTYPE_CODES.get(dtype, 16)


def dtypes_mask(dtypes: Iterable[torch.dtype]) -> int:
    """The set of ``dtypes`` as a bit mask of their :func:`dtype_code` values."""
    mask = 0
    for d in dtypes:
        mask |= dtype_code(d)
    return mask


def text_hash(text: str) -> int:
    """A non-negative int64 digest of ``text``, equal on every rank, for :func:`check_ranks_agree`."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


@_traced.constant_result  # static metadata: hashed once per trace
def _names_hash(names: Iterable[str]) -> int:
    return int(hashlib.sha256("\0".join(names).encode()).hexdigest()[:15], 16)


#: Bits per piece of a value that :func:`agreement_terms` spreads over a scalar all-reduce.
_PIECE_BITS = 12
_PIECES = 5  # 60 bits: a layout fingerprint (:attr:`~zerofn.layout.ShardLayout.fingerprint_int`)
#: Up to this many ranks, ``N * sum(v**2)`` and ``sum(v)**2`` of 12-bit pieces stay below
#: ``2**53``: exact in float64, so :func:`agreement_holds` is exact.
MAX_AGREEMENT_RANKS = 2**14


def agreement_terms(values: Sequence[int], op: str) -> list[float]:
    """Terms that let a scalar all-reduce with ``op`` (``"sum"`` or ``"max"``) tell whether every
    rank passed the same ``values`` (non-negative ints, 60 bits each are compared).

    Each value is cut into five 12-bit pieces ``v``; with ``"sum"`` the terms are the pieces
    and their squares (all ranks equal iff ``N * sum(v**2) == sum(v)**2``, Cauchy-Schwarz),
    with ``"max"`` the pieces and their negatives (equal iff ``max(v) == -max(-v)``). The
    verdict, :func:`agreement_holds`, is computed from the reduced sums alike on every rank.
    """
    mask = (1 << _PIECE_BITS) - 1
    pieces = [float((v >> (_PIECE_BITS * k)) & mask) for v in values for k in range(_PIECES)]
    return pieces + [p * p if op == "sum" else -p for p in pieces]


def agreement_holds(reduced: Sequence[float], n: int, op: str) -> bool:
    """Whether the all-reduced :func:`agreement_terms` of ``n`` ranks say every rank's values were equal."""
    half = len(reduced) // 2
    pieces, second = reduced[:half], reduced[half:]
    if op == "sum":
        return all(n * sq == p * p for p, sq in zip(pieces, second, strict=True))
    return all(p == -neg for p, neg in zip(pieces, second, strict=True))


def agreement_key(group: comm.Group) -> str:
    """What :attr:`~zerofn.state.ZeroState.agreed_in` records for ``group`` (``""``: the default group)."""
    return comm.group_name(group) or ""


def check_ranks_agree(
    layout: ShardLayout,
    group: comm.Group,
    where: str,
    *,
    present: list[str] | None = None,
    settings: Mapping[str, int] | None = None,
    device: torch.device | str = "cpu",
    failure: Exception | None = None,
) -> torch.Tensor:
    """Confirm every rank has the same layout, gradient set and settings, or raise.

    ``failure`` is this rank's local validation error, if any: it travels in the same
    all-gather as a flag, so when any rank rejected its input *every* rank raises (that
    rank its own error, the others a :class:`RankMismatchError` quoting it) and none is
    left waiting in a collective.

    Cost: one ``all_gather`` of ``3 + len(settings)`` int64 values per call (a few
    dozen bytes; on gloo tens of microseconds), plus hashing the names of ``present``.
    Only when ranks differ does a second, slower object all-gather collect the details
    for the message; every rank sees the same table, so all raise together.

    Under ``torch.compile`` the local values (fingerprint, names, settings, this rank's
    ``failure``) are static metadata, computed once per trace; the all-gather and the
    verdict on its table run on every call of the compiled step, with the same messages.

    Returns the all-gathered ``(N, k)`` table (in a graph: the verdict node's output), for
    a caller whose next collectives must follow the verdict by data dependency.
    """
    settings = dict(settings or {})
    values = [
        layout.fingerprint_int,
        _names_hash(present) if present is not None else 0,
        int(failure is not None),
        *settings.values(),
    ]
    table = comm.all_gather_ints(values, group, device=device)
    if not comm.tracing() and failure is None and bool((table == table[0]).all()):
        return table  # the common case, without building the description below
    # Eagerly settled now; in a compiled step, every time the graph runs (zerofn._traced).
    # Strings, not a tuple per param: a compiled step traces this once, at a cost per element.
    desc = (
        where,
        comm.group_name(group),
        layout.fingerprint,
        layout.world_size,
        "\0".join(present) if present is not None else None,
        tuple(settings.items()),
        failure if not comm.tracing() else _traced.failure_desc(failure),
    )
    return _traced.verdict(table, "ranks_agree", desc)


@_traced.handler("ranks_agree")
def _settle_agreement(
    table: torch.Tensor,
    tensors: list[torch.Tensor],
    where: str,
    group_name: str | None,
    fingerprint: str,
    world_size: int,
    present: str | None,
    settings: tuple[tuple[str, int], ...],
    failure: Exception | tuple[str, str] | None,
) -> None:
    """:func:`check_ranks_agree`'s verdict on the all-gathered ``table``: return, or raise on every rank.

    ``fingerprint`` names this rank's layout (:func:`~zerofn.layout.layout_by_fingerprint`);
    ``present`` is the names with a gradient joined by NUL characters.
    """
    del tensors
    if bool((table == table[0]).all()) and failure is None:
        return
    if failure is not None and not isinstance(failure, Exception):
        failure = _traced.rebuild_failure(failure)
    group = comm.group_from_name(group_name)
    layout = layout_by_fingerprint(fingerprint)
    params = [] if layout is None else [(p.name, p.shape, str(p.dtype)) for p in layout.params]
    mine: dict[str, Any] = {
        "params": params,
        "world_size": world_size,
        "present": None if present is None else (present.split("\0") if present else []),
        "settings": dict(settings),
        "failure": None if failure is None else f"{type(failure).__name__}: {failure}",
    }
    everyone = comm.all_gather_objects(mine, group)
    if failure is not None:
        raise failure
    failed = [(r, e["failure"]) for r, e in enumerate(everyone) if e["failure"] is not None]
    if failed:
        r, why = failed[0]
        raise RankMismatchError(
            f"{where}: rank {r} rejected its input ({why}), so no rank exchanged anything; fix the input on that rank"
        )
    raise RankMismatchError(f"{where}: ranks disagree before any shard was exchanged. {_explain(everyone)}")


def validate_replicas(replicate_group: comm.Group, where: str) -> None:
    """A replicate group, when given, must contain this rank."""
    if replicate_group is not None:
        comm.group_rank(replicate_group)  # raises for a group this rank is not in


def validate_bucket_dtypes(
    buckets: Iterable[Any], grad_dtypes: Mapping[str, torch.dtype], group: comm.Group, where: str
) -> None:
    """All present gradients of one bucket must share a dtype (a bucket is one flat buffer)."""
    for bucket in buckets:
        kinds = {grad_dtypes[n] for n in bucket.names if n in grad_dtypes}
        if len(kinds) > 1:
            listing = ", ".join(f"{n!r}: {grad_dtypes[n]}" for n in bucket.names if n in grad_dtypes)
            raise ValueError(
                f"{where} on rank {comm.group_rank(group)}: the params of one bucket have gradients "
                f"in different dtypes ({listing}); give them all in the params' dtype or all in the "
                "accumulation dtype"
            )


def _explain(everyone: list[Any]) -> str:
    ref = everyone[0]
    for r, other in enumerate(everyone[1:], start=1):
        if other["params"] != ref["params"]:
            return _explain_params(ref["params"], other["params"], r)
        if other["settings"] != ref["settings"]:
            diffs = {
                k: (ref["settings"].get(k), other["settings"].get(k))
                for k in ref["settings"]
                if ref["settings"].get(k) != other["settings"].get(k)
            }
            listing = ", ".join(f"{k}: rank 0 has {a}, rank {r} has {b}" for k, (a, b) in diffs.items())
            return f"Settings differ ({listing}); pass the same options on every rank."
        if other["present"] != ref["present"]:
            a, b = set(ref["present"]), set(other["present"])
            name = sorted(a ^ b)[0]
            has = [i for i, e in enumerate(everyone) if name in e["present"]]
            lacks = [i for i, e in enumerate(everyone) if name not in e["present"]]
            return (
                f"Param {name!r} has a gradient on ranks {has} but none on ranks {lacks}. Every rank must "
                "produce gradients for the same params in a step (a layer that is skipped must be skipped "
                "on all ranks, e.g. by seeding layer drop identically)."
            )
    return "The layouts' fingerprints differ."


def _explain_params(ref: list[Any], other: list[Any], r: int) -> str:
    for i in range(max(len(ref), len(other))):
        a = ref[i] if i < len(ref) else None
        b = other[i] if i < len(other) else None
        if a != b:
            if a is not None and b is not None and a[0] == b[0]:
                return (
                    f"Param {a[0]!r}: rank 0 has shape {a[1]} dtype {a[2]}, rank {r} has shape {b[1]} dtype {b[2]}. "
                    "Build the same model on every rank."
                )
            names_ref = [p[0] for p in ref]
            names_other = [p[0] for p in other]
            if sorted(names_ref) == sorted(names_other):
                return (
                    f"Rank 0 and rank {r} list the same params in a different order (position {i}: "
                    f"{a[0] if a else None!r} vs {b[0] if b else None!r}). Pass params in the same order on "
                    "every rank, e.g. dict(model.named_parameters())."
                )
            missing = sorted(set(names_ref) ^ set(names_other))
            return (
                f"Param sets differ between rank 0 and rank {r}: {missing[:5]} not on both. "
                "Build the same model on every rank."
            )
    return "The layouts differ."
