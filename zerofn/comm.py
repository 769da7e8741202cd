"""Deprecated alias of the private :mod:`zerofn._comm`; removed in the next release.

What users touch is exported at the top level (``zf.CommPolicy``, ``zf.count_bytes``,
``zf.CommCounter``), and the bucket collectives are the pieces of :mod:`zerofn.buckets`
(``launch_reduce``, ``launch_gather``). Import those instead.
"""

from zerofn._comm import (
    CommCounter,
    CommPolicy,
    Group,
    Pending,
    all_gather_ints,
    all_gather_objects,
    all_reduce_scalars,
    barrier,
    broadcast_object,
    count_bytes,
    dcp_load,
    dcp_save,
    device_mesh,
    gather_rows,
    grid_groups,
    group_rank,
    group_size,
    sum_across,
    sum_rows,
)

__all__ = [
    "CommCounter",
    "CommPolicy",
    "Group",
    "Pending",
    "all_gather_ints",
    "all_gather_objects",
    "all_reduce_scalars",
    "barrier",
    "broadcast_object",
    "count_bytes",
    "dcp_load",
    "dcp_save",
    "device_mesh",
    "gather_rows",
    "grid_groups",
    "group_rank",
    "group_size",
    "sum_across",
    "sum_rows",
]
