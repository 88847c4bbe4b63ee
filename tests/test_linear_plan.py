"""Linear plans: which product computes each bf16 linear layer, chosen from timings; the choice by hand-built
timings, the cache, and the products a plan picks giving the stock layer's values."""

from __future__ import annotations

import time

import pytest
import torch

import runtime.target.decode_layers as decode_layers
import runtime.target.linear_plan as linear_plan_module
from runtime.target.decode_layers import PackedWeights, decode_linear
from runtime.target.kernels import lean_product, onednn_bf16_linear, pack_bf16_weight, pack_onednn_weight
from runtime.target.linear_plan import STOCK, LinearPlan, choose_plan, default_plan, linear_plan, measure_linear_seconds

SMALL, LARGE = (8, 4), (64, 4)


def test_a_plan_reads_runs_of_row_counts_per_shape():
    plan = LinearPlan("onednn", {SMALL: ((2, False), (16, True)), LARGE: ((4, True),)}, ((8, True),))
    assert [plan.packed(SMALL, rows) for rows in (1, 2, 3, 16, 17)] == [False, False, True, True, False]
    assert [plan.packed(LARGE, rows) for rows in (1, 4, 5)] == [True, True, False]
    assert plan.packed((3, 3), 8) and not plan.packed((3, 3), 9)  # a shape not timed follows the default
    assert plan.uses_packed(SMALL) and not LinearPlan("blocks", {SMALL: ((4, False),)}, ()).uses_packed(SMALL)
    assert LinearPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="form"):
        LinearPlan("tiles", {}, ())


def test_choose_plan_keeps_the_form_whose_best_products_sum_to_less():
    """Each shape and row count takes the faster of the form and the stock rules; the form with the smaller sum
    wins; a form not timed at a row count (too slow) leaves it to the stock rules."""
    seconds = {
        "blocks": {SMALL: {1: 1.0, 8: 5.0}, LARGE: {1: 10.0, 8: 50.0}},
        "onednn": {SMALL: {1: 3.0, 8: 3.0}, LARGE: {1: 20.0}},  # LARGE at 8 rows: given up
        STOCK: {SMALL: {1: 2.0, 8: 9.0}, LARGE: {1: 8.0, 8: 30.0}},
    }
    # blocks: 1 + 5 + 8 + 30 = 44; onednn: 2 + 3 + 8 + 30 = 43
    plan = choose_plan(seconds)
    assert plan.form == "onednn"
    assert plan.choices == {SMALL: ((1, False), (8, True)), LARGE: ((8, False),)}
    seconds["blocks"][LARGE][8] = 28.0  # now blocks: 1 + 5 + 8 + 28 = 42
    plan = choose_plan(seconds)
    assert plan.form == "blocks" and plan.choices == {SMALL: ((8, True),), LARGE: ((1, False), (8, True))}
    tie = {"blocks": {SMALL: {1: 1.0}}, "onednn": {SMALL: {1: 1.0}}, STOCK: {SMALL: {1: 2.0}}}
    assert choose_plan(tie).form == "blocks"
    with pytest.raises(ValueError, match="packed form"):
        choose_plan({STOCK: {SMALL: {1: 1.0}}})


def test_measuring_gives_up_on_a_slow_form_but_times_the_stock_rules_everywhere():
    weights = [torch.zeros(SMALL, dtype=torch.bfloat16), torch.zeros(LARGE, dtype=torch.bfloat16)]
    calls = {"blocks": 0, STOCK: 0}

    def slow(x, w):
        calls["blocks"] += 1
        time.sleep(0.002)
        return x

    def quick(x, w):
        calls[STOCK] += 1
        return x

    products = {"blocks": (lambda w: w, slow), STOCK: (lambda w: w, quick)}
    found = measure_linear_seconds(weights, products, rows=(1, 2, 4), repeats=2)
    assert set(found[STOCK][SMALL]) == set(found[STOCK][LARGE]) == {1, 2, 4}
    assert set(found["blocks"][SMALL]) == {1}  # more than twice as slow at 1 row: not timed further
    assert calls["blocks"] == 2 * 3 and calls[STOCK] == 2 * 3 * 3  # (warm-up + 2 repeats) per count, per weight


