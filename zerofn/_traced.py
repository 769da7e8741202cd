"""Checks a compiled step runs on every call: host-side verdicts as one opaque graph node.

Under ``torch.compile`` the stage functions' local validation runs once per trace (on
static metadata: names, shapes, dtypes, settings), and its result travels, as in eager
mode, in the rank-agreement all-gather or the norm all-reduce. Reading that collective's
verdict needs the host, and raising the eager mode's exact error needs the slow object
all-gather that explains it. Both run in a *handler* registered here by the module that
owns the check, called with the collective's result: eagerly at once, and in a compiled
graph through ``zerofn::verdict``, a custom op the graph keeps (it has a side effect, so it
is never dead code) right after the collective, so it runs on every call with the real
tensors. A handler returns when every rank agrees and otherwise raises the eager error on
every rank (they all read the same collective result). What it needs besides tensors is
a tuple of plain constants (names, shapes, messages, the group's name), fixed per trace.

Those constants are static metadata, but dynamo does not know it: an int read from a
step's inputs (a shape in the layout the state carries, a setting in a closure) is an
input to it, and when it compiles the same code again with other values (a second model
through the same step function) its automatic dynamic shapes turn that int into a
symbol, which no constant can hold. :func:`verdict` therefore makes every int of the
description a constant of the trace first (``operator.index``, as CPython's, forces a
concrete int: dynamo guards on the value), so a step over another layout is another
trace, as the once-per-trace validation before it assumes.
"""

from __future__ import annotations

import ast
import functools
import operator
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["constant_result", "decode", "failure_desc", "handler", "rebuild_failure", "refuse", "verdict"]

Handler = Callable[..., None]
_HANDLERS: dict[str, Handler] = {}


def handler(kind: str) -> Callable[[Handler], Handler]:
    """Register ``fn(table, tensors, *desc)`` as the check named ``kind``."""

    def register(fn: Handler) -> Handler:
        _HANDLERS[kind] = fn
        return fn

    return register


def constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.assume_constant_result``, without importing dynamo with zerofn.

    A compiled graph calls ``fn`` at trace time and keeps its result as a constant. The
    marker below is all that torch's decorator sets (tests/test_jit.py checks it against
    torch's own); torch's imports ``torch._dynamo`` first, about half of the time zerofn
    takes to import, paid by every process that never compiles (each rank torchrun starts).
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@constant_result  # run for real at trace time: a constant of the graph
def _encode(desc: tuple) -> str:
    return repr(desc)


@torch.library.custom_op("zerofn::verdict", mutates_args=())
def _verdict_op(table: torch.Tensor, tensors: list[torch.Tensor], kind: str, desc: str) -> torch.Tensor:
    _HANDLERS[kind](table, tensors, *_decode(desc))
    return table.clone()  # (an op may not return its input itself)


@functools.lru_cache(maxsize=256)  # one string per trace point: parsed once, not every step
def _decode(desc: str) -> tuple[Any, ...]:
    return ast.literal_eval(desc)


@_verdict_op.register_fake
def _(table: torch.Tensor, tensors: list[torch.Tensor], kind: str, desc: str) -> torch.Tensor:
    del tensors, kind, desc
    return torch.empty_like(table)


torch.fx.node.has_side_effect(torch.ops.zerofn.verdict.default)


def verdict(
    table: torch.Tensor, kind: str, desc: tuple[Any, ...], tensors: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """Run the ``kind`` handler on ``table`` every time the compiled graph runs (eagerly: now).

    Returns ``table`` as the handler passed it (in a graph, the node's output): what is
    computed from the result instead of from ``table`` runs after the verdict by data
    dependency, whatever order a compiler gives the graph's other nodes.

    Args:
      table: the collective's result the verdict reads (on every rank the same).
      kind: a name given to :func:`handler`.
      desc: the handler's other arguments: Python constants only (str, int, float, bool,
        None, tuples of them), fixed for the trace.
      tensors: values the handler needs to explain an error (e.g. the gradient shards, to
        name the non-finite ones); in a compiled graph it gets the call's real tensors.
    """
    tensors = list(tensors or [])
    if torch.compiler.is_compiling():
        return torch.ops.zerofn.verdict(table, tensors, kind, _encode(_constant(desc)))
    _HANDLERS[kind](table, tensors, *desc)
    return table


def decode(desc: str) -> tuple[Any, ...]:
    """The tuple a description string holds (parsed once per string)."""
    return _decode(desc)


def _constant(value: Any) -> Any:
    """``value`` with every int in it (tuples searched) a constant of the trace: dynamo guards on it."""
    if isinstance(value, tuple):
        return tuple(_constant(v) for v in value)
    if isinstance(value, int) and not isinstance(value, bool):
        return operator.index(value)
    return value


def failure_desc(failure: Exception | None) -> tuple[str, str] | None:
    """A local validation error as constants: (type name, message)."""
    if failure is None:
        return None
    return (type(failure).__name__, str(failure.args[0]) if failure.args else "")


_FAILURE_TYPES: dict[str, type[Exception]] = {"TypeError": TypeError, "ValueError": ValueError, "KeyError": KeyError}


def rebuild_failure(desc: tuple[str, str]) -> Exception:
    """The error :func:`failure_desc` described, to raise again."""
    return _FAILURE_TYPES.get(desc[0], RuntimeError)(desc[1])


def refuse(message: str) -> None:
    """Stop a compiled step at trace time because ``message`` names what cannot be compiled.

    With ``fullgraph=True`` dynamo raises its ``Unsupported`` error carrying ``message``
    while tracing, before the graph ever runs (so before any collective of that call).
    Without it the graph breaks here and the resumed code raises ``NotImplementedError``
    with the same message on the first call: never a silently different step. Eagerly
    (not tracing) it raises the ``NotImplementedError`` at once.
    """
    if torch.compiler.is_compiling():
        torch._dynamo.graph_break(msg=message)
    raise NotImplementedError(message)
