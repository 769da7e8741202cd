"""Flat shards: a rank's shards of every split param of one group in one contiguous buffer.

Note: the flat vocabulary
-------------------------
flat group
    The split (and ``blocked(B)``) params of one working dtype, in layout order (which is
    bucket order: a bucket is a run of consecutive same-dtype split params, so its
    members are consecutive in their flat group too). On every rank the group's shards
    lie side by side in one 1-D buffer of ``sum(shard_numel)`` elements: the shard of the
    ``k``-th member starts where the ``(k-1)``-th ends. No alignment padding is added
    between shards: a buffer holds the shards' own padding (zero, see
    :mod:`zerofn.layout`) and nothing else, so a rank's state bytes are the formula's and
    the buffer is the concatenation of the per-param shards, bit for bit.
loose
    A whole param this rank owns (``placement="whole"``): it keeps its full shape and its
    own tensor (per-matrix math: Muon, Adafactor), outside every buffer.
:class:`FlatLayout`
    Static, hashable metadata: the groups (names, offsets, shard sizes), the loose names
    and the view shape of every name this rank holds. A pure function of the
    :class:`~zerofn.layout.ShardLayout` and the rank (:func:`flat_layout`), so reduce_grads
    (which knows no optimizer) and shard_params agree on it without talking.
:class:`FlatDict`
    A read-only ``Mapping[str, Tensor]`` over a :class:`FlatLayout`: ``d[name]`` is a view
    of its group's buffer (``buf[off:off + shard_numel]``) or the loose tensor. A pytree
    node whose leaves are the buffers (and the loose tensors) and whose context is the
    layout, so ``tree_map`` over a state touches a handful of tensors and a compiled graph
    receives a handful of inputs. A FlatDict may hold a subset of the layout's names (the
    gradients of a step in which some params got none): the ranges of the names it does
    not hold are zero (gradients) or unspecified (never read), and a group none of whose
    names it holds has no buffer (``None``).

Padding stays zero: every buffer's padding elements (the tails of the last ranks' shards)
are zero in masters, gradients and optimizer state, and the element-wise updates keep
them so (a zero gradient moves nothing).

No collectives here.
"""

from zerofn._offsets import FlatGroup, FlatLayout, flat_layout
from zerofn._offsets import full_param_offsets as full_param_offsets
from zerofn.flat._dict import FlatDict, as_flat, pack, packable

# zerofn's own boundary helpers, shared by its modules (not in __all__: see docs/design.md).
from zerofn.flat._dict import owned as owned
from zerofn.flat._dict import pieces as pieces
from zerofn.flat._dict import run_view as run_view
from zerofn.flat._dict import split as split
from zerofn.flat._dict import zeros_like as zeros_like
from zerofn.flat._forms import bucket_range as bucket_range
from zerofn.flat._forms import buffer_metadata as buffer_metadata
from zerofn.flat._forms import buffer_views as buffer_views
from zerofn.flat._forms import grads_on as grads_on
from zerofn.flat._forms import held_flat as held_flat
from zerofn.flat._forms import hold_like as hold_like
from zerofn.flat._forms import metadata as metadata
from zerofn.flat._forms import named_pieces as named_pieces
from zerofn.flat._forms import names_with_values as names_with_values
from zerofn.flat._forms import pack_state as pack_state
from zerofn.flat._forms import reshare_steps as reshare_steps
from zerofn.flat._forms import same_flat_layout as same_flat_layout

__all__ = ["FlatDict", "FlatGroup", "FlatLayout", "as_flat", "flat_layout", "pack", "packable"]
