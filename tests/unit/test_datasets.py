"""Prompt datasets: reasoning-gym, local files and hf folders, order by seed, epochs, held-out
rows, resume, bad rows."""

import itertools
import json
import logging

import datasets
import pytest

from forge.data.datasets import (
    DataConfig,
    DatasetError,
    PromptDataset,
    PromptTemplate,
    ReasoningGymDataset,
    easy_arithmetic,
    open_dataset,
)
from forge.data.rewards import ANSWER_INSTRUCTION, reasoning_gym_reward


def take(dataset, n: int) -> list[dict]:
    return list(itertools.islice(dataset, n))


def test_reasoning_gym_order_is_fixed_by_the_seed():
    first = take(ReasoningGymDataset(easy_arithmetic(size=50, seed=1)), 10)
    again = take(ReasoningGymDataset(easy_arithmetic(size=50, seed=1)), 10)
    other = take(ReasoningGymDataset(easy_arithmetic(size=50, seed=2)), 10)
    assert first == again
    assert [r["question"] for r in first] != [r["question"] for r in other]


def test_easy_arithmetic_rows_ask_for_the_answer_format_and_score():
    row = next(ReasoningGymDataset(easy_arithmetic(size=20)))
    a, b = row["columns"]["metadata"]["expression"].split(" + ")
    assert row["answer"] == str(int(a) + int(b)) and int(a) <= 10 and int(b) <= 10
    assert row["prompt"] == [
        {"role": "user", "content": f"{row['question']}\n\n{ANSWER_INSTRUCTION}"}
    ]
    assert row["task"] == "basic_arithmetic"
    assert reasoning_gym_reward(row, f"<answer>{row['answer']}</answer>") == 1.0


def test_template_with_a_system_prompt_and_braces():
    template = PromptTemplate(system="Be brief.", user="Q: {question} Use \\boxed{}.")
    config = DataConfig(task="chain_sum", size=5, template=template)
    row = next(ReasoningGymDataset(config))
    assert row["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"Q: {row['question']} Use \\boxed{{}}."},
    ]


def test_epochs_visit_every_row_once_in_a_new_order():
    dataset = ReasoningGymDataset(easy_arithmetic(size=8, seed=3))
    epochs = [[row["index"] for row in take(dataset, 8)] for _ in range(3)]
    assert dataset.epoch == 3
    assert all(sorted(order) == list(range(8)) for order in epochs)
    assert len({tuple(order) for order in epochs}) == 3


def test_no_shuffle_keeps_source_order():
    config = DataConfig(size=4, shuffle=False)
    assert [r["index"] for r in take(ReasoningGymDataset(config), 6)] == [0, 1, 2, 3, 0, 1]


def test_state_dict_resumes_where_it_stopped():
    dataset = ReasoningGymDataset(easy_arithmetic(size=6, seed=4))
    take(dataset, 9)  # into the second epoch
    state = dataset.state_dict()
    expected = take(dataset, 10)
    resumed = ReasoningGymDataset(easy_arithmetic(size=6, seed=4))
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    assert take(resumed, 10) == expected
    with pytest.raises(DatasetError, match="cannot resume"):
        ReasoningGymDataset(easy_arithmetic(size=6, seed=5)).load_state_dict(state)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (DataConfig(task="no_such_task"), "'no_such_task'.*not registered"),
        (DataConfig(config={"max_digitz": 1}), "max_digitz"),
        (DataConfig(config={"min_terms": 0}), "min_terms must be positive"),
    ],
)
def test_bad_reasoning_gym_config_is_a_dataset_error(config, match):
    with pytest.raises(DatasetError, match=match):
        ReasoningGymDataset(config)


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def local(tmp_path, path: str, hold_out: int | float = 0, **kwargs) -> PromptDataset:
    config = DataConfig(source="local", path=path, cache_dir=str(tmp_path / "cache"), **kwargs)
    return open_dataset(config, hold_out)


RECORDS = [{"q": f"What is {i} + 1?", "a": i + 1, "id": f"p{i}"} for i in range(5)]


