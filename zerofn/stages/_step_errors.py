"""What ``step_shards`` checks and raises: its input validation and the errors every rank raises alike.

The checks read static metadata only (names, shapes, dtypes), so a compiled step runs them
once per trace; their verdict travels in the step's scalar all-reduce, and the raising
functions here run on every rank once that all-reduce said some rank rejected its input,
vetoed the step or (``nonfinite="raise"``) held a non-finite gradient. Eagerly
``step_shards`` calls them after its host read; compiled, :func:`_settle_step` does, as
the handler of :func:`zerofn._traced.verdict`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from zerofn import _agreement as agreement
from zerofn import _checks as checks
from zerofn import _comm as comm
from zerofn import _comm_setup as comm_setup
from zerofn import _traced, flat
from zerofn._comm import Group
from zerofn.layout import live_layout
from zerofn.precision import NonFiniteGradError, nonfinite_grad_names
from zerofn.state import ZeroState

__all__ = ["StepVetoed", "raise_nonfinite", "raise_rejected", "traced_verdict", "validate_step"]


def validate_step(
    state: ZeroState, grad_shards: Mapping[str, torch.Tensor], group: Group, max_norm: float | None, norm_type: float
) -> Exception | None:
    """``step_shards``' local checks (static metadata only): the error, or ``None``."""
    try:
        checks.validate_world(state.layout, group, "step_shards")
        if comm.group_rank(group) != state.rank:
            raise ValueError(
                f"step_shards: the state holds rank {state.rank}'s shards but this process is rank "
                f"{comm.group_rank(group)} of the group"
            )
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"step_shards: norm_type must be 2.0 or math.inf, got {norm_type!r}")
        if max_norm is not None and not (max_norm > 0 and math.isfinite(max_norm)):
            raise ValueError(f"step_shards: max_norm must be a positive finite number or None, got {max_norm!r}")
        for name, shape, dtype in _metadata_to_check(state, grad_shards):
            if name not in state.layout:
                raise KeyError(f"step_shards on rank {state.rank}: gradient shard for unknown param {name!r}")
            spec = state.layout[name]
            expected = spec.local_shape(state.rank)
            if expected is None:
                raise ValueError(
                    f"step_shards on rank {state.rank}: got a gradient for whole param {name!r} (shape {spec.shape}), "
                    f"which rank {spec.owner} owns; pass the output of reduce_grads on this rank"
                )
            if shape != expected:
                what = "the full shape of a whole param this rank owns" if spec.is_whole else "a split param"
                raise ValueError(
                    f"step_shards on rank {state.rank}: shard of {name!r} has shape {shape}, expected "
                    f"{expected} ({what}) for a param of shape {spec.shape} over {state.layout.world_size} ranks; "
                    "pass the output of reduce_grads, not full gradients"
                )
            if not dtype.is_floating_point:
                raise TypeError(f"step_shards on rank {state.rank}: shard of {name!r} has dtype {dtype}, not floating")
    except (TypeError, ValueError, KeyError) as e:
        return e
    return None


def _metadata_to_check(
    state: ZeroState, grad_shards: Mapping[str, torch.Tensor]
) -> Iterable[tuple[str, tuple[int, ...], torch.dtype]]:
    """What :func:`_validate_step` checks per name. Shards on the master's own flat layout
    (what ``reduce_grads`` returns) are right in names and shapes by construction: only each
    buffer (as its first name) and the loose tensors are checked, so a compiled step traces
    no loop over the names."""
    by_buffer = flat.buffer_metadata(grad_shards, state.master.flat_layout)
    return flat.metadata(grad_shards) if by_buffer is None else by_buffer


def traced_verdict(
    state: ZeroState,
    grad_shards: Mapping[str, torch.Tensor],
    group: Group,
    failure: Exception | None,
    veto: object,
    total: torch.Tensor,
    confirm: tuple[int, str] | None,
) -> torch.Tensor:
    """A compiled step's verdict on the all-reduced scalars, without a host sync; ``total`` as
    the verdict passed it (decide from this, so the update follows the verdict by data).

    The local checks ran once, at trace time (shapes and dtypes are static); their
    verdict rides in the scalar all-reduce as eagerly, and :func:`zerofn._traced.verdict`
    raises the eager errors on every rank when a rank rejected its input, when the
    agreement terms (``confirm``: the group size and the all-reduce's op; ``None``
    when none were sent) say the ranks' layouts or bucket sizes differ, or, with
    ``nonfinite="raise"``, when a gradient is not finite. The shards the handler names
    non-finite ones from are flat, one tensor per run of the buffers (so the graph does not
    grow with the tensor count), or per name; the names travel as one string and the layout
    as its fingerprint (a tuple per name would cost a compiled step's trace per name).
    """
    names, tensors, is_flat = flat.named_pieces(grad_shards)
    desc = (
        comm.group_name(group),
        _traced.failure_desc(failure),
        None if veto is None else repr(veto),
        state.precision.nonfinite,
        state.rank,
        state.layout.fingerprint,
        "\0".join(names),
        is_flat,
        confirm,
        state.bucket_numel,
    )
    return _traced.verdict(total, "step_shards", desc, tensors)


