"""handbook_lib.models.published_pipeline: published pipelined runs beside the planner's pricing."""

import pytest

from handbook_lib.models.presets import get_shape
from handbook_lib.models.published_pipeline import PUBLISHED_PIPELINES, pipeline_rows, tokens_per_s


def test_llama3_s_flops_become_tokens_per_gpu_by_its_own_count():
    """430 TFLOP/s over 6 x 405,853,388,800 + 12 x 126 x 16,384 x 8,192 FLOPs a token."""
    shape = get_shape("llama3-405b")
    per_token = 6 * 405_853_388_800 + 12 * 126 * 16_384 * 8_192
    assert shape.num_params == 405_853_388_800 and shape.attention_width == 16_384
    assert tokens_per_s(430e12, shape.num_params, 126, 16_384, 8192) == pytest.approx(430e12 / per_token)
    assert PUBLISHED_PIPELINES[0].tokens_per_s_per_gpu == pytest.approx(163.0, abs=0.1)


def test_each_run_is_priced_by_the_planner_s_own_row_for_its_layout():
    rows = pipeline_rows()
    assert [r.predicted.name for r in rows] == ["TP 8 x PP 16 (m 32) x FSDP 64", "TP 8 x PP 16 (m 16) x FSDP 128",
                                                "TP 8 x PP 8 (m 32) x FSDP 8 + AC"]
    for row in rows:
        published, predicted = row.published, row.predicted
        assert (predicted.pp_size, predicted.tp_size, predicted.microbatches) == (
            published.pp, published.tp, published.microbatches)
        assert predicted.dp_size * published.tp * published.pp == published.gpus
        assert predicted.tokens_per_step == predicted.dp_size * published.microbatches * published.seq_len
        assert row.tokens_error == pytest.approx(predicted.tokens_per_s_per_gpu / published.tokens_per_s_per_gpu - 1)
    memory = [r.memory_error for r in rows]
    assert memory[:2] == [None, None] and memory[2] is not None


def test_1f1b_pricing_is_below_the_published_runs_by_at_most_half():
    """The model prices 1F1B: Llama 3's interleaved schedule idles less than 1F1B's 15/31 of a step
    at 16 micro-batches, so the model stays below it; every error within -50 % and +10 %."""
    rows = pipeline_rows()
    assert all(-0.5 < r.tokens_error < 0.1 for r in rows)
    bubble = rows[1].predicted.bubble_s / rows[1].predicted.step_s
    assert bubble > 0.4  # (16 - 1)/(16 + 16 - 1) of the stage time, TP's included
