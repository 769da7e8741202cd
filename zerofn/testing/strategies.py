"""Hypothesis strategies for ZeRO property tests: param dicts and world sizes.

They deliberately reach the corners sharding code gets wrong: 0-d tensors, empty
tensors, numel smaller than the world size, odd sizes that need padding, and several
floating dtypes in one dict.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

__all__ = ["DTYPES", "param_dicts", "shapes", "world_sizes"]

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def world_sizes(max_size: int = 4) -> st.SearchStrategy[int]:
    """World sizes 1..max_size (3 catches power-of-two assumptions)."""
    return st.integers(min_value=1, max_value=max_size)


def shapes(max_dims: int = 3, max_side: int = 9) -> st.SearchStrategy[tuple[int, ...]]:
    """Tensor shapes: 0-d, empty (a zero side), tiny, odd."""
    return st.lists(st.integers(min_value=0, max_value=max_side), min_size=0, max_size=max_dims).map(tuple)


@st.composite
def param_dicts(
    draw: st.DrawFn,
    *,
    min_params: int = 1,
    max_params: int = 6,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    shape_strategy: st.SearchStrategy[tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """``name -> tensor`` dicts with random names, shapes, dtypes and finite values.

    Values are drawn from a seeded generator (reproducible from the hypothesis seed) and
    are exactly representable in every dtype drawn (small integers divided by 8), so
    round trips through any dtype are comparable bitwise.
    """
    n = draw(st.integers(min_value=min_params, max_value=max_params))
    names = draw(
        st.lists(
            st.from_regex(r"[a-z][a-z0-9_]{0,6}(\.[a-z0-9_]{1,6}){0,2}", fullmatch=True),
            min_size=n,
            max_size=n,
            unique=True,
        )
    )
    seed = draw(st.integers(min_value=0, max_value=2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in names:
        shape = draw(shape_strategy or shapes())
        dtype = draw(st.sampled_from(dtypes))
        out[name] = (torch.randint(-64, 64, shape, generator=gen).to(torch.float64) / 8).to(dtype)
    return out
