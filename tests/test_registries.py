"""The extension registries (score sources, importance methods, KV methods, adapters) are complete: every entry has
its help and definition, every function reference resolves to a module of its own wing or below, the CLI can read
them without torch, and every architecture adapter has a tiny test model."""

from __future__ import annotations

import subprocess
import sys

import pytest
from models import MLA_SPECS, SPECS
from test_layers import WINGS, layer_of

from headlab.core.arch import ADAPTERS
from headlab.core.errors import HeadlabError
from headlab.core.registry import Lazy, Registry
from headlab.kv.methods import KV_METHODS
from headlab.measure.importance_methods import IMPORTANCE_METHODS
from headlab.pruning.score_sources import ORDER_HELP, SCORE_SOURCES, SWEEP_METHODS

REGISTRIES = {
    "headlab.measure.importance_methods": IMPORTANCE_METHODS,
    "headlab.pruning.score_sources": SCORE_SOURCES,
    "headlab.kv.methods": KV_METHODS,
}
RANK = {wing: position for position, line in enumerate(WINGS) for wing in line}  # 0 = top


def _references(entry) -> list[Lazy]:
    return [value for value in vars(entry).values() if isinstance(value, Lazy)]


@pytest.mark.parametrize("home", list(REGISTRIES))
def test_every_reference_resolves_downwards(home):
    for name, entry in REGISTRIES[home].items():
        assert entry.name == name
        for reference in _references(entry):
            assert callable(reference.resolve()), reference.target
            target = reference.target.partition(":")[0]
            assert RANK[layer_of(target)] >= RANK[layer_of(home)], f"{home} {name} -> {target} points upward"


def test_every_score_has_help_definition_and_budget():
    for source in SCORE_SOURCES.values():
        assert source.help.strip() and source.definition.strip(), source.name
    for method in IMPORTANCE_METHODS.values():
        assert method.default_max_tokens > 0 and "I_h" in method.definition, method.name
        # an importance method is a score source without a second edit, with its budget and meaning
        assert SCORE_SOURCES[method.name].default_max_tokens == method.default_max_tokens
        assert SCORE_SOURCES[method.name].recomputable
    assert set(SWEEP_METHODS) == set(IMPORTANCE_METHODS.names(backward=True))
    assert set(SCORE_SOURCES.names(choosable=True)) <= set(ORDER_HELP)


def test_every_kv_method_says_how_a_group_becomes_one_head():
    for method in KV_METHODS.values():
        assert method.help.strip()
        assert method.pools != (method.merge is not None), method.name  # pooled by `pool`, or merged: one of them


def test_unknown_names_are_one_line_errors_listing_the_registry():
    with pytest.raises(HeadlabError, match=r"unknown method='nope'; use one of mean, svd"):
        KV_METHODS["nope"]
    registry = Registry("order", [])
    with pytest.raises(HeadlabError, match="unknown order="):
        registry["x"]


def test_registries_import_without_torch():
    """The CLI lists choices and help from the registries at start-up; importing them must not pull in torch."""
    code = "import sys; " + "; ".join(f"import {home}" for home in REGISTRIES) + "; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_every_adapter_has_a_tiny_test_model():
    """A new adapter in headlab.core.arch fails here until tests/models.py builds a tiny model of it (SPECS, or
    MLA_SPECS for latent attention)."""
    missing = sorted(set(ADAPTERS) - set(SPECS) - {spec[0] for spec in MLA_SPECS.values()})
    assert not missing, f"add a tiny config to tests/models.py SPECS for: {missing}"
