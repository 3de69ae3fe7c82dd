"""bench/cifar_seeds.py: the CIFAR-10 seed table's rows, blocks and budgets, and its bad input."""

import importlib

import pytest

cs = importlib.import_module("bench.cifar_seeds")
rows = importlib.import_module("bench.rows")


def test_the_table_rows_train_4_blocks_on_local4_and_the_comparisons_2_on_local2():
    for name, variant in cs.ROWS.items():
        f = rows.seed_file("cifar10", variant)
        assert rows.file_value(f, "engine.master") == "local[4]", f
        assert cs._blocks(rows.Variant(f)) == 4 == rows.file_value(f, "data.test_blocks"), f
        assert rows.file_value(f, "model.name") == "resnet20"
    keras = rows.seed_file("cifar10", "keras")
    epochs = {rows.file_value(rows.seed_file("cifar10", v), "train.epochs") for v in rows.ROWS}
    assert epochs == {10}  # one budget for every row, Keras's too
    two = rows.Variant(rows.seed_file("cifar10", "gs_asgd_ms"), cs.TWO_BLOCKS)
    assert cs._blocks(two) == 2 and "engine.master=local[2]" in two.sets
    row = cs.described({"name": "x", "seeds": [42]}, two)
    assert (row["model"], row["blocks"]) == ("resnet20", 2)
    assert rows.file_value(keras, "model.name") == "resnet20"


@pytest.mark.parametrize("argv, message", [
    (["--parts", "table,nope"], "--parts: unknown part 'nope'"),
    (["--seeds", "0"], "--seeds must be >= 1, got 0"),
    (["--long-epochs", "0"], "--long-epochs must be >= 1, got 0"),
    (["--data", "{tmp}/missing"], "data <tmp>/missing: no prepared dataset (make data-cifar10)"),
    (["--budget-min", "30"], "--budget-min needs --runs and a positive number of minutes, got 30.0"),
    (["--runs", "{tmp}/runs", "--budget-min", "0"], "--budget-min needs --runs and a positive number"),
])
def test_bad_input_exits_2_with_one_line(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cs.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err


def test_the_targets_it_prints_are_the_three_the_render_judges():
    assert cs.TARGETS == {"within_keras_points": 1.5, "within_asgd_points": 0.3, "long_at_least": 0.90}
    assert cs.LONG_EPOCHS == 75 and cs.PARTS == ("table", "two-blocks", "long")
