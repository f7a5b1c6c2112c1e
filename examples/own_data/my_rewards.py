"""A reward module of a user's own, for configs/grpo/own_data_cpu.yaml.

forge imports it by the name in `reward.functions` ("my_rewards:right_length"), so its folder
must be on PYTHONPATH: `PYTHONPATH=examples/own_data forge run ...` (what `make grpo-own-data`
does). Every reward function has this signature: the data row the prompt came from, the
completion's text, a score.
"""

from collections.abc import Mapping
from typing import Any

from forge.data.rewards import extract_answer, reads_columns


@reads_columns("digits")
def right_length(row: Mapping[str, Any], text: str) -> float:
    """1.0 when the model's answer has as many digits as the sum (the file's `digits` column):
    partial credit on the way to the exact sum, which math_verify scores."""
    answer = extract_answer(text)
    if answer is None:
        return 0.0
    digits = sum(c.isdigit() for c in answer)
    return float(digits == row["columns"]["digits"])
