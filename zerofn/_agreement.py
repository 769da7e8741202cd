"""The rank agreement: one tiny all-gather that every rank runs before a stage's first bucket.

A rank with another layout, gradient set or setting would send buckets of other sizes,
and a collective of mismatched sizes hangs every rank (or sums the wrong elements).
So before its buckets a stage all-gathers a few int64 values per rank (the layout's
fingerprint, a hash of the names with a gradient, this rank's verdict on its input, the
settings that decide the sizes) and every rank reads the same table: equal rows, go on;
any difference, every rank raises :class:`RankMismatchError`, the details collected in a
second, slower all-gather. :func:`agreement_terms` carries the same comparison inside a
scalar all-reduce instead (``step_shards``'s).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from zerofn import _comm as comm
from zerofn import _comm_setup as comm_setup
from zerofn import _traced
from zerofn.layout import ShardLayout, layout_by_fingerprint

__all__ = [
    "MAX_AGREEMENT_RANKS",
    "Agreement",
    "RankMismatchError",
    "agreement_holds",
    "agreement_key",
    "agreement_terms",
    "check_ranks_agree",
    "dtype_code",
    "dtypes_mask",
    "launch_agreement",
    "text_hash",
]


class RankMismatchError(RuntimeError):
    """Ranks of one group disagree on something every rank must share.

    Raised on every rank of the group at once, before any bucket is exchanged.
    """


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
    return launch_agreement(
        layout, group, where, present=present, settings=settings, device=device, failure=failure
    ).settle()


class Agreement:
    """A :func:`check_ranks_agree` in flight: its all-gather launched, its verdict not yet read.

    :meth:`settle` waits for the table and returns it, or raises on every rank; it must
    run before the caller's first collective whose sizes the agreement vouches for (a
    rank that disagrees would send other sizes). In between, the caller may compute:
    ``value_and_reduced_grads`` runs the backward while the table travels.
    """

    __slots__ = ("_failure", "_group", "_layout", "_pending", "_present", "_settings", "_table", "_where")

    def __init__(
        self,
        pending: comm.Pending,
        layout: ShardLayout,
        group: comm.Group,
        where: str,
        present: list[str] | None,
        settings: dict[str, int],
        failure: Exception | None,
    ) -> None:
        self._pending, self._layout, self._group, self._where = pending, layout, group, where
        self._present, self._settings, self._failure = present, settings, failure
        self._table: torch.Tensor | None = None

    def settle(self) -> torch.Tensor:
        """The ``(N, k)`` table once every rank agrees (the verdict node's output in a graph); else raise."""
        if self._table is not None:
            return self._table
        table = self._pending.wait()
        if not comm.tracing() and self._failure is None and bool((table == table[0]).all()):
            self._table = table  # the common case, without building the description below
            return table
        # Eagerly settled now; in a compiled step, every time the graph runs (zerofn._traced).
        # Strings, not a tuple per param: a compiled step traces this once, at a cost per element.
        present, failure = self._present, self._failure
        desc = (
            self._where,
            comm.group_name(self._group),
            self._layout.fingerprint,
            self._layout.world_size,
            "\0".join(present) if present is not None else None,
            tuple(self._settings.items()),
            failure if not comm.tracing() else _traced.failure_desc(failure),
        )
        self._table = _traced.verdict(table, "ranks_agree", desc)
        return self._table


def launch_agreement(
    layout: ShardLayout,
    group: comm.Group,
    where: str,
    *,
    present: list[str] | None = None,
    settings: Mapping[str, int] | None = None,
    device: torch.device | str = "cpu",
    failure: Exception | None = None,
) -> Agreement:
    """:func:`check_ranks_agree` with its all-gather launched and its verdict left to
    :meth:`Agreement.settle` (same arguments). Collectives: the one ``all_gather``."""
    settings = dict(settings or {})
    values = [
        layout.fingerprint_int,
        _names_hash(present) if present is not None else 0,
        int(failure is not None),
        *settings.values(),
    ]
    pending = comm.launch_gather_ints(values, group, device=device)
    return Agreement(pending, layout, group, where, present, settings, failure)


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
    everyone = comm_setup.all_gather_objects(mine, group)
    if failure is not None:
        raise failure
    failed = [(r, e["failure"]) for r, e in enumerate(everyone) if e["failure"] is not None]
    if failed:
        r, why = failed[0]
        raise RankMismatchError(
            f"{where}: rank {r} rejected its input ({why}), so no rank exchanged anything; fix the input on that rank"
        )
    raise RankMismatchError(f"{where}: ranks disagree before any shard was exchanged. {_explain(everyone)}")


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
