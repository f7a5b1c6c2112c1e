"""The chat bridge extends a conversation token-exactly: SmolLM2's template (append-only), and a
Qwen3 template, which keeps history across tool results but strips earlier `<think>` blocks
once a user message follows: the bridge says so instead of training on tokens that are not the
conversation's.

The Qwen3 template is the one vLLM ships for MiniCPM-V 4.5 (a Qwen3 model: the same history
rules), rendered with SmolLM2's tokenizer, which has the `<|im_start|>`/`<|im_end|>` tokens it
needs: no Qwen3 tokenizer can be fetched here.
"""

from pathlib import Path

import pytest
import vllm
from transformers import AutoTokenizer

from forge.data.chat import ChatBridge, NotAppendOnly
from forge.models import smollm2

QWEN3_TEMPLATE = (
    Path(vllm.__file__).parent / "transformers_utils/chat_templates/template_minicpmv45.jinja"
)
HISTORY = [
    {"role": "system", "content": "You can call a calculator."},
    {"role": "user", "content": "What is 12 * 34, doubled?"},
]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return AutoTokenizer.from_pretrained(smollm2())


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(smollm2())
    tokenizer.chat_template = QWEN3_TEMPLATE.read_text()
    return tokenizer


def full_render(tokenizer, messages, **template_kwargs) -> list[int]:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False, **template_kwargs
    )


def sample(tokenizer, text: str) -> list[int]:
    """A turn's ids as the generator returns them: the text's tokens and the end of turn."""
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


def test_three_turns_on_smollm2_equal_the_template_s_render_of_the_whole_conversation(
    smollm2_tokenizer,
):
    bridge = ChatBridge(smollm2_tokenizer)
    ids = bridge.first(HISTORY)
    assert ids == full_render(smollm2_tokenizer, HISTORY)
    messages = list(HISTORY)
    for turn, reply in [
        ("calculator(12 * 34)", {"role": "tool", "content": "408"}),
        ("408 * 2 = 816", {"role": "user", "content": "Check it once more."}),
    ]:
        turn_ids = sample(smollm2_tokenizer, turn)
        ids += turn_ids + bridge.extend(messages, turn, turn_ids, [reply])
        messages += [{"role": "assistant", "content": turn}, reply]
        assert ids == full_render(smollm2_tokenizer, messages)


def test_sampled_tokens_stay_as_sampled_when_another_tokenization_of_their_text_exists(
    smollm2_tokenizer,
):
    bridge = ChatBridge(smollm2_tokenizer)
    prompt = bridge.first(HISTORY)
    # "Yes" sampled one letter at a time: re-tokenizing the text would give one token.
    spelled = [smollm2_tokenizer.convert_tokens_to_ids(c) for c in "Yes"]
    assert len(smollm2_tokenizer.encode("Yes", add_special_tokens=False)) == 1
    turn_ids = [*spelled, smollm2_tokenizer.eos_token_id]
    reply = {"role": "user", "content": "Sure?"}
    context = prompt + turn_ids + bridge.extend(HISTORY, "Yes", turn_ids, [reply])
    assert context[len(prompt) : len(prompt) + len(turn_ids)] == turn_ids
    whole = [*HISTORY, {"role": "assistant", "content": "Yes"}, reply]
    assert context != full_render(smollm2_tokenizer, whole)  # what a re-render would train on
    assert smollm2_tokenizer.decode(context) == smollm2_tokenizer.decode(
        full_render(smollm2_tokenizer, whole)
    )


def test_a_turn_cut_at_its_token_limit_is_closed_by_the_template_s_end_of_turn(
    smollm2_tokenizer,
):
    bridge = ChatBridge(smollm2_tokenizer)
    turn_ids = smollm2_tokenizer.encode("12 * 34 is", add_special_tokens=False)
    after = bridge.extend(HISTORY, "12 * 34 is", turn_ids, [{"role": "user", "content": "Go on"}])
    assert after[0] == smollm2_tokenizer.eos_token_id
    whole = [*HISTORY, {"role": "assistant", "content": "12 * 34 is"}]
    whole.append({"role": "user", "content": "Go on"})
    assert bridge.first(HISTORY) + turn_ids + after == full_render(smollm2_tokenizer, whole)


def test_qwen3_keeps_the_thinking_turn_across_a_tool_result(qwen3_tokenizer):
    """Thinking on: the generation prompt opens `<think>`, the model closes it and calls the
    tool; the conversation so far is the template's render of it, to the character."""
    thinking = {"enable_thinking": True}
    bridge = ChatBridge(qwen3_tokenizer, template_kwargs=thinking)
    turn = "Multiply first.\n</think>\n\ncalculator(12 * 34)"
    turn_ids = sample(qwen3_tokenizer, turn)
    tool = {"role": "tool", "content": "408"}
    context = bridge.first(HISTORY) + turn_ids + bridge.extend(HISTORY, turn, turn_ids, [tool])
    whole = [*HISTORY, {"role": "assistant", "content": turn}, tool]
    assert qwen3_tokenizer.decode(context) == qwen3_tokenizer.decode(
        full_render(qwen3_tokenizer, whole, **thinking)
    )
    assert qwen3_tokenizer.decode(context).endswith("<|im_start|>assistant\n<think>\n")


def test_qwen3_stripping_thoughts_when_the_user_answers_is_one_clear_error(qwen3_tokenizer):
    bridge = ChatBridge(qwen3_tokenizer, template_kwargs={"enable_thinking": True})
    turn = "Multiply first.\n</think>\n\n816"
    user = {"role": "user", "content": "Are you sure?"}
    with pytest.raises(NotAppendOnly, match="differently once a 'user' message follows"):
        bridge.extend(HISTORY, turn, sample(qwen3_tokenizer, turn), [user])


def test_an_assistant_message_among_the_new_ones_is_refused(smollm2_tokenizer):
    bridge = ChatBridge(smollm2_tokenizer)
    with pytest.raises(ValueError, match="none the assistant's"):
        bridge.extend(HISTORY, "a", [1], [{"role": "assistant", "content": "b"}])