def test_local_jsonl_with_custom_columns(tmp_path):
    path = write_jsonl(tmp_path / "sums.jsonl", RECORDS)
    dataset = local(tmp_path, path, prompt_column="q", answer_column="a", shuffle=False)
    assert len(dataset) == 5
    row = next(dataset)
    assert row == {
        "prompt": [{"role": "user", "content": f"What is 0 + 1?\n\n{ANSWER_INSTRUCTION}"}],
        "question": "What is 0 + 1?",
        "answer": "1",
        "task": "sums",
        "index": 0,
        "columns": {"q": "What is 0 + 1?", "a": 1, "id": "p0"},
    }


def test_local_chat_prompts_are_used_as_they_are(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": chat, "answer": "2"}])
    row = next(local(tmp_path, path))
    assert row["prompt"] == chat and row["question"] == "1+1?" and row["task"] == "chat"


def test_local_saved_dataset_dict_and_parquet(tmp_path):
    records = [{"prompt": r["q"], "answer": str(r["a"])} for r in RECORDS]
    data = datasets.Dataset.from_list(records)
    datasets.DatasetDict({"test": data}).save_to_disk(str(tmp_path / "saved"))
    saved = local(tmp_path, str(tmp_path / "saved"), split="test", seed=7)
    assert sorted(r["answer"] for r in take(saved, 5)) == ["1", "2", "3", "4", "5"]
    with pytest.raises(DatasetError, match="no split 'train' \\(splits: test\\)$"):
        local(tmp_path, str(tmp_path / "saved"))
    data.to_parquet(str(tmp_path / "sums.parquet"))
    assert len(local(tmp_path, str(tmp_path / "sums.parquet"))) == 5


def test_local_order_is_fixed_by_the_seed_and_resumes(tmp_path):
    path = write_jsonl(tmp_path / "sums.jsonl", RECORDS)
    kwargs = {"prompt_column": "q", "answer_column": "a", "seed": 3}
    dataset = local(tmp_path, path, **kwargs)
    assert take(dataset, 7) == take(local(tmp_path, path, **kwargs), 7)
    state = dataset.state_dict()
    resumed = local(tmp_path, path, **kwargs)
    resumed.load_state_dict(state)
    assert take(resumed, 4) == take(dataset, 4)


def test_missing_column_names_the_column(tmp_path):
    path = write_jsonl(tmp_path / "sums.jsonl", RECORDS)
    with pytest.raises(
        DatasetError, match="no column 'prompt' \\(columns: q, a, id\\); set data.prompt_column"
    ):
        local(tmp_path, path, answer_column="a")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"q": None, "a": 3}, "line 3: column 'q' is null"),
        ({"q": "  ", "a": 3}, "line 3: column 'q' is an empty string"),
        ({"q": "x", "a": ""}, "line 3: column 'a' is an empty string"),
        ({"q": "x", "a": [3]}, "line 3: column 'a' is a list \\('\\[3\\]'\\), expected a string"),
        ({"q": [{"role": "user"}], "a": 3}, "line 3: column 'q' is a list but not chat messages"),
        ({"q": "x"}, "line 3: column 'a' is null"),  # a key absent from one row reads as null
    ],
)
def test_malformed_row_names_row_and_column(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "bad.jsonl", RECORDS[:2] + [bad] + RECORDS[2:])
    with pytest.raises(DatasetError, match=message) as raised:
        local(tmp_path, path, prompt_column="q", answer_column="a")
    assert "\n" not in str(raised.value)


def test_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"q": "x", "a": 1}\n\n{"q": "y", "a": \n')
    with pytest.raises(DatasetError, match="broken.jsonl line 3: not valid JSON"):
        local(tmp_path, str(path), prompt_column="q", answer_column="a")


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        # Blank lines count, as in an editor.
        ("rows.jsonl", '{"q": "x", "a": 1}\n\n{"q": "y", "a": 2}\n{"q": "z"}\n', "line 4"),
        # Line 1 is the header; a quoted field spans lines 2 and 3.
        ("rows.csv", 'q,a\n"two\nlines",1\ny,2\nz,\n', "line 5"),
        # An array's rows are not lines: the third row.
        ("rows.json", '[{"q": "x", "a": 1},\n {"q": "y", "a": 2},\n {"q": "z"}]', "row 3"),
    ],
)
def test_a_malformed_row_is_named_as_an_editor_shows_it(tmp_path, name, text, where):
    (tmp_path / name).write_text(text)
    with pytest.raises(DatasetError, match=f"/{name} {where}: column 'a' is null; data.on_bad"):
        local(tmp_path, str(tmp_path / name), prompt_column="q", answer_column="a")


