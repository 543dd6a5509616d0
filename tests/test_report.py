"""The report: table numbers, summary rows, and the files it writes."""

from __future__ import annotations

import struct

import pytest
import yaml

from doremi.reports.report import FINAL_LOSS_PNG, VAL_LOSS_PNG, WEIGHTS_PNG, format_table, write_report

DOMAINS = ["noise", "easy", "web"]
MIXTURES = {"uniform": [1 / 3, 1 / 3, 1 / 3], "doremi": [0.1, 0.2, 0.7]}
LOSSES = {"uniform": [4.5, 0.25, 3.0], "doremi": [4.25, 0.5, 2.5]}
ENTROPY = [4.0, 0.0, None]


def _cells(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]


def test_table_rows_and_summaries():
    rows = _cells(format_table(DOMAINS, MIXTURES, LOSSES, ENTROPY))
    assert rows[0] == [
        "domain",
        "H",
        "weight: uniform",
        "weight: doremi",
        "loss: uniform",
        "loss: doremi",
        "loss - H: uniform",
        "loss - H: doremi",
    ]
    assert rows[2] == ["noise", "4.0000", "0.3333", "0.1000", "4.5000", "4.2500", "0.5000", "0.2500"]
    assert rows[3] == ["easy", "0.0000", "0.3333", "0.2000", "0.2500", "0.5000", "0.2500", "0.5000"]
    assert rows[4] == ["web", "", "0.3333", "0.7000", "3.0000", "2.5000", "", ""]
    # average over 3 domains: (4.5 + 0.25 + 3) / 3, (4.25 + 0.5 + 2.5) / 3; loss - H over the
    # 2 domains with known entropy: (0.5 + 0.25) / 2, (0.25 + 0.5) / 2
    assert rows[5] == ["**average**", "", "", "", "2.5833", "2.4167", "0.3750", "0.3750"]
    assert rows[6] == ["**worst case**", "", "", "", "4.5000", "4.2500", "0.5000", "0.5000"]
    assert len(rows) == 7


def test_table_without_entropy_has_no_entropy_columns():
    rows = _cells(format_table(DOMAINS, {}, LOSSES, None))
    assert rows[0] == ["domain", "loss: uniform", "loss: doremi"]
    assert rows[-1] == ["**worst case**", "4.5000", "4.2500"]


def test_table_rejects_wrong_lengths():
    with pytest.raises(ValueError, match=r"losses\['doremi'\]: expected 3 values .* got 2"):
        format_table(DOMAINS, MIXTURES, {"doremi": [1.0, 2.0]}, ENTROPY)
    with pytest.raises(ValueError, match="entropy: expected 3 values"):
        format_table(DOMAINS, MIXTURES, LOSSES, [1.0])


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_write_report_writes_markdown_and_pngs(tmp_path):
    history = [[1 / 3, 1 / 3, 1 / 3], [0.2, 0.3, 0.5], [0.1, 0.2, 0.7]]
    runs = {name: [(0, [6.0, 2.0, 5.0]), (50, [5.0, 1.0, 4.0]), (100, loss)] for name, loss in LOSSES.items()}
    report = write_report(tmp_path / "report", DOMAINS, history, runs, LOSSES, MIXTURES, ENTROPY)
    text = report.read_text()
    assert report.name == "report.md"
    assert format_table(DOMAINS, MIXTURES, LOSSES, ENTROPY) in text
    assert "Best" not in text and "One seed: no mixture is named best here." in text
    for png in (WEIGHTS_PNG, VAL_LOSS_PNG, FINAL_LOSS_PNG):
        assert f"]({png})" in text
        w, h = _png_size(tmp_path / "report" / png)
        assert w > 300 and h > 200
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == sorted(
        ["report.md", WEIGHTS_PNG, VAL_LOSS_PNG, FINAL_LOSS_PNG]
    )


