"""The memory model's coefficients are what benchmarks/memory_coefficients.py fits from the committed traces."""

from __future__ import annotations

import copy
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


def test_the_committed_traces_are_the_ones_the_trace_command_plans(traces):
    """``python -m benchmarks.memory_coefficients trace`` would trace exactly what the file holds, each once: a trace
    committed by hand at a length no setting names, or one a check reads that the command would not re-create, fails
    here; and the docstring counts them."""
    kept = [(t["setting"], t["shape"], t["layers"], t["tokens"]) for t in traces["traces"]]
    planned = mc.planned_traces()
    assert len(kept) == len(set(kept)) and sorted(kept) == sorted(planned)
    assert f"{len(planned)} traces;" in mc.__doc__


def test_every_fitted_row_is_what_the_memory_model_uses():
    """Every row the script fits is in the module (none skipped for want of traces), and the model reads it."""
    assert set(memory_fit.LAYERS) == set(mc.FITTED_ROWS)
    for key, row in memory_fit.LAYERS.items():
        *unrecomputed, norms = key
        layer = (memory.RECOMPUTED_NORMS_LAYER_BYTES if norms else memory.LAYER_BYTES)[tuple(unrecomputed)]
        assert (layer.forward, layer.head_loss, layer.backward) == tuple(
            memory.Widths(*row[phase]) for phase in ("forward", "loss", "backward")
        )
    assert memory.OFFLOAD_ROWS_ON_DEVICE == memory_fit.OFFLOAD_ROWS_ON_DEVICE
    for key, saved in memory_fit.SAVED.items():
        assert memory.LAYER_BYTES[(*key, False)].saved == memory.Widths(*saved)
    assert memory.LOGITS_LOSS_BYTES == memory_fit.LOGITS_LOSS and set(memory_fit.LOGITS_LOSS) == set(
        mc.LOGITS_ROWS
    )
    assert memory.CHUNK_BYTES == memory_fit.CHUNK_BYTES and set(memory_fit.CHUNK_BYTES) == {"head", "logits"}


def test_every_row_of_the_memory_model_is_fitted():
    """Every row the memory model has is fitted from the traces (none legacy), and the untiled ones with what each
    layer keeps without gradient checkpointing."""
    assert set(memory.LAYER_BYTES) == {key[:3] for key in memory_fit.LAYERS if not key[3]}
    assert set(memory_fit.SAVED) == {key[:2] for key in memory.LAYER_BYTES}


def test_the_features_page_quotes_the_memory_models_current_predictions():
    """docs/benchmarks.md's memory features section quotes the memory model's predictions and their errors from
    results.json, where they were computed when the section was measured or last refreshed: a refit of
    memory_fit.py must refresh them too. Recomputed here from the committed measurements (no new process)."""
    from benchmarks import features

    results = json.loads((mc.REPO / "docs" / "benchmarks" / "results.json").read_text())
    committed = results["sections"][features.NAME]["result"]
    assert features.refresh(copy.deepcopy(committed)) == committed, (
        "python -c 'from benchmarks.features import refresh_results; refresh_results()' && "
        "python -m devtools.docgen"
    )


def test_what_head_dim_128_holds_beyond_head_dim_64_is_the_rotary_tables(traces):
    """Every fitted row traced at head_dim 64 with the base shape's hidden and KV widths (8 query heads, 2 KV
    heads): per token, the forward and the loss hold 2 tables x 64 x the compute dtype's bytes less, exactly,
    what ROTARY_TABLES states; the layer backward the same less 4 bytes per more query head (the attention's
    fp32 log-sum-exp, one per head and token: in the hidden term at head_dim 128, as heads = hidden / 128).
    Exact: the traces count bytes, and both slopes are taken between the same lengths."""
    narrow = mc.TRACED_SHAPES["head_dim"]
    assert (narrow["hidden_size"], narrow["num_key_value_heads"] * narrow["head_dim"]) == (
        mc.BASE["hidden_size"],
        mc.BASE["num_key_value_heads"] * mc.HEAD_DIM,
    )
    more_heads = narrow["num_attention_heads"] - mc.BASE["num_attention_heads"]
    for setting in mc.FITTED_ROWS.values():
        tables = mc.rotary_bytes(setting) * (mc.HEAD_DIM - narrow["head_dim"])
        assert mc.rotary_differences(traces["traces"], setting) == {
            "forward": tables,
            "loss": tables,
            "backward": tables - 4 * more_heads,
        }, setting


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
    """Four shapes, four widths (and the rotary tables, stated): the fitted widths give back each shape's
    per-token bytes (to the coefficients' rounding to 0.01 byte per unit of width: at most 0.01 x the sum of
    the widths)."""
    fitted = mc.fit(traces["traces"], traces["attention_backward"])
    for key, setting in (
        (k, v) for k, v in mc.FITTED_ROWS.items() if "/".join(map(str, k)) in fitted["layers"]
    ):
        row = fitted["layers"]["/".join(map(str, key))]
        kept = fitted["offload_rows_on_device"] if mc.SETTINGS[setting].offload else 2
        for shape_name, shape in mc.SHAPES.items():
            terms = mc.layer_terms(traces["traces"], setting, shape_name, 2, kept)
            widths = mc.widths_of(shape)
            for phase in mc.PHASES:
                predicted = sum(w * c for w, c in zip(widths, row[phase], strict=True))
                assert predicted == pytest.approx(terms[phase], abs=0.01 * sum(widths))


