"""Tool-use demonstrations for the agent recipe's warm start (`make agent`).

    python apps/agent/demos.py --config configs/agent/smollm2_cpu.yaml --out demos.jsonl \
        --rows 200 [key=value ...]

SmolLM2-135M never writes a well-formed tool call from instructions or an in-context example,
so reinforcement learning from it has no signal: the recipe first fine-tunes it on
demonstrations (an SFT "cold start", as ReTool and SkyRL's tool recipes do). Each
demonstration is an episode of the config's own environment (the `env` section, the
`data` rows; overrides such as `data.seed=1` give other questions than training's) played by a
scripted policy: call the calculator on the row's expression, then answer with its result. The
observations are the environment's own, so the SFT rows hold exactly the messages the model
will see in training. Each assistant turn is one row: `prompt` (the messages before it),
`target` (its text) and `answer`, for `apps/sft` with `target.column: target`.
"""

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from forge.config import load_config
from forge.data.datasets import Row, open_dataset
from forge.envs.config import EnvConfig
from forge.loop import RLConfig


def calculator_call(expression: str) -> str:
    """The turn that asks the calculator for `expression`."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


async def demonstrate(row: Row, env: EnvConfig) -> list[dict[str, Any]]:
    """The SFT rows of one scripted episode on `row`: a calculator call on the row's
    expression, then the tool's result as the answer (checked against the row's)."""
    environment = env.resolve()(row, **env.options)
    messages = await environment.reset()
    call = calculator_call(row["columns"]["metadata"]["expression"])
    step = await environment.step(call)
    (result,) = step.messages
    if result["content"] != row["answer"]:
        raise ValueError(
            f"row {row['index']}: the tool says {result['content']!r}, the row {row['answer']!r}"
        )
    answer = f"<answer>{result['content']}</answer>"
    await environment.close()
    after_call = [*messages, {"role": "assistant", "content": call}, result]
    turns = [(messages, call), (after_call, answer)]
    return [{"prompt": p, "target": t, "answer": row["answer"]} for p, t in turns]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the agent run's yaml")
    parser.add_argument("--out", required=True, type=Path, help="the jsonl file to write")
    parser.add_argument("--rows", type=int, default=200, help="episodes to demonstrate")
    parser.add_argument("overrides", nargs="*", help="key=value, as for forge run")
    args = parser.parse_args()
    cfg = load_config(RLConfig, args.config, args.overrides)
    rows = open_dataset(cfg.data)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out:
        for _ in range(args.rows):
            for record in await demonstrate(next(rows), cfg.env):
                out.write(json.dumps(record) + "\n")
    print(f"{2 * args.rows} demonstration turns of {args.rows} episodes in {args.out}")


if __name__ == "__main__":
    asyncio.run(main())
