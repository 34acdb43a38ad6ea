"""launch/bench/sizes.py's pure pieces (issue 42): the model sizes and their parameter counts, the rows'
bytes ratio against ddp_adamw at the same size and steps, and the columns of results/sizes.csv."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch" / "bench"))

import sizes  # noqa: E402
from integrations.model import SIZES, GPTConfig, parameter_count  # noqa: E402


def test_sizes_are_about_4x_and_16x_the_small_gpt():
    counts = {size: parameter_count(GPTConfig(vocab_size=4096, **shape)) for size, shape in SIZES.items()}
    # token and position embeddings (the head tied), per block 12·d² of weights and two norms, a final norm
    assert counts["S"] == 4096 * 128 + 64 * 128 + 4 * (12 * 128 ** 2 + 2 * 128) + 128 == 1_320_064
    assert 3 < counts["M"] / counts["S"] < 5 and 14 < counts["L"] / counts["S"] < 18


def _row(size, method, replicate_bytes, loss="5.0", steps=200):
    return {"size": size, "params": 1, "method": method, "steps": str(steps), "final_val_loss": loss,
            "replicate_bytes_total": str(replicate_bytes)}


def test_rows_are_against_ddp_adamw_of_the_same_size_and_steps():
    rows = [_row("M", "local_x", 100), _row("S", "ddp_adamw", 8000), _row("S", "ddp_adamw", 1, loss="9.0"),
            _row("S", "local_x", 100), _row("M", "ddp_adamw", 40000), _row("L", "local_x", 7)]
    out = sizes.arrange(rows)
    assert [(r["size"], r["method"]) for r in out][:2] == [("S", "ddp_adamw"), ("S", "ddp_adamw")]
    assert all(list(r) == sizes.FIELDS for r in out)
    by = {(r["size"], r["method"], r["final_val_loss"]): r for r in out}
    assert by[("S", "local_x", "5.0")]["x_fewer_bytes"] == "80.0"      # the lowest-loss ddp_adamw of S
    assert by[("M", "local_x", "5.0")]["x_fewer_bytes"] == "400.0"
    assert by[("L", "local_x", "5.0")]["x_fewer_bytes"] == ""          # no ddp_adamw row at L


def test_a_curve_against_h_has_one_point_per_h_the_lowest_loss_there():
    rows = [{"H": "40", "final_val_loss": "5.08"}, {"H": "30", "final_val_loss": "5.03"},
            {"H": "40", "final_val_loss": "5.01"}, {"H": "30", "final_val_loss": "4.97"}]
    assert sizes.lowest_at_each_h(rows) == [(30, 4.97), (40, 5.01)]


def test_a_panel_tops_out_above_ddp_adamw_so_a_diverged_run_does_not_squash_the_others():
    rows = [{"method": "ddp_adamw", "final_val_loss": "4.7"}, {"method": "ddp_adamw", "final_val_loss": "4.6"},
            {"method": "diloco_m0.6_H100", "final_val_loss": "13.2"}]
    assert sizes.ceiling(rows) == 4.7 + 1.5 and sizes.ceiling(rows[2:]) == float("inf")


def test_a_label_keeps_its_colour_in_every_panel_whichever_labels_the_others_lack():
    palette = sizes.label_palette([["ddp_adamw", "topk", "MuLoCo"], ["ddp_adamw", "MuLoCo", "DiLoCo"]])
    assert palette == {"ddp_adamw": 0, "topk": 1, "MuLoCo": 2, "DiLoCo": 3}