def test_skip_policy_counts_and_leaves_out_bad_rows(tmp_path, caplog):
    bad = [{"q": None, "a": 1, "id": "b1"}, {"q": "x", "a": {"n": 1}, "id": "b2"}]
    path = write_jsonl(tmp_path / "bad.jsonl", RECORDS[:1] + bad + RECORDS[1:])
    with caplog.at_level(logging.WARNING, logger="forge.data.datasets"):
        dataset = local(tmp_path, path, prompt_column="q", answer_column="a", on_bad_row="skip")
    assert sorted(dataset.skipped) == [1, 2] and "column 'a' is a dict" in dataset.skipped[2]
    assert "skipping 2 malformed rows" in caplog.text
    assert len(dataset) == 5
    assert sorted(r["index"] for r in take(dataset, 5)) == [0, 3, 4, 5, 6]
    with pytest.raises(DatasetError, match="and 1 more malformed rows\\); data.on_bad_row: skip"):
        local(tmp_path, path, prompt_column="q", answer_column="a")


def test_bad_paths(tmp_path):
    with pytest.raises(DatasetError, match="no such file or folder"):
        local(tmp_path, str(tmp_path / "nope.jsonl"))
    (tmp_path / "data.txt").write_text("hi")
    with pytest.raises(DatasetError, match="unknown file type"):
        local(tmp_path, str(tmp_path / "data.txt"))
    with pytest.raises(ValueError, match="on_bad_row must be"):
        DataConfig(source="local", path="x", on_bad_row="ignore")


def test_nth_is_the_iteration_order_across_epochs():
    dataset = ReasoningGymDataset(easy_arithmetic(size=5, seed=3))
    first_three_epochs = [next(dataset)["index"] for _ in range(15)]
    assert [dataset.nth(n)["index"] for n in range(15)] == first_three_epochs


def save_as(tmp_path, records: list[dict], kind: str) -> str:
    """`records` as a jsonl file, a parquet file or a save_to_disk folder."""
    if kind == "jsonl":
        return write_jsonl(tmp_path / "rows.jsonl", records)
    table = datasets.Dataset.from_list(records)
    if kind == "parquet":
        table.to_parquet(str(tmp_path / "rows.parquet"))
        return str(tmp_path / "rows.parquet")
    table.save_to_disk(str(tmp_path / "rows"))
    return str(tmp_path / "rows")


ROWS = [{"q": f"What is {i} + 7?", "a": str(i + 7), "level": i % 3} for i in range(40)]
KINDS = ["jsonl", "parquet", "save_to_disk"]


@pytest.mark.parametrize("kind", KINDS)
def test_held_out_rows_are_never_in_the_training_order(tmp_path, kind):
    path = save_as(tmp_path, ROWS, kind)
    columns = {"prompt_column": "q", "answer_column": "a", "seed": 5}
    dataset = local(tmp_path, path, hold_out=8, **columns)
    assert len(dataset) == 32 and len(dataset.held_out) == 8
    trained = {row["index"] for row in take(dataset, 3 * 32)}  # three epochs
    assert trained == set(range(40)) - set(dataset.held_out)
    rows = dataset.held_out_rows(5)
    assert [r["index"] for r in rows] == dataset.held_out[:5]
    assert rows[0]["columns"]["level"] == ROWS[rows[0]["index"]]["level"]
    # The same config holds out the same rows; a fraction holds out its share.
    assert local(tmp_path, path, hold_out=8, **columns).held_out == dataset.held_out
    assert len(local(tmp_path, path, hold_out=0.25, **columns).held_out) == 10
    # A held-out sample, not the first rows of the file (files are often sorted).
    assert dataset.held_out != list(range(8))