@_traced.handler("step_shards")
def _settle_step(
    total: torch.Tensor,
    shards: list[torch.Tensor],
    group_name: str | None,
    failure: tuple[str, str] | None,
    veto: str | None,
    nonfinite: str,
    rank: int,
    fingerprint: str,
    joined_names: str,
    is_flat: bool,
    confirm: tuple[int, str] | None,
    bucket_numel: int,
) -> None:
    """A compiled ``step_shards``' verdict on the all-reduced scalars: return, or raise the eager error everywhere.

    ``shards``: one per name (``joined_names``, NUL-separated), or when ``is_flat`` one per
    run of the rank's flat layout under the layout with ``fingerprint`` (cut into its
    members' shards; a loose tensor is one name). ``confirm``: ``(n, op)`` of the
    agreement terms after the first three scalars, or ``None``.
    """
    group = comm.group_from_name(group_name)
    if total[2] > 0:
        raise_rejected(None if failure is None else _traced.rebuild_failure(failure), group, veto)
    if confirm is not None and not agreement.agreement_holds(total[3:].tolist(), *confirm):
        agreement.check_ranks_agree(
            live_layout(fingerprint), group, "step_shards", settings={"bucket_numel": bucket_numel}
        )
    if total[1] > 0 and nonfinite == "raise":
        layout = live_layout(fingerprint)
        names = tuple(joined_names.split("\0")) if joined_names else ()
        if is_flat:
            fl = flat.flat_layout(layout, rank)
            shards = [
                t
                for piece, (g, _, _, members) in zip(shards, fl.runs(names), strict=True)
                for t in ([piece] if g < 0 else piece.split([fl.where[m][2] for m in members]))
            ]
        _raise_nonfinite_names(rank, layout.names, dict(zip(names, shards, strict=True)), group)


class StepVetoed(RuntimeError):
    """Raised by ``step_shards`` on every rank when some rank passed a ``veto``; nothing was applied.

    Attributes:
      vetoes: every rank's ``veto`` argument, by group rank (``None`` for ranks without one),
        the same list on every rank.
    """

    def __init__(self, vetoes: list[object]) -> None:
        ranks = [r for r, v in enumerate(vetoes) if v is not None]
        super().__init__(f"step_shards: ranks {ranks} vetoed this step, so no rank applied it")
        self.vetoes = vetoes


def raise_rejected(failure: Exception | None, group: Group, veto: object = None) -> None:
    """Every rank: some rank found its ``step_shards`` input invalid or vetoed; all raise, none changed state."""
    everyone = comm_setup.all_gather_objects(
        (None if failure is None else f"{type(failure).__name__}: {failure}", veto), group
    )
    if failure is not None:
        raise failure
    bad = next(((r, w) for r, (w, _) in enumerate(everyone) if w is not None), None)
    if bad is not None:
        raise agreement.RankMismatchError(
            f"step_shards: rank {bad[0]} rejected its input ({bad[1]}), so no rank applied this step; fix the input "
            "on that rank"
        )
    raise StepVetoed([v for _, v in everyone])


def raise_nonfinite(state: ZeroState, grad_shards: Mapping[str, torch.Tensor], group: Group) -> None:
    """Every rank: collect which params hold non-finite shards where, then raise the same error.

    Only called once the scalar all-reduce has told every rank that the step is bad, so
    every rank issues this one object all-gather and raises: none is left waiting.
    """
    _raise_nonfinite_names(state.rank, state.layout.names, grad_shards, group)


def _raise_nonfinite_names(
    rank: int, layout_names: tuple[str, ...], grad_shards: Mapping[str, torch.Tensor], group: Group
) -> None:
    everyone = comm_setup.all_gather_objects(nonfinite_grad_names(grad_shards), group)
    where = {
        name: [r for r, names in enumerate(everyone) if name in names]  # type: ignore[operator]
        for name in layout_names
        if any(name in names for names in everyone)  # type: ignore[operator]
    }
    if where:
        listing = "; ".join(f"{name!r} (in the shards of ranks {ranks})" for name, ranks in where.items())
        what = f"gradients of these params hold inf or nan: {listing}"
    else:
        what = "no gradient element is inf or nan, but the squared global norm overflowed float64"
    raise NonFiniteGradError(
        f"step_shards on rank {rank}: {what}. The policy says nonfinite='raise', so no rank applied "
        "this step and the state is unchanged. Find the cause (a bad batch, a too large learning rate, an "
        "overflow in the forward), or use PrecisionPolicy(nonfinite='skip') to skip such steps."
    )
