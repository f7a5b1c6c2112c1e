"""The chat bridge: a conversation's next turn as token ids appended to the ids it already has.

The sampled tokens of a turn are never re-tokenized: text -> ids is not one-to-one (the same
text has many tokenizations, and the model may sample a rare one), so decoding a turn and
rendering the conversation anew could give the trainer other tokens than those the generator
sampled, with other logprobs. Instead, what the chat template renders after the turn (the end
of the turn, the new messages, the next generation prompt) is computed as text and appended as
its own ids.

That is exact only where the template is append-only: adding messages leaves the text of the
earlier turns as it was. Some templates rewrite history (Qwen3's strips the `<think>` blocks of
earlier assistant turns once a user message follows); `extend` checks the condition on the
conversation itself and raises `NotAppendOnly` naming the message that broke it.

The `renderers` package (PyPI, 0.1.12) implements this contract per model family, but it has no
renderer for SmolLM2's template (its generic renderer never extends), so forge renders with the
tokenizer's own template for every model.
"""

from collections.abc import Sequence
from typing import Any

Message = dict[str, Any]


class NotAppendOnly(ValueError):
    """The chat template renders earlier turns differently once new messages follow."""


class ChatBridge:
    """Renders chat messages to token ids with a tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        tools: tool schemas (JSON schema dicts) the template renders into the prompt, if any.
        template_kwargs: the template's own switches (Qwen3's `enable_thinking`).
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: Sequence[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.template_kwargs = dict(template_kwargs or {})
        self.end_of_turn = tokenizer.eos_token

    def first(self, messages: Sequence[Message]) -> list[int]:
        """The ids of the first prompt: `messages` and the generation prompt."""
        return self._ids(self._render(messages, generation_prompt=True))

    def extend(
        self, history: Sequence[Message], turn: str, turn_ids: Sequence[int], new: Sequence[Message]
    ) -> list[int]:
        """The ids to append after a sampled turn so that `new` follows it, ending with the
        next generation prompt.

        Args:
            history: the messages before the turn (those `first` and earlier `extend`s had).
            turn: the sampled turn's text: the assistant message the template would render.
            turn_ids: its token ids, as sampled. A turn cut at its token limit lacks the
                end-of-turn token, which the returned ids then begin with.
            new: the messages that follow (tool results, the user's answer); no assistant turn.
        """
        if not new or any(m["role"] == "assistant" for m in new):
            raise ValueError("a turn is followed by one or more messages, none the assistant's")
        turn = turn.removesuffix(self.end_of_turn)
        before = [*history, {"role": "assistant", "content": turn}]
        closed = self._render(before, generation_prompt=False)
        cut = closed.rfind(self.end_of_turn)
        if cut < 0:
            raise NotAppendOnly(f"the template ends no assistant turn with {self.end_of_turn!r}")
        cut += len(self.end_of_turn)
        after = self._render([*before, *new], generation_prompt=True)
        if after[:cut] != closed[:cut]:
            raise NotAppendOnly(
                f"the chat template renders the earlier turns differently once a "
                f"{new[0]['role']!r} message follows (it rewrites history, as Qwen3's does with "
                "<think> blocks): this conversation cannot be extended token-exactly"
            )
        ids = self._ids(after[cut:])
        closing = self.tokenizer.convert_tokens_to_ids(self.end_of_turn)
        return ids if turn_ids and turn_ids[-1] == closing else [closing, *ids]

    def _render(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
