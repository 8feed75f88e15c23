"""The streamed reload that verifies a saved checkpoint prints nothing of its own: accelerate's "Some parameters are
on the meta device" notice (the offload is headlab's intent there) is dropped while the reload runs, and only then."""

from __future__ import annotations

import logging

import pytest
from conftest import tiny_model

from headlab.core import reload_stream
from headlab.core.checkpoint import save_checkpoint
from headlab.core.loading import from_model


@pytest.fixture
def always_stream(monkeypatch):
    monkeypatch.setattr(reload_stream, "STREAM_ABOVE_BYTES", 0)


def _physically_pruned():
    from headlab.pruning.prune import apply_physical, physical_layout, prepare_config

    loaded = from_model(tiny_model("llama"))
    layout = physical_layout(loaded.layers, [{0, 1}, {3}])
    apply_physical(loaded, layout)
    prepare_config(loaded, layout)
    return loaded.model


@pytest.mark.parametrize("build", [lambda: tiny_model("llama"), _physically_pruned], ids=["vanilla", "per-layer"])
def test_streamed_verification_prints_and_logs_nothing(build, tmp_path, always_stream, capfd, caplog):
    model = build()
    capfd.readouterr()  # building the model is not under test
    with caplog.at_level(logging.DEBUG):
        check = save_checkpoint(model, None, tmp_path / "c")
    assert "streamed from disk" in check.loader and check.max_abs_diff <= 1e-6
    assert not [r for r in caplog.records if r.getMessage().startswith(reload_stream.OFFLOAD_NOTICE)]
    printed = capfd.readouterr()
    assert reload_stream.OFFLOAD_NOTICE not in printed.out + printed.err
    assert printed.err == ""


def test_only_the_offload_notice_is_dropped_and_only_inside_the_block(caplog):
    logger = logging.getLogger(reload_stream.OFFLOAD_LOGGER)
    notice = reload_stream.OFFLOAD_NOTICE + " because they were offloaded to the cpu and disk."
    with caplog.at_level(logging.WARNING, logger=reload_stream.OFFLOAD_LOGGER):
        with reload_stream.offload_notice_dropped():
            logger.warning(notice)
            logger.warning("another accelerate warning")
        logger.warning(notice)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["another accelerate warning", notice]
    assert reload_stream._not_offload_notice not in logger.filters
