"""zerofn.precision: the loss scaler state machine, the clip coefficient, the dtype policy.

All pure: no process group is started here.
"""

from __future__ import annotations

import dataclasses
import doctest
import math

import hypothesis.strategies as st
import pytest
import torch
from helpers import seeded
from hypothesis import given, settings

import zerofn.precision as zp
from zerofn import _loss_scale
from zerofn.precision import (
    DynamicLossScaler,
    LossScaler,
    LossScaleState,
    MixedDtypeError,
    NoLossScaling,
    PrecisionPolicy,
    StaticLossScaler,
    nonfinite_grad_names,
    resolve_param_dtypes,
    scale_loss,
    unscale_and_clip_coef,
    unscaled_norm,
)

# ---------------------------------------------------------------------------------------
# A plain reference of ColossalAI's scaler rules: counters counting up, as ColossalAI writes it.
# ---------------------------------------------------------------------------------------


class ReferenceScaler:
    """Straight transliteration of ColossalAI's dynamic scaler (growth_step, hysteresis_step)."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
        max_scale: float,
    ) -> None:
        self.scale = initial_scale
        self.min_scale, self.max_scale = min_scale, max_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_step = 0
        self.hysteresis_step = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.hysteresis_step += 1
            self.growth_step = 0
            if self.hysteresis_step >= self.hysteresis:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_step += 1
            if self.growth_step == self.growth_interval:
                self.growth_step = 0
                self.hysteresis_step = 0
                self.scale = min(self.scale * self.growth_factor, self.max_scale)

    def as_state(self) -> LossScaleState:
        # The countdown zerofn keeps is ColossalAI's count-up seen from the other end.
        left = max(self.hysteresis - self.hysteresis_step, 0)
        return LossScaleState(self.scale, self.growth_step, left)


@st.composite
def scaler_hparams(draw: st.DrawFn) -> dict:
    min_scale = draw(st.floats(2.0**-8, 2.0**8))
    initial_scale = min_scale * draw(st.floats(1.0, 2.0**12))
    finite_max = st.floats(1.0, 2.0**12).map(lambda k: initial_scale * k)
    max_scale = draw(st.one_of(st.just(math.inf), finite_max))
    return dict(
        initial_scale=initial_scale,
        min_scale=min_scale,
        growth_factor=draw(st.one_of(st.just(2.0), st.floats(1.0001, 8.0))),
        backoff_factor=draw(st.one_of(st.just(0.5), st.floats(0.01, 0.9999))),
        growth_interval=draw(st.integers(1, 6)),
        hysteresis=draw(st.integers(0, 4)),
        max_scale=max_scale,
    )


@settings(max_examples=300)
@given(hp=scaler_hparams(), overflows=st.lists(st.booleans(), max_size=80))
def test_dynamic_scaler_matches_the_reference_rules_on_random_overflow_sequences(
    hp: dict, overflows: list[bool]
) -> None:
    scaler = DynamicLossScaler(**hp)
    ref = ReferenceScaler(**hp)
    state = scaler.init()
    assert state == ref.as_state()
    for i, overflow in enumerate(overflows):
        before = state
        state = scaler.update(state, overflow)
        ref.update(overflow)
        assert state == ref.as_state(), f"step {i} ({overflow=}): {before} -> {state}"
        assert hp["min_scale"] <= state.scale <= hp["max_scale"]
        assert 0 <= state.growth_tracker < hp["growth_interval"]
        assert 0 <= state.hysteresis_left <= hp["hysteresis"]
        assert isinstance(state.scale, float)


@given(
    log2_min=st.integers(-4, 4),
    log2_span=st.integers(0, 12),
    log2_init=st.integers(0, 12),
    growth_interval=st.integers(1, 4),
    hysteresis=st.integers(0, 3),
    overflows=st.lists(st.booleans(), max_size=60),
)
def test_power_of_two_scales_equal_a_float32_tensor_implementation_bitwise(
    log2_min: int,
    log2_span: int,
    log2_init: int,
    growth_interval: int,
    hysteresis: int,
    overflows: list[bool],
) -> None:
    # ColossalAI keeps the scale in a float32 tensor; zerofn keeps a Python float. With the
    # default power-of-two factors both are exact, so they agree bit for bit.
    lo, hi = 2.0**log2_min, 2.0 ** (log2_min + log2_span)
    init = 2.0 ** (log2_min + min(log2_init, log2_span))
    scaler = DynamicLossScaler(
        initial_scale=init,
        min_scale=lo,
        max_scale=hi,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
    )
    t_scale, t_min, t_max = (torch.tensor([v], dtype=torch.float32) for v in (init, lo, hi))
    ref = ReferenceScaler(init, lo, 2.0, 0.5, growth_interval, hysteresis, hi)
    state = scaler.init()
    for overflow in overflows:
        backs_off = overflow and ref.hysteresis_step + 1 >= hysteresis
        grows = not overflow and ref.growth_step + 1 == growth_interval
        ref.update(overflow)
        if backs_off:
            t_scale = torch.max(t_scale * 0.5, t_min)
        if grows:
            t_scale = torch.min(t_scale * 2.0, t_max)
        state = scaler.update(state, overflow)
        assert state.scale == t_scale.item() == ref.scale


# ---------------------------------------------------------------------------------------
# Scaler edge cases
# ---------------------------------------------------------------------------------------


def run(scaler: DynamicLossScaler, overflows: str) -> list[LossScaleState]:
    """States after each step of a sequence written as 'x' (overflow) and '.' (good)."""
    states, state = [], scaler.init()
    for c in overflows:
        state = scaler.update(state, c == "x")
        states.append(state)
    return states


def test_defaults_are_the_seeds() -> None:
    s = DynamicLossScaler()
    assert (s.initial_scale, s.min_scale, s.growth_factor, s.backoff_factor) == (2**16, 1, 2, 0.5)
    assert (s.growth_interval, s.hysteresis, s.max_scale) == (1000, 2, 2**24)
    assert s.init() == LossScaleState(65536.0, 0, 2)


def test_backoff_is_clamped_at_min_scale() -> None:
    scaler = DynamicLossScaler(initial_scale=3.0, min_scale=2.0, hysteresis=0)
    assert [s.scale for s in run(scaler, "xxx")] == [2.0, 2.0, 2.0]


def test_growth_is_clamped_at_max_scale_and_still_resets_the_counters() -> None:
    top = 3.0 * 2**22
    scaler = DynamicLossScaler(initial_scale=2.0**23, max_scale=top, growth_interval=2)
    states = run(scaler, "x..x..")
    assert [s.scale for s in states] == [2.0**23, 2.0**23, top, top, top, top]
    assert states[2] == LossScaleState(top, 0, 2)  # growth refilled hysteresis
    assert states[5] == LossScaleState(top, 0, 2)


def test_hysteresis_absorbs_overflows_then_every_further_overflow_backs_off() -> None:
    scaler = DynamicLossScaler(initial_scale=64.0, growth_interval=3, hysteresis=3)
    states = run(scaler, "xx.x.x")
    assert [s.scale for s in states] == [64.0, 64.0, 64.0, 32.0, 32.0, 16.0]
    assert [s.hysteresis_left for s in states] == [2, 1, 1, 0, 0, 0]
    # A good step alone does not refill hysteresis; only a growth does.
    assert [s.growth_tracker for s in states] == [0, 0, 1, 0, 1, 0]


def test_growth_refills_hysteresis() -> None:
    scaler = DynamicLossScaler(initial_scale=64.0, growth_interval=2, hysteresis=2)
    states = run(scaler, "xx..x")
    assert [s.scale for s in states] == [64.0, 32.0, 32.0, 64.0, 64.0]
    assert states[3] == LossScaleState(64.0, 0, 2)
    assert states[4] == LossScaleState(64.0, 0, 1)  # absorbed again after the refill


def test_overflow_resets_the_growth_tracker_even_when_absorbed() -> None:
    scaler = DynamicLossScaler(initial_scale=8.0, growth_interval=3, hysteresis=5)
    states = run(scaler, "..x..")
    assert [s.growth_tracker for s in states] == [1, 2, 0, 1, 2]
    assert all(s.scale == 8.0 for s in states)


def test_growth_interval_one_grows_on_every_good_step() -> None:
    scaler = DynamicLossScaler(initial_scale=4.0, growth_interval=1, hysteresis=1)
    states = run(scaler, "...x.")
    assert [s.scale for s in states] == [8.0, 16.0, 32.0, 16.0, 32.0]
    assert all(s.growth_tracker == 0 for s in states)


def test_hysteresis_zero_and_one_behave_alike() -> None:
    seq = "x.x..xx...x"
    a = run(DynamicLossScaler(initial_scale=1024.0, growth_interval=2, hysteresis=0), seq)
    b = run(DynamicLossScaler(initial_scale=1024.0, growth_interval=2, hysteresis=1), seq)
    assert [s.scale for s in a] == [s.scale for s in b]
    assert a[0].scale == 512.0


def test_update_leaves_its_input_state_unchanged() -> None:
    scaler = DynamicLossScaler(initial_scale=16.0, growth_interval=1)
    state = scaler.init()
    copy = LossScaleState(*state)
    scaler.update(state, True)
    scaler.update(state, False)
    assert state == copy


def test_static_and_no_scaling_never_move_and_share_the_interface() -> None:
    for scaler, scale in ((StaticLossScaler(128.0), 128.0), (NoLossScaling(), 1.0)):
        assert isinstance(scaler, LossScaler)
        state = scaler.init()
        assert state == LossScaleState(scale, 0, 0)
        for overflow in (True, False, True):
            state = scaler.update(state, overflow)
        assert state == LossScaleState(scale, 0, 0)
    assert isinstance(DynamicLossScaler(), LossScaler)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(initial_scale=0.0), ValueError, "initial_scale must be a positive finite"),
        (dict(initial_scale=math.inf), ValueError, "initial_scale must be a positive finite"),
        (dict(initial_scale="big"), TypeError, "initial_scale must be a number"),
        (dict(min_scale=0.0), ValueError, "min_scale must be a positive finite"),
        (dict(max_scale=-1.0), ValueError, "max_scale must be positive"),
        (dict(initial_scale=0.5), ValueError, r"need min_scale <= initial_scale <= max_scale"),
        (dict(initial_scale=2.0**30), ValueError, r"need min_scale <= initial_scale <= max_scale"),
        (dict(growth_factor=1.0), ValueError, "growth_factor must be > 1"),
        (dict(backoff_factor=1.0), ValueError, r"backoff_factor must be in \(0, 1\)"),
        (dict(backoff_factor=0.0), ValueError, "backoff_factor must be a positive finite"),
        (dict(growth_interval=0), ValueError, "growth_interval must be >= 1"),
        (dict(growth_interval=2.5), TypeError, "growth_interval must be an int"),
        (dict(hysteresis=-1), ValueError, "hysteresis must be >= 0"),
        (dict(hysteresis=True), TypeError, "hysteresis must be an int"),
    ],
)
def test_dynamic_scaler_rejects_bad_hyperparameters(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        DynamicLossScaler(**kwargs)


def test_static_scaler_rejects_a_non_positive_scale() -> None:
    with pytest.raises(ValueError, match="StaticLossScaler: scale must be a positive finite"):
        StaticLossScaler(0.0)


def test_max_scale_inf_means_no_ceiling() -> None:
    scaler = DynamicLossScaler(initial_scale=2.0**24, max_scale=math.inf, growth_interval=1)
    assert run(scaler, "..")[-1].scale == 2.0**26


# ---------------------------------------------------------------------------------------
# scale_loss, unscale_and_clip_coef
# ---------------------------------------------------------------------------------------


def test_scale_loss_scales_the_gradients_and_leaves_the_loss_alone() -> None:
    w = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    x = torch.tensor([0.5, 0.25, -1.0])
    loss = (w * x).sum()
    version = loss._version
    scaled = scale_loss(loss, LossScaleState(1024.0, 0, 2))
    scaled.backward()
    assert loss._version == version
    assert scaled.item() == 1024.0 * loss.item()
    assert torch.equal(w.grad, 1024.0 * x)


def seed_formula(norm: float, scale: float, max_norm: float | None) -> float:
    """ColossalAI's unscale-and-clip, written as it is there (clip_grad_norm 0 means off)."""
    div_scale = scale
    clip_grad_norm = 0.0 if max_norm is None else max_norm
    if clip_grad_norm > 0.0:
        clip = ((norm / div_scale) + 1e-6) / clip_grad_norm
        if clip > 1:
            div_scale = clip * div_scale
    return 1.0 / div_scale