def test_a_plan_is_timed_once_per_machine_and_shapes_and_small_models_keep_the_fallback(monkeypatch, tmp_path):
    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path))
    weights = [torch.zeros(SMALL, dtype=torch.bfloat16)]
    products = {"blocks": (lambda w: w, lambda x, w: x), STOCK: (lambda w: w, lambda x, w: x)}
    fallback = default_plan(4)
    assert linear_plan(weights, products, fallback) is fallback  # far below MEASURE_MIN_BYTES
    monkeypatch.setattr(linear_plan_module, "MEASURE_MIN_BYTES", 0)
    timed = []
    measured = {"blocks": {SMALL: {1: 1.0, 2: 1.0}}, STOCK: {SMALL: {1: 2.0, 2: 0.5}}}
    monkeypatch.setattr(linear_plan_module, "measure_linear_seconds", lambda w, p, r: timed.append(1) or measured)
    plan = linear_plan(weights, products, fallback)
    assert plan == LinearPlan("blocks", {SMALL: ((1, True), (2, False))}, ((2, True),)) and timed == [1]
    assert linear_plan(weights, products, fallback) == plan and timed == [1]  # read back, not timed again
    (saved,) = (tmp_path / "linear_plans").glob("*.json")
    saved.write_text("{not json")
    assert linear_plan(weights, products, fallback) == plan and timed == [1, 1]  # a damaged file: timed again
    assert linear_plan(weights, {STOCK: products[STOCK]}, fallback) is fallback  # no packed form runs here


@pytest.mark.parametrize("form", ["blocks", "onednn", "amx", "avx2"])
def test_packed_weights_follow_their_plan_and_keep_the_values(monkeypatch, form):
    """Where the plan says so, the packed copy in the plan's form computes the rows; elsewhere the stock rules do;
    both give the bf16 product up to summation order."""
    if form == "onednn" and onednn_bf16_linear() is None:
        pytest.skip("oneDNN does not take bf16 on this CPU")
    if form == "blocks" and lean_product("blocks") is None:
        pytest.skip("the packed AVX512-BF16 kernel needs a CPU with AVX512-BF16")
    if form == "amx" and lean_product("amx") is None:
        pytest.skip("the AMX kernel needs a CPU with AMX tiles")
    if form == "avx2" and lean_product("avx2") is None:
        pytest.skip("the AVX2 packed kernel needs a CPU with AVX2 and FMA")
    weight, bias = torch.randn(48, 64).bfloat16(), torch.randn(48).bfloat16()
    store = PackedWeights(LinearPlan(form, {(48, 64): ((2, True),)}, ()))
    packed_rows = []
    real = store.linear

    def counted(x, w, b):
        out = real(x, w, b)
        if out is not None:
            packed_rows.append(x.shape[0])
        return out

    monkeypatch.setattr(store, "linear", counted)
    for rows in (1, 2, 3):
        hidden = torch.randn(rows, 64).bfloat16()
        with torch.inference_mode():
            got = decode_linear(hidden, weight, bias, store)
        exact = hidden.float() @ weight.float().T + bias.float()
        step = exact.abs().clamp_min(1e-3) * 2.0 ** -7
        assert ((got.float() - exact).abs() <= 2 * step).all()
    assert packed_rows == [1, 2]  # 3 rows: beyond the plan's run, the stock rules
    expected = pack_onednn_weight(weight) if form == "onednn" else pack_bf16_weight(weight)
    assert store.of(weight).shape == expected.shape and len(store) == 1


