"""SFT data: tokenized (prompt, answer) rows, Episodes for the SFT loss, length bucketing."""

import itertools
import json

import pytest
import transformers

import forge.models
from forge.data.collate import collate
from forge.data.datasets import (
    DataConfig,
    DatasetError,
    PromptDataset,
    PromptTemplate,
    ReasoningGymDataset,
    easy_arithmetic,
    open_dataset,
)
from forge.data.sft import (
    LengthBucketBatcher,
    SFTExample,
    SFTExamples,
    SFTTarget,
    padding_fraction,
    sft_episode,
    target_text,
    tokenize_row,
)


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(forge.models.smollm2())


def chat_ids(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_prompt_and_answer_are_the_chat_template_up_to_its_newline(tokenizer, system):
    config = easy_arithmetic(size=10, seed=2)
    config.template = PromptTemplate(system=system)
    row = next(ReasoningGymDataset(config))
    example = tokenize_row(row, tokenizer, SFTTarget())
    target = f"<answer>{row['answer']}</answer>"
    full = chat_ids(tokenizer, row["prompt"] + [{"role": "assistant", "content": target}])
    sequence = example.prompt_ids + example.answer_ids
    assert full[: len(sequence)] == sequence
    assert tokenizer.decode(full[len(sequence) :]) == "\n"
    # The prompt is what the generator sends; the answer ends with the stop token.
    assert example.prompt_ids == tokenizer.apply_chat_template(
        row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert example.answer_ids[-1] == tokenizer.eos_token_id
    assert example.text == target and example.name == f"basic_arithmetic row {row['index']}"


def test_episode_collates_to_a_loss_mask_on_the_answer_tokens(tokenizer):
    rows = ReasoningGymDataset(DataConfig(size=4, seed=1))
    examples = [tokenize_row(row, tokenizer, SFTTarget()) for row in itertools.islice(rows, 3)]
    episodes = [sft_episode(e, f"e{i}") for i, e in enumerate(examples)]
    completion = episodes[0].completion
    assert completion.token_ids == examples[0].answer_ids and completion.stop_reason == "stop"
    assert completion.text == examples[0].text and episodes[0].group_id == examples[0].name
    batch = collate(episodes)
    for i, example in enumerate(examples):
        # Mask position j predicts token j + 1: the masked targets are the answer tokens.
        targets = batch.input_ids[i, 1:][batch.mask[i]].tolist()
        assert targets == example.answer_ids
    assert batch.num_tokens == sum(len(e.answer_ids) for e in examples)
    assert not batch.behaviour_logprobs.any() and episodes[0].policy_version == 0


@pytest.mark.parametrize(
    ("answer", "problem"), [(None, "answer is null"), ("  ", "answer is empty \\('  '\\)")]
)
def test_a_row_without_an_answer_is_a_one_line_error(tokenizer, answer, problem):
    row = {"prompt": [{"role": "user", "content": "1+1?"}], "answer": answer}
    row |= {"task": "sums", "index": 7}
    with pytest.raises(DatasetError, match=f"^sums row 8: {problem}; SFT needs") as raised:
        tokenize_row(row, tokenizer, SFTTarget())
    assert "\n" not in str(raised.value)


def test_answer_template_fills_only_the_answer():
    row = {"answer": "12", "task": "t", "index": 0}
    assert target_text(row, SFTTarget("\\boxed{{answer}} {x}")) == "\\boxed{12} {x}"


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


RECORDS = [
    {"prompt": f"What is {i} + 1?", "answer": str(i + 1), "solution": f"{i} + 1 = {i + 1}."}
    for i in range(4)
]


def local_rows(tmp_path, records) -> PromptDataset:
    path = write_jsonl(tmp_path / "sums.jsonl", records)
    config = DataConfig(source="local", path=path, shuffle=False, cache_dir=str(tmp_path / "c"))
    return open_dataset(config)


def test_target_column_is_the_target_as_it_is(tmp_path, tokenizer):
    target = SFTTarget(column="solution")
    example = next(SFTExamples(local_rows(tmp_path, RECORDS), target, tokenizer))
    assert example.text == "0 + 1 = 1." and example.name == "sums row 0"
    with pytest.raises(DatasetError, match="no column 'proof' \\(columns: prompt, answer, solu"):
        SFTExamples(local_rows(tmp_path, RECORDS), SFTTarget(column="proof"), tokenizer)
    records = RECORDS[:1] + [{**RECORDS[1], "solution": ""}]
    examples = SFTExamples(local_rows(tmp_path, records), target, tokenizer)
    next(examples)
    with pytest.raises(DatasetError, match="^sums row 2: column 'solution' is empty"):
        next(examples)


def test_a_template_without_the_answer_is_refused():
    with pytest.raises(ValueError, match="has no \\{answer\\}"):
        SFTTarget(template="<answer></answer>")


def mixed_lengths(tokenizer, size: int = 48, seed: int = 0) -> SFTExamples:
    # reasoning-gym's default arithmetic: 2 to 6 terms of 1 to 4 digits, prompts of 53-93 tokens.
    return SFTExamples(open_dataset(DataConfig(size=size, seed=seed)), SFTTarget(), tokenizer)


def names(batches: list[list[SFTExample]]) -> list[list[str]]:
    return [[e.name for e in batch] for batch in batches]


def take(batcher: LengthBucketBatcher, n: int) -> list[list[SFTExample]]:
    return list(itertools.islice(batcher, n))


def test_bucketing_pads_less_than_sequential_batches(tokenizer):
    def mean_padding(bucket_window: int) -> float:
        batcher = LengthBucketBatcher(mixed_lengths(tokenizer, 128), 8, bucket_window)
        batches = take(batcher, 16)  # one pass
        return sum(padding_fraction([sft_episode(e, "") for e in b]) for b in batches) / 16

    sequential, bucketed = mean_padding(1), mean_padding(8)
    # Measured: 0.166 and 0.031 (128 rows, batches of 8).
    assert sequential > 0.12 and bucketed < 0.05 and bucketed < sequential / 4


def test_every_example_once_per_pass_in_batches_of_similar_length(tokenizer):
    batcher = LengthBucketBatcher(mixed_lengths(tokenizer), batch_size=4, bucket_window=3)
    for _ in range(2):
        batches = take(batcher, 12)  # 48 rows: 4 windows of 12
        assert all(len(b) == 4 for b in batches)
        assert sorted(itertools.chain(*names(batches))) == sorted(
            f"basic_arithmetic row {i}" for i in range(48)
        )
    # A window's batches hold consecutive slices of its rows sorted by length.
    ranges = sorted((b[0].length, b[-1].length) for b in take(batcher, 3))
    assert all(low <= high for low, high in ranges)
    assert all(ranges[i][1] <= ranges[i + 1][0] for i in range(2))


def test_batches_are_fixed_by_the_seed_and_resume(tokenizer):
    def batcher(seed: int) -> LengthBucketBatcher:
        return LengthBucketBatcher(mixed_lengths(tokenizer), 4, bucket_window=3, seed=seed)

    first = batcher(0)
    assert names(take(first, 12)) == names(take(batcher(0), 12))
    assert names(take(batcher(1), 12)) != names(take(batcher(0), 12))
    for before in (2, 3):  # mid-window, and at a window's end
        original = batcher(0)
        take(original, before)
        state = original.state_dict()
        resumed = batcher(0)
        resumed.load_state_dict(state)
        assert names(take(resumed, 7)) == names(take(original, 7))
    with pytest.raises(DatasetError, match="cannot resume"):
        batcher(5).load_state_dict(state)
