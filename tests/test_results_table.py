"""launch/results_table.py: the README's and docs/results.md's tables are computed from the CSVs' rows, and
the committed ones are what the committed CSVs give."""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
import markdown_tables  # noqa: E402
import results_table  # noqa: E402
from integrations.results import write_csv  # noqa: E402


def _row(method, rate, target_s, step_ms="100.0", counted="1000", wire=""):
    return {"method": method, "rate_mbit": rate, "procs_per_node": "1", "lr": "0.001", "steps": "200",
            "step_ms": step_ms, "replicate_bytes_per_step": counted, "wire_bytes_per_step": wire,
            "time_to_target_s": target_s, "final_val_loss": "5.0"}


def test_localsteps_summary_shows_the_peers_the_bests_and_the_most_compressed_at_ddp_adamws_loss():
    def row(method, loss, fewer):
        return {"method": method, "lr": "0.01", "steps": "200", "final_val_loss": loss, "x_fewer_bytes": fewer,
                "time_to_target_10mbit_s": "12.5", "time_to_target_1mbit_s": "not reached"}
    rows = [row("ddp_adamw", "4.6", "1.0"), row("diloco_m0.9_H30", "4.7", "40.0"), row("local_a_H10", "4.5", "400.0"),
            row("local_b_H100", "4.58", "4000.0"), row("local_c_H100", "4.9", "9000.0")]
    lines = markdown_tables.localsteps_summary(rows).splitlines()[2:]
    assert [line.split(" | ")[1] for line in lines] == ["ddp_adamw", "diloco_m0.9_H30", "local_a_H10", "local_b_H100"]
    assert lines[-1].endswith("| 4,000× | 12 s | not reached |")
    other_mesh = {**row("local_d_H100_M4", "4.1", "9000.0"), "replicas": "4"}      # not the benchmark's 2 × 2
    assert markdown_tables.localsteps_summary(rows + [other_mesh]) == markdown_tables.localsteps_summary(rows)


def test_sizes_gap_table_gives_each_size_its_references_methods_best_local_row_and_gaps_with_the_spread():
    def row(size, method, H, loss, fewer, lr="0.02", exchange="sign_mean, block 128"):
        return {"size": size, "params": "1000000", "method": method, "H": H, "lr": lr, "steps": "400",
                "tokens": "2000000", "final_val_loss": loss, "x_fewer_bytes": fewer, "exchange": exchange}
    rows = [row("S", "ddp_adamw", "0", "4.50", "1.0", "0.003"), row("S", "ddp_adamw", "0", "4.40", "1.0", "0.0015"),
            row("S", "ddp_muon", "0", "4.30", "1.0"), row("S", "local_a_H10", "10", "4.45", "400.0"),
            row("S", "local_b_H30", "30", "4.60", "1200.0"), row("S", "local_b_H30", "30", "4.70", "1200.0", "0.01"),
            {**row("S", "local_c_H30", "30", "4.55", "1300.0"), "final_model": "rank 0's, 20 local steps"},   # no final sync
            row("S", "diloco_m0.6_H100", "100", "9.0", "100.0", exchange="mean"),
            row("S", "diloco_m0.6_H30", "30", "4.90", "29.0", exchange="mean"),
            row("S", "muloco_H30_olr0.7_m0", "30", "4.48", "227.0", exchange="int4"),
            row("S", "local_muon_H30_topk_as_int4", "30", "4.70", "227.0", exchange="topk, density 0.143"),
            row("M", "ddp_adamw", "0", "4.0", "1.0")]
    lines = markdown_tables.sizes_gap_table(rows).splitlines()[2:]
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines]
    assert [c[2] for c in cells] == ["ddp_adamw", "ddp_muon", "DiLoCo", "MuLoCo", "topk", "best local steps",
                                     "best at ≥ 1,000×", "ddp_adamw"]
    assert cells[0][3:5] == ["ddp_adamw (lr 0.0015)", "4.400 (2: 4.400–4.500)"] and cells[0][1] == "400 (2.00)"
    assert [c[3].split()[0] for c in cells[2:5]] == ["diloco_m0.6_H30", "muloco_H30_olr0.7_m0",
                                                      "local_muon_H30_topk_as_int4"]
    assert cells[2][4] == "4.900 (1: 4.900–4.900)" and cells[3][6:] == ["+0.080", "+0.180"]
    assert cells[5][3] == "local_a_H10 (lr 0.02)" and cells[5][6:] == ["+0.050", "+0.150"]
    assert cells[6][4:] == ["4.600 (2: 4.600–4.700)", "1,200×", "+0.200", "+0.300"]
    assert cells[7][0] == "M (1.00 M)" and cells[7][7] == "–"          # M has no ddp_muon row


