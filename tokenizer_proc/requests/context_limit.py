"""The refusals of a request that does not fit the context, worded as the peer whose route it came in
on words them, since clients match on the wording to tell "too long" from other 400s.

- OpenAI routes (vLLM's wording): a prompt that fills the context is "This model's maximum context length is
  C tokens. However, your request has P input tokens ..." and also says that "the input (P tokens) is longer
  than the model's context length (C tokens)"; a prompt plus `max_tokens` past it is "This model's maximum
  context length is C tokens. However, you requested T tokens (P in the messages, M in the completion).
  Please reduce the length of the messages or completion."
- SGLang's /generate: "The input (P tokens) is longer than the model's context length (C tokens)." and
  "Requested token count exceeds the model's maximum context length of C tokens. You requested a total of
  T tokens: P tokens from the input messages and M tokens for the completion. ..." (SGLang's text).

Both are 400s naming the field at fault (`prompt`, or the max-tokens field). The bounds themselves are
validation.build_sampling's: a prompt must leave room for one token, and prompt + max tokens may equal the context.
"""

from __future__ import annotations

from tokenizer_proc.http.errors import ApiError, bad_request


def prompt_too_long(prompt_len: int, context: int, sglang: bool) -> ApiError:
    """The 400 of a prompt of `prompt_len` tokens that leaves no room in a context of `context` tokens."""
    longer = f"The input ({prompt_len} tokens) is longer than the model's context length ({context} tokens)."
    if sglang:
        return bad_request(longer, "prompt")
    return bad_request(f"This model's maximum context length is {context} tokens. However, your request has "
                       f"{prompt_len} input tokens. {longer} Please reduce the length of the input messages.",
                       "prompt")  # fmt: skip


def total_too_long(prompt_len: int, max_new: int, context: int, sglang: bool, param: str) -> ApiError:
    """The 400 of a prompt of `prompt_len` tokens plus `max_new` asked for (`param`) past `context` tokens."""
    total = prompt_len + max_new
    if sglang:
        return bad_request(
            f"Requested token count exceeds the model's maximum context length of {context} tokens. You requested "
            f"a total of {total} tokens: {prompt_len} tokens from the input messages and {max_new} tokens for the "
            "completion. Please reduce the number of tokens in the input messages or the completion to fit within "
            "the limit.", param)  # fmt: skip
    return bad_request(f"This model's maximum context length is {context} tokens. However, you requested {total} "
                       f"tokens ({prompt_len} in the messages, {max_new} in the completion). Please reduce the "
                       "length of the messages or completion.", param)  # fmt: skip