@pytest.mark.parametrize("kind", KINDS)
def test_every_format_refuses_or_skips_a_row_without_an_answer(tmp_path, kind):
    path = save_as(tmp_path, ROWS[:3] + [{"q": "What is 1 + 1?", "a": None, "level": 0}], kind)
    row = "line 4" if kind == "jsonl" else "row 4"  # the fourth row, as an editor counts
    with pytest.raises(DatasetError, match=f"{row}: column 'a' is null; data.on_bad_row: skip"):
        local(tmp_path, path, prompt_column="q", answer_column="a")
    dataset = local(tmp_path, path, prompt_column="q", answer_column="a", on_bad_row="skip")
    assert list(dataset.skipped) == [3] and len(dataset) == 3


def test_size_takes_the_first_rows_and_checks_only_those(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS[:10] + [{"q": "x", "a": ""}])
    dataset = local(tmp_path, path, prompt_column="q", answer_column="a", size=10)
    assert sorted(r["index"] for r in take(dataset, 10)) == list(range(10))


def test_resuming_with_other_held_out_rows_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    columns = {"prompt_column": "q", "answer_column": "a"}
    dataset = local(tmp_path, path, hold_out=4, **columns)
    take(dataset, 7)
    state = dataset.state_dict()
    resumed = local(tmp_path, path, hold_out=4, **columns)
    resumed.load_state_dict(state)
    assert take(resumed, 5) == take(dataset, 5)
    with pytest.raises(DatasetError, match="cannot resume: the run read other rows"):
        local(tmp_path, path, hold_out=5, **columns).load_state_dict(state)
    write_jsonl(tmp_path / "rows.jsonl", ROWS[:-1])  # the file lost a row meanwhile
    with pytest.raises(DatasetError, match="its file changed"):
        local(tmp_path, path, hold_out=4, **columns).load_state_dict(state)


def test_holding_out_every_row_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS[:4])
    with pytest.raises(DatasetError, match="cannot hold out 4 of its 4 rows"):
        local(tmp_path, path, hold_out=4, prompt_column="q", answer_column="a")


def hf(tmp_path, path: str, **kwargs) -> PromptDataset:
    config = DataConfig(source="hf", path=path, cache_dir=str(tmp_path / "cache"), **kwargs)
    return open_dataset(config)


def test_hf_source_reads_a_repository_folder_by_split(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    write_jsonl(repo / "train.jsonl", ROWS[:6])
    write_jsonl(repo / "test.jsonl", ROWS[6:8])
    columns = {"prompt_column": "q", "answer_column": "a", "shuffle": False}
    train = hf(tmp_path, str(repo), **columns)
    assert [r["answer"] for r in take(train, 6)] == [r["a"] for r in ROWS[:6]]
    assert train.name == f"hf:{repo}" and train.columns == ("q", "a", "level")
    test = hf(tmp_path, str(repo), split="test", **columns)
    assert [r["answer"] for r in take(test, 2)] == ["13", "14"]
    with pytest.raises(DatasetError, match=f"^hf dataset {repo}: no split 'valid'"):
        hf(tmp_path, str(repo), split="valid", **columns)


def test_a_dataset_name_that_cannot_load_is_one_line_naming_it(tmp_path, monkeypatch):
    # Offline, as this machine is: the same call reaches the Hub where the machine can.
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DatasetError, match="^hf dataset nobody/no-such-set: cannot load: ") as e:
        hf(tmp_path, "nobody/no-such-set")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"source": "hub"}, r"source must be one of \('reasoning_gym', 'local', 'hf'\)"),
        ({"source": "local"}, "source local needs path"),
        ({"path": "rows.jsonl"}, "path is read by source local or hf: set source"),
        ({"source": "local", "path": "x", "subset": "main"}, "subset is read by source hf"),
        ({"size": 0}, "size must be >= 1"),
    ],
)
def test_bad_data_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**kwargs)


def test_a_folder_of_data_files_read_as_local_points_at_hf(tmp_path):
    (tmp_path / "repo").mkdir()
    write_jsonl(tmp_path / "repo" / "train.jsonl", ROWS[:2])
    with pytest.raises(DatasetError, match="not a save_to_disk folder .*data.source: hf"):
        local(tmp_path, str(tmp_path / "repo"))