def test_fp32_weights_get_an_operand_order_plan_that_keeps_the_values(monkeypatch, tmp_path):
    """An fp32 model large enough to time gets a ``weight_major`` plan: no copies, weight @ rows^T where it says so,
    F.linear elsewhere, the same values either way; its decode layers give the stock model's logits."""
    from runtime.target.decode_layers import DecodeLayers, packed_weights_for
    from tests.conftest import tiny_model

    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path))
    model = tiny_model("llama", seed=0).float().eval()
    assert packed_weights_for(model) is None  # too small to time: the stock rules
    monkeypatch.setattr(linear_plan_module, "MEASURE_MIN_BYTES", 0)
    measured_rows = []

    def measured(weights, products, rows):
        assert set(products) == {"weight_major", STOCK} and all(w.dtype == torch.float32 for w in weights)
        measured_rows.append(rows)
        shapes = {tuple(w.shape) for w in weights}
        # weight-major wins at one row only, F.linear from two on
        return {"weight_major": {shape: {1: 1.0, 2: 3.0} for shape in shapes},
                STOCK: {shape: {1: 2.0, 2: 1.0} for shape in shapes}}

    monkeypatch.setattr(linear_plan_module, "measure_linear_seconds", measured)
    store = packed_weights_for(model)
    assert measured_rows == [linear_plan_module.FP32_PLAN_ROWS]
    assert store.plan.form == "weight_major" and store.dtype == torch.float32
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    with torch.inference_mode():
        expected = model(ids).logits
        layers = DecodeLayers(model)  # reads the plan back from the cache
        assert layers.packed.plan == store.plan
        with layers.active():
            got = torch.cat([model(ids[:, :1]).logits, model(ids).logits], dim=1)  # one row, then six
    torch.testing.assert_close(got, torch.cat([expected[:, :1], expected], dim=1))
    assert measured_rows == [linear_plan_module.FP32_PLAN_ROWS]  # timed once
    weight, bias = torch.randn(48, 64), torch.randn(48)
    store = PackedWeights(LinearPlan("weight_major", {(48, 64): ((1, True), (2, False))}, ()))
    routes = []
    monkeypatch.setattr(decode_layers, "weight_major_linear",
                        lambda x, w, b=None: routes.append(x.shape[0]) or torch.mm(w, x.t()).t().contiguous() + b)
    for rows in (1, 2, 3):
        hidden = torch.randn(rows, 64)
        with torch.inference_mode():
            got = decode_linear(hidden, weight, bias, store)
        torch.testing.assert_close(got, torch.nn.functional.linear(hidden, weight, bias))
    assert routes == [1] and store.of(weight) is weight  # 2 and 3 rows: F.linear; no copy of the weight


def test_the_greedy_heads_int8_rows_stop_at_the_first_count_it_does_not_win():
    bf16 = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.2}
    assert linear_plan_module.choose_greedy_rows({"bf16": bf16, "int8": {1: 0.5, 2: 0.6, 4: 0.95, 8: 0.5}}) == 2
    assert linear_plan_module.choose_greedy_rows({"bf16": bf16, "int8": {1: 0.5, 2: 0.6, 4: 0.8, 8: 1.0}}) == 8
    assert linear_plan_module.choose_greedy_rows({"bf16": bf16, "int8": {1: 1.5}}) == 0  # never, or not timed


def test_the_greedy_heads_rows_are_timed_once_and_small_heads_keep_the_fallback(monkeypatch, tmp_path):
    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path))
    weight = torch.randn(64, 32).bfloat16()
    timed = []
    seconds = {"bf16": {1: 1.0, 2: 1.0, 4: 1.0}, "int8": {1: 0.5, 2: 0.5, 4: 2.0}}
    monkeypatch.setattr(linear_plan_module, "measure_greedy_head_seconds",
                        lambda *args: timed.append(1) or seconds)
    assert linear_plan_module.greedy_head_rows(weight, None, None, None, fallback=3) == 3 and not timed  # too small
    monkeypatch.setattr(linear_plan_module, "MEASURE_MIN_BYTES", 0)
    assert linear_plan_module.greedy_head_rows(weight, None, None, None, fallback=3) == 2 and len(timed) == 1
    assert linear_plan_module.greedy_head_rows(weight, None, None, None, fallback=3) == 2 and len(timed) == 1
