"""`continue_final_message` (vLLM / SGLang chat): the prompt ends inside the last message, so the model
continues it (a "prefilled" start of the assistant's answer).

Rule (transformers' `apply_chat_template(continue_final_message=True)`): the conversation is
rendered without a generation prompt, then cut right after the last occurrence of the final
message's content, dropping whatever the template writes after it (end-of-turn tokens); when the
template stripped trailing whitespace of the content, the cut is after the stripped content.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizer_proc.requests.chat_template import ChatTemplateError


def continue_final(rendered: str, messages: Sequence[dict[str, Any]]) -> str:
    """`rendered` (the conversation without a generation prompt) cut after the final message's
    content; ChatTemplateError when that content is empty or the template did not write it."""
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message needs a final message with text to continue")
    stripped = content.strip()
    at = rendered.rfind(stripped)
    if at < 0:
        raise ChatTemplateError("continue_final_message: the chat template does not write the final message's "
                                "content as it was given, so there is no place to continue it")
    kept = content.lstrip()
    if rendered[at : at + len(kept)] == kept:
        return rendered[: at + len(kept)]
    return rendered[: at + len(stripped)]