def test_the_saved_and_logits_fits_reproduce_each_traced_shape(traces):
    """As above for what a layer keeps without gradient checkpointing (four shapes, four widths; no rotary
    tables) and the loss from logits (three shapes: vocabulary, hidden, token; the rotary tables stated), to
    the coefficients' rounding to 0.01 byte."""
    fitted = mc.fit(traces["traces"], traces["attention_backward"])
    for key in (key for key in mc.SAVED_ROWS if "/".join(key) in fitted["saved"]):
        row = fitted["saved"]["/".join(key)]
        for shape_name, shape in mc.SHAPES.items():
            widths = mc.widths_of(shape)
            predicted = sum(w * c for w, c in zip(widths, row, strict=True))
            assert predicted == pytest.approx(
                mc.saved_terms(traces["traces"], key, shape_name), abs=0.01 * sum(widths)
            )
    for mode, setting in mc.LOGITS_ROWS.items():
        row = fitted["logits_loss"][mode]
        for shape in mc.LOSS_SHAPES:
            widths = mc.logits_widths(shape)
            predicted = sum(w * c for w, c in zip(widths, row, strict=True))
            assert predicted == pytest.approx(
                mc.logits_terms(traces["traces"], setting, shape), abs=0.01 * sum(widths)
            )


def test_the_whole_logits_loss_holds_no_chunk(traces):
    """The whole loss's peak grows with the tokens from (nearly) zero: nothing of a fixed size is in flight,
    unlike the chunked one's chunk. Bound: 1/64 byte per logit of a chunk (16 KiB at 2**20 logits), far below
    the chunked loss's measured bytes per logit (its fit, several bytes)."""
    chunk = mc.CHUNK_TOKENS * mc.VOCAB
    for shape in ("base", "hidden"):
        whole = next(
            t
            for t in traces["traces"]
            if (t["setting"], t["shape"], t["layers"], t["tokens"])
            == (mc.LOGITS_ROWS["whole"], shape, 2, mc.LENGTHS[0])
        )
        constant = (
            whole["loss"]
            - mc.slopes(traces["traces"], mc.LOGITS_ROWS["whole"], shape, 2)["loss"] * whole["tokens"]
        )
        assert abs(constant) < chunk / 64
    per_logit, _ = mc.fit(traces["traces"], traces["attention_backward"])["chunk_bytes"]["logits"]
    assert per_logit > 1


def test_the_tiled_full_fine_tune_is_fitted_where_its_peak_is_one_moment(traces):
    """The full fine-tune with the tiled MLP: at 2,048 tokens the base shape's layer backward peaks where the
    MLP's weight gradients are summed (more than the MLP shape's, whose peak is the attention backward's);
    at the fitted lengths the two shapes' peaks are the same bytes (the MLP's size does not set them), and
    every shape's peak is a line through (nearly) zero, with none of the weight gradients' fixed size.

    Bound on the line's constant: 0.1 MB, against the smallest MLP's weight gradients in bf16
    (3 x 512 x 1,024 x 2 bytes = 3.1 MB) that a peak at the summing would hold."""
    moments = mc.tiled_moments(traces["traces"])
    assert moments["base"][0] > moments["mlp"][0]
    assert moments["base"][1:] == moments["mlp"][1:]
    assert mc.SETTINGS["full-everything"].lengths == mc.LONG_LENGTHS
    for shape in mc.SHAPES:
        short = next(
            t
            for t in traces["traces"]
            if (t["setting"], t["shape"], t["layers"], t["tokens"])
            == ("full-everything", shape, 2, mc.LONG_LENGTHS[0])
        )
        slope = mc.slopes(traces["traces"], "full-everything", shape, 2)["backward"]
        assert abs(short["backward"] - slope * short["tokens"]) < 0.1e6, shape


