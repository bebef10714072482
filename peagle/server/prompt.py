"""Request -> prompt token ids (completions: text or ids; chat: the tokenizer's chat template, as LLM.chat does).

Invariants: a prompt is never empty, its ids are in the vocabulary, and it is at most the server's prompt limit
(at most the context minus one generated token); text far longer than that limit is refused before tokenizing."""
from __future__ import annotations

from ..llm import chat_ids
from .protocol import ApiError, ChatRequest


def _need_tokenizer(state):
    if state.tokenizer is None:
        raise ApiError(400, f"{state.model_name} has no tokenizer: send the prompt as a list of token ids",
                       param="prompt")


def _check_chars(state, n_chars: int, param: str):
    """A cheap bound before tokenizing megabytes: no tokenizer packs 64 characters into every token."""
    limit = state.limits.prompt_tokens(state.max_model_len)
    if n_chars > 64 * limit + 4096:
        raise ApiError(400, f"{param} is far longer than the prompt limit ({limit} tokens)", param=param,
                       code="context_length_exceeded")


def completion_prompt(state, prompt, add_special_tokens: bool = True):
    """-> (ids, text or None). A text prompt is encoded as vLLM's completions endpoint encodes it: with the
    tokenizer's special tokens (a Llama tokenizer's BOS; SmolLM2's adds none) unless add_special_tokens is false."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, "only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        _need_tokenizer(state)
        _check_chars(state, len(prompt), "prompt")
        ids = state.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        text = prompt
    else:
        ids, text = list(prompt), None
        if ids and (min(ids) < 0 or max(ids) >= state.vocab_size):
            raise ApiError(400, f"prompt token ids must be in 0..{state.vocab_size - 1}", param="prompt")
    return check_prompt_len(state, ids, "prompt"), text


def check_prompt_len(state, ids, param: str):
    if not ids:
        raise ApiError(400, "prompt is empty", param=param)
    ctx, limit = state.max_model_len, state.limits.prompt_tokens(state.max_model_len)
    if len(ids) >= ctx:
        raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, your prompt has "
                            f"{len(ids)} tokens (the context must hold the prompt and at least one generated "
                            f"token).", param=param, code="context_length_exceeded")
    if len(ids) > limit:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this server accepts at most {limit}", param=param,
                       code="prompt_too_long")
    return ids


def chat_prompt(state, req: ChatRequest):
    _need_tokenizer(state)
    tok = state.tokenizer
    if not getattr(tok, "chat_template", None):
        raise ApiError(400, f"{state.model_name} has no chat template", param="messages")
    if not req.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    msgs = []
    for i, mm in enumerate(req.messages):
        c = mm.content
        if isinstance(c, list):
            if any(p.type != "text" or p.text is None for p in c):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            c = "".join(p.text for p in c)
        msgs.append({"role": mm.role, "content": c or ""})
    # each message costs its template text too: count its role and one character more
    _check_chars(state, sum(len(x["content"]) + len(x["role"]) + 1 for x in msgs), "messages")
    try:
        ids = chat_ids(tok, msgs)
    except Exception as e:  # noqa: BLE001 - template errors (e.g. role order) are the client's
        raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None
    return check_prompt_len(state, ids, "messages")
