"""The memory model's coefficients are what benchmarks/memory_coefficients.py fits from the committed traces."""

from __future__ import annotations

import json

import pytest

from benchmarks import memory_coefficients as mc
from cptune.parallel import memory, memory_fit


@pytest.fixture(scope="module")
def traces() -> dict:
    return json.loads(mc.TRACES.read_text())


def test_the_checked_in_coefficients_are_the_fit_of_the_committed_traces(traces):
    """A hand edit of memory_fit.py, or traces committed without refitting, fails here."""
    expected = mc.render_module(mc.fit(traces["traces"], traces["attention_backward"]), traces["about"])
    assert mc.FITTED.read_text() == expected, "python -m benchmarks.memory_coefficients fit"


def test_every_fitted_row_is_what_the_memory_model_uses():
    assert set(memory_fit.LAYERS) == set(mc.FITTED_ROWS)
    for key, row in memory_fit.LAYERS.items():
        *unrecomputed, norms = key
        layer = (memory.RECOMPUTED_NORMS_LAYER_BYTES if norms else memory.LAYER_BYTES)[tuple(unrecomputed)]
        assert (layer.forward, layer.head_loss, layer.backward) == tuple(
            memory.Widths(*row[phase]) for phase in ("forward", "loss", "backward")
        )
    assert memory.OFFLOAD_ROWS_ON_DEVICE == memory_fit.OFFLOAD_ROWS_ON_DEVICE


def test_offloading_leaves_two_checkpoint_rows_on_the_device(traces):
    """Measured at 2 and 4 layers: the layer backward's slope drops by all but two rows of the checkpoints.

    The traces count bytes exactly; a share of a row that is not whole would be another tensor, so the
    bound is 1/16 of a row (64 of the 1,024 bytes per token of one bf16 row at hidden 512).
    """
    for layers in (2, 4):
        assert mc.offload_rows(traces["traces"], layers) == pytest.approx(2, abs=1 / 16)
    assert memory.OFFLOAD_ROWS_ON_DEVICE == 2
    # Without offloading, each more layer keeps one more row: its input, in bf16.
    per_layer = mc.fit(traces["traces"], traces["attention_backward"])["checkpoint_row_bytes_per_token"][
        "lora-tiled"
    ]
    assert per_layer == pytest.approx(mc.BASE["hidden_size"] * 2, abs=64)


def test_the_fit_reproduces_each_traced_shape(traces):
    """Four shapes, four widths: the fitted widths give back each shape's per-token bytes (to the
    coefficients' rounding to 0.01 byte per unit of width: at most 0.01 x the sum of the widths)."""
    fitted = mc.fit(traces["traces"], traces["attention_backward"])
    for key, setting in mc.FITTED_ROWS.items():
        row = fitted["layers"]["/".join(map(str, key))]
        kept = fitted["offload_rows_on_device"] if mc.SETTINGS[setting].offload else 2
        for shape_name, shape in mc.SHAPES.items():
            terms = mc.layer_terms(traces["traces"], setting, shape_name, 2, kept)
            widths = mc.widths_of(shape)
            for phase in mc.PHASES:
                predicted = sum(w * c for w, c in zip(widths, row[phase], strict=True))
                assert predicted == pytest.approx(terms[phase], abs=0.01 * sum(widths))
