"""The pure KV-head conversion plan (headlab.kv.grouping.plan_conversion) on hand-made layouts, and headlab.kv.gqa.apply
doing what the plan says. Layers here are bare layouts (no modules, no weights): planning never touches a model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from models import tiny_model

from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.kv import gqa
from headlab.kv.grouping import ConversionPlan, plan_conversion


def layout(num_layers: int, H: int, G: int, D: int = 16) -> list[SimpleNamespace]:
    return [SimpleNamespace(index=i, num_heads=H, num_kv_heads=G, head_dim=D) for i in range(num_layers)]


def similarity_of(*pairs_per_layer) -> dict:
    """A [L, G, G] similarity of 4 KV heads: 1 between the heads of each given pair, 0 elsewhere."""
    sim = torch.zeros(len(pairs_per_layer), 4, 4)
    for layer, pairs in enumerate(pairs_per_layer):
        for i, j in pairs:
            sim[layer, i, j] = sim[layer, j, i] = 1.0
    return {"similarity": sim}


def test_contiguous_pooling_plan_by_hand():
    plan = plan_conversion(layout(2, 8, 4), 2)
    assert (plan.action, plan.pool, plan.grouping, plan.method) == ("pool", "mean", "contiguous", "mean")
    # transformers' layout: query head h reads KV head h // (H/G); new KV head g pools old heads 2g and 2g+1
    assert plan.groups == [[[0, 1], [2, 3]], [[0, 1], [2, 3]]] and plan.methods == ["contiguous"] * 2
    assert plan.order(0) == [0, 1, 2, 3] and not plan.permutes(0) and not plan.permutes(1)
    rows = plan.table().query("layer == 0").itertuples(index=False)
    assert [(r.kv_head, r.new_kv_head) for r in rows] == [(0, 0), (1, 0), (2, 1), (3, 1)]


def test_similarity_plan_pools_the_similar_heads_and_permutes_them_together():
    sim = similarity_of([(0, 3), (1, 2)], [(0, 1), (2, 3)])
    plan = plan_conversion(layout(2, 8, 4), 2, grouping="similarity", similarity=sim)
    assert plan.groups == [[[0, 3], [1, 2]], [[0, 1], [2, 3]]] and plan.methods == ["exact", "exact"]
    assert plan.order(0) == [0, 3, 1, 2] and plan.permutes(0)  # heads 0, 3 side by side, then 1, 2
    assert plan.order(1) == [0, 1, 2, 3] and not plan.permutes(1)
    new_of = {(r.layer, r.kv_head): r.new_kv_head for r in plan.table().itertuples(index=False)}
    assert [new_of[0, kv] for kv in range(4)] == [0, 1, 1, 0]
    assert [new_of[1, kv] for kv in range(4)] == [0, 0, 1, 1]


def test_given_groups_are_canonical_and_checked():
    plan = plan_conversion(layout(1, 4, 4), 2, grouping="similarity", groups=[[[3, 0], [2, 1]]])
    assert plan.groups == [[[0, 3], [1, 2]]] and plan.methods == ["given"]
    for bad in ([[[0, 1, 2], [3]]], [[[0, 1], [1, 2]]], [[[0, 1], [2, 4]]]):
        with pytest.raises(HeadlabError, match="not 2 equal parts of 4 heads"):
            plan_conversion(layout(1, 4, 4), 2, groups=bad)


def test_expand_keep_and_svd_plans():
    expand = plan_conversion(layout(1, 8, 2), 4)
    assert (expand.action, expand.pool, expand.grouping, expand.method) == ("expand", None, None, None)
    # original KV head g becomes new heads 2g and 2g+1 (repeat_kv's copies, in place)
    assert expand.groups == [[[0, 1], [2, 3]]] and not expand.permutes(0)
    rows = expand.table().itertuples(index=False)
    assert [(r.kv_head, r.new_kv_head) for r in rows] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    keep = plan_conversion(layout(2, 8, 2), 2)
    assert keep.action == "keep" and keep.groups == [[[0], [1]]] * 2 and keep.methods == ["keep"] * 2
    svd = plan_conversion(layout(1, 4, 4), 1, method="svd", pool="first")
    assert (svd.pool, svd.method, svd.groups) == (None, "svd", [[[0, 1, 2, 3]]])  # the merge, not a pool rule


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(kv_heads=3), HeadlabError, "does not divide"),
        (dict(kv_heads=2, method="pca"), HeadlabError, "unknown method="),
        (dict(kv_heads=2, pool="max"), HeadlabError, "unknown pool="),
        (dict(kv_heads=2, grouping="random"), HeadlabError, "unknown grouping="),
        (dict(kv_heads=2, grouping="similarity"), ValueError, "needs kv_similarity"),
    ],
)
def test_bad_plans_fail_before_any_work(kwargs, error, message):
    with pytest.raises(error, match=message):
        plan_conversion(layout(2, 8, 4), **kwargs)


def test_mixed_layouts_cannot_be_planned():
    layers = layout(1, 8, 4) + [SimpleNamespace(index=1, num_heads=8, num_kv_heads=2, head_dim=16)]
    with pytest.raises(HeadlabError, match="same \\(H, G, D\\)"):
        plan_conversion(layers, 2)


def test_apply_does_what_the_plan_says_and_convert_is_plan_then_apply():
    model = tiny_model("llama_mha")  # H = G = 4
    loaded = from_model(model)
    sim = similarity_of([(0, 3), (1, 2)], [(0, 2), (1, 3)])
    plan = plan_conversion(loaded.layers, 2, grouping="similarity", similarity=sim)
    before = [loaded.adapter.read(layer) for layer in loaded.layers]
    conversion = gqa.apply(loaded, plan)
    assert conversion.groups == plan.groups and conversion.permuted_layers == 2
    assert model.config.num_key_value_heads == 2
    for layer, weights in zip(loaded.layers, before):
        after = loaded.adapter.read(layer)
        for g, group in enumerate(plan.groups[layer.index]):  # new KV head g = mean of the planned group
            expected = weights.k.reshape(4, -1, weights.k.shape[-1])[group].double().mean(0).float()
            torch.testing.assert_close(after.k.reshape(2, -1, weights.k.shape[-1])[g], expected, rtol=0, atol=1e-6)
    again = from_model(tiny_model("llama_mha"))
    gqa.convert(again, 2, grouping="similarity", similarity=sim)
    for a, b in zip(model.state_dict().values(), again.model.state_dict().values()):
        assert torch.equal(a, b)


def test_apply_refuses_a_plan_for_another_layout():
    plan = plan_conversion(layout(2, 8, 4), 2)
    assert isinstance(plan, ConversionPlan)
    with pytest.raises(ValueError, match="the plan is for 2 layers"):
        gqa.apply(from_model(tiny_model("llama_mha")), plan)