def test_against_a_baseline_the_report_plots_differences_with_average_and_worst(tmp_path, monkeypatch):
    """The final-loss figure against a baseline shows differences (the few hundredths of a nat
    that decide a comparison), per domain, average and worst case, each value written."""
    import doremi.reports.report as rep

    drawn = {}
    real = rep.plot_differences

    def spy(path, domains, final, baseline):
        drawn.update(
            baseline=baseline,
            diff={
                n: [x - b for x, b in zip(rep.summary_groups(final[n]), rep.summary_groups(final[baseline]))]
                for n in final
                if n != baseline
            },
        )
        real(path, domains, final, baseline)

    monkeypatch.setattr(rep, "plot_differences", spy)
    runs = {name: [(1, loss), (2, loss)] for name, loss in LOSSES.items()}
    setup = "| run | steps |\n|---|---:|\n| main/doremi | 2 |\n"
    text = rep.write_report(
        tmp_path, DOMAINS, [], runs, LOSSES, MIXTURES, ENTROPY, baselines=["uniform"], setup_table=setup
    ).read_text()
    # doremi - uniform: noise -0.25, easy +0.25, web -0.5; average (7.25 - 7.75) / 3; worst 4.25 - 4.5
    assert drawn["baseline"] == "uniform"
    assert drawn["diff"]["doremi"] == pytest.approx([-0.25, 0.25, -0.5, -0.5 / 3, -0.25])
    assert f"]({rep.DIFF_PNG})" in text and rep.FINAL_LOSS_PNG not in text
    assert "## What was run" in text and setup in text
    assert _png_size(tmp_path / rep.DIFF_PNG)[0] > 300


