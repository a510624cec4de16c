"""Token-exact multi-turn chats: `replace_prefix_tokens` (public in chatgen.generation; pure
Python).

An RL trainer learns from the token ids the engine generated. A chat server receives the history
back as text and re-renders it with the chat template, which can tokenize an earlier answer
differently (" 4" as one token where the model produced " " + "4"), so turn 2's prompt would no
longer begin with turn 1's tokens. The fix (NeMo RL's `_replace_prefix_tokens`, written anew here):
keep the exact tokens the model saw and produced up to the end of its last answer, and take the
template's tokens only after that answer's EOS.

Worked example (EOS = 2), the one in NeMo RL's docs:

    model_prefix_token_ids    = [11, 12, 13, 40, 41, 220, 17, 2]      turn 1 prompt + the model's answer
    template_prefix_token_ids = [11, 12, 13, 40, 41, 1001, 2]         the template's rendering of that history
    template_token_ids        = [11, 12, 13, 40, 41, 1001, 2, 21, 22, 40, 41]   ... plus the new user turn
    replace_prefix_tokens(...) = [11, 12, 13, 40, 41, 220, 17, 2, 21, 22, 40, 41]

The answer's end is found by counting EOS tokens, not by position: the template prefix holds k EOS
tokens, and the result continues from the k-th EOS of `template_token_ids`. So templates that
rewrite history when a turn is added (Qwen3 drops the think blocks of older answers) still line up.
"""


def replace_prefix_tokens(
    tokenizer,
    model_prefix_token_ids: list,
    template_prefix_token_ids: list,
    template_token_ids: list,
) -> list:
    """The chat's token ids: `model_prefix_token_ids` up to (not including) its final EOS, then
    `template_token_ids` from the EOS that closes the same answer on.

    tokenizer: anything with `eos_token_id`. model_prefix_token_ids: the previous turn's prompt +
    generated ids (the EOS at the end may be missing, e.g. when that turn hit its token limit).
    template_prefix_token_ids: the chat template's ids for the history up to and including that
    answer; template_token_ids: the template's ids for the whole chat (that history + the new
    messages). With no model prefix the template's ids are returned unchanged.
    """
    model_prefix_token_ids = list(model_prefix_token_ids)
    if not model_prefix_token_ids:
        return list(template_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(
            "replace_prefix_tokens: the tokenizer has no eos_token_id, so the end of the model's last "
            "answer cannot be found; give the tokenizer an EOS token (eos_token in "
            "tokenizer_config.json)"
        )
    answers = sum(1 for t in template_prefix_token_ids if t == eos)
    if answers == 0:
        raise ValueError(
            f"replace_prefix_tokens: the chat template's rendering of the history holds no EOS token "
            f"(id {eos}), so the end of the model's last answer cannot be found; use a chat template "
            "that ends each assistant turn with the tokenizer's EOS token"
        )
    seen = 0
    for position, token in enumerate(template_token_ids):
        if token == eos:
            seen += 1
            if seen == answers:
                break
    else:
        raise ValueError(
            f"replace_prefix_tokens: the history holds {answers} EOS token(s) (id {eos}) but the whole "
            f"chat's template ids hold only {seen}; template_token_ids must render the same history "
            "plus the new messages"
        )
    cut = len(model_prefix_token_ids) - (model_prefix_token_ids[-1] == eos)
    return model_prefix_token_ids[:cut] + list(template_token_ids[position:])