def test_sizes_topk_table_pairs_each_topk_row_with_the_dense_rows_of_equal_counted_bytes_and_same_settings():
    def row(exchange, loss, sent, H="30", lr="0.02", steps="200"):
        return {"size": "S", "steps": steps, "H": H, "inner": "muon", "outer_lr": "0.7", "outer_momentum": "0",
                "lr": lr, "seed": "0", "exchange": exchange, "final_val_loss": loss, "replicate_bytes_total": sent}
    rows = [row("topk, density 0.089", "5.06", "1010"), row("sign_mean, block 128", "4.91", "1000"),
            row("int4", "4.84", "1600"),                                   # other bytes
            row("sign_vote, block 128", "4.80", "1000", lr="0.01"),        # other lr
            row("sign_mean, block 128", "4.70", "1000", H="40"),           # other H
            row("sign_mean, block 128", "4.60", "1000", steps="400")]      # other steps
    lines = markdown_tables.sizes_topk_table(rows).splitlines()[2:]
    assert lines == ["| S | 200 | 30 | density 0.089: 5.060 | sign_mean, block 128: 4.910 | 1.010 | +0.150 |"]


def test_a_csv_of_several_sizes_is_shown_row_for_row_not_as_one_lr_grid():
    rows = [{"size": size, "method": "ddp_adamw", "lr": lr, "seed": "0", "steps": "200", "final_val_loss": loss}
            for size, lr, loss in (("S", "0.003", "4.7"), ("M", "0.00075", "4.6"))]
    lines = markdown_tables.table(rows).splitlines()
    assert lines[0].startswith("| size | method | lr |") and len(lines) == 4
    assert markdown_tables.table([{k: v for k, v in r.items() if k != "size"} for r in rows]).startswith(
        "| method | final_val_loss at each lr")      # (one model: the grid)


def test_sizes_horizon_table_lines_up_each_family_by_h_at_one_lr_beside_the_references():
    def row(method, H, loss, lr="0.02", exchange="sign_mean, block 128", final_model="synced", seed="0"):
        return {"size": "S", "method": method, "H": H, "lr": lr, "steps": "400", "final_val_loss": loss, "seed": seed,
                "inner": "muon", "exchange": exchange, "outer_lr": "0.7", "outer_momentum": "0", "final_model": final_model,
                "x_fewer_bytes": "1.0" if H == "0" else str(12.8 * int(H))}
    rows = [row("ddp_adamw", "0", "4.46", "0.003"), row("local_x_H30_e_m0", "30", "4.62"),
            row("local_x_H5_e_m0", "5", "4.41"), row("local_defaults", "10", "4.46"),      # the same settings: one family
            row("local_x_H10_e_m0", "10", "4.50", "0.01"), row("muloco_H30", "30", "4.9", exchange="int4"),
            row("local_x_H40_e_m0", "40", "4.70"), row("local_x_H40_e_m0", "40", "4.65", seed="1"),
            row("local_y_H30", "30", "4.60", final_model="rank 0's, 10 local steps"),
            row("local_y_H10", "10", "4.50", final_model="rank 0's, 10 local steps")]
    lines = markdown_tables.sizes_horizon_table(rows).splitlines()[2:]
    assert lines == ["| S | 400 | muon, sign_mean, block 128, outer 0.7 / 0 (0.02) | H 5: 4.410 (64×), H 10: 4.460 (128×), "
                     "H 30: 4.620 (384×), H 40: 4.650 (512×, best of 2) | 4.460 | – |",
                     "| S | 400 | muon, sign_mean, block 128, outer 0.7 / 0, rank 0's model (0.02) | H 10: 4.500 (128×; "
                     "rank 0's model), H 30: 4.600 (384×; rank 0's model) | 4.460 | – |"]
    # one H at lr 0.01 and one int4 row: no curve


def test_sizes_summary_gives_each_size_its_bests_and_the_best_synced_row_at_1000x_with_its_gap():
    def row(size, method, H, loss, fewer, final_model="synced", steps="200"):
        return {"size": size, "params": "2000000", "method": method, "H": H, "lr": "0.02", "steps": steps,
                "tokens": "1000000", "final_val_loss": loss, "x_fewer_bytes": fewer, "final_model": final_model,
                "exchange": "sign_vote, block 128"}
    rows = [row("S", "ddp_adamw", "0", "4.70", "1.0"), row("S", "ddp_adamw", "0", "4.69", "1.0"),
            row("S", "ddp_muon", "0", "4.55", "1.0"), row("S", "local_defaults", "30", "4.98", "731.4"),
            row("S", "local_a_H40", "40", "5.08", "1024.0"), row("S", "local_b_H30", "30", "4.90", "1058.3", "rank 0's"),
            row("S", "local_c_H10", "10", "4.79", "256.0"), row("S", "local_d_H40", "40", "4.00", "1024.0", steps="1000"),
            row("L", "ddp_adamw", "0", "5.20", "1.0")]
    lines = markdown_tables.sizes_summary(rows).splitlines()[2:]
    assert lines == ["| S (2.0 M, 0.50) | 4.690 | 4.550 | – | 4.980 (731×) | local_a_H40: 5.080 (1,024×) | +0.390 |",
                     "| L (2.0 M, 0.50) | 5.200 | – | – | – | – | – |"]


