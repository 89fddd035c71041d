"""Chat conversations in (rollout/engine/chat.py): Engine.chat and rollout.generate render through the
tokenizer's chat template exactly as transformers' `apply_chat_template(..., tokenize=True)`
does, and a bad conversation raises ValueError naming it and changes nothing.

The tokenizer is built locally: characters, a post-processor that prepends <bos> to plain
encodes, and a template that writes the BOS itself, so encoding the template's text with
special tokens added would show up as a doubled BOS.
"""

import pytest
from models import bos_chat_tokenizer, tiny_model

import rollout
from rollout import Engine, EngineConfig, SamplingParams
from rollout.engine.chat import is_conversations

CONFIG = dict(kv_cache_tokens=1024, max_model_len=128, seed=0)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] == 'bad' %}{{ raise_exception('no such role') }}{% endif %}"
            "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
CHATS = [
    [{"role": "user", "content": "what is 2+3"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": "hi"}, {"role": "user", "content": "count to 3"}],
]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def chat_tokenizer():
    return bos_chat_tokenizer(TEMPLATE)


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model("llama", vocab_size=len(tok))


def reference_ids(tok, chat, **kwargs):
    return tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                   **kwargs)["input_ids"]


def tokens(outs):
    return [s.token_ids for o in outs for s in o.samples]


def test_engine_chat_prompts_are_the_chat_templates_ids(tok, model):
    engine = Engine(model, EngineConfig(**CONFIG), tokenizer=tok)
    outs = engine.chat(CHATS, GREEDY)
    for out, chat in zip(outs, CHATS):
        ids = reference_ids(tok, chat)
        assert ids.count(tok.bos_token_id) == 1  # the template's BOS, not a second one
        assert out.prompt_token_ids == ids
        assert out.prompt == tok.apply_chat_template(chat, add_generation_prompt=True,
                                                     tokenize=False)
        assert out.prompt.endswith("<assistant>")
    # The same generation as from the ids themselves.
    assert tokens(outs) == tokens(engine.generate([reference_ids(tok, c) for c in CHATS], GREEDY))
    one = engine.chat(CHATS[1], [GREEDY])  # a single conversation, params as a list
    assert len(one) == 1 and one[0].prompt_token_ids == reference_ids(tok, CHATS[1])
    engine.check_invariants()


def test_rollout_generate_takes_conversations(tok, model):
    outs = rollout.generate(model, CHATS, GREEDY, tokenizer=tok, **CONFIG)
    assert [o.prompt_token_ids for o in outs] == [reference_ids(tok, c) for c in CHATS]
    fresh = Engine(model, EngineConfig(**CONFIG), tokenizer=tok).chat(CHATS, GREEDY)
    assert tokens(outs) == tokens(fresh)
    # chat_template_kwargs reach the template: without the generation prompt the ids end
    # where the last message does.
    plain = rollout.generate(model, CHATS, GREEDY, tokenizer=tok,
                             chat_template_kwargs={"add_generation_prompt": False}, **CONFIG)
    assert [o.prompt_token_ids for o in plain] == [
        tok.apply_chat_template(c, add_generation_prompt=False, tokenize=True)["input_ids"]
        for c in CHATS]
    with pytest.raises(ValueError, match="chat_template_kwargs: prompts are not chat"):
        rollout.generate(model, ["abc"], GREEDY, tokenizer=tok,
                         chat_template_kwargs={"x": 1}, **CONFIG)


def test_continuing_the_final_message_needs_no_generation_prompt_override(tok, model):
    """chat_template_kwargs={"continue_final_message": True} continues a conversation's last
    (assistant) message: the ids are transformers' for that option alone (the engine's default
    generation prompt gives way; it had made the template fail, blamed on the conversation)."""
    chat = CHATS[1][:3]  # ... ending with the assistant's "hi"
    engine = Engine(model, EngineConfig(**CONFIG), tokenizer=tok)
    (out,) = engine.chat([chat], GREEDY, chat_template_kwargs={"continue_final_message": True})
    assert out.prompt_token_ids == tok.apply_chat_template(
        chat, continue_final_message=True, tokenize=True)["input_ids"]
    assert out.prompt.endswith("hi")


def test_which_prompts_are_conversations():
    message = {"role": "user", "content": "x"}
    assert is_conversations([message]) and is_conversations([[message]])
    assert is_conversations(([message],))
    for prompts in (["abc"], [[1, 2]], [], "abc", [[]], None):
        assert not is_conversations(prompts), prompts


BAD = [
    ("abc", "conversations must be a list of conversations"),
    ([[]], r"conversations\[0\] must be a non-empty list"),
    ([CHATS[0], "hello"], r"conversations\[1\] must be a non-empty list"),
    ([CHATS[0], [{"content": "no role"}]], r"conversations\[1\]\[0\] must be a dict with a "
                                           r"'role' string"),
    ([CHATS[0], [{"role": "user", "content": "x"}, "y"]], r"conversations\[1\]\[1\]"),
    ([CHATS[0], [{"role": "bad", "content": "x"}]],
     r"conversations\[1\]: the chat template failed: .*no such role"),
]


def check_unchanged(engine, model, tok):
    """Nothing queued, nothing counted, no seed drawn: the next (unseeded) sampling call is
    what a fresh engine with the same config seed gives."""
    assert not engine.has_unfinished and engine.stats.prompt_tokens == 0
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True)
    fresh = Engine(model, EngineConfig(**CONFIG), tokenizer=tok)
    assert tokens(engine.chat(CHATS, sampled)) == tokens(fresh.chat(CHATS, sampled))
    engine.check_invariants()