def test_final_loss_axis_starts_near_the_smallest_value(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from doremi.reports.report import plot_final_loss

    limits = {}
    real = Axes.set_ylim
    monkeypatch.setattr(Axes, "set_ylim", lambda self, *a, **k: limits.update(k) or real(self, *a, **k))
    plot_final_loss(tmp_path / "f.png", DOMAINS, {"a": [4.0, 4.1, 4.2], "b": [4.05, 4.1, 4.3]}, [None] * 3)
    assert limits["bottom"] == pytest.approx(4.0 - 0.15 * 0.3 - 1e-3)


def test_validation_curves_use_integer_step_ticks(tmp_path, monkeypatch):
    from matplotlib.ticker import MaxNLocator

    from doremi.reports.report import plot_val_loss

    seen = []
    real = MaxNLocator.__init__
    monkeypatch.setattr(MaxNLocator, "__init__", lambda self, *a, **k: seen.append(k) or real(self, *a, **k))
    plot_val_loss(tmp_path / "v.png", DOMAINS, {"uniform": [(1, [1.0, 2.0, 3.0])]}, [None] * 3)
    assert sum(k.get("integer") is True for k in seen) == len(DOMAINS)


def test_write_report_skips_plots_without_data(tmp_path):
    report = write_report(tmp_path, DOMAINS, [], {"uniform": []}, {}, MIXTURES, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]
    assert "| noise | 0.3333 | 0.1000 |" in report.read_text()


def test_write_report_rejects_bad_history_before_writing(tmp_path):
    with pytest.raises(ValueError, match=r"weight_history\[step 2\]: expected 3 values"):
        write_report(tmp_path / "r", DOMAINS, [[0.5, 0.25, 0.25], [1.0]], {}, LOSSES, MIXTURES)
    assert not (tmp_path / "r").exists()


def test_final_loss_plot_on_a_log_axis_needs_positive_values(tmp_path):
    from doremi.reports.report import plot_final_loss

    plot_final_loss(tmp_path / "log.png", DOMAINS, LOSSES, [None] * 3, ylabel="loss - H", log=True)
    assert _png_size(tmp_path / "log.png")[0] > 300
    with pytest.raises(ValueError, match=r"a log axis needs values > 0, got uniform: 0.0"):
        plot_final_loss(tmp_path / "bad.png", DOMAINS, {"uniform": [1.0, 0.0, 2.0]}, [None] * 3, log=True)
    assert not (tmp_path / "bad.png").exists()


# -- bits per byte, domains better, steps-to-target --------------------------------------------


def test_bits_per_byte():
    from doremi.reports.report import bits_per_byte

    # 2 nats/token, 1000 tokens for 4000 bytes: 2 * 0.25 / ln 2
    assert bits_per_byte(2.0, 1000 / 4000) == pytest.approx(0.72134752, abs=1e-8)
    assert bits_per_byte(2.0, None) is None


def test_table_with_bits_per_byte_columns():
    rows = _cells(format_table(DOMAINS, {}, LOSSES, None, tokens_per_byte=[0.25, None, 0.5]))
    assert rows[0] == ["domain", "loss: uniform", "loss: doremi", "bits/byte: uniform", "bits/byte: doremi"]
    # 4.5 * 0.25 / ln 2, 4.25 * 0.25 / ln 2; web: 3.0 * 0.5 / ln 2, 2.5 * 0.5 / ln 2
    assert rows[2] == ["noise", "4.5000", "4.2500", "1.6230", "1.5329"]
    assert rows[3] == ["easy", "0.2500", "0.5000", "", ""]
    assert rows[4] == ["web", "3.0000", "2.5000", "2.1640", "1.8034"]
    assert rows[5] == ["**average**", "2.5833", "2.4167", "1.8935", "1.6681"]
    assert rows[6] == ["**worst case**", "4.5000", "4.2500", "2.1640", "1.8034"]


def test_domains_better_and_steps_to_target():
    from doremi.reports.report import domains_better, fmt_speedup, speedup, steps_to_target

    assert domains_better(LOSSES["doremi"], LOSSES["uniform"]) == 2
    assert domains_better([1.0, 2.0], [1.0, 2.5]) == 1  # a tie is not better
    curve = [(10, 3.0), (20, 2.5), (30, 2.0)]
    assert steps_to_target(curve, 2.5) == 20  # reaching the target exactly counts
    assert steps_to_target(curve, 1.9) is None
    assert speedup(30, 20) == 1.5 and speedup(30, None) is None
    assert fmt_speedup(30, 20) == "1.50x (step 20)" and fmt_speedup(30, None) == "not reached"


def test_vs_baselines_table():
    from doremi.reports.report import format_vs_baselines

    runs = {
        "uniform": [(50, [5.0, 1.0, 4.0]), (100, LOSSES["uniform"])],
        "doremi": [(50, [4.5, 0.5, 2.5]), (100, LOSSES["doremi"])],
    }
    rows = _cells(format_vs_baselines(DOMAINS, LOSSES, runs, ["uniform"]))
    assert rows[0] == [
        "run",
        "domains better than uniform (of 3)",
        "mean loss - uniform",
        "speed-up to uniform's final loss",
    ]
    # doremi's mean at step 50 is 2.5 <= uniform's final mean 2.5833: 100 / 50 steps
    assert rows[2:] == [["doremi", "2", "-0.1667", "2.00x (step 50)"]]


def test_report_with_warnings_and_guardrail_sections(tmp_path):
    report = write_report(
        tmp_path,
        DOMAINS,
        [],
        {},
        LOSSES,
        MIXTURES,
        None,
        baselines=["uniform"],
        warnings=["round1/reference: easy: epochs read 40 > max_epochs 2"],
        guardrail_table="| domain | epochs: round1/reference |\n",
    )
    text = report.read_text()
    assert "## Warnings\n\n- round1/reference: easy: epochs read 40 > max_epochs 2\n" in text
    assert "## Against the baselines" in text and "| doremi | 2 | -0.1667 |  |" in text
    assert "## Guardrails\n\n| domain | epochs: round1/reference |\n" in text
    clean = write_report(tmp_path / "clean", DOMAINS, [], {}, LOSSES, MIXTURES, None, warnings=[]).read_text()
    assert "## Warnings\n\nNone: every guardrail passed.\n" in clean
    assert "## Warnings" not in write_report(tmp_path / "none", DOMAINS, [], {}, LOSSES, MIXTURES).read_text()


def test_closing_summary_fits_100_columns_best_first_against_the_baseline():
    from doremi.reports.report import format_summary

    losses = {
        "uniform": [2.0, 3.0, 4.0],
        "doremi": [1.5, 3.5, 3.8],
        "a-mixture-with-a-name-far-longer-than-any-screen-would-show-in-one-line-of-a-terminal": [2.1, 3.1, 4.1],
    }
    text = format_summary(losses, "uniform")
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert lines[1].split() == ["doremi", "2.9333", "3.8000", "-0.0667", "-0.2000", "2/3"]
    assert lines[2].split() == ["uniform", "3.0000", "4.0000", "+0.0000", "+0.0000", "0/3"]
    assert lines[3].split()[0].endswith("~") and lines[3].split()[1:] == [
        "3.1000",
        "4.1000",
        "+0.1000",
        "+0.1000",
        "0/3",
    ]
    assert format_summary({"doremi": [1.0]}, None).splitlines()[1].split() == ["doremi", "1.0000", "1.0000"]


def test_setup_table_names_the_proxy_keys_that_change_its_algorithm(tmp_path):
    from doremi.reports.summary import setup_table

    model = {"d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_dim": 32, "vocab_size": 512}
    train = {"steps": 4, "global_batch_size": 2, "lr": 0.001, "min_lr": 0.0001, "seed": 3}
    doremi = {"eta": 1.0, "smoothing": 0.001, "update": "lagged", "reference_fp8": True, "rounds": 1}
    proxy = tmp_path / "round1" / "proxy"
    proxy.mkdir(parents=True)
    cfg = {"model": model, "train": train, "data": {"seq_len": 8}, "mixing": {"doremi": doremi}}
    (proxy / "config.yaml").write_text(yaml.safe_dump(cfg))
    table = setup_table(tmp_path)
    assert table.splitlines()[-1] == "DoReMi: eta 1.0, smoothing 0.001, update lagged, reference_fp8 True, rounds 1."
