"""Validation that runs before any collective: each stage checks its inputs locally.

A mismatch discovered *inside* a collective hangs every rank (or, worse, silently sums
the wrong elements), so every stage function validates its inputs locally first; the
verdict then travels in the rank agreement (:mod:`zerofn._agreement`), so a bad input on
one rank makes every rank raise. Errors name the rank, the parameter and the shapes, and
say what to do.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from zerofn import _comm as comm
from zerofn import _traced
from zerofn.layout import ShardLayout, live_layout

__all__ = ["validate_grads", "validate_params"]


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
    names, expected = _expected_out(layout)
    try:  # the common case, every destination right, in one comparison of two lists
        if [(t.shape, t.dtype, t.is_contiguous()) for t in map(out.__getitem__, names)] == expected:
            return
    except (KeyError, AttributeError):
        pass
    _out_verdict(lambda name: _out_meta(out.get(name)), layout, where)


@functools.lru_cache(maxsize=8)
def _expected_out(layout: ShardLayout) -> tuple[tuple[str, ...], list[tuple[torch.Size, torch.dtype, bool]]]:
    """The layout's names and what :func:`validate_out` expects of each destination (shape, dtype, contiguous)."""
    return layout.names, [(torch.Size(spec.shape), spec.dtype, True) for spec in layout.params]


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
