"""Chat conversations in: `Engine.chat` and `rollout.generate` render each conversation (a list
of {"role", "content"} messages) through the tokenizer's chat template with the generation
prompt, then generate from those token ids.

The template's text already holds its special tokens (a Llama-3 BOS, say), so it is encoded
without adding them again: the same ids `apply_chat_template(..., tokenize=True)` gives. Every
conversation is rendered and checked before any request is queued, so a bad one raises
ValueError (naming it) and changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..fields import show


def is_conversations(prompts) -> bool:
    """Whether generate()'s `prompts` are chat conversations rather than strings or token ids:
    one conversation (a list of message dicts) or a list of them. The first element decides;
    render_conversations checks all of them."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        return False
    first = prompts[0]
    if isinstance(first, Mapping):
        return True
    return (isinstance(first, Sequence) and not isinstance(first, (str, bytes)) and len(first) > 0
            and isinstance(first[0], Mapping))


def render_conversations(tokenizer, conversations, chat_template_kwargs: dict | None = None
                         ) -> list[tuple[str, list[int]]]:
    """(templated text, prompt token ids) per conversation. A single conversation (a list of
    message dicts) counts as a list of one."""
    if tokenizer is None:
        raise ValueError("conversations: chat needs a tokenizer; pass tokenizer= to the Engine")
    given = check_template_kwargs(chat_template_kwargs)
    # continue_final_message extends the last (assistant) message, where a generation prompt
    # would open a new turn: transformers refuses the two together, which is no fault of the
    # conversation's, so the default gives way.
    kwargs = {"add_generation_prompt": not given.get("continue_final_message", False), **given}
    if getattr(tokenizer, "chat_template", None) is None and kwargs.get("chat_template") is None:
        raise ValueError("conversations: the tokenizer has no chat template; set "
                         "tokenizer.chat_template, pass chat_template_kwargs={'chat_template': "
                         "...} or pass prompts to generate()")
    conversations = _as_conversations(conversations)
    rendered = []
    for i, conversation in enumerate(conversations):
        try:
            text = tokenizer.apply_chat_template(list(conversation), tokenize=False, **kwargs)
        except Exception as e:  # the template is user code (jinja raise_exception, ...)
            raise ValueError(f"conversations[{i}]: the chat template failed: "
                             f"{type(e).__name__}: {e}") from e
        if not isinstance(text, str):
            raise ValueError(f"conversations[{i}]: the chat template rendered "
                             f"{type(text).__name__}, not text")
        rendered.append((text, list(tokenizer.encode(text, add_special_tokens=False))))
    return rendered


def _as_conversations(conversations) -> list[Sequence[Mapping]]:
    if isinstance(conversations, (str, bytes)) or not isinstance(conversations, Sequence):
        raise ValueError("conversations must be a list of conversations, each a list of "
                         "{'role', 'content'} messages")
    if conversations and isinstance(conversations[0], Mapping):
        conversations = [conversations]  # one conversation
    for i, conversation in enumerate(conversations):
        if isinstance(conversation, (str, bytes)) or not isinstance(conversation, Sequence) \
                or not conversation:
            raise ValueError(f"conversations[{i}] must be a non-empty list of "
                             f"{{'role', 'content'}} messages, got {conversation!r:.80}")
        for j, message in enumerate(conversation):
            # 'content' may be absent (an assistant message holding only tool calls): the
            # template decides what it needs.
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise ValueError(f"conversations[{i}][{j}] must be a dict with a 'role' string "
                                 f"(and 'content'), got {message!r:.80}")
    return list(conversations)


# What the engine passes itself: the conversation (apply_chat_template's `conversation`, the
# template's `messages`) and tokenize=False. Given again they had failed inside the template,
# reported as the conversation's fault.
ENGINE_KWARGS = ("conversation", "messages", "tokenize")


def check_template_kwargs(kwargs) -> dict:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"chat_template_kwargs must be a dict or None, "
                         f"got {type(kwargs).__name__}")
    for key in kwargs:
        if not isinstance(key, str):  # keyword arguments, then the template's variables
            raise ValueError(f"chat_template_kwargs: keys must be str (the template's variable "
                             f"names), got {show(key)}")
        if key in ENGINE_KWARGS:
            raise ValueError(f"chat_template_kwargs: {key!r} is the engine's to set (it passes "
                             f"{', '.join(ENGINE_KWARGS)} itself)")
    return dict(kwargs)


def chat(engine, conversations, params, use_tqdm: bool, chat_template_kwargs: dict | None):
    """Engine.chat: generate() over the rendered conversations, each output's `prompt` the
    templated text."""
    rendered = render_conversations(engine.tokenizer, conversations, chat_template_kwargs)
    outs = engine.generate([ids for _, ids in rendered], params, use_tqdm=use_tqdm)
    for out, (text, _) in zip(outs, rendered):
        out.prompt = text
    return outs
