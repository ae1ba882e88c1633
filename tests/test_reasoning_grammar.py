"""The answer a reasoning parser reports is exactly the text the grammar constrained (issue 33, suspected).

The grammar of a constrained request on a reasoning server wakes up at the `</think>` TOKEN. The front
door's split must agree with it: text before that token is reasoning, text after it is the answer. It
used to split at the TEXT `</think>`, so a model that spelled `</think>` with ordinary tokens had an
unconstrained answer delivered as if constrained; and a prompt that closed the reasoning itself (Qwen3's
`enable_thinking: false`) had its constrained answer reported as reasoning.

The model here is built to write what the test needs: with no attention or MLP output, its next token
depends on the last one only, through a successor table in its LM head (`_chain_model`).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_hf_config
from test_decode_server import start_server
from tiny_tokenizer import CHATML_TEMPLATE, TINY_VOCAB_SIZE, build_tiny_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from decode_service.front_door.choice_text import AnswerParser, ChoiceText
from decode_service.front_door.reasoning import make_reasoning_parser
from engine.params import StoppingParams
from engine.tokenizer import Tokenizer
from protos.tandem.v1 import generation_pb2 as pb

# ChatML, and Qwen3's switch: with enable_thinking false the generation prompt holds an empty think block.
THINKING_TEMPLATE = CHATML_TEMPLATE.replace(
    "{{ '<|im_start|>assistant\n' }}",
    "{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}",
)
VOCAB = TINY_VOCAB_SIZE + 2
CHOICES = ["yes", "no"]
QUESTION = [pb.ChatMessage(role="user", content="Think, then answer.")]


def _chain_model(successors: dict[int, int]) -> torch.nn.Module:
    """A one-layer Llama whose greedy next token is `successors[last token]` (token 0 for the others):
    one-hot embeddings, attention and MLP that add nothing, and an LM head that maps each one-hot."""
    config = tiny_hf_config(num_heads=18, num_kv_heads=2, head_dim=32, vocab_size=VOCAB, num_layers=1)
    assert config.hidden_size >= VOCAB
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :VOCAB] = torch.eye(VOCAB)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for token, successor in successors.items():
            model.lm_head.weight[successor, token] = 1.0
    return model.eval()


@pytest.fixture(scope="module")
def spelled(tmp_path_factory) -> dict:
    """A model directory whose model answers the chat's question by spelling `</think>` with ordinary
    tokens, then writing the real `</think>` token (the grammar starts there)."""
    directory = build_tiny_tokenizer(tmp_path_factory.mktemp("spelled-think"))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    pieces = tokenizer.encode("</think>", add_special_tokens=False)  # before it is one token
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(directory)
    end = tokenizer.convert_tokens_to_ids("</think>")
    chat = [{"role": "user", "content": QUESTION[0].content}]
    last = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)[-1]
    chain = [last, *pieces, end]
    assert len(pieces) > 1 and len(set(chain)) == len(chain)
    _chain_model(dict(zip(chain[:-1], chain[1:], strict=True))).save_pretrained(directory)
    return {"directory": directory, "pieces": pieces, "end": end}


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def server(request, spelled):
    running = start_server(spelled["directory"], max_model_len=256, reasoning_parser=request.param)
    yield running
    running.close()


def _ask(running, **fields) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(
        messages=QUESTION,
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingParams(max_tokens=20),
        structured_output=pb.StructuredOutput(choice=pb.ChoiceList(choices=CHOICES)),
        **fields,
    )
    return list(running.stub.Generate(request, timeout=120))


def _texts(responses) -> tuple[list[int], str, str]:
    ids = [token_id for response in responses for token_id in response.token_ids]
    return ids, "".join(r.reasoning_text for r in responses), "".join(r.text for r in responses)


@pytest.mark.slow
def test_a_spelled_end_of_reasoning_is_reasoning_and_the_answer_is_what_the_grammar_made(server, spelled):
    ids, reasoning, answer = _texts(_ask(server))
    assert ids[: len(spelled["pieces"]) + 1] == [*spelled["pieces"], spelled["end"]]
    assert reasoning == "</think>"  # spelled by the model: thinking, as far as the grammar knows
    assert answer in CHOICES


@pytest.mark.slow
def test_a_prompt_that_closed_the_reasoning_gets_its_constrained_answer_as_the_answer(server, spelled):
    responses = _ask(server, chat_template_kwargs_json=json.dumps({"enable_thinking": False}))
    ids, reasoning, answer = _texts(responses)
    assert spelled["end"] not in ids
    assert (reasoning, answer in CHOICES) == ("", True)
    assert responses[-1].finish_reason == pb.STOP


# --- the split, token by token ----------------------------------------------------------------------


def _split(tokenizer: Tokenizer, ids: list[int], end: int, stop: tuple[str, ...] = ()) -> tuple[str, str]:
    """Feed `ids` one message of two tokens at a time through a choice's text and a parser whose grammar
    waits for `end`; (reasoning, answer) as the client gets them."""
    text = ChoiceText(tokenizer, [], StoppingParams(max_tokens=100, stop=stop), True, reasoning_end_id=end)
    parser = AnswerParser(make_reasoning_parser("qwen3", grammar_waits=True), None)
    reasoning, answer = [], []
    for start in range(0, len(ids), 2):
        piece = text.feed(ids[start : start + 2], None)
        more_answer, more_reasoning, _ = parser.feed(piece.text, text.reasoning_end)
        reasoning.append(more_reasoning)
        answer.append(more_answer)
        if piece.stop is not None:
            break
    more_answer, more_reasoning, _ = parser.finish()
    return "".join(reasoning) + more_reasoning, "".join(answer) + more_answer


def test_the_split_follows_the_end_token_through_messages_stop_strings_and_lookalikes(spelled):
    tokenizer = Tokenizer.from_pretrained(spelled["directory"])
    end, encode = spelled["end"], tokenizer.encode
    fake = spelled["pieces"]
    ids = [*encode("<think>a"), *fake, *encode(" b"), end, *encode("yes"), *fake, *encode("!")]
    assert _split(tokenizer, ids, end) == ("a</think> b", "yes</think>!")
    # A stop string that holds back the end token's text until the next message, and does not match.
    assert _split(tokenizer, ids, end, stop=("</think>z",)) == ("a</think> b", "yes</think>!")
    # A stop string inside the reasoning ends it there: no answer.
    assert _split(tokenizer, ids, end, stop=(" b",)) == ("a</think>", "")
    # The end token's text cut by a stop string: nothing of it leaks into either part.
    assert _split(tokenizer, ids, end, stop=("think>yes",)) == ("a</think> b", "")
