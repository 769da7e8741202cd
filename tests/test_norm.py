"""The local term of the global gradient norm (zerofn/_norm.py) against torch's float64 norms.

No collectives: these are the per-rank pieces ``step_shards`` and ``global_grad_norm``
all-reduce. The streamed sum of squares accumulates in float64 like
``torch.linalg.vector_norm(g, dtype=torch.float64)`` but in another order, so the two
agree to float64 rounding of the sum: relative 1e-12 (the measured difference on 4.2M
float32 elements is 8e-14); the inf-norm is exact.
"""

from __future__ import annotations

import math

import torch
from helpers import seeded
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofn._norm import CHUNK_NUMEL, _fused_sum_of_squares, local_norm_term

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

# Sizes around the chunk edges, so pieces end exactly on, just before and just after one.
sizes = st.sampled_from([0, 1, 7, CHUNK_NUMEL - 1, CHUNK_NUMEL, CHUNK_NUMEL + 1, 3 * CHUNK_NUMEL + 5, 1000])


def _pieces(shapes: list[int], dtypes: list[torch.dtype], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seeded(seed))
    return [torch.randn(n, generator=gen, dtype=torch.float32).to(d) * 3 for n, d in zip(shapes, dtypes, strict=True)]


def _reference_sum_of_squares(pieces: list[torch.Tensor]) -> float:
    return sum(float(torch.linalg.vector_norm(p, 2, dtype=torch.float64)) ** 2 for p in pieces)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(sizes, st.sampled_from(DTYPES)), min_size=0, max_size=6),
    st.integers(0, 2**16),
)
def test_sum_of_squares_matches_float64_vector_norm(specs, seed):
    pieces = _pieces([n for n, _ in specs], [d for _, d in specs], seed)
    got = local_norm_term(pieces, 2.0, CPU)
    assert got.dtype == torch.float64 and got.shape == ()
    want = _reference_sum_of_squares(pieces)
    assert math.isclose(float(got), want, rel_tol=1e-12, abs_tol=0.0), (float(got), want)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(sizes, st.sampled_from(DTYPES)), min_size=1, max_size=5),
    st.integers(0, 2**16),
)
def test_inf_norm_is_exact(specs, seed):
    pieces = _pieces([n for n, _ in specs], [d for _, d in specs], seed)
    want = max((float(p.abs().max()) for p in pieces if p.numel()), default=0.0)
    assert float(local_norm_term(pieces, math.inf, CPU)) == want


def test_non_finite_elements_give_a_non_finite_term():
    for bad in (math.inf, -math.inf, math.nan):
        for dtype in DTYPES:
            g = torch.ones(CHUNK_NUMEL + 3, dtype=dtype)
            g[CHUNK_NUMEL + 1] = bad
            for norm_type in (2.0, math.inf):
                term = local_norm_term([torch.ones(5), g], norm_type, CPU)
                assert not math.isfinite(float(term)), (bad, dtype, norm_type)


def test_no_elements_is_zero():
    assert float(local_norm_term([], 2.0, CPU)) == 0.0
    assert float(local_norm_term([torch.empty(0)], math.inf, CPU)) == 0.0


def test_the_inputs_are_not_changed():
    pieces = _pieces([CHUNK_NUMEL + 9, 3], [torch.float32, torch.bfloat16], 0)
    before = [p.clone() for p in pieces]
    local_norm_term(pieces, 2.0, CPU)
    assert all(torch.equal(a, b) for a, b in zip(pieces, before, strict=True))


@settings(max_examples=20, deadline=None)
@given(
    st.lists(st.tuples(sizes, st.sampled_from(DTYPES)), min_size=1, max_size=5),
    st.integers(0, 2**16),
)
def test_the_fused_path_cuda_takes_agrees_on_the_cpu(specs, seed):
    # CUDA uses _foreach_norm(dtype=float64); the same call runs (unfused) on the CPU here.
    pieces = [p for p in _pieces([n for n, _ in specs], [d for _, d in specs], seed) if p.numel()]
    if pieces:
        got = float(_fused_sum_of_squares(pieces))
        assert math.isclose(got, _reference_sum_of_squares(pieces), rel_tol=1e-12, abs_tol=0.0)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 3000), min_size=1, max_size=40),
    st.lists(st.integers(0, 39), max_size=6),
    st.integers(0, 2**16),
)
def test_adjacent_views_of_one_row_count_each_element_once(widths, dropped, seed):
    # The reducer's stage-2 shards: consecutive views of one reduced row. Some are left out
    # (a param without gradient), one repeated: only exactly adjacent pieces merge.
    row = torch.randn(sum(widths), generator=torch.Generator().manual_seed(seeded(seed)))
    shards = list(row.split(widths))
    kept = [s for i, s in enumerate(shards) if i not in set(dropped)] or shards[:1]
    pieces = [*kept, kept[0]]  # the first again, at the end: counted twice, as given
    got = float(local_norm_term(pieces, 2.0, CPU))
    assert math.isclose(got, _reference_sum_of_squares(pieces), rel_tol=1e-12, abs_tol=0.0)
    assert float(local_norm_term(pieces, math.inf, CPU)) == float(torch.cat(pieces).abs().max())