def test_slowlink_table_divides_by_ddp_adamw_at_the_same_rate_and_shows_wire_over_counted():
    rows = [_row("ddp_adamw", "inf", "20.0"), _row("fast", "inf", "10.0", step_ms="150.0"),
            _row("ddp_adamw", "10", "900.0", wire="1010"), _row("fast", "10", "12.0", wire="1100"),
            _row("never", "10", "inf", wire="1000"), _row("slow", "10", "1800.0", wire="1000")]
    lines = markdown_tables.slowlink_table(rows).splitlines()
    assert "no limit" in lines[0] and "10 Mbit/s" in lines[0]
    fast = next(line for line in lines if "| fast |" in line)
    assert "10.0 s (1/2.0); 150 ms/step" in fast and "12.0 s (1/75.0)" in fast
    assert fast.endswith("| 1.10 |")
    never = next(line for line in lines if "| never |" in line)
    assert "| – | never; 100 ms/step | 1.00 |" in never    # no unlimited row: no no-limit cell
    assert "1800.0 s (2.0×)" in next(line for line in lines if "| slow |" in line)     # slower: k times the time


def test_grid_table_orders_lrs_lists_seeds_and_marks_the_best_of_the_first_seed():
    rows = [{"method": "m", "lr": lr, "seed": seed, "final_val_loss": loss}
            for lr, seed, loss in [("0.01", "0", "4.9"), ("0.001", "0", "4.5"), ("0.001", "1", "4.4"), ("0.1", "0", "5.0")]]
    line = markdown_tables.grid_table(rows).splitlines()[2]
    assert line == "| m | **0.001: 4.5 / 4.4** · 0.01: 4.9 · 0.1: 5.0 |"
    accuracy = [{"method": "c", "lr": lr, "seed": "0", "test_accuracy": a} for lr, a in [("1", "0.8"), ("2", "0.9")]]
    assert markdown_tables.grid_table(accuracy).splitlines()[2] == "| c | 1: 0.8 · **2: 0.9** |"    # accuracy: the highest


def test_grid_table_and_slowlink_table_show_the_scalar_lr_with_the_lr():
    rows = [{"method": "m", "lr": "0.001", "scalar_lr": scalar, "seed": "0", "final_val_loss": loss}
            for scalar, loss in [("0.03", "4.4"), ("0.003", "4.6")]]
    table = markdown_tables.grid_table(rows).splitlines()
    assert "lr (scalar lr)" in table[0] and table[2] == "| m | 0.001 (0.003): 4.6 · **0.001 (0.03): 4.4** |"
    slow = markdown_tables.slowlink_table([{**_row("ddp_adamw", "inf", "20.0"), "scalar_lr": "0.03"}]).splitlines()
    assert "| 1 | ddp_adamw | 0.001 (0.03) |" in slow[2]


def test_slowlink_summary_has_one_column_per_limited_rate_and_process_count_and_leaves_out_overlap_variants():
    rows = [_row("ddp_adamw", "inf", "20.0"), _row("ddp_adamw", "10", "900.0"), _row("fast", "10", "12.0"),
            {**_row("ddp_adamw", "10", "1200.0"), "procs_per_node": "2"}, _row("never", "10", "inf"),
            _row("fast_overlap", "10", "11.0")]
    lines = markdown_tables.slowlink_summary(rows).splitlines()
    assert lines[0] == "| time to ddp_adamw's val loss | 10 Mbit/s, 1 per node | 10 Mbit/s, 2 per node |"
    assert lines[2:] == ["| ddp_adamw | 900.0 s | 1200.0 s |", "| fast | 12.0 s (1/75.0) | – |",
                         "| never | never | – |"]


def test_results_document_refuses_a_csv_it_has_no_command_for(tmp_path):
    path = tmp_path / "new_benchmark.csv"
    write_csv(path, ["method", "value"], [{"method": "m", "value": "1"}])
    with pytest.raises(SystemExit, match="new_benchmark.csv"):
        results_table.results_document([path])


def test_the_committed_readme_and_results_md_are_what_the_committed_csvs_give(tmp_path):
    root = results_table.ROOT
    readme, results = tmp_path / "README.md", tmp_path / "docs" / "results.md"
    shutil.copy(root / "README.md", readme)
    results_table.regenerate(readme, results)
    stale = "is stale: run python launch/results_table.py --readme README.md and commit what it writes"
    assert readme.read_text() == (root / "README.md").read_text(), f"README.md {stale}"
    assert results.read_text() == (root / "docs" / "results.md").read_text(), f"docs/results.md {stale}"


def test_the_committed_docs_tables_are_what_the_committed_csvs_give():
    """docs/trainers.md's byte tables (and any other document of DOCS_WITH_TABLES) redrawn from results/*.csv."""
    for document in results_table.DOCS_WITH_TABLES:
        text = (results_table.ROOT / document).read_text()
        assert "-->\n|" in text, f"{document} has no table drawn between its markers"
        assert results_table.readme_with_tables(text) == text, \
            f"{document} is stale: run python launch/results_table.py --readme README.md and commit what it writes"