@pytest.mark.parametrize("conversations, match", BAD)
def test_bad_conversations_are_refused_and_change_nothing(tok, model, conversations, match):
    engine = Engine(model, EngineConfig(**CONFIG), tokenizer=tok)
    with pytest.raises(ValueError, match=match):
        engine.chat(conversations, GREEDY)
    check_unchanged(engine, model, tok)


@pytest.mark.parametrize("conversations, match", BAD[2:])  # the first one is a conversation
def test_rollout_generate_refuses_bad_conversations(tok, conversations, match):
    model = tiny_model("llama", vocab_size=len(tok))  # its own engine: nothing ran on it
    with pytest.raises(ValueError, match=match):
        rollout.generate(model, conversations, GREEDY, tokenizer=tok, **CONFIG)
    check_unchanged(rollout.api.engine_for(model, tokenizer=tok, **CONFIG), model, tok)


def test_bad_chat_arguments_are_refused_and_change_nothing(tok, model):
    engine = Engine(model, EngineConfig(**CONFIG), tokenizer=tok)
    cases = [
        (dict(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs: 'tokenize'"),
        (dict(chat_template_kwargs=["x"]), "chat_template_kwargs must be a dict"),
        # what the engine passes itself: these had failed in the template and been blamed on
        # conversations[0]
        (dict(chat_template_kwargs={"conversation": []}),
         r"^chat_template_kwargs: 'conversation' is the engine's to set"),
        (dict(chat_template_kwargs={"messages": 1}),
         r"^chat_template_kwargs: 'messages' is the engine's to set"),
        (dict(chat_template_kwargs={1: 2}),
         r"^chat_template_kwargs: keys must be str \(the template's variable names\), got 1"),
        (dict(params=[GREEDY]), "params: 1 SamplingParams for 2 prompts"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            engine.chat(CHATS, **{"params": GREEDY, **kwargs})
    # Rendered fine, refused by generate's own checks (longer than max_model_len).
    too_long = [CHATS[0], [{"role": "user", "content": "a" * 200}]]
    with pytest.raises(ValueError, match="max_model_len"):
        engine.chat(too_long, GREEDY)
    check_unchanged(engine, model, tok)


def test_chat_needs_a_tokenizer_with_a_chat_template(model):
    with pytest.raises(ValueError, match="conversations: chat needs a tokenizer"):
        Engine(model, EngineConfig(**CONFIG)).chat(CHATS, GREEDY)
    plain = chat_tokenizer()
    plain.chat_template = None
    engine = Engine(model, EngineConfig(**CONFIG), tokenizer=plain)
    with pytest.raises(ValueError, match="conversations: the tokenizer has no chat template"):
        engine.chat(CHATS, GREEDY)
    # A template given as transformers takes it, in chat_template_kwargs (it had been refused).
    given = engine.chat(CHATS, GREEDY, chat_template_kwargs={"chat_template": TEMPLATE})
    assert [o.prompt_token_ids for o in given] == [reference_ids(chat_tokenizer(), c)
                                                    for c in CHATS]