def test_fp32_lora_with_the_tiled_mlp_is_one_moment_in_every_shape_at_its_lengths(traces):
    """At its two lengths each shape's phases peak at the same moment (where the trace says each
    peaked), and the base and MLP shapes' layer backward grows by the same bytes per token (a tile holds a
    fixed number of tokens, so the MLP's width adds only bytes that do not grow with them). Exact: the traces
    count bytes. Between 4,096 and 8,192 tokens the base shape grew by 27.1 KB per token and the MLP shape by
    29.0: two moments (mc.FITTED_ROWS)."""
    setting = "fp32-lora-everything"
    for shape, phases in mc.peak_moments(traces["traces"], setting).items():
        for phase, (short, long) in phases.items():
            assert short is not None and short == long, (shape, phase, short, long)
    base, mlp = (mc.slopes(traces["traces"], setting, shape, 2)["backward"] for shape in ("base", "mlp"))
    assert base == mlp
    moments = mc.tiled_moments(traces["traces"], setting, (4096, 8192))
    assert moments["base"][0] > moments["mlp"][0] and moments["base"][1] == moments["mlp"][1]


def test_fp32_full_with_the_tiled_mlp_is_one_moment_in_every_shape_from_32768_tokens(traces):
    """Its row is fitted between 32,768 and 65,536 tokens: there every shape names the same moment for each phase
    at both lengths, the layer backward's at the `torch.cat` of the tiled MLP's forward (recomputed by gradient
    checkpointing in the layer backward), the base and MLP shapes at the same bytes. Not shorter: at 16,384 the MLP
    shape already peaks there but the others in a tile's backward (two moments), and at 4,096 and 8,192 the base
    shape's loss phase peaks at two moments."""
    setting = "fp32-full-everything"
    assert mc.SETTINGS[setting].lengths == (32768, 65536) and setting in mc.FITTED_ROWS.values()
    cat = "_TiledMlpFunctionBackward > aten::cat"
    for shape, phases in mc.peak_moments(traces["traces"], setting).items():
        for phase, (short, long) in phases.items():
            assert short is not None and short == long, (shape, phase, short, long)
        assert phases["backward"][0] == cat, shape
    same = mc.tiled_moments(traces["traces"], setting, mc.FP32_FULL_TILED_LENGTHS)
    assert same["base"] == same["mlp"]
    at_16k = {
        shape: phases["backward"][0]
        for shape, phases in mc.peak_moments(traces["traces"], setting, (16384,)).items()
    }
    assert at_16k["mlp"] == cat and {at_16k[shape] for shape in ("base", "kv", "hidden")} == {
        "_TiledMlpFunctionBackward > MulBackward0 > aten::mul"
    }
    loss = mc.peak_moments(traces["traces"], setting, mc.LONG_LENGTHS)["base"]["loss"]
    assert loss[0] != loss[1]


def test_the_fp32_full_tiled_row_bounds_its_traces_at_every_length_from_4096(traces):
    """The memory model with the row fitted at 32,768 and 65,536 tokens, for each traced shape at 2 layers, against
    the step's traced peak at every length traced (2,048 to 65,536): at or above it from 4,096 on, where below the
    fitted lengths the tile's fixed bytes the model adds cover the other moment (a tile's backward); 6% over at
    most. At 2,048 a tile's fixed bytes are the larger share and the model is under by less than 1%."""
    setting = "fp32-full-everything"
    setup = memory.ActivationSetup(
        mixed_precision=False,
        lora=False,
        offload=True,
        tiled_mlp=True,
        head_loss=True,
        loss_chunk_elements=mc.CHUNK_TOKENS * mc.VOCAB,
        flash_attention=False,  # a CPU trace
    )
    checked = 0
    for t in traces["traces"]:
        if (t["setting"], t["layers"]) != (setting, 2):
            continue
        shape = mc.TRACED_SHAPES[t["shape"]]
        model = memory.ModelShape(
            layers=2,
            hidden=shape["hidden_size"],
            intermediate=shape["intermediate_size"],
            heads=shape["num_attention_heads"],
            kv_heads=shape["num_key_value_heads"],
            head_dim=shape.get("head_dim", mc.HEAD_DIM),
            vocab=mc.VOCAB,
        )
        ratio = memory.activation_memory(model, setup, t["tokens"]).peak / max(t[p] for p in mc.PHASES)
        low = 1.0 if t["tokens"] >= 4096 else 0.99
        assert low <= ratio <= 1.06, (t["shape"], t["tokens"], ratio)
        checked += 1
    assert checked == len(mc.SHAPES) * 6 + 2  # four shapes at 2,048 to 65,536; head_dim 64 at the fitted two


def test_a_peak_is_named_by_the_autograd_nodes_around_it_and_the_op_that_allocated():
    from benchmarks.memory_traces import moment_at

    node = "autograd::engine::evaluate_function: "
    ops = [
        (0, 100, f"{node}_TiledMlpFunctionBackward"),
        (10, 60, f"{node}MulBackward0"),
        (15, 50, "aten::mul"),
        (20, 30, "aten::empty"),
        (70, 80, "aten::add"),
    ]
    assert moment_at(ops, 25) == "_TiledMlpFunctionBackward > MulBackward0 > aten::empty"
    assert moment_at(ops, 75) == "_TiledMlpFunctionBackward > aten::add"
    assert moment_at(ops, 200) == "-"