@given(
    norm=st.floats(0.0, 1e12),
    scale=st.one_of(st.integers(-10, 24).map(lambda k: 2.0**k), st.floats(1e-3, 1e6)),
    max_norm=st.one_of(st.none(), st.floats(1e-4, 1e4)),
)
def test_unscale_and_clip_coef_matches_the_seed_formula_and_the_direct_rule(
    norm: float, scale: float, max_norm: float | None
) -> None:
    coef = unscale_and_clip_coef(norm, scale, max_norm)
    assert coef == seed_formula(norm, scale, max_norm)
    true_norm = norm / scale
    if max_norm is None or true_norm + 1e-6 <= max_norm:
        expected = 1.0 / scale
    else:
        expected = max_norm / ((true_norm + 1e-6) * scale)
    assert coef == pytest.approx(expected, rel=1e-12)
    assert unscaled_norm(norm, scale) == true_norm


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("max_norm", [None, 0.5, 100.0])
def test_coef_applied_to_scaled_grads_gives_clipped_true_grads(
    norm_type: float,
    max_norm: float | None,
) -> None:
    g = torch.Generator().manual_seed(seeded(0))
    true_grads = [torch.randn(7, generator=g, dtype=torch.float64) for _ in range(3)]
    scale = 2.0**10
    scaled = [t * scale for t in true_grads]
    norm_scaled = torch.linalg.vector_norm(torch.cat(scaled), norm_type)
    coef = unscale_and_clip_coef(norm_scaled, scale, max_norm)  # a 0-d tensor is fine too
    out = torch.cat([t * coef for t in scaled])
    true_norm = torch.linalg.vector_norm(torch.cat(true_grads), norm_type).item()
    assert unscaled_norm(norm_scaled, scale) == pytest.approx(true_norm, rel=1e-15)
    # torch's own clip rule on the true grads gives the same result.
    clipped = [t.clone() for t in true_grads]
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(_as_params(clipped), max_norm, norm_type)
    torch.testing.assert_close(out, torch.cat(clipped), rtol=1e-12, atol=0.0)
    expected_norm = true_norm if max_norm is None else min(true_norm, max_norm)
    assert torch.linalg.vector_norm(out, norm_type).item() == pytest.approx(expected_norm, rel=1e-5)


