"""The public surface: ``zerofn.__all__`` changes only on purpose.

Adding or removing a public name means editing the list below in the same change, so a
review sees it. Everything listed is importable; the communication and validation
modules are private (``zerofn._comm``, ``zerofn._agreement``), and what users touch of them
is at the top level.
"""

from __future__ import annotations

import zerofn as zf

PUBLIC = [
    "Bucket",
    "CheckpointError",
    "CommCounter",
    "CommPolicy",
    "CompressedWire",
    "DynamicLossScaler",
    "FrozenDict",
    "LossScaleState",
    "MixedDtypeError",
    "NoLossScaling",
    "NonFiniteGradError",
    "NotJoinedError",
    "ParamSpec",
    "ParamsChangedError",
    "PrecisionPolicy",
    "RankMismatchError",
    "ShardLayout",
    "ShardedGradError",
    "StaticLossScaler",
    "StepInfo",
    "ZeroOptimizer",
    "ZeroState",
    "broadcast_params",
    "buckets",
    "check_ranks_agree",
    "checkpoint",
    "count_bytes",
    "gather_params",
    "make_layout",
    "optim",
    "precision",
    "reduce_grads",
    "scale_loss",
    "shard_params",
    "step_shards",
    "torch_optim",
    "value_and_reduced_grads",
]


def test_the_public_surface_is_pinned():
    assert sorted(zf.__all__) == PUBLIC
    for name in zf.__all__:
        assert getattr(zf, name) is not None, name


def test_plumbing_is_private_and_what_users_touch_is_top_level():
    from zerofn import _agreement, _comm_count

    assert "comm" not in zf.__all__ and "checks" not in zf.__all__
    assert zf.CommCounter is _comm_count.CommCounter and zf.count_bytes is _comm_count.count_bytes
    assert zf.RankMismatchError is _agreement.RankMismatchError
    assert zf.CheckpointError is zf.checkpoint.CheckpointError
    with zf.count_bytes() as counter:
        pass
    assert isinstance(counter, zf.CommCounter) and counter.bytes_sent == 0


def test_the_facade_s_precision_keywords_default_to_what_its_options_record():
    # (internal: zerofn.facade._options keeps the keywords as a value, and a precision=
    # policy given beside a keyword changed from these defaults is refused)
    import dataclasses
    import inspect

    from zerofn.facade._options import PrecisionKeywords

    signature = inspect.signature(zf.ZeroOptimizer.__init__).parameters
    for field in dataclasses.fields(PrecisionKeywords):
        assert signature[field.name].default == field.default, field.name