def _as_params(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Params whose .grad are exactly ``grads`` (clip_grad_norm_ scales them in place)."""
    params = []
    for t in grads:
        p = torch.nn.Parameter(torch.zeros_like(t))
        p.grad = t
        params.append(p)
    return params


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((math.inf, 1.0, None), "grad_norm_scaled must be finite"),
        ((math.nan, 1.0, 1.0), "grad_norm_scaled must be finite"),
        ((-1.0, 1.0, None), "grad_norm_scaled must be finite and >= 0"),
        ((1.0, 0.0, None), "scale must be positive and finite"),
        ((1.0, 1.0, 0.0), "max_norm must be a positive finite number or None"),
        ((1.0, 1.0, -2.0), "max_norm must be a positive finite number or None"),
    ],
)
def test_unscale_and_clip_coef_rejects_bad_inputs(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        unscale_and_clip_coef(*args)


def test_nonfinite_grad_names_lists_inf_and_nan_grads_in_order() -> None:
    grads = {
        "a": torch.ones(3),
        "b": torch.tensor([1.0, math.inf]),
        "c": None,
        "d": torch.tensor([-math.inf], dtype=torch.bfloat16),
        "e": torch.tensor([[math.nan]], dtype=torch.float16),
    }
    assert nonfinite_grad_names(grads) == ["b", "d", "e"]
    assert nonfinite_grad_names({"a": torch.zeros(0)}) == []


# ---------------------------------------------------------------------------------------
# PrecisionPolicy
# ---------------------------------------------------------------------------------------


def test_for_dtype_builds_the_usual_policies() -> None:
    fp16 = PrecisionPolicy.for_dtype(torch.float16)
    assert fp16.param_dtype == torch.float16 and fp16.master_dtype == torch.float32
    assert fp16.loss_scaler == DynamicLossScaler()
    assert fp16.grad_accum_dtype_for(torch.float16) == torch.float32
    bf16 = PrecisionPolicy.for_dtype(torch.bfloat16)
    assert bf16.loss_scaler == NoLossScaling() and bf16.nonfinite == "skip"
    assert bf16.grad_accum_dtype_for(torch.bfloat16) == torch.float32
    fp32 = PrecisionPolicy.for_dtype(torch.float32)
    assert fp32.grad_accum_dtype_for(torch.float32) == torch.float32
    fp64 = PrecisionPolicy.for_dtype(torch.float64)
    assert fp64.master_dtype == torch.float64
    custom = PrecisionPolicy.for_dtype(
        torch.float16, loss_scaler=DynamicLossScaler(initial_scale=2.0**12), state_device="cpu"
    )
    assert custom.loss_scaler.init().scale == 4096.0 and custom.cpu_offload


def test_policy_dtype_helpers() -> None:
    p = PrecisionPolicy()
    assert p.grad_accum_dtype_for(torch.bfloat16) == torch.float32  # "auto"
    assert p.grad_accum_dtype_for(torch.float64) == torch.float64
    in_working = PrecisionPolicy(grad_accum_dtype=None)
    assert in_working.grad_accum_dtype_for(torch.float16) == torch.float16
    explicit = PrecisionPolicy(grad_accum_dtype=torch.float64)
    assert explicit.grad_accum_dtype_for(torch.bfloat16) == torch.float64
    assert p.comm_dtype_for(torch.bfloat16) == torch.bfloat16
    assert PrecisionPolicy(comm_dtype=torch.float32).comm_dtype_for(torch.bfloat16) == torch.float32
    assert p.master_dtype_for(torch.float16) == torch.float32
    low = PrecisionPolicy(param_dtype=torch.float16, master_weights=False)
    assert low.master_dtype_for(torch.float16) == torch.float16
    assert not p.cpu_offload and p.state_device is None


def test_policy_is_a_hashable_frozen_value_and_normalises_the_device() -> None:
    p = PrecisionPolicy.for_dtype(torch.bfloat16, state_device=torch.device("cpu"))
    assert p.state_device == "cpu" and p.cpu_offload
    assert hash(p) == hash(PrecisionPolicy.for_dtype(torch.bfloat16, state_device="cpu"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.master_weights = False  # type: ignore[misc]
    with pytest.raises(ValueError, match="narrower than param_dtype"):
        p.replace(master_dtype=torch.float16, param_dtype=torch.float32)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            dict(param_dtype=torch.int32),
            ValueError,
            r"param_dtype=torch.int32 is not a floating-point",
        ),
        (dict(param_dtype="float16"), TypeError, "param_dtype must be a torch.dtype"),
        (dict(master_dtype=None), TypeError, "master_dtype must be a torch.dtype"),
        (dict(comm_dtype=torch.int8), ValueError, "comm_dtype=torch.int8 is not a floating-point"),
        (dict(grad_accum_dtype="fp32"), TypeError, "grad_accum_dtype must be a torch.dtype"),
        (
            dict(param_dtype=torch.float32, master_dtype=torch.bfloat16),
            ValueError,
            r"master_dtype=torch.bfloat16 is narrower than param_dtype=torch.float32",
        ),
        (
            dict(master_weights=False, master_dtype=torch.float64),
            ValueError,
            "has no effect with master_weights=False",
        ),
        (dict(master_weights=1), TypeError, "master_weights must be a bool"),
        (dict(state_device="gpu0"), ValueError, r"state_device='gpu0' is not a device"),
        (dict(nonfinite="ignore"), ValueError, "nonfinite must be 'skip' or 'raise'"),
        (dict(mixed_dtypes="cast"), ValueError, "mixed_dtypes must be 'error' or 'keep'"),
        (dict(loss_scaler=2.0**16), TypeError, "loss_scaler must be a DynamicLossScaler"),
        (
            dict(loss_scaler=DynamicLossScaler(), nonfinite="raise"),
            ValueError,
            "a DynamicLossScaler needs nonfinite='skip'",
        ),
    ],
)
def test_policy_validation_errors(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        PrecisionPolicy(**kwargs)


def test_policy_accepts_raise_with_static_or_no_scaling() -> None:
    static = PrecisionPolicy(loss_scaler=StaticLossScaler(8.0), nonfinite="raise")
    assert static.nonfinite == "raise"
    assert PrecisionPolicy.for_dtype(torch.bfloat16, nonfinite="raise").nonfinite == "raise"


def test_for_dtype_rejects_a_non_float_dtype() -> None:
    with pytest.raises(ValueError, match=r"dtype=torch.int64 is not a floating-point dtype"):
        PrecisionPolicy.for_dtype(torch.int64)


# ---------------------------------------------------------------------------------------
# resolve_param_dtypes
# ---------------------------------------------------------------------------------------


def mixed_params() -> dict[str, torch.Tensor]:
    params = {f"block{i}.weight": torch.zeros(2, dtype=torch.bfloat16) for i in range(6)}
    params["ln.weight"] = torch.ones(2)
    params["ln.bias"] = torch.zeros(2)
    return params


def test_mixed_dtypes_raise_naming_the_params() -> None:
    with pytest.raises(MixedDtypeError) as err:
        resolve_param_dtypes(mixed_params(), PrecisionPolicy())
    msg = str(err.value)
    assert "params have mixed dtypes" in msg
    shown = "'block0.weight', 'block1.weight', 'block2.weight', 'block3.weight' and 2 more"
    assert f"torch.bfloat16: {shown}" in msg
    assert "torch.float32: 'ln.weight', 'ln.bias'" in msg
    assert "PrecisionPolicy(param_dtype=<dtype>)" in msg and "mixed_dtypes='keep'" in msg
    assert isinstance(err.value, TypeError)


def test_param_dtype_settles_mixed_dtypes_and_casts_nothing() -> None:
    params = mixed_params()
    dtypes = resolve_param_dtypes(params, PrecisionPolicy(param_dtype=torch.bfloat16))
    assert list(dtypes) == list(params)
    assert set(dtypes.values()) == {torch.bfloat16}
    assert params["ln.weight"].dtype == torch.float32  # only read
    with pytest.raises(TypeError):
        dtypes["ln.weight"] = torch.float32  # type: ignore[index]


def test_mixed_dtypes_keep_gives_each_param_its_own_dtype() -> None:
    dtypes = resolve_param_dtypes(mixed_params(), PrecisionPolicy(mixed_dtypes="keep"))
    assert dtypes["block3.weight"] == torch.bfloat16 and dtypes["ln.bias"] == torch.float32


def test_uniform_params_resolve_without_a_policy_choice() -> None:
    params = {"a": torch.zeros(3, dtype=torch.float16), "b": torch.zeros((), dtype=torch.float16)}
    assert dict(resolve_param_dtypes(params, PrecisionPolicy())) == {
        "a": torch.float16,
        "b": torch.float16,
    }


def test_non_float_param_is_rejected_by_name() -> None:
    params = {"w": torch.zeros(2), "steps": torch.zeros(1, dtype=torch.int64)}
    with pytest.raises(TypeError, match=r"param 'steps' is torch.int64, not a floating-point"):
        resolve_param_dtypes(params, PrecisionPolicy(param_dtype=torch.float16))


# ---------------------------------------------------------------------------------------
# Docstring examples
# ---------------------------------------------------------------------------------------


def test_module_docstring_examples_run() -> None:
    # The loss scalers zerofn.precision exports are defined (with their examples) in zerofn._loss_scale.
    results = [doctest.testmod(module, verbose=False) for module in (zp, _loss_scale)]
    assert sum(r.attempted for r in results) >= 15
    assert all(r.failed == 0 for r in results)


# ---------------------------------------------------------------------------------------
# The precision state inside ZeroState
# ---------------------------------------------------------------------------------------


def test_zero_state_holds_the_loss_scale_as_leaves_and_the_policy_as_static_metadata() -> None:
    import torch.utils._pytree as pytree

    import zerofn as zf
    from zerofn._tree import FrozenDict
    from zerofn.state import DEFAULT_POLICY

    layout = zf.make_layout({"w": torch.zeros(3, dtype=torch.float16)}, 1)
    opt = zf.optim.sgd(lr=0.1)
    master = FrozenDict({"w": torch.zeros(3)})
    policy = PrecisionPolicy.for_dtype(torch.float16)
    state = zf.ZeroState(
        layout, opt, 0, master, opt.init(master), 4, loss_scale=policy.loss_scaler.init(), precision=policy
    )
    leaves, spec = pytree.tree_flatten(state)
    assert leaves[-4:] == [4, 65536.0, 0, 2]  # step, then scale, growth tracker, hysteresis left
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert rebuilt.precision is policy and rebuilt.loss_scale == state.loss_scale and rebuilt.layout == layout
    halved = pytree.tree_map(lambda x: x / 2 if isinstance(x, float) else x, state)
    assert halved.loss_scale.scale == 32768.0 and halved.precision is policy
    # A state built positionally, without precision, gets the defaults.
    old = zf.ZeroState(layout, opt, 0, master, opt.init(master))
    assert old.loss_scale == LossScaleState(1.0, 0, 0) and old.precision is DEFAULT_POLICY
    assert old.param_device is None and old.work_device == old.state_device == torch.device("cpu")
